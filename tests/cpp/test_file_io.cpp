// The file-I/O layer (vitrify/file_io.hpp): the direct-I/O parser, the descriptor owner, the
// open routine's O_DIRECT probe and buffered fallback, the full pread/pwrite loops, and the
// messages of their errors. Faults the kernel will not produce on demand (EINTR, short
// transfers, a filesystem that refuses O_DIRECT) are injected through file_io::detail::Syscalls.
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <string>
#include <system_error>
#include <tuple>
#include <utility>
#include <vector>

#include <gtest/gtest.h>

#include "vitrify/aligned.hpp"
#include "vitrify/crc32c.hpp"
#include "vitrify/file_io.hpp"
#include "vitrify/fs.hpp"
#include "odd_files.hpp"

namespace fio = vitrify::file_io;
using fio::DirectIo;

namespace {

struct TempDir {
  std::string path;
  explicit TempDir(const std::string& base = "/tmp") {
    std::string tmpl = base + "/vitrify-file-io-test-XXXXXX";
    if (::mkdtemp(tmpl.data()) == nullptr) throw std::runtime_error("mkdtemp failed");
    path = tmpl;
  }
  ~TempDir() {
    std::error_code ec;
    std::filesystem::remove_all(path, ec);
  }
};

bool is_open(int fd) { return ::fcntl(fd, F_GETFD) != -1; }

std::string error_text(int err) { return std::error_code(err, std::generic_category()).message(); }

// The message of the std::system_error `fn` throws, and its errno.
template <class F>
std::pair<std::string, int> system_error_of(F&& fn) {
  try {
    fn();
  } catch (const std::system_error& e) {
    return {e.what(), e.code().value()};
  }
  return {"(no exception)", 0};
}

// ---- injected transfers: an in-memory file, EINTR and short transfers ----------------------
std::vector<uint8_t> g_file;
int g_calls = 0;          // pread/pwrite calls made
int g_eintr_every = 0;    // every n-th call fails with EINTR (0: never)
size_t g_max_chunk = 0;   // the most one call moves (0: no limit)
int g_fail_errno = 0;     // when set, every call fails with it
bool g_write_nothing = false;

void reset_fakes() {
  g_file.clear();
  g_calls = 0;
  g_eintr_every = 0;
  g_max_chunk = 0;
  g_fail_errno = 0;
  g_write_nothing = false;
}

bool inject_failure() {
  ++g_calls;
  if (g_fail_errno != 0) {
    errno = g_fail_errno;
    return true;
  }
  if (g_eintr_every > 0 && g_calls % g_eintr_every == 0) {
    errno = EINTR;
    return true;
  }
  return false;
}

size_t chunk(size_t n) { return g_max_chunk > 0 ? std::min(n, g_max_chunk) : n; }

ssize_t fake_pread(int, void* buf, size_t n, off_t off) {
  if (inject_failure()) return -1;
  const auto at = static_cast<size_t>(off);
  if (at >= g_file.size()) return 0;
  const size_t k = std::min(chunk(n), g_file.size() - at);
  std::memcpy(buf, g_file.data() + at, k);
  return static_cast<ssize_t>(k);
}

ssize_t fake_pwrite(int, const void* buf, size_t n, off_t off) {
  if (inject_failure()) return -1;
  if (g_write_nothing) return 0;
  const auto at = static_cast<size_t>(off);
  const size_t k = chunk(n);
  if (g_file.size() < at + k) g_file.resize(at + k);
  std::memcpy(g_file.data() + at, buf, k);
  return static_cast<ssize_t>(k);
}

// ---- injected open and probe: a filesystem that refuses O_DIRECT ----------------------------
// fake_open opens the real file without O_DIRECT (so the tests do not depend on the filesystem
// under /tmp) unless it is told to fail.
bool g_probe_supported = true;
int g_probe_calls = 0;
int g_direct_open_errno = 0;  // open with O_DIRECT fails with it (0: the real open decides)
int g_open_eintr = 0;         // this many opens fail with EINTR first
std::vector<int> g_open_flags;

void reset_open_fakes() {
  g_probe_supported = true;
  g_probe_calls = 0;
  g_direct_open_errno = 0;
  g_open_eintr = 0;
  g_open_flags.clear();
}

vitrify::fs::DirectIoProbe fake_probe(const std::string&) {
  ++g_probe_calls;
  vitrify::fs::DirectIoProbe p;
  p.supported = g_probe_supported;
  p.fs_type = "testfs";
  p.reason = g_probe_supported ? "" : "open(O_DIRECT) refused: Invalid argument";
  return p;
}

int fake_open(const char* path, int flags, mode_t perm) {
  g_open_flags.push_back(flags);
  if (g_open_eintr > 0) {
    --g_open_eintr;
    errno = EINTR;
    return -1;
  }
  if ((flags & O_DIRECT) != 0 && g_direct_open_errno != 0) {
    errno = g_direct_open_errno;
    return -1;
  }
  return ::open(path, flags & ~O_DIRECT, perm);
}

fio::detail::Syscalls fakes() {
  fio::detail::Syscalls os = fio::detail::system_calls();
  os.open = fake_open;
  os.pread = fake_pread;
  os.pwrite = fake_pwrite;
  os.probe_direct_io = fake_probe;
  return os;
}

std::vector<uint8_t> pattern(size_t n, uint8_t seed) {
  std::vector<uint8_t> v(n);
  for (size_t i = 0; i < n; ++i) v[i] = static_cast<uint8_t>(i * 131 + seed);
  return v;
}

}  // namespace

// ------------------------------------------------------------------------------- parser
TEST(FileIoParse, AnyCaseAndOneErrorNamingTheValue) {
  EXPECT_EQ(fio::parse_direct_io("auto"), DirectIo::kAuto);
  EXPECT_EQ(fio::parse_direct_io("AUTO"), DirectIo::kAuto);
  EXPECT_EQ(fio::parse_direct_io("On"), DirectIo::kOn);
  EXPECT_EQ(fio::parse_direct_io("oFF"), DirectIo::kOff);
  for (DirectIo m : {DirectIo::kAuto, DirectIo::kOn, DirectIo::kOff})
    EXPECT_EQ(fio::parse_direct_io(fio::direct_io_name(m)), m);
  EXPECT_STREQ(fio::direct_io_name(DirectIo::kOn), "on");
  for (const char* bad : {"maybe", "", " on", "of", "auto\n"}) {
    try {
      fio::parse_direct_io(bad);
      ADD_FAILURE() << "accepted \"" << bad << "\"";
    } catch (const std::invalid_argument& e) {
      EXPECT_EQ(std::string(e.what()),
                "direct_io must be auto, on or off, got \"" + std::string(bad) + "\"");
    }
  }
}

// ------------------------------------------------------------------------------- Fd
TEST(FileIoFd, ClosesExactlyOnceAndMovesOwnership) {
  int raw = ::open("/dev/null", O_RDONLY | O_CLOEXEC);
  ASSERT_GE(raw, 0);
  {
    fio::Fd a(raw);
    EXPECT_TRUE(a);
    fio::Fd b(std::move(a));
    EXPECT_FALSE(a);  // NOLINT(bugprone-use-after-move): a moved-from Fd owns nothing
    EXPECT_EQ(a.get(), -1);
    EXPECT_EQ(b.get(), raw);
    fio::Fd c;
    c = std::move(b);
    EXPECT_EQ(c.get(), raw);
    EXPECT_TRUE(is_open(raw));
  }
  EXPECT_FALSE(is_open(raw));
  // Closed once: the number is free again; a new file takes it, and the owners destroyed above
  // (all moved from) do not close it.
  const int again = ::open("/dev/null", O_RDONLY | O_CLOEXEC);
  ASSERT_GE(again, 0);
  {
    fio::Fd d(again);
    d.reset(again);  // owning the same descriptor again closes nothing
    EXPECT_TRUE(is_open(again));
    const int kept = d.release();
    EXPECT_EQ(kept, again);
  }
  EXPECT_TRUE(is_open(again));  // released: not closed by the owner
  fio::Fd e(again);
  e.reset();
  EXPECT_FALSE(is_open(again));
  EXPECT_FALSE(e);
}

// ------------------------------------------------------------------------------- transfers
TEST(FileIoTransfer, RealFileRoundTripAndShortReadAtEndOfFile) {
  TempDir d;
  const std::string path = d.path + "/f.bin";
  fio::OpenedFile f = fio::open_file(path, O_RDWR | O_CREAT, DirectIo::kOff);
  const auto data = pattern(10000, 3);
  fio::pwrite_full(f.fd.get(), data.data(), data.size(), 0, path);
  EXPECT_EQ(std::filesystem::file_size(path), data.size());
  std::vector<uint8_t> back(20000, 0xEE);
  EXPECT_EQ(fio::pread_full(f.fd.get(), back.data(), 4000, 6000, path), 4000u);
  EXPECT_TRUE(std::equal(data.begin() + 6000, data.end(), back.begin()));
  // Past the end: what there is, then nothing, never an error and never a hang.
  EXPECT_EQ(fio::pread_full(f.fd.get(), back.data(), back.size(), 0, path), data.size());
  EXPECT_TRUE(std::equal(data.begin(), data.end(), back.begin()));
  EXPECT_EQ(back[data.size()], 0xEE);  // nothing written past what was read
  EXPECT_EQ(fio::pread_full(f.fd.get(), back.data(), 100, data.size(), path), 0u);
  EXPECT_EQ(fio::pread_full(f.fd.get(), back.data(), 0, 0, path), 0u);
}

TEST(FileIoWhole, ManyFilesInOneCallWithTheirChecksumsAndSizesChecked) {
  TempDir d;
  std::vector<std::string> paths;
  std::vector<uint64_t> sizes;
  std::vector<std::vector<uint8_t>> contents;
  for (int i = 0; i < 9; ++i) {  // more files than threads, one empty
    contents.push_back(pattern(static_cast<size_t>(i) * 3001, i));
    paths.push_back(d.path + "/f" + std::to_string(i));
    fio::OpenedFile f = fio::open_file(paths.back(), O_RDWR | O_CREAT, DirectIo::kOff);
    fio::pwrite_full(f.fd.get(), contents.back().data(), contents.back().size(), 0, paths.back());
    sizes.push_back(contents.back().size());
  }
  sizes[4] += 1;  // the manifest says one byte more: returned unread, with the real size
  const auto got = fio::read_whole_files(paths, sizes, 4);
  ASSERT_EQ(got.size(), paths.size());
  for (size_t i = 0; i < got.size(); ++i) {
    EXPECT_EQ(got[i].size, contents[i].size()) << i;
    if (i == 4) {
      EXPECT_TRUE(got[i].data.empty());
      continue;
    }
    EXPECT_EQ(got[i].data, contents[i]) << i;
    EXPECT_EQ(got[i].crc32c, vitrify::crc32c(contents[i].data(), contents[i].size())) << i;
  }
  // A missing file or a symlink is an OSError naming the call and the path; nothing is left
  // running (every reader joined before the throw).
  paths.push_back(d.path + "/missing");
  sizes.push_back(1);
  try {
    fio::read_whole_files(paths, sizes, 3);
    FAIL() << "no error";
  } catch (const std::system_error& e) {
    EXPECT_NE(std::string(e.what()).find(d.path + "/missing"), std::string::npos) << e.what();
    EXPECT_EQ(e.code().value(), ENOENT);
  }
  const std::string link = d.path + "/link";
  ASSERT_EQ(::symlink(paths[1].c_str(), link.c_str()), 0);
  EXPECT_EQ(system_error_of([&] { fio::read_whole_files({link}, {sizes[1]}, 1); }).second, ELOOP);
  EXPECT_THROW(fio::read_whole_files({link}, {}, 1), std::invalid_argument);
}

TEST(FileIoTransfer, ReadLoopRetriesEintrAndShortReads) {
  reset_fakes();
  g_file = pattern(1000, 9);
  g_max_chunk = 7;
  g_eintr_every = 3;
  std::vector<uint8_t> back(1000);
  const auto os = fakes();
  EXPECT_EQ(fio::detail::pread_full(os, 5, back.data(), 990, 10, "/x"), 990u);
  EXPECT_TRUE(std::equal(back.begin(), back.begin() + 990, g_file.begin() + 10));
  // 990 bytes at 7 per read = 142 reads, plus the 70 calls (every third) that were interrupted.
  EXPECT_EQ(g_calls, 142 + 70);
  // End of file inside the request: the bytes that are there.
  g_calls = 0;
  EXPECT_EQ(fio::detail::pread_full(os, 5, back.data(), 500, 900, "/x"), 100u);
  EXPECT_TRUE(std::equal(back.begin(), back.begin() + 100, g_file.begin() + 900));
}

TEST(FileIoTransfer, WriteLoopRetriesEintrAndShortWrites) {
  reset_fakes();
  g_max_chunk = 5;
  g_eintr_every = 2;
  const auto data = pattern(333, 1);
  fio::detail::pwrite_full(fakes(), 5, data.data(), data.size(), 17, "/x");
  ASSERT_EQ(g_file.size(), 17u + 333u);
  EXPECT_TRUE(std::equal(data.begin(), data.end(), g_file.begin() + 17));
  EXPECT_EQ(g_calls, 67 * 2 - 1);  // 67 writes, an EINTR before every one but the first
}

TEST(FileIoTransfer, ErrorsNameTheCallThePathTheRangeAndErrno) {
  reset_fakes();
  g_file = pattern(100, 0);
  g_fail_errno = EIO;
  uint8_t buf[64];
  const auto os = fakes();
  const std::string path = "/d/a.slab";
  auto [msg, err] = system_error_of([&] { fio::detail::pread_full(os, 5, buf, 64, 8192, path); });
  EXPECT_EQ(err, EIO);
  EXPECT_EQ(msg, "pread(\"/d/a.slab\", 64 bytes at 8192): " + error_text(EIO));
  std::tie(msg, err) = system_error_of([&] { fio::detail::pwrite_full(os, 5, buf, 64, 0, path); });
  EXPECT_EQ(err, EIO);
  EXPECT_EQ(msg, "pwrite(\"/d/a.slab\", 64 bytes at 0): " + error_text(EIO));
  // A write that moves nothing is an error too, never an endless loop.
  reset_fakes();
  g_write_nothing = true;
  std::tie(msg, err) =
      system_error_of([&] { fio::detail::pwrite_full(os, 5, buf, 64, 4096, path); });
  EXPECT_EQ(err, EIO);
  EXPECT_EQ(msg, "pwrite(\"/d/a.slab\", 64 bytes at 4096, nothing written at byte 4096): " +
                     error_text(EIO));
  reset_fakes();
}

TEST(FileIoTransfer, RealSyscallErrorsComeFromTheKernel) {
  TempDir d;
  const std::string path = d.path + "/ro.bin";
  { fio::OpenedFile w = fio::open_file(path, O_WRONLY | O_CREAT, DirectIo::kOff); }
  fio::OpenedFile ro = fio::open_file(path, O_RDONLY, DirectIo::kOff);
  fio::OpenedFile wo = fio::open_file(path, O_WRONLY, DirectIo::kOff);
  uint8_t buf[16] = {};
  auto [msg, err] = system_error_of([&] { fio::pwrite_full(ro.fd.get(), buf, 16, 0, path); });
  EXPECT_EQ(err, EBADF);
  EXPECT_EQ(msg, "pwrite(\"" + path + "\", 16 bytes at 0): " + error_text(EBADF));
  std::tie(msg, err) = system_error_of([&] { fio::pread_full(wo.fd.get(), buf, 16, 0, path); });
  EXPECT_EQ(err, EBADF);
  EXPECT_EQ(msg, "pread(\"" + path + "\", 16 bytes at 0): " + error_text(EBADF));
}

// ------------------------------------------------------------------------------- open
TEST(FileIoOpen, BufferedWhenOffAndCloseOnExec) {
  TempDir d;
  const std::string path = d.path + "/b.bin";
  fio::OpenedFile f = fio::open_file(path, O_RDWR | O_CREAT, DirectIo::kOff, 0600);
  ASSERT_TRUE(f.fd);
  EXPECT_FALSE(f.direct);
  EXPECT_EQ(f.buffered_reason, "VITRIFY_DIRECT_IO=off");
  EXPECT_NE(::fcntl(f.fd.get(), F_GETFD) & FD_CLOEXEC, 0);
  EXPECT_EQ(::fcntl(f.fd.get(), F_GETFL) & O_DIRECT, 0);
  struct stat st{};
  ASSERT_EQ(::fstat(f.fd.get(), &st), 0);
  EXPECT_EQ(st.st_mode & 0777, 0600u);
}

TEST(FileIoOpen, MissingFileNamesOpenPathAndErrno) {
  for (DirectIo m : {DirectIo::kOff, DirectIo::kOn}) {
    const auto [msg, err] =
        system_error_of([&] { fio::open_file("/tmp/no-such-dir-vitrify/x", O_RDONLY, m); });
    EXPECT_EQ(err, ENOENT);
    EXPECT_EQ(msg, std::string("open(\"/tmp/no-such-dir-vitrify/x\"") +
                       (m == DirectIo::kOn ? ", O_DIRECT" : "") + "): " + error_text(ENOENT));
  }
  // auto probes the directory first: a missing one is its error (stat names it).
  auto [msg, err] = system_error_of([] {
    fio::open_file("/tmp/no-such-dir-vitrify/x", O_RDONLY, DirectIo::kAuto);
  });
  EXPECT_EQ(err, ENOENT);
  EXPECT_EQ(msg, "stat(\"/tmp/no-such-dir-vitrify\"): " + error_text(ENOENT));
}

// Issue 33: every reader of an archive's files opens O_NOFOLLOW | O_NONBLOCK, fstat, regular files
// only: a link swapped in after the Python layer's check is never followed, a FIFO never blocks,
// a directory is no file; each refusal one line naming the call and the path, with its errno.
TEST(FileIoOpen, ReadersRefuseLinksFifosAndDirectoriesPromptlyNamingThePath) {
  TempDir d;
  const std::string good = d.path + "/good.bin";
  const auto data = pattern(5000, 3);
  {
    fio::OpenedFile w = fio::open_file(good, O_WRONLY | O_CREAT, DirectIo::kOff);
    fio::pwrite_full(w.fd.get(), data.data(), data.size(), 0, good);
  }
  const auto odd = vitrify::test::plant_odd_files(d.path, good);
  const std::string fifo = d.path + "/fifo";
  for (const auto& o : odd) {
    for (DirectIo m : {DirectIo::kOff, DirectIo::kAuto, DirectIo::kOn}) {
      SCOPED_TRACE(o.name + ", direct_io=" + fio::direct_io_name(m));
      const auto r = vitrify::test::call_reader(
          [&] { fio::open_for_reading(o.path, m, "module file"); }, fifo);
      EXPECT_TRUE(r.prompt) << "the open blocked";
      EXPECT_EQ(r.err, o.err) << r.message << r.other;
      EXPECT_EQ(r.message, "open(\"" + o.path + "\", read-only): module file is " + o.kind +
                               "; vitrify reads only regular files and never follows a link "
                               "there: " + error_text(o.err));
    }
    // read_whole_files (graph and module files): the same refusal, nothing read.
    const auto r = vitrify::test::call_reader(
        [&] { fio::read_whole_files({good, o.path}, {data.size(), data.size()}, 2); }, fifo);
    EXPECT_TRUE(r.prompt) << o.name << ": read_whole_files blocked";
    EXPECT_EQ(r.err, o.err) << o.name << ": " << r.message << r.other;
    EXPECT_NE(r.message.find("\"" + o.path + "\""), std::string::npos) << r.message;
    EXPECT_NE(r.message.find(std::string("file is ") + o.kind), std::string::npos) << r.message;
  }
  // A regular file still opens: read-only, blocking again, close-on-exec, its bytes.
  fio::OpenedFile f = fio::open_for_reading(good, DirectIo::kOff, "module file");
  EXPECT_EQ(::fcntl(f.fd.get(), F_GETFL) & (O_ACCMODE | O_NONBLOCK), O_RDONLY);
  EXPECT_NE(::fcntl(f.fd.get(), F_GETFD) & FD_CLOEXEC, 0);
  std::vector<uint8_t> back(data.size());
  EXPECT_EQ(fio::pread_full(f.fd.get(), back.data(), back.size(), 0, good), data.size());
  EXPECT_EQ(back, data);
  const auto whole = fio::read_whole_files({good}, {data.size()}, 1);
  EXPECT_EQ(whole.at(0).data, data);
  // /proc/self/fd/<n>: the caller's own descriptor, reopened; of a FIFO still refused at once.
  const std::string own = "/proc/self/fd/" + std::to_string(f.fd.get());
  EXPECT_EQ(fio::read_whole_files({own}, {data.size()}, 1).at(0).data, data);
  fio::Fd fifo_fd(::open(fifo.c_str(), O_RDONLY | O_NONBLOCK | O_CLOEXEC));
  ASSERT_TRUE(fifo_fd);
  const std::string own_fifo = "/proc/self/fd/" + std::to_string(fifo_fd.get());
  const auto r = vitrify::test::call_reader(
      [&] { fio::open_for_reading(own_fifo, DirectIo::kOff, "file"); }, fifo);
  EXPECT_TRUE(r.prompt);
  EXPECT_EQ(r.err, EINVAL) << r.message << r.other;
  EXPECT_EQ(r.message, "open(\"" + own_fifo + "\", read-only): file is a FIFO; vitrify reads "
                       "only regular files and never follows a link there: " +
                           error_text(EINVAL));
  // Another /proc link is a link like any other.
  EXPECT_EQ(system_error_of([] { fio::open_for_reading("/proc/self/exe", DirectIo::kOff, "file"); })
                .second,
            ELOOP);
}

// Real filesystems: auto uses O_DIRECT exactly where the probe says the filesystem takes it.
// /dev/shm is tmpfs, which refuses O_DIRECT before Linux 6.6 (the fallback) and accepts it since.
TEST(FileIoOpen, AutoFollowsTheProbeOnRealFilesystems) {
  for (const char* base : {"/tmp", "/dev/shm"}) {
    if (::access(base, W_OK) != 0) continue;
    TempDir d(base);
    const std::string path = d.path + "/a.bin";
    const auto probe = vitrify::fs::probe_direct_io(d.path);
    fio::OpenedFile f = fio::open_file(path, O_RDWR | O_CREAT, DirectIo::kAuto);
    ASSERT_TRUE(f.fd) << base;
    EXPECT_EQ(f.direct, probe.supported) << base << " (" << probe.fs_type << ")";
    EXPECT_EQ(::fcntl(f.fd.get(), F_GETFL) & O_DIRECT, probe.supported ? O_DIRECT : 0) << base;
    EXPECT_EQ(f.buffered_reason.empty(), probe.supported) << base;
    if (!probe.supported)
      EXPECT_EQ(f.buffered_reason, "O_DIRECT refused in " + d.path + " (" + probe.fs_type +
                                       "): " + probe.reason);
    // Either way the same aligned transfers work.
    vitrify::AlignedBuffer buf(8192), back(8192);
    const auto data = pattern(8192, 5);
    std::memcpy(buf.data(), data.data(), data.size());
    fio::pwrite_full(f.fd.get(), buf.data(), 8192, 4096, path);
    EXPECT_EQ(fio::pread_full(f.fd.get(), back.data(), 8192, 4096, path), 8192u);
    EXPECT_EQ(std::memcmp(buf.data(), back.data(), 8192), 0) << base;
  }
}

// Open against the injected open and probe, in a fresh directory.
class FileIoOpenFake : public ::testing::Test {
 protected:
  void SetUp() override { reset_open_fakes(); }
  void TearDown() override { reset_open_fakes(); }
  fio::OpenedFile open(int flags, DirectIo mode) {
    return fio::detail::open_file(os_, path_, flags, mode, 0644);
  }
  // The message and errno of the std::system_error that open throws.
  std::pair<std::string, int> open_error(int flags, DirectIo mode) {
    return system_error_of([&] { open(flags, mode); });
  }

  TempDir dir_;
  std::string path_ = dir_.path + "/f.bin";
  fio::detail::Syscalls os_ = fakes();
};

TEST_F(FileIoOpenFake, AutoFallsBackWhereTheFilesystemRefusesODirect) {
  // The probe says no: buffered, saying why, and no O_DIRECT open is tried.
  g_probe_supported = false;
  fio::OpenedFile f = open(O_RDWR | O_CREAT, DirectIo::kAuto);
  ASSERT_TRUE(f.fd);
  EXPECT_FALSE(f.direct);
  EXPECT_EQ(f.buffered_reason, "O_DIRECT refused in " + dir_.path +
                                   " (testfs): open(O_DIRECT) refused: Invalid argument");
  EXPECT_EQ(g_probe_calls, 1);
  ASSERT_EQ(g_open_flags.size(), 1u);
  EXPECT_EQ(g_open_flags[0] & O_DIRECT, 0);
  EXPECT_NE(g_open_flags[0] & O_CLOEXEC, 0);
  // The probe says yes but open refuses O_DIRECT (EINVAL): buffered after all.
  reset_open_fakes();
  g_direct_open_errno = EINVAL;
  fio::OpenedFile g = open(O_RDWR, DirectIo::kAuto);
  ASSERT_TRUE(g.fd);
  EXPECT_FALSE(g.direct);
  EXPECT_EQ(g.buffered_reason, "open(O_DIRECT) refused for " + path_);
  ASSERT_EQ(g_open_flags.size(), 2u);
  EXPECT_NE(g_open_flags[0] & O_DIRECT, 0);
  EXPECT_EQ(g_open_flags[1] & O_DIRECT, 0);
  // Another O_DIRECT open failure is an error, not a fallback.
  reset_open_fakes();
  g_direct_open_errno = EACCES;
  const auto [msg, err] = open_error(O_RDWR, DirectIo::kAuto);
  EXPECT_EQ(err, EACCES);
  EXPECT_EQ(msg, "open(\"" + path_ + "\", O_DIRECT): " + error_text(EACCES));
}

TEST_F(FileIoOpenFake, OnNeverFallsBack) {
  g_direct_open_errno = EINVAL;
  const auto [msg, err] = open_error(O_RDWR | O_CREAT, DirectIo::kOn);
  EXPECT_EQ(err, EINVAL);
  EXPECT_EQ(msg, "open(\"" + path_ + "\", O_DIRECT with direct_io=on): " + error_text(EINVAL));
  EXPECT_EQ(g_open_flags.size(), 1u);  // no buffered retry
  EXPECT_EQ(g_probe_calls, 0);         // on does not ask the probe; open decides
  EXPECT_FALSE(std::filesystem::exists(path_));
  // Where open takes O_DIRECT, on opens with it.
  reset_open_fakes();
  fio::OpenedFile f = open(O_RDWR | O_CREAT, DirectIo::kOn);
  EXPECT_TRUE(f.fd);
  EXPECT_TRUE(f.direct);
  EXPECT_TRUE(f.buffered_reason.empty());
  ASSERT_EQ(g_open_flags.size(), 1u);
  EXPECT_NE(g_open_flags[0] & O_DIRECT, 0);
}

TEST_F(FileIoOpenFake, RetriesAnInterruptedOpen) {
  g_open_eintr = 2;
  EXPECT_TRUE(open(O_RDWR | O_CREAT, DirectIo::kOff).fd);
  EXPECT_EQ(g_open_flags.size(), 3u);
  reset_open_fakes();
  g_open_eintr = 1;
  EXPECT_TRUE(open(O_RDWR, DirectIo::kAuto).fd);
  ASSERT_EQ(g_open_flags.size(), 2u);
  EXPECT_NE(g_open_flags[1] & O_DIRECT, 0);  // the retry asks for O_DIRECT again
}

TEST(FileIo, DirectoryOf) {
  EXPECT_EQ(fio::directory_of("/a/b/c.slab"), "/a/b");
  EXPECT_EQ(fio::directory_of("/c.slab"), "/");
  EXPECT_EQ(fio::directory_of("c.slab"), ".");
  EXPECT_EQ(fio::directory_of("a/c.slab"), "a");
}
