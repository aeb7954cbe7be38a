// What the KV stores do to the files at their paths (issue 32; csrc/src/disk/DESIGN.md D13,
// D22, H2): a link or any non-regular file where a store writes is refused naming it, its
// target untouched; a failed open (a full filesystem) removes the slab files it created and
// gives the space back.
#include <fcntl.h>
#include <sys/mount.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <filesystem>
#include <memory>
#include <fstream>
#include <sstream>
#include <string>
#include <system_error>
#include <vector>

#include <gtest/gtest.h>

#include "temp_dir.hpp"
#include "vitrify/disk.hpp"
#include "vitrify/error.hpp"

namespace fs = std::filesystem;
using namespace vitrify::disk;
using vitrify::test::TempDir;

namespace {

StoreConfig cfg_of(const std::string& dir, bool host = false, uint64_t slots = 8) {
  StoreConfig c;
  c.dirs = {dir};
  c.kinds = {KindConfig{4000, 1.0}};
  c.budget_bytes = kFileHeaderBytes + slots * slot_bytes_for(4000);
  c.name = "safe";
  c.write_threads = 1;
  c.read_threads = 1;
  c.host = host;
  return c;
}

std::string read_all(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::ostringstream o;
  o << in.rdbuf();
  return o.str();
}

void write_all(const std::string& path, const std::string& bytes) {
  std::ofstream(path, std::ios::binary) << bytes;
}

// The std::system_error opening `c` throws (fails the test when it opens).
std::system_error open_error(const StoreConfig& c) {
  try {
    Store s(c);
  } catch (const std::system_error& e) {
    return e;
  }
  ADD_FAILURE() << "the store opened";
  return std::system_error(0, std::generic_category());
}

std::vector<std::string> names_in(const std::string& dir) {
  std::vector<std::string> out;
  for (const auto& e : fs::directory_iterator(dir)) out.push_back(e.path().filename().string());
  return out;
}

// A tmpfs of `bytes` mounted on a fresh directory (root only), unmounted at the end.
struct SmallTmpfs {
  TempDir at;
  bool mounted = false;
  std::string why;
  explicit SmallTmpfs(uint64_t bytes) {
    const std::string opts = "size=" + std::to_string(bytes) + ",mode=0700";
    if (::mount("tmpfs", at.path.c_str(), "tmpfs", 0, opts.c_str()) == 0)
      mounted = true;
    else
      why = std::string("mount -t tmpfs -o ") + opts + ": " + std::strerror(errno) +
            " (needs root with CAP_SYS_ADMIN)";
  }
  ~SmallTmpfs() {
    if (mounted) ::umount2(at.path.c_str(), MNT_DETACH);
  }
  uint64_t free_bytes() const {
    struct statvfs v{};
    EXPECT_EQ(::statvfs(at.path.c_str(), &v), 0);
    return static_cast<uint64_t>(v.f_bavail) * v.f_frsize;
  }
};

}  // namespace

// A link at the slab path (to a user's 3-byte file) is refused naming the slab path; the user's
// file keeps its bytes. The same for a host slab, for a reader, and for a FIFO (never blocks).
TEST(SlabSafety, ALinkOrANonRegularFileAtTheSlabPathIsRefusedAndItsTargetUntouched) {
  for (const bool host : {false, true}) {
    TempDir user;
    const std::string target = user.path + "/notes.txt";
    write_all(target, "abc");
    auto dir = std::make_unique<TempDir>(host ? "/dev/shm" : nullptr);
    const std::string slab = dir->path + "/safe.kind0.slab";
    ASSERT_EQ(::symlink(target.c_str(), slab.c_str()), 0);
    const std::system_error e = open_error(cfg_of(dir->path, host));
    EXPECT_EQ(e.code().value(), ELOOP);
    const std::string m = e.what();
    EXPECT_NE(m.find("\"" + slab + "\" is a symbolic link"), std::string::npos) << m;
    EXPECT_EQ(m.find('\n'), std::string::npos) << m;
    EXPECT_EQ(read_all(target), "abc");
    EXPECT_EQ(fs::file_size(target), 3u);
    StoreConfig reader = cfg_of(dir->path, host);
    reader.read_only = true;
    EXPECT_EQ(open_error(reader).code().value(), ELOOP);
    EXPECT_EQ(read_all(target), "abc");
    // A dangling link is not followed either (O_CREAT would create its target).
    ASSERT_EQ(::unlink(slab.c_str()), 0);
    const std::string absent = user.path + "/would-be-created";
    ASSERT_EQ(::symlink(absent.c_str(), slab.c_str()), 0);
    EXPECT_EQ(open_error(cfg_of(dir->path, host)).code().value(), ELOOP);
    EXPECT_FALSE(fs::exists(absent));
    // A FIFO: refused at once (opening it for reading would wait for a writer forever).
    ASSERT_EQ(::unlink(slab.c_str()), 0);
    ASSERT_EQ(::mkfifo(slab.c_str(), 0600), 0);
    const std::system_error f = open_error(cfg_of(dir->path, host));
    EXPECT_EQ(f.code().value(), EINVAL);
    EXPECT_NE(std::string(f.what()).find("\"" + slab + "\" is a FIFO"), std::string::npos)
        << f.what();
    EXPECT_EQ(open_error(reader).code().value(), EINVAL);
    EXPECT_EQ(read_slab_header(slab), std::nullopt);
    EXPECT_FALSE(slab_lock_held(slab));
  }
}

// The owner record and its temporary file are never written through a link: a link at either
// name is replaced or removed, its target keeps its bytes, and the record names this process.
TEST(SlabSafety, TheOwnerRecordIsNeverWrittenThroughALink) {
  TempDir user, dir;
  const std::string a = user.path + "/a.txt", b = user.path + "/b.txt";
  write_all(a, "abc");
  write_all(b, "xyz");
  const std::string slab = dir.path + "/safe.kind0.slab";
  const std::string record = slab_owner_path(slab);
  const std::string tmp = record + "." + std::to_string(::getpid()) + ".tmp";
  ASSERT_EQ(::symlink(a.c_str(), record.c_str()), 0);
  ASSERT_EQ(::symlink(b.c_str(), tmp.c_str()), 0);
  {
    Store s(cfg_of(dir.path));
    EXPECT_EQ(read_slab_owner(slab).pid, ::getpid());
    EXPECT_FALSE(fs::is_symlink(record));
    EXPECT_FALSE(fs::exists(tmp));
  }
  EXPECT_EQ(read_all(a), "abc");
  EXPECT_EQ(read_all(b), "xyz");
  // A FIFO where a refused opener reads the record never blocks it: no record.
  ASSERT_EQ(::mkfifo(record.c_str(), 0600), 0);
  EXPECT_EQ(read_slab_owner(slab).pid, -1);
}

// D22: a store that cannot get its space on a full filesystem (posix_fallocate: ENOSPC) fails
// with one line and leaves the filesystem as it found it: the slab file it created is gone and
// the space is free again; a slab that existed keeps its bytes.
TEST(SlabSafety, AFailedOpenOnAFullFilesystemRemovesWhatItCreated) {
  SmallTmpfs small(8 << 20);
  if (!small.mounted) GTEST_SKIP() << small.why;
  const uint64_t free_before = small.free_bytes();
  StoreConfig c = cfg_of(small.at.path, false, (32u << 20) / slot_bytes_for(4000));
  const std::system_error e = open_error(c);
  EXPECT_EQ(e.code().value(), ENOSPC) << e.what();
  EXPECT_NE(std::string(e.what()).find("safe.kind0.slab"), std::string::npos) << e.what();
  EXPECT_EQ(names_in(small.at.path), std::vector<std::string>{});
  EXPECT_EQ(small.free_bytes(), free_before);
  // Two kinds: the first slab fits, the second does not; both are removed.
  StoreConfig two = c;
  two.kinds = {KindConfig{4000, 1.0}, KindConfig{4000, 1.0}};
  two.budget_bytes = 2 * (kFileHeaderBytes + ((6u << 20) / slot_bytes_for(4000)) * slot_bytes_for(4000));
  EXPECT_EQ(open_error(two).code().value(), ENOSPC);
  EXPECT_EQ(names_in(small.at.path), std::vector<std::string>{});
  EXPECT_EQ(small.free_bytes(), free_before);
  // An existing file at the slab path is not this open's to remove: it keeps its bytes.
  // (It is not a vitrify slab either, so the open refuses it before allocating anything.)
  write_all(small.at.path + "/safe.kind0.slab", "abc");
  try {
    Store s(c);
    ADD_FAILURE() << "a user's file at the slab path was opened as a slab";
  } catch (const std::exception& e) {
    EXPECT_NE(std::string(e.what()).find("is not a vitrify slab"), std::string::npos) << e.what();
  }
  EXPECT_EQ(read_all(small.at.path + "/safe.kind0.slab"), "abc");
  EXPECT_EQ(names_in(small.at.path), std::vector<std::string>{"safe.kind0.slab"});
  // And a store that fits opens, works and leaves its files.
  ASSERT_EQ(::unlink((small.at.path + "/safe.kind0.slab").c_str()), 0);
  {
    Store s(cfg_of(small.at.path));
    EXPECT_EQ(s.stats().kinds.at(0).slots_total, 8u);
  }
  EXPECT_TRUE(fs::exists(small.at.path + "/safe.kind0.slab"));
}

// D22 for a host store: the space check refuses before growth, and the empty slab files the
// open created are removed.
TEST(SlabSafety, AHostStoreRefusedForSpaceLeavesNoFile) {
  SmallTmpfs small(8 << 20);
  if (!small.mounted) GTEST_SKIP() << small.why;
  StoreConfig c = cfg_of(small.at.path, true, (32u << 20) / slot_bytes_for(4000));
  const std::system_error e = open_error(c);
  EXPECT_EQ(e.code().value(), ENOSPC);
  EXPECT_EQ(names_in(small.at.path), std::vector<std::string>{});
}
