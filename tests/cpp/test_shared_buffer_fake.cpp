// region::SharedBuffer on the fake driver (tests/cpp/fake_cuda/vmm.cpp backs exportable handles
// with memfds, so an exported fd imported here or in another process maps the same bytes).
// R<n> = invariant n in csrc/src/region/DESIGN.md.
//
// Some cases need a second process, or a driver table loaded with an entry point hidden (the
// table is loaded once per process): they run this binary again (fork + exec of /proc/self/exe)
// with VITRIFY_SHARED_CHILD set, and the gtest Environment below (set up after UseFakeDriver's)
// does the child's part and exits before any test runs.
#include <fcntl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <gtest/gtest.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <string>
#include <system_error>
#include <vector>

#include "run_self.hpp"
#include "fake_cuda/use_fake.hpp"
#include "vitrify/driver.hpp"
#include "vitrify/error.hpp"
#include "vitrify/shared_buffer.hpp"

extern char** environ;

using vitrify::region::SharedBuffer;

namespace {

constexpr uint64_t kMiB = uint64_t(1) << 20;

uint8_t pattern(uint64_t i, uint8_t seed) { return uint8_t((i * 7 + seed) & 0xff); }

std::vector<uint8_t> bytes_of(uint64_t n, uint8_t seed) {
  std::vector<uint8_t> v(n);
  for (uint64_t i = 0; i < n; ++i) v[i] = pattern(i, seed);
  return v;
}

std::vector<uint8_t> read_all(const SharedBuffer& b) {
  std::vector<uint8_t> v(b.size());
  b.read(0, v.data(), v.size());
  return v;
}

// [reservations, handles, mappings, physical bytes] of the fake, without gtest assertions (the
// child's part reports through its exit status).
struct Live {
  uint64_t reservations = 0, handles = 0, mappings = 0, physical = 0;
  bool operator==(const Live&) const = default;
};
Live live() {
  auto f = reinterpret_cast<void (*)(uint64_t*)>(vitrify::test::fake_symbol("fake_cuda_counts"));
  uint64_t v[5] = {};
  if (f != nullptr) f(v);
  return Live{v[0], v[1], v[2], v[4]};
}
std::ostream& operator<<(std::ostream& os, const Live& l) {
  return os << "{reservations " << l.reservations << ", handles " << l.handles << ", mappings "
            << l.mappings << ", physical " << l.physical << "}";
}

struct Env {
  Env(const char* k, const char* v) : key(k) { ::setenv(k, v, 1); }
  ~Env() { ::unsetenv(key); }
  const char* key;
};

// ---- the child's part -------------------------------------------------------------------------
// VITRIFY_SHARED_CHILD=import (the parent's fake-driver environment is inherited): import VITRIFY_SHARED_FD (inherited) of VITRIFY_SHARED_SIZE bytes,
//   check it holds pattern seed 3, write pattern seed 9 over its first MiB, release; exit kChildOk.
// VITRIFY_SHARED_CHILD=missing: SharedBuffer(1, 0) must be DriverUnavailable naming
//   VITRIFY_SHARED_MISSING (the parent hid it with FAKE_CUDA_MISSING); exit kChildOk.
// The child's success status: not 0, so that a child that ran the whole suite instead of its
// part (exit 0) does not pass.
constexpr int kChildOk = 77;

int child_fail(const std::string& why) {
  std::fprintf(stderr, "child: %s\n", why.c_str());
  return 1;
}

int child_main(const std::string& mode) {
  try {
    if (mode == "import") {
      const int fd = std::atoi(std::getenv("VITRIFY_SHARED_FD"));
      const uint64_t size = std::strtoull(std::getenv("VITRIFY_SHARED_SIZE"), nullptr, 10);
      const Live before = live();
      {
        SharedBuffer b = SharedBuffer::import_fd(fd, size, 0);
        if (!b.imported() || b.size() != size) return child_fail("imported buffer looks wrong");
        if (read_all(b) != bytes_of(size, 3)) return child_fail("the peer sees other bytes");
        const auto mine = bytes_of(kMiB, 9);
        b.write(0, mine.data(), mine.size());
        if (const int r = b.release(); r != 0)
          return child_fail("release() returned " + std::to_string(r));
        if (!(live() == before)) return child_fail("the released import left fake objects");
      }
      if (!(live() == before)) return child_fail("the destructor after release() changed things");
      return kChildOk;
    }
    if (mode == "missing") {
      const std::string name = std::getenv("VITRIFY_SHARED_MISSING");
      try {
        SharedBuffer b(1, 0);
        return child_fail("no throw");
      } catch (const vitrify::DriverUnavailable& e) {
        const std::string m = e.what();
        if (m.find("lacks " + name) == std::string::npos) return child_fail("message: " + m);
      }
      if (!(live() == Live{})) return child_fail("the failed constructor left fake objects");
      return kChildOk;
    }
    return child_fail("unknown mode " + mode);
  } catch (const std::exception& e) {
    return child_fail(std::string("exception: ") + e.what());
  }
}

class ChildMode : public ::testing::Environment {
 public:
  void SetUp() override {
    const char* mode = std::getenv("VITRIFY_SHARED_CHILD");
    if (mode == nullptr || *mode == '\0') return;
    const int rc = child_main(mode);
    std::fflush(stdout);
    std::fflush(stderr);
    ::_exit(rc);
  }
};
[[maybe_unused]] ::testing::Environment* const kChildMode =
    ::testing::AddGlobalTestEnvironment(new ChildMode);

// Runs this binary in child mode with `extra` added to the environment, `keep_fd` (if >= 0)
// inherited; returns its exit status (-1 when it did not exit normally).
int run_child(const std::vector<std::string>& extra, int keep_fd = -1) {
  return vitrify::test::run_self("test_shared_buffer_fake", extra, keep_fd);
}

}  // namespace

TEST(SharedBufferFake, ExportImportInOneProcessSeesTheSameBytes) {  // R14
  ASSERT_NE(vitrify::test::kUseFakeDriver, nullptr);
  const Live before = live();
  {
    SharedBuffer a(3 * kMiB + 1, 0);
    EXPECT_EQ(a.size(), 4 * kMiB);  // rounded up to the 2 MiB granularity
    EXPECT_NE(a.ptr(), 0u);
    EXPECT_EQ(a.device(), 0);
    EXPECT_FALSE(a.imported());
    const auto data = bytes_of(a.size(), 3);
    a.write(0, data.data(), data.size());

    const int fd = a.export_fd();
    ASSERT_GE(fd, 0);
    EXPECT_NE(::fcntl(fd, F_GETFD) & FD_CLOEXEC, 0) << "the exported fd must be close-on-exec";
    SharedBuffer b = SharedBuffer::import_fd(fd, a.size(), 0);
    EXPECT_NE(::fcntl(fd, F_GETFD), -1) << "import_fd must not consume the fd";
    ASSERT_EQ(::close(fd), 0);  // the import holds its own reference
    EXPECT_TRUE(b.imported());
    EXPECT_EQ(b.size(), a.size());
    EXPECT_NE(b.ptr(), a.ptr());
    EXPECT_EQ(read_all(b), data);

    const auto back = bytes_of(kMiB, 5);
    b.write(kMiB, back.data(), back.size());
    std::vector<uint8_t> seen(kMiB);
    a.read(kMiB, seen.data(), seen.size());
    EXPECT_EQ(seen, back);

    const Live now = live();
    EXPECT_EQ(now.reservations, before.reservations + 2);
    EXPECT_EQ(now.handles, before.handles + 2);
    EXPECT_EQ(now.mappings, before.mappings + 2);
    EXPECT_EQ(now.physical, before.physical + 4 * kMiB);  // the import holds no bytes of its own
  }
  EXPECT_EQ(live(), before);
}

TEST(SharedBufferFake, ReleaseInEitherOrderLeavesNothingBehind) {  // R14, R9
  const Live before = live();
  {
    SharedBuffer a(2 * kMiB, 0);
    const auto data = bytes_of(a.size(), 11);
    a.write(0, data.data(), data.size());
    const int fd = a.export_fd();
    SharedBuffer b = SharedBuffer::import_fd(fd, a.size(), 0);
    ::close(fd);
    // The exporter lets go first: the importer's mapping keeps the memory.
    EXPECT_EQ(a.release(), 0);
    EXPECT_TRUE(a.released());
    EXPECT_EQ(a.ptr(), 0u);
    EXPECT_EQ(read_all(b), data);
    EXPECT_EQ(b.release(), 0);
    EXPECT_EQ(b.release(), 0);  // a second release does nothing
    EXPECT_EQ(live(), before);
    std::vector<uint8_t> one(1);
    EXPECT_THROW(b.read(0, one.data(), 1), std::invalid_argument);
    EXPECT_THROW(a.write(0, one.data(), 1), std::invalid_argument);
    EXPECT_THROW((void)a.export_fd(), std::invalid_argument);
  }  // destructors after release() do nothing
  EXPECT_EQ(live(), before);
  {
    SharedBuffer a(2 * kMiB, 0);
    const int fd = a.export_fd();
    SharedBuffer b = SharedBuffer::import_fd(fd, a.size(), 0);
    ::close(fd);
    SharedBuffer moved(std::move(b));
    EXPECT_TRUE(b.released());  // NOLINT(bugprone-use-after-move): moved-from is empty
    EXPECT_EQ(b.release(), 0);  // NOLINT(bugprone-use-after-move)
    EXPECT_FALSE(moved.released());
  }  // the importer (declared last) dies first, then the exporter
  EXPECT_EQ(live(), before);
}

TEST(SharedBufferFake, ASecondProcessImportsTheInheritedFdAndSeesTheBytes) {  // R14
  const Live before = live();
  {
    SharedBuffer a(6 * kMiB, 0);
    const auto data = bytes_of(a.size(), 3);
    a.write(0, data.data(), data.size());
    const int fd = a.export_fd();
    const int rc = run_child({"VITRIFY_SHARED_CHILD=import", "VITRIFY_SHARED_FD=" + std::to_string(fd),
                              "VITRIFY_SHARED_SIZE=" + std::to_string(a.size())},
                             fd);
    ::close(fd);
    EXPECT_EQ(rc, kChildOk) << "the child's reason is on stderr";
    // The child wrote its pattern over the first MiB, through its own mapping.
    std::vector<uint8_t> seen(kMiB);
    a.read(0, seen.data(), seen.size());
    EXPECT_EQ(seen, bytes_of(kMiB, 9));
    std::vector<uint8_t> rest(a.size() - kMiB);
    a.read(kMiB, rest.data(), rest.size());
    EXPECT_EQ(rest, std::vector<uint8_t>(data.begin() + kMiB, data.end()));
  }
  EXPECT_EQ(live(), before);
}

TEST(SharedBufferFake, SizeMismatchOnImportNamesBothSizes) {  // R14
  SharedBuffer a(4 * kMiB, 0);
  const int fd = a.export_fd();
  const Live before = live();
  try {
    (void)SharedBuffer::import_fd(fd, 2 * kMiB, 0);
    ADD_FAILURE() << "no throw";
  } catch (const std::invalid_argument& e) {
    const std::string m = e.what();
    EXPECT_NE(m.find("holds 4194304 bytes"), std::string::npos) << m;
    EXPECT_NE(m.find("not the 2097152 bytes"), std::string::npos) << m;
  }
  EXPECT_THROW((void)SharedBuffer::import_fd(fd, 0, 0), std::invalid_argument);
  EXPECT_THROW((void)SharedBuffer::import_fd(fd, 4 * kMiB, 1), std::invalid_argument);  // 1 device
  EXPECT_EQ(live(), before);
  ::close(fd);
}

TEST(SharedBufferFake, BadFdsAreClearErrors) {  // R14
  const Live before = live();
  EXPECT_THROW((void)SharedBuffer::import_fd(-1, 2 * kMiB, 0), std::invalid_argument);
  // A closed fd: EBADF, naming the fd.
  int p[2];
  ASSERT_EQ(::pipe(p), 0);
  ::close(p[0]);
  ::close(p[1]);
  try {
    (void)SharedBuffer::import_fd(p[0], 2 * kMiB, 0);
    ADD_FAILURE() << "no throw";
  } catch (const std::system_error& e) {
    EXPECT_EQ(e.code().value(), EBADF);
    EXPECT_NE(std::string(e.what()).find("import_fd(fd " + std::to_string(p[0]) + ")"),
              std::string::npos)
        << e.what();
  }
  // An open fd the driver never exported: the driver refuses it, and the call is named.
  const int null_fd = ::open("/dev/null", O_RDONLY | O_CLOEXEC);
  ASSERT_GE(null_fd, 0);
  try {
    (void)SharedBuffer::import_fd(null_fd, 2 * kMiB, 0);
    ADD_FAILURE() << "no throw";
  } catch (const vitrify::CudaError& e) {
    EXPECT_EQ(e.call(), "cuMemImportFromShareableHandle(fd " + std::to_string(null_fd) + ")");
    EXPECT_EQ(e.name(), "CUDA_ERROR_INVALID_VALUE");
  }
  ::close(null_fd);
  EXPECT_EQ(live(), before);
}

TEST(SharedBufferFake, AMissingEntryPointIsDriverUnavailableNamingIt) {  // R14
  for (const char* name : {"cuMemExportToShareableHandle", "cuMemImportFromShareableHandle"}) {
    EXPECT_EQ(run_child({"VITRIFY_SHARED_CHILD=missing", std::string("FAKE_CUDA_MISSING=") + name,
                         std::string("VITRIFY_SHARED_MISSING=") + name}),
              kChildOk)
        << name << ": the child's reason is on stderr";
  }
}

TEST(SharedBufferFake, ADeviceWithoutPosixFdHandlesIsNamed) {  // R14
  const Live before = live();
  Env off("FAKE_CUDA_POSIX_FD", "0");
  try {
    SharedBuffer a(2 * kMiB, 0);
    ADD_FAILURE() << "no throw";
  } catch (const vitrify::Error& e) {
    const std::string m = e.what();
    EXPECT_NE(m.find("device 0 cannot export memory as a POSIX file descriptor"), std::string::npos)
        << m;
    EXPECT_NE(m.find("CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED"),
              std::string::npos)
        << m;
  }
  EXPECT_EQ(live(), before);
}

TEST(SharedBufferFake, EachFailingDriverStepUnwinds) {  // R9, R14
  const Live before = live();
  for (const char* step : {"cuMemCreate", "cuMemAddressReserve", "cuMemMap", "cuMemSetAccess"}) {
    Env fail("FAKE_CUDA_FAIL", step);
    try {
      SharedBuffer a(2 * kMiB, 0);
      ADD_FAILURE() << step << ": no throw";
    } catch (const vitrify::CudaError& e) {
      EXPECT_EQ(e.call(), step);
    }
    EXPECT_EQ(live(), before) << step;
  }
  SharedBuffer a(2 * kMiB, 0);
  const int fd = a.export_fd();
  const Live with_a = live();
  for (const char* step : {"cuMemImportFromShareableHandle", "cuMemAddressReserve", "cuMemMap",
                           "cuMemSetAccess"}) {
    Env fail("FAKE_CUDA_FAIL", step);
    try {
      (void)SharedBuffer::import_fd(fd, a.size(), 0);
      ADD_FAILURE() << step << ": no throw";
    } catch (const vitrify::CudaError& e) {
      EXPECT_EQ(e.call().rfind(step, 0), 0u) << e.call();
    }
    EXPECT_EQ(live(), with_a) << step;  // the adopted handle was released too
  }
  {
    Env fail("FAKE_CUDA_FAIL", "cuMemExportToShareableHandle");
    try {
      (void)a.export_fd();
      ADD_FAILURE() << "no throw";
    } catch (const vitrify::CudaError& e) {
      EXPECT_EQ(e.call(), "cuMemExportToShareableHandle");
      EXPECT_EQ(e.name(), "CUDA_ERROR_UNKNOWN");
    }
  }
  ::close(fd);
}

TEST(SharedBufferFake, CopiesOutsideTheBufferAreRefused) {
  SharedBuffer a(2 * kMiB, 0);
  std::vector<uint8_t> v(16);
  EXPECT_THROW(a.write(2 * kMiB - 8, v.data(), v.size()), std::invalid_argument);
  EXPECT_THROW(a.read(2 * kMiB + 1, v.data(), 0), std::invalid_argument);
  EXPECT_NO_THROW(a.read(2 * kMiB, v.data(), 0));
  EXPECT_THROW(SharedBuffer(0, 0), std::invalid_argument);
}
