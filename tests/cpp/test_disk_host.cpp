// The host tier (csrc/src/disk/DESIGN.md, "Host tier", H1-H8): the Store with its slabs in
// shared memory (/dev/shm), mapped and copied with memcpy, in the disk slabs' page format.
// Files 0600, another user's slabs refused, another identity's slabs never served, too little
// space one line, torn and flipped slots misses, a SIGKILLed writer's acknowledged pages found
// by `load`, a reader in the same or another process serving the writer's pages.
#include <fcntl.h>
#include <signal.h>
#include <sys/stat.h>
#include <sys/statfs.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <random>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include <gtest/gtest.h>

#include "temp_dir.hpp"
#include "vitrify/disk.hpp"

namespace fs = std::filesystem;
using namespace vitrify::disk;

namespace {

constexpr size_t kPage = 10000;

using vitrify::test::ShmDir;
using vitrify::test::TempDir;

Key key_of(uint64_t i) {
  Key k{};
  std::memcpy(k.data(), &i, sizeof i);
  k[31] = 0xC3;
  return k;
}
size_t len_of(uint64_t i) { return 1 + (i * 7919) % kPage; }
uint8_t byte_of(uint64_t i, size_t off) {
  return static_cast<uint8_t>((i * 2654435761u) >> 11 ^ (off * 131u) ^ (off >> 9));
}

StoreConfig host_cfg(const std::string& dir, uint64_t slots, ColdStart cs = ColdStart::kClear,
                     bool read_only = false, const std::string& name = "host") {
  StoreConfig c;
  c.dirs = {dir};
  c.kinds = {KindConfig{kPage, 1.0}};
  c.budget_bytes = kFileHeaderBytes + slots * slot_bytes_for(kPage);
  c.cold_start = cs;
  c.name = name;
  c.host = true;
  c.read_only = read_only;
  c.write_threads = 1;
  return c;
}

int64_t put(Store& s, uint64_t i) {
  auto b = s.make_buffer(0);
  for (size_t o = 0; o < len_of(i); ++o) b->data()[kSlotHeaderBytes + o] = byte_of(i, o);
  return s.submit_put(0, {PutItem{key_of(i), b, len_of(i)}})->wait()[0];
}

// 1 exact bytes, 0 miss, -1 wrong bytes (must never happen).
int read_check(Store& s, uint64_t i) {
  std::vector<uint8_t> dst(kPage + 1, 0xEE);
  const int64_t r = s.submit_get(0, {GetItem{key_of(i), dst.data(), dst.size(), false}})->wait()[0];
  if (r < 0) return 0;
  if (static_cast<size_t>(r) != len_of(i)) return -1;
  for (size_t o = 0; o < len_of(i); ++o)
    if (dst[o] != byte_of(i, o)) return -1;
  return 1;
}

constexpr int64_t kStored = static_cast<int64_t>(PutResult::kStored);

}  // namespace

// H1, H2, H3: the slab is a 0600 file in /dev/shm of a whole number of blocks, mapped; pages
// round-trip; `load` after close finds every page; the page format is the disk slab's.
TEST(HostTier, RoundTripFormatPermissionsAndLoad) {
  ShmDir d;
  const std::string path = d.path + "/host.kind0.slab";
  {
    Store s(host_cfg(d.path, 16));
    EXPECT_TRUE(s.slab(0, 0).host());
    EXPECT_FALSE(s.slab(0, 0).direct());
    EXPECT_FALSE(s.stats().direct_io);
    for (uint64_t i = 0; i < 12; ++i) ASSERT_EQ(put(s, i), kStored);
    for (uint64_t i = 0; i < 12; ++i) EXPECT_EQ(read_check(s, i), 1) << i;
    EXPECT_EQ(read_check(s, 99), 0);
    struct stat st{};
    ASSERT_EQ(::stat(path.c_str(), &st), 0);
    EXPECT_EQ(st.st_mode & 0777, 0600u);
    EXPECT_EQ(static_cast<uint64_t>(st.st_size), kFileHeaderBytes + 16 * slot_bytes_for(kPage));
    EXPECT_EQ(static_cast<uint64_t>(st.st_blocks) * 512, static_cast<uint64_t>(st.st_size));
    EXPECT_TRUE(slab_lock_held(path));
  }
  EXPECT_FALSE(slab_lock_held(path));
  // The same format as a disk slab: the file header verifies through read_slab_header, and a
  // disk-tier store of the same name and geometry on a copy of the file serves the pages.
  const auto h = read_slab_header(path);
  ASSERT_TRUE(h.has_value());
  EXPECT_EQ(h->store_tag, store_tag("host"));
  EXPECT_EQ(h->slot_count, 16u);
  {
    ShmDir disk_copy;  // tmpfs, read through pread by a disk-tier (non-host) store
    fs::copy_file(path, disk_copy.path + "/host.kind0.slab");
    StoreConfig c = host_cfg(disk_copy.path, 16, ColdStart::kLoad);
    c.host = false;
    Store s(c);
    EXPECT_FALSE(s.slab(0, 0).host());
    for (uint64_t i = 0; i < 12; ++i) EXPECT_EQ(read_check(s, i), 1) << i;
  }
  Store s(host_cfg(d.path, 16, ColdStart::kLoad));
  EXPECT_EQ(s.stats().loaded_entries, 12u);
  for (uint64_t i = 0; i < 12; ++i) EXPECT_EQ(read_check(s, i), 1) << i;
}

// H2: a file created with wider permissions is narrowed to 0600 by its owner's writer.
TEST(HostTier, AnOwnFileWithWiderPermissionsBecomes0600) {
  ShmDir d;
  const std::string path = d.path + "/host.kind0.slab";
  const int fd = ::open(path.c_str(), O_CREAT | O_WRONLY, 0666);
  ASSERT_GE(fd, 0);
  ASSERT_EQ(::fchmod(fd, 0666), 0);
  ::close(fd);
  Store s(host_cfg(d.path, 4));
  struct stat st{};
  ASSERT_EQ(::stat(path.c_str(), &st), 0);
  EXPECT_EQ(st.st_mode & 0777, 0600u);
}

// H2: a slab of another user is never mapped, by a writer or a reader (needs root to chown).
TEST(HostTier, AnotherUsersSlabIsRefused) {
  if (::geteuid() != 0) GTEST_SKIP() << "needs root to give a file to another user";
  ShmDir d;
  const std::string path = d.path + "/host.kind0.slab";
  { Store s(host_cfg(d.path, 4)); ASSERT_EQ(put(s, 1), kStored); }
  ASSERT_EQ(::chown(path.c_str(), 4242, 4242), 0);
  for (bool read_only : {false, true}) {
    try {
      Store s(host_cfg(d.path, 4, ColdStart::kLoad, read_only));
      FAIL() << "opened another user's slab, read_only=" << read_only;
    } catch (const std::system_error& e) {
      EXPECT_EQ(e.code().value(), EACCES);
      const std::string m = e.what();
      EXPECT_NE(m.find(path), std::string::npos) << m;
      EXPECT_NE(m.find("uid 4242"), std::string::npos) << m;
      EXPECT_EQ(m.find('\n'), std::string::npos) << m;
    }
  }
}

// H6: another identity (store name -> store tag) or geometry is never served: a writer starts
// it empty, a reader refuses it.
TEST(HostTier, AnotherIdentityIsNeverServed) {
  ShmDir d;
  { Store s(host_cfg(d.path, 8, ColdStart::kClear, false, "model-a")); ASSERT_EQ(put(s, 5), kStored); }
  fs::copy_file(d.path + "/model-a.kind0.slab", d.path + "/model-b.kind0.slab");
  EXPECT_THROW(Store(host_cfg(d.path, 8, ColdStart::kLoad, true, "model-b")),
               std::invalid_argument);
  // A writer's load refuses it too (D7: only clear wipes a slab holding a valid header) ...
  try {
    Store b(host_cfg(d.path, 8, ColdStart::kLoad, false, "model-b"));
    ADD_FAILURE() << "loaded another identity's slab";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("it belongs to another store"), std::string::npos)
        << e.what();
  }
  // ... and a writer's clear starts it empty: model-a's page is never served under model-b.
  Store b(host_cfg(d.path, 8, ColdStart::kClear, false, "model-b"));
  EXPECT_EQ(b.stats().loaded_entries, 0u);
  EXPECT_EQ(read_check(b, 5), 0);
  Store a(host_cfg(d.path, 8, ColdStart::kLoad, false, "model-a"));
  EXPECT_EQ(read_check(a, 5), 1);
}

// H5: too little space is one line naming the mount, its filesystem, the need and what is
// free, before any slab grows; a directory not in memory is refused.
TEST(HostTier, TooLittleSpaceIsOneLineNamingMountNeedAndFree) {
  ShmDir d;
  struct statfs st{};
  ASSERT_EQ(::statfs(d.path.c_str(), &st), 0);
  const uint64_t free_bytes = static_cast<uint64_t>(st.f_bavail) * st.f_bsize;
  StoreConfig c = host_cfg(d.path, 1);
  c.kinds = {KindConfig{uint64_t{1} << 30, 1.0}};
  c.budget_bytes = free_bytes + (uint64_t{8} << 30);
  try {
    Store s(c);
    FAIL() << "opened a store larger than /dev/shm";
  } catch (const std::system_error& e) {
    EXPECT_EQ(e.code().value(), ENOSPC);
    const std::string m = e.what();
    EXPECT_NE(m.find("\"/dev/shm\""), std::string::npos) << m;
    EXPECT_NE(m.find("tmpfs"), std::string::npos) << m;
    EXPECT_NE(m.find("needs "), std::string::npos) << m;
    EXPECT_NE(m.find(" bytes free"), std::string::npos) << m;
    EXPECT_EQ(m.find('\n'), std::string::npos) << m;
  }
  // D22: the slab file this failed open created is gone; one that existed stays as it was.
  struct stat sst{};
  EXPECT_NE(::stat((d.path + "/host.kind0.slab").c_str(), &sst), 0) << "left behind";
  EXPECT_EQ(errno, ENOENT);
  {
    const int fd = ::open((d.path + "/host.kind0.slab").c_str(), O_CREAT | O_WRONLY, 0600);
    ASSERT_GE(fd, 0);
    ::close(fd);
  }
  EXPECT_THROW(Store{c}, std::system_error);
  ASSERT_EQ(::stat((d.path + "/host.kind0.slab").c_str(), &sst), 0);
  EXPECT_EQ(sst.st_size, 0) << "the slab grew before the space check";

  // Not in memory: the current directory of the test (the build tree) is on a drive here.
  struct statfs cwd{};
  ASSERT_EQ(::statfs(".", &cwd), 0);
  if (cwd.f_type != 0x01021994) {
    try {
      Store s(host_cfg(".", 1));
      FAIL();
    } catch (const std::invalid_argument& e) {
      EXPECT_NE(std::string(e.what()).find("not in memory"), std::string::npos) << e.what();
    }
  }
}

// H1: a larger existing slab is never shrunk (a reader may map it): an error naming the file.
TEST(HostTier, ALargerSlabIsNeverShrunk) {
  ShmDir d;
  { Store s(host_cfg(d.path, 16)); }
  try {
    Store s(host_cfg(d.path, 4));
    FAIL();
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("never shrunk"), std::string::npos) << e.what();
  }
  struct stat st{};
  ASSERT_EQ(::stat((d.path + "/host.kind0.slab").c_str(), &st), 0);
  EXPECT_EQ(static_cast<uint64_t>(st.st_size), kFileHeaderBytes + 16 * slot_bytes_for(kPage));
}

// H4, D1: torn, flipped and foreign slot bytes written into the shared memory under a live
// writer and a live reader are misses, never wrong bytes.
TEST(HostTier, TornFlippedAndForeignSlotsAreMissesForWriterAndReader) {
  ShmDir d, other;
  const uint64_t n = 24;
  Store w(host_cfg(d.path, 32));
  Store o(host_cfg(other.path, 32));  // same name and geometry, another slab id
  for (uint64_t i = 0; i < n; ++i) {
    ASSERT_EQ(put(w, i), kStored);
    ASSERT_EQ(put(o, i), kStored);
  }
  Store r(host_cfg(d.path, 32, ColdStart::kLoad, true));
  const std::string path = d.path + "/host.kind0.slab";
  const int fd = ::open(path.c_str(), O_RDWR);
  const int ofd = ::open((other.path + "/host.kind0.slab").c_str(), O_RDONLY);
  ASSERT_GE(fd, 0);
  ASSERT_GE(ofd, 0);
  const uint64_t sb = slot_bytes_for(kPage);
  std::mt19937_64 rng(19);
  int hits = 0, misses = 0;
  std::vector<uint8_t> buf(sb);
  for (int t = 0; t < 600; ++t) {
    const uint64_t slot = rng() % n;
    const off_t off = static_cast<off_t>(kFileHeaderBytes + slot * sb);
    switch (rng() % 4) {
      case 0: {  // flip a header bit
        uint8_t b;
        ASSERT_EQ(::pread(fd, &b, 1, off + rng() % 64), 1);
        b ^= static_cast<uint8_t>(1u << (rng() % 8));
        ASSERT_EQ(::pwrite(fd, &b, 1, off + rng() % 64), 1);
        break;
      }
      case 1: {  // flip a payload bit
        const off_t p = off + 64 + static_cast<off_t>(rng() % (sb - 64));
        uint8_t b;
        ASSERT_EQ(::pread(fd, &b, 1, p), 1);
        b ^= static_cast<uint8_t>(1u << (rng() % 8));
        ASSERT_EQ(::pwrite(fd, &b, 1, p), 1);
        break;
      }
      case 2: {  // torn: the head of another slot's image
        const size_t len = 1 + rng() % (sb - 1);
        const off_t src = static_cast<off_t>(kFileHeaderBytes + (rng() % n) * sb);
        ASSERT_EQ(::pread(fd, buf.data(), len, src), static_cast<ssize_t>(len));
        ASSERT_EQ(::pwrite(fd, buf.data(), len, off), static_cast<ssize_t>(len));
        break;
      }
      default:  // the same slot of another store's slab (same name: only the slab id differs)
        ASSERT_EQ(::pread(ofd, buf.data(), sb, off), static_cast<ssize_t>(sb));
        ASSERT_EQ(::pwrite(fd, buf.data(), sb, off), static_cast<ssize_t>(sb));
    }
    for (Store* s : {&w, &r}) {
      const int c = read_check(*s, slot);
      ASSERT_GE(c, 0) << "wrong bytes for key " << slot << " in trial " << t;
      (c == 1 ? hits : misses)++;
    }
    if (rng() % 10 == 0)
      for (uint64_t i = 0; i < n; ++i) ASSERT_GE(put(w, i), 0);
    if (rng() % 20 == 0) r.refresh();
  }
  ::close(fd);
  ::close(ofd);
  EXPECT_GT(hits, 0);
  EXPECT_GT(misses, 0);
}

// H4, D3: a writer SIGKILLed at random points (mid-memcpy included) leaves, for `load`, every
// acknowledged page it did not evict, and never wrong bytes.
TEST(HostTier, KillWriterAtRandomPointsThenLoadIsExactOrMiss) {
  ShmDir d;
  std::mt19937_64 rng(23);
  uint64_t next = 0;
  uint64_t checked = 0;
  for (int t = 0; t < 10; ++t) {
    int fds[2];
    ASSERT_EQ(::pipe(fds), 0);
    const uint64_t base = next;
    const pid_t pid = ::fork();
    ASSERT_GE(pid, 0);
    if (pid == 0) {
      ::close(fds[0]);
      try {
        Store s(host_cfg(d.path, 48, t == 0 ? ColdStart::kClear : ColdStart::kLoad));
        for (uint64_t i = base;; ++i)
          if (put(s, i) == kStored && ::write(fds[1], &i, sizeof i) != sizeof i) ::_exit(3);
      } catch (...) {
        ::_exit(2);
      }
    }
    ::close(fds[1]);
    std::this_thread::sleep_for(std::chrono::microseconds(1000 + rng() % 30000));
    ::kill(pid, SIGKILL);
    int status = 0;
    ::waitpid(pid, &status, 0);
    ASSERT_TRUE(WIFSIGNALED(status)) << "child exited early with " << WEXITSTATUS(status);
    std::vector<uint64_t> acked;
    uint64_t v;
    while (::read(fds[0], &v, sizeof v) == sizeof v) acked.push_back(v);
    ::close(fds[0]);
    next = base + acked.size() + 1000;
    Store s(host_cfg(d.path, 48, ColdStart::kLoad));  // the dead writer's lock is gone
    for (size_t j = acked.size() > 5 ? acked.size() - 5 : 0; j < acked.size(); ++j)
      EXPECT_EQ(read_check(s, acked[j]), 1) << "acknowledged key lost: " << acked[j];
    for (uint64_t i = 0; i < base + acked.size() + 2; i += (i < base ? 7 : 1), ++checked)
      ASSERT_GE(read_check(s, i), 0) << "wrong bytes for key " << i;
    const auto st = s.stats();
    EXPECT_EQ(st.kinds[0].entries, st.kinds[0].slots_used);
  }
  EXPECT_GT(checked, 0u);
}

// D14 on the host tier: a reader in another process maps the slabs read-only and serves the
// writer's pages while the writer holds the lock; after the writer is SIGKILLed the reader
// still serves them (the memory outlives the writer) and a new writer loads them.
TEST(HostTier, ReaderInAnotherProcessServesTheWritersPagesAndOutlivesIt) {
  ShmDir d;
  int go[2], done[2];
  ASSERT_EQ(::pipe(go), 0);
  ASSERT_EQ(::pipe(done), 0);
  const pid_t writer = ::fork();
  ASSERT_GE(writer, 0);
  if (writer == 0) {
    try {
      Store s(host_cfg(d.path, 32));
      for (uint64_t i = 0; i < 20; ++i)
        if (put(s, i) != kStored) ::_exit(4);
      char c = 1;
      if (::write(go[1], &c, 1) != 1) ::_exit(3);
      for (;;) ::pause();
    } catch (...) {
      ::_exit(2);
    }
  }
  char c;
  ASSERT_EQ(::read(go[0], &c, 1), 1);
  EXPECT_TRUE(slab_lock_held(d.path + "/host.kind0.slab"));
  EXPECT_THROW(Store(host_cfg(d.path, 32, ColdStart::kLoad)), SlabBusy);
  Store r(host_cfg(d.path, 32, ColdStart::kLoad, true));
  for (uint64_t i = 0; i < 20; ++i) EXPECT_EQ(read_check(r, i), 1) << i;
  ::kill(writer, SIGKILL);
  int status = 0;
  ::waitpid(writer, &status, 0);
  for (uint64_t i = 0; i < 20; ++i) EXPECT_EQ(read_check(r, i), 1) << i;
  EXPECT_EQ(r.refresh(), 20u);
  Store w(host_cfg(d.path, 32, ColdStart::kLoad));
  EXPECT_EQ(w.stats().loaded_entries, 20u);
  for (uint64_t i = 0; i < 20; ++i) EXPECT_EQ(read_check(w, i), 1) << i;
  for (int fd : {go[0], go[1], done[0], done[1]}) ::close(fd);
}

namespace {
int64_t put_copy(Store& s, uint64_t i, bool dirty) {
  std::vector<uint8_t> src(len_of(i));
  for (size_t o = 0; o < src.size(); ++o) src[o] = byte_of(i, o);
  return s.submit_put_copy(0, {key_of(i)}, {src.data()}, {src.size()}, dirty)->wait()[0];
}
std::set<Key> key_set(const std::vector<Key>& v) { return std::set<Key>(v.begin(), v.end()); }
}  // namespace

// D24: a dirty page (a write-back page the disk has not acknowledged) is never evicted: a host
// tier full of them refuses the next put (kFull) instead; the flag is in the slot header, so a
// restart (load) finds exactly the dirty pages again; mark_clean makes a page evictable and
// clears the flag in its header.
TEST(HostTier, DirtyPagesAreNeverEvictedAndSurviveARestartDirty) {
  ShmDir d;
  {
    Store s(host_cfg(d.path, 10));
    for (uint64_t i = 0; i < 10; ++i) ASSERT_EQ(put_copy(s, i, true), kStored) << i;
    EXPECT_EQ(put_copy(s, 10, true), static_cast<int64_t>(PutResult::kFull));
    EXPECT_EQ(put_copy(s, 11, false), static_cast<int64_t>(PutResult::kFull));
    EXPECT_EQ(s.stats().kinds[0].dirty, 10u);
    for (uint64_t i = 0; i < 10; ++i) EXPECT_EQ(read_check(s, i), 1) << i;
    EXPECT_EQ(put_copy(s, 3, false), static_cast<int64_t>(PutResult::kDuplicate));
    EXPECT_EQ(s.stats().kinds[0].dirty, 10u) << "a duplicate put leaves it dirty";
  }
  std::set<Key> dirty;
  for (uint64_t i = 0; i < 10; ++i) dirty.insert(key_of(i));
  {
    Store s(host_cfg(d.path, 10, ColdStart::kLoad));
    EXPECT_EQ(key_set(s.keys(0, true)), dirty);
    EXPECT_EQ(put_copy(s, 10, false), static_cast<int64_t>(PutResult::kFull)) << "still dirty";
    std::vector<Key> clean;
    for (uint64_t i = 0; i < 5; ++i) clean.push_back(key_of(i));
    clean.push_back(key_of(42));  // not there
    EXPECT_EQ(s.mark_clean(0, clean), (std::vector<bool>{true, true, true, true, true, false}));
    EXPECT_EQ(s.mark_clean(0, {key_of(0)}), std::vector<bool>{false}) << "already clean";
    for (uint64_t i = 0; i < 5; ++i) dirty.erase(key_of(i));
    EXPECT_EQ(key_set(s.keys(0, true)), dirty);
    EXPECT_EQ(s.stats().kinds[0].dirty, 5u);
  }
  {
    Store s(host_cfg(d.path, 10, ColdStart::kLoad));
    EXPECT_EQ(key_set(s.keys(0, true)), dirty) << "mark_clean cleared the flag in the header";
    EXPECT_EQ(s.keys(0, false).size(), 10u);
    // New pages evict the clean ones, never a dirty one.
    for (uint64_t i = 100; i < 140; ++i) ASSERT_EQ(put_copy(s, i, false), kStored) << i;
    for (uint64_t i = 5; i < 10; ++i) EXPECT_EQ(read_check(s, i), 1) << i;
    for (uint64_t i = 0; i < 5; ++i) EXPECT_EQ(read_check(s, i), 0) << i;
    EXPECT_EQ(s.stats().kinds[0].dirty, 5u);
    // A delete removes a dirty page.
    EXPECT_TRUE(s.remove(0, key_of(7)));
    EXPECT_EQ(s.stats().kinds[0].dirty, 4u);
  }
  // A reader sees the dirty pages like any other; dirty puts and mark_clean are a writer's and
  // a host store's.
  Store r(host_cfg(d.path, 10, ColdStart::kLoad, true));
  EXPECT_EQ(read_check(r, 5), 1);
  EXPECT_THROW(r.mark_clean(0, {key_of(5)}), std::system_error);
  TempDir disk_dir;
  StoreConfig dc = host_cfg(disk_dir.path, 4);
  dc.host = false;
  Store disk(dc);
  EXPECT_THROW(put_copy(disk, 1, true), std::invalid_argument);
  EXPECT_THROW(disk.mark_clean(0, {key_of(1)}), std::invalid_argument);
}
