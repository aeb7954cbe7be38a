// The owner lock of slab files (csrc/src/disk/DESIGN.md D13): one open store per slab file, in
// this process or another; the refusal names the file and the holder; a refused open leaves
// nothing locked and nothing read or written; a dead holder never blocks a restart.
#include <fcntl.h>
#include <signal.h>
#include <sys/file.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <optional>
#include <sstream>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "temp_dir.hpp"
#include "vitrify/disk.hpp"
#include "vitrify/error.hpp"

namespace fs = std::filesystem;
using namespace vitrify::disk;
using vitrify::file_io::DirectIo;

namespace {

using vitrify::test::TempDir;

Key key_of(uint8_t i) {
  Key k{};
  k.fill(i);
  return k;
}

StoreConfig cfg_of(std::vector<std::string> dirs, unsigned kinds = 1,
                   ColdStart cs = ColdStart::kClear) {
  StoreConfig c;
  c.dirs = std::move(dirs);
  for (unsigned i = 0; i < kinds; ++i) c.kinds.push_back(KindConfig{4000, 1.0});
  c.budget_bytes = (kFileHeaderBytes + 8 * slot_bytes_for(4000)) * c.dirs.size() * kinds;
  c.cold_start = cs;
  c.name = "lk";
  c.write_threads = 1;
  c.read_threads = 1;
  return c;
}

std::string slab_of(const std::string& dir, unsigned kind) {
  return dir + "/lk.kind" + std::to_string(kind) + ".slab";
}

void put_one(Store& s, unsigned kind, uint8_t i) {
  auto b = s.make_buffer(kind);
  std::memset(b->data() + kSlotHeaderBytes, i, 100);
  ASSERT_EQ(s.submit_put(kind, {PutItem{key_of(i), b, 100}})->wait()[0],
            static_cast<int64_t>(PutResult::kStored));
}

bool has(Store& s, unsigned kind, uint8_t i) {
  std::vector<uint8_t> dst(4000);
  const int64_t r = s.submit_get(kind, {GetItem{key_of(i), dst.data(), dst.size(), false}})->wait()[0];
  return r == 100 && dst[0] == i && dst[99] == i;
}

// Whether an OFD lock / a flock is held on `path` by any other open file description.
bool ofd_locked(const std::string& path) {
  const int fd = ::open(path.c_str(), O_RDWR | O_CLOEXEC);
  EXPECT_GE(fd, 0) << path;
  struct flock fl{};
  fl.l_type = F_WRLCK;
  fl.l_whence = SEEK_SET;
  EXPECT_EQ(::fcntl(fd, F_OFD_GETLK, &fl), 0) << std::strerror(errno);
  ::close(fd);
  return fl.l_type != F_UNLCK;
}
bool flocked(const std::string& path) {
  const int fd = ::open(path.c_str(), O_RDWR | O_CLOEXEC);
  EXPECT_GE(fd, 0) << path;
  const bool held = ::flock(fd, LOCK_EX | LOCK_NB) != 0 && errno == EWOULDBLOCK;
  ::close(fd);  // drops the flock just taken, if any
  return held;
}

// The SlabBusy that opening `cfg` throws, or nullopt when it opens.
std::optional<SlabBusy> refusal(const StoreConfig& cfg) {
  try {
    Store s(cfg);
  } catch (const SlabBusy& e) {
    return e;
  }
  return std::nullopt;
}

std::string host() {
  char buf[256] = {};
  ::gethostname(buf, sizeof buf - 1);
  return buf;
}

}  // namespace

TEST(SlabLock, SecondStoreOnTheSameDirAndNameIsRefusedNamingFileAndHolderUntilTheFirstCloses) {
  TempDir d;
  Store a(cfg_of({d.path}));
  put_one(a, 0, 1);
  EXPECT_EQ(a.slab(0, 0).lock_method(), LockMethod::kOfd);  // this kernel has OFD locks
  EXPECT_TRUE(ofd_locked(slab_of(d.path, 0)));
  const SlabOwner o = read_slab_owner(slab_of(d.path, 0));
  EXPECT_EQ(o.pid, ::getpid());
  EXPECT_EQ(o.host, host());
  EXPECT_FALSE(o.since.empty());

  for (ColdStart cs : {ColdStart::kClear, ColdStart::kLoad}) {
    const auto e = refusal(cfg_of({d.path}, 1, cs));
    ASSERT_TRUE(e.has_value());
    const std::string msg = e->what();
    EXPECT_NE(msg.find("\"" + slab_of(d.path, 0) + "\""), std::string::npos) << msg;
    EXPECT_NE(msg.find("process " + std::to_string(::getpid()) + " on host " + host()),
              std::string::npos) << msg;
    EXPECT_NE(msg.find("(this process)"), std::string::npos) << msg;
    EXPECT_EQ(msg.find('\n'), std::string::npos) << "one line: " << msg;
    EXPECT_EQ(e->path(), slab_of(d.path, 0));
    EXPECT_EQ(e->holder_pid(), ::getpid());
    EXPECT_EQ(e->holder_host(), host());
    EXPECT_EQ(e->code().value(), EBUSY);  // an OSError in Python
  }
  // The refused opens wrote nothing: the first store's page is still there and served.
  EXPECT_TRUE(has(a, 0, 1));
  // Another name in the same directory is another set of files.
  {
    StoreConfig other = cfg_of({d.path});
    other.name = "lk2";
    Store b(other);
  }
  a.close();  // releases the locks and removes the owner record
  EXPECT_FALSE(ofd_locked(slab_of(d.path, 0)));
  EXPECT_FALSE(fs::exists(slab_owner_path(slab_of(d.path, 0))));
  Store b(cfg_of({d.path}, 1, ColdStart::kLoad));
  EXPECT_TRUE(has(b, 0, 1));  // nothing was lost while it was refused
  EXPECT_EQ(read_slab_owner(slab_of(d.path, 0)).pid, ::getpid());
}

TEST(SlabLock, ARefusedOpenLeavesNothingLockedAndNothingWritten) {
  TempDir d1, d2;
  {
    Store s(cfg_of({d1.path, d2.path}, 2));
    for (unsigned k = 0; k < 2; ++k)
      for (uint8_t i = 1; i <= 4; ++i) put_one(s, k, static_cast<uint8_t>(i + 10 * k));
  }
  const std::string held = slab_of(d2.path, 1);  // the last slab the store would lock
  std::optional<SlabBusy> e;
  {
    LockedSlab other = lock_slab(held, DirectIo::kAuto, SlabLocking::kAuto);
    ASSERT_TRUE(other.lock.held());
    // cold start clear would have formatted every slab: refused before anything was written
    e = refusal(cfg_of({d1.path, d2.path}, 2, ColdStart::kClear));
    ASSERT_TRUE(e.has_value());
    EXPECT_EQ(e->path(), held);
    for (const std::string& p : {slab_of(d1.path, 0), slab_of(d2.path, 0), slab_of(d1.path, 1)}) {
      EXPECT_FALSE(ofd_locked(p)) << p << " stayed locked after the refusal";
      EXPECT_FALSE(flocked(p)) << p;
    }
    EXPECT_TRUE(ofd_locked(held));
  }
  EXPECT_FALSE(ofd_locked(held));
  Store s(cfg_of({d1.path, d2.path}, 2, ColdStart::kLoad));
  EXPECT_EQ(s.stats().loaded_entries, 8u);
  for (unsigned k = 0; k < 2; ++k)
    for (uint8_t i = 1; i <= 4; ++i) EXPECT_TRUE(has(s, k, static_cast<uint8_t>(i + 10 * k)));
}

TEST(SlabLock, MissingOwnerRecordIsAnUnknownHolderAndAStaleRecordIsOverwritten) {
  TempDir d;
  const std::string path = slab_of(d.path, 0);
  {
    LockedSlab other = lock_slab(path, DirectIo::kAuto, SlabLocking::kAuto);
    ASSERT_EQ(::unlink(slab_owner_path(path).c_str()), 0);
    const auto e = refusal(cfg_of({d.path}));
    ASSERT_TRUE(e.has_value());
    EXPECT_EQ(e->holder_pid(), -1);
    EXPECT_EQ(e->holder_host(), "");
    EXPECT_NE(std::string(e->what()).find("unknown holder"), std::string::npos) << e->what();
    EXPECT_NE(std::string(e->what()).find(path), std::string::npos) << e->what();
  }
  // A record left by a holder that died (the kernel dropped its lock): it blocks nothing.
  pid_t dead = ::fork();
  ASSERT_GE(dead, 0);
  if (dead == 0) ::_exit(0);
  ASSERT_EQ(::waitpid(dead, nullptr, 0), dead);
  {
    std::ofstream(slab_owner_path(path)) << "pid=" << dead << " host=" << host()
                                         << " since=2000-01-01T00:00:00Z\n";
  }
  EXPECT_EQ(read_slab_owner(path).pid, dead);
  Store s(cfg_of({d.path}));
  EXPECT_EQ(read_slab_owner(path).pid, ::getpid());
  // Garbage is no record.
  s.close();
  { std::ofstream(slab_owner_path(path)) << "pid=12x host=\n"; }
  EXPECT_EQ(read_slab_owner(path).pid, -1);
  EXPECT_EQ(read_slab_owner(d.path + "/absent.slab").pid, -1);
}

// Issue 33 item 6: the lock's holder writes its record a moment after it takes the lock; until
// then the record may be a dead process's. The refusal never names that dead pid as the holder.
TEST(SlabLock, ARecordNamingADeadProcessIsAnUnknownHolderNeverTheDeadPid) {
  TempDir d;
  const std::string path = slab_of(d.path, 0);
  pid_t dead = ::fork();
  ASSERT_GE(dead, 0);
  if (dead == 0) ::_exit(0);
  ASSERT_EQ(::waitpid(dead, nullptr, 0), dead);
  LockedSlab other = lock_slab(path, DirectIo::kAuto, SlabLocking::kAuto);
  {  // the holder's record is late: the dead process's is still there
    std::ofstream(slab_owner_path(path)) << "pid=" << dead << " host=" << host()
                                         << " since=2000-01-01T00:00:00Z\n";
  }
  const auto e = refusal(cfg_of({d.path}));
  ASSERT_TRUE(e.has_value());
  const std::string m = e->what();
  EXPECT_NE(m.find("slab file \"" + path + "\" is held by an unknown process (the record names " +
                   std::to_string(dead) + ", which has exited)"),
            std::string::npos) << m;
  EXPECT_EQ(m.find("locked by process"), std::string::npos) << m;
  EXPECT_EQ(e->holder_pid(), -1);
  EXPECT_EQ(e->holder_host(), "");
  EXPECT_EQ(e->code().value(), EBUSY);
  // Once the holder's record is there, it is named.
  {
    std::ofstream(slab_owner_path(path)) << "pid=" << ::getpid() << " host=" << host()
                                         << " since=2000-01-01T00:00:00Z\n";
  }
  const auto named = refusal(cfg_of({d.path}));
  ASSERT_TRUE(named.has_value());
  EXPECT_EQ(named->holder_pid(), ::getpid());
}

TEST(SlabLock, FlockFallbackLocksTheSameWay) {
  TempDir d;
  StoreConfig c = cfg_of({d.path});
  c.slab_locking = SlabLocking::kFlock;
  EXPECT_EQ(parse_slab_locking("flock"), SlabLocking::kFlock);
  EXPECT_EQ(parse_slab_locking("auto"), SlabLocking::kAuto);
  EXPECT_THROW(parse_slab_locking("none"), std::invalid_argument);
  {
    Store a(c);
    put_one(a, 0, 7);
    EXPECT_EQ(a.slab(0, 0).lock_method(), LockMethod::kFlock);
    EXPECT_TRUE(flocked(slab_of(d.path, 0)));
    EXPECT_FALSE(ofd_locked(slab_of(d.path, 0)));  // flock only, no OFD lock
    const auto e = refusal(c);
    ASSERT_TRUE(e.has_value());
    EXPECT_EQ(e->holder_pid(), ::getpid());
    EXPECT_NE(std::string(e->what()).find(slab_of(d.path, 0)), std::string::npos);
  }
  EXPECT_FALSE(flocked(slab_of(d.path, 0)));
  c.cold_start = ColdStart::kLoad;
  Store b(c);
  EXPECT_TRUE(has(b, 0, 7));
}

TEST(SlabLock, ASlabFileAloneIsLockedAndMovingTheLockKeepsIt) {
  TempDir d;
  const std::string path = d.path + "/a.slab";
  const SlabGeometry g{0, 4096, 2, store_tag("x")};
  {
    SlabFile f(path, g, ColdStart::kClear, DirectIo::kAuto);
    EXPECT_TRUE(f.locked());
    EXPECT_THROW(SlabFile(path, g, ColdStart::kLoad, DirectIo::kAuto), SlabBusy);
    f.release_lock();
    f.release_lock();  // idempotent
    EXPECT_FALSE(f.locked());
    EXPECT_FALSE(ofd_locked(path));
    SlabFile again(path, g, ColdStart::kLoad, DirectIo::kAuto);
    EXPECT_FALSE(again.formatted());
  }
  LockedSlab a = lock_slab(path, DirectIo::kAuto, SlabLocking::kAuto);
  LockedSlab b = std::move(a);
  EXPECT_FALSE(a.lock.held());
  EXPECT_TRUE(b.lock.held());
  EXPECT_TRUE(ofd_locked(path));
  b.lock = SlabLock();  // move-assigning releases the old lock
  EXPECT_FALSE(ofd_locked(path));
}

TEST(SlabLock, AHolderKilledWithSigkillNeverBlocksARestart) {
  TempDir d;
  int ready[2], hold[2];
  ASSERT_EQ(::pipe(ready), 0);
  ASSERT_EQ(::pipe(hold), 0);
  const pid_t pid = ::fork();
  ASSERT_GE(pid, 0);
  if (pid == 0) {
    ::close(ready[0]);
    ::close(hold[1]);
    try {
      Store s(cfg_of({d.path}));
      auto b = s.make_buffer(0);
      std::memset(b->data() + kSlotHeaderBytes, 9, 100);
      if (s.submit_put(0, {PutItem{key_of(9), b, 100}})->wait()[0] != 0) ::_exit(3);
      const char c = 'r';
      if (::write(ready[1], &c, 1) != 1) ::_exit(4);
      char x;
      while (::read(hold[0], &x, 1) != 0) {}  // until the parent kills us
    } catch (...) {
      ::_exit(2);
    }
    ::_exit(0);
  }
  ::close(ready[1]);
  ::close(hold[0]);
  char c = 0;
  ASSERT_EQ(::read(ready[0], &c, 1), 1) << "the child could not open its store";
  const auto e = refusal(cfg_of({d.path}, 1, ColdStart::kLoad));
  ASSERT_TRUE(e.has_value());
  EXPECT_EQ(e->holder_pid(), pid);
  EXPECT_NE(std::string(e->what()).find("process " + std::to_string(pid)), std::string::npos);
  EXPECT_EQ(std::string(e->what()).find("this process"), std::string::npos);
  ASSERT_EQ(::kill(pid, SIGKILL), 0);
  int status = 0;
  ASSERT_EQ(::waitpid(pid, &status, 0), pid);
  ASSERT_TRUE(WIFSIGNALED(status));
  ::close(ready[0]);
  ::close(hold[1]);
  // Its stale record is still there; the lock is not.
  EXPECT_EQ(read_slab_owner(slab_of(d.path, 0)).pid, pid);
  Store s(cfg_of({d.path}, 1, ColdStart::kLoad));
  EXPECT_TRUE(has(s, 0, 9));  // the acknowledged put survived the kill
  EXPECT_EQ(read_slab_owner(slab_of(d.path, 0)).pid, ::getpid());
}
