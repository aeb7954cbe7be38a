// Exportable regions (invariant R15 in csrc/src/region/DESIGN.md) on the fake driver: a region's
// mapped chunks exported as POSIX fds (Region::export_range) and imported as one contiguous range
// (SharedBuffer::import_fds). The fake backs exportable handles with memfds, so an export
// imported in this process maps the same bytes.
//
// The missing-entry-point case needs a driver table loaded with the entry hidden (the table is
// loaded once per process): it runs this binary again with VITRIFY_EXPORT_CHILD set, and the
// gtest Environment below does the child's part and exits before any test runs.
#include <dirent.h>
#include <fcntl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <gtest/gtest.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <string>
#include <system_error>
#include <utility>
#include <vector>

#include "run_self.hpp"
#include "fake_cuda/use_fake.hpp"
#include "vitrify/driver.hpp"
#include "vitrify/error.hpp"
#include "vitrify/region.hpp"
#include "vitrify/shared_buffer.hpp"

extern char** environ;

using vitrify::Region;
using vitrify::region::ExportedChunk;
using vitrify::region::kGiB;
using vitrify::region::kMiB;
using vitrify::region::SharedBuffer;

namespace {

constexpr uint64_t G = 2 * kMiB;  // the fake's granularity
constexpr int kChildOk = 77;      // not 0: a child that ran the whole suite does not pass

struct Env {
  Env(const char* k, const char* v) : key(k) { ::setenv(k, v, 1); }
  ~Env() { ::unsetenv(key); }
  const char* key;
};

using Counts = vitrify::test::FakeCounts;
Counts counts() { return vitrify::test::fake_counts(); }

uint64_t free_base() {  // a base nobody else in this process uses
  static uint64_t next = 0x510000000000ull;
  next += 64 * kGiB;
  return next;
}

int open_fds() {
  int n = 0;
  DIR* d = ::opendir("/proc/self/fd");
  if (d == nullptr) return -1;
  while (::readdir(d) != nullptr) ++n;
  ::closedir(d);
  return n;
}

std::vector<uint8_t> pattern(uint64_t n, uint8_t seed) {
  std::vector<uint8_t> v(n);
  for (uint64_t i = 0; i < n; ++i) v[i] = uint8_t((i * 13 + seed) & 0xff);
  return v;
}

void close_all(const std::vector<ExportedChunk>& cs) {
  for (const auto& c : cs) ::close(c.fd);
}

template <typename E, typename F>
std::string message_of(F&& f) {
  try {
    f();
  } catch (const E& e) {
    return e.what();
  }
  return "(no throw)";
}

int child_main(const std::string& mode) {
  if (mode != "missing") return 1;
  try {
    Region r(std::nullopt, 8 * kMiB, 0, /*exportable=*/true);
    std::fprintf(stderr, "child: no throw\n");
    return 1;
  } catch (const vitrify::DriverUnavailable& e) {
    if (std::string(e.what()).find("lacks cuMemExportToShareableHandle") == std::string::npos) {
      std::fprintf(stderr, "child: message: %s\n", e.what());
      return 1;
    }
  } catch (const std::exception& e) {
    std::fprintf(stderr, "child: other exception: %s\n", e.what());
    return 1;
  }
  // A plain region does not need the entry point.
  try {
    Region r(std::nullopt, 8 * kMiB, 0);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "child: plain region: %s\n", e.what());
    return 1;
  }
  return kChildOk;
}

class ChildMode : public ::testing::Environment {
 public:
  void SetUp() override {
    const char* mode = std::getenv("VITRIFY_EXPORT_CHILD");
    if (mode == nullptr || *mode == '\0') return;
    const int rc = child_main(mode);
    std::fflush(stderr);
    ::_exit(rc);
  }
};
[[maybe_unused]] ::testing::Environment* const kChildMode =
    ::testing::AddGlobalTestEnvironment(new ChildMode);

int run_child(const std::vector<std::string>& extra) {
  return vitrify::test::run_self("test_region_export_fake", extra);
}

}  // namespace

TEST(RegionExportFake, ExportedChunksImportAsOneRangeSeeingTheSameBytes) {  // R15
  ASSERT_NE(vitrify::test::kUseFakeDriver, nullptr);
  const Counts before = counts();
  const int fds_before = open_fds();
  {
    Region r(free_base(), 64 * kMiB, 0, /*exportable=*/true);
    EXPECT_TRUE(r.exportable());
    EXPECT_EQ(r.granularity(), G);
    // Chunks of 4 MiB: [0,4) [4,8) [8,12) [12,16) [16,20) MiB.
    ASSERT_EQ(r.preallocate(20 * kMiB, 4 * kMiB), 20 * kMiB);
    const uint64_t a = r.allocate(20 * kMiB);  // one live allocation over all of it
    ASSERT_EQ(a, r.base());
    const auto data = pattern(20 * kMiB, 5);
    r.write(a, data.data(), data.size());

    // [5 MiB, 13 MiB + 1): chunks 4, 8 and 12 MiB.
    const auto cs = r.export_range(5 * kMiB, 8 * kMiB + 1);
    ASSERT_EQ(cs.size(), 3u);
    for (size_t i = 0; i < cs.size(); ++i) {
      EXPECT_EQ(cs[i].offset, (4 + 4 * i) * kMiB) << i;
      EXPECT_EQ(cs[i].size, 4 * kMiB) << i;
      ASSERT_GE(cs[i].fd, 0);
      EXPECT_NE(::fcntl(cs[i].fd, F_GETFD) & FD_CLOEXEC, 0) << "exported fds are close-on-exec";
    }
    // A range inside one chunk exports that chunk only.
    {
      const auto one = r.export_range(17 * kMiB, 1);
      ASSERT_EQ(one.size(), 1u);
      EXPECT_EQ(one[0].offset, 16 * kMiB);
      EXPECT_EQ(one[0].size, 4 * kMiB);
      close_all(one);
    }

    std::vector<std::pair<int, uint64_t>> pieces;
    for (const auto& c : cs) pieces.emplace_back(c.fd, c.size);
    SharedBuffer peer = SharedBuffer::import_fds(pieces, 0);
    for (const auto& c : cs) EXPECT_NE(::fcntl(c.fd, F_GETFD), -1) << "import_fds consumed an fd";
    close_all(cs);  // the imported handles hold their own references
    EXPECT_TRUE(peer.imported());
    EXPECT_EQ(peer.size(), 12 * kMiB);
    EXPECT_NE(peer.ptr(), 0u);

    // Region -> import: the whole imported span, across the chunk boundaries, at the same
    // relative offsets (peer offset 0 = region offset 4 MiB).
    std::vector<uint8_t> seen(peer.size());
    peer.read(0, seen.data(), seen.size());
    EXPECT_EQ(seen, std::vector<uint8_t>(data.begin() + 4 * kMiB, data.begin() + 16 * kMiB));

    // Import -> region: a write straddling the boundary between the first and second piece.
    const auto back = pattern(2 * kMiB, 99);
    peer.write(3 * kMiB, back.data(), back.size());  // region [7 MiB, 9 MiB)
    std::vector<uint8_t> got(back.size());
    r.read(a + 7 * kMiB, got.data(), got.size());
    EXPECT_EQ(got, back);

    EXPECT_THROW((void)peer.export_fd(), std::invalid_argument);  // several pieces

    const Counts with = counts();
    EXPECT_EQ(with.reservations, before.reservations + 2);
    EXPECT_EQ(with.mappings, before.mappings + 5 + 3);
    EXPECT_EQ(with.handles, before.handles + 5 + 3);

    EXPECT_EQ(peer.release(), 0);
    EXPECT_TRUE(peer.released());
    EXPECT_EQ(peer.ptr(), 0u);
    const Counts after_peer = counts();
    EXPECT_EQ(after_peer.reservations, before.reservations + 1);
    EXPECT_EQ(after_peer.mappings, before.mappings + 5);
    EXPECT_EQ(after_peer.handles, before.handles + 5);
  }
  EXPECT_EQ(counts(), before);
  EXPECT_EQ(open_fds(), fds_before) << "an fd leaked";
}

TEST(RegionExportFake, AllocateMapsExportableChunksToo) {  // R15
  Region r(free_base(), 16 * kMiB, 0, true);
  const uint64_t a = r.allocate(3 * kMiB);  // one 4 MiB chunk, mapped by allocate
  const auto cs = r.export_range(a - r.base(), 3 * kMiB);
  ASSERT_EQ(cs.size(), 1u);
  EXPECT_EQ(cs[0].offset, 0u);
  EXPECT_EQ(cs[0].size, 4 * kMiB);
  SharedBuffer peer = SharedBuffer::import_fds({{cs[0].fd, cs[0].size}}, 0);
  close_all(cs);
  const auto data = pattern(3 * kMiB, 1);
  r.write(a, data.data(), data.size());
  std::vector<uint8_t> seen(data.size());
  peer.read(0, seen.data(), seen.size());
  EXPECT_EQ(seen, data);
  // A single-piece import_fds may be exported again, like an import_fd buffer.
  const int fd = peer.export_fd();
  EXPECT_GE(fd, 0);
  ::close(fd);
}

TEST(RegionExportFake, ExportErrorsAreClear) {  // R15
  const int fds_before = open_fds();
  {
    Region plain(free_base(), 16 * kMiB, 0);
    EXPECT_FALSE(plain.exportable());
    plain.preallocate(4 * kMiB, 2 * kMiB);
    const std::string m = message_of<vitrify::Error>([&] { (void)plain.export_range(0, 1); });
    EXPECT_NE(m.find("created without exportable=True"), std::string::npos) << m;

    Region r(free_base(), 16 * kMiB, 0, true);
    r.preallocate(6 * kMiB, 2 * kMiB);  // [0, 6 MiB) mapped
    EXPECT_NE(message_of<std::invalid_argument>([&] { (void)r.export_range(0, 0); })
                  .find("nbytes must be positive"),
              std::string::npos);
    EXPECT_NE(message_of<std::invalid_argument>([&] { (void)r.export_range(15 * kMiB, 2 * kMiB); })
                  .find("runs outside the region"),
              std::string::npos);
    EXPECT_NE(message_of<std::invalid_argument>([&] { (void)r.export_range(17 * kMiB, 1); })
                  .find("runs outside the region"),
              std::string::npos);
    EXPECT_NE(message_of<std::invalid_argument>([&] { (void)r.export_range(1, UINT64_MAX); })
                  .find("runs outside the region"),
              std::string::npos);
    // [4 MiB, 8 MiB): the first unmapped offset is 6 MiB.
    const std::string u =
        message_of<std::invalid_argument>([&] { (void)r.export_range(4 * kMiB, 4 * kMiB); });
    EXPECT_NE(u.find("offset " + std::to_string(6 * kMiB) + " "), std::string::npos) << u;
    EXPECT_NE(u.find("is not mapped"), std::string::npos) << u;
    const std::string u2 =
        message_of<std::invalid_argument>([&] { (void)r.export_range(10 * kMiB, 1); });
    EXPECT_NE(u2.find("offset " + std::to_string(10 * kMiB) + " "), std::string::npos) << u2;
    r.close();
    EXPECT_THROW((void)r.export_range(0, 1), vitrify::Error);
  }
  EXPECT_EQ(open_fds(), fds_before) << "a failed export leaked an fd";
}

TEST(RegionExportFake, AFailingExportPartWayClosesTheFdsAlreadyMade) {  // R15
  Region r(free_base(), 16 * kMiB, 0, true);
  r.preallocate(8 * kMiB, 2 * kMiB);  // 4 chunks
  const int fds_before = open_fds();
  {
    Env fail("FAKE_CUDA_FAIL_AFTER", "cuMemExportToShareableHandle:2");  // the third fails
    try {
      (void)r.export_range(0, 8 * kMiB);
      ADD_FAILURE() << "no throw";
    } catch (const vitrify::CudaError& e) {
      EXPECT_EQ(e.call(), "cuMemExportToShareableHandle");
      EXPECT_EQ(e.name(), "CUDA_ERROR_UNKNOWN");
    }
  }
  EXPECT_EQ(open_fds(), fds_before) << "the two fds made before the failure leaked";
  // The region is unharmed: the export works now.
  const auto cs = r.export_range(0, 8 * kMiB);
  EXPECT_EQ(cs.size(), 4u);
  close_all(cs);
  EXPECT_EQ(open_fds(), fds_before);
}

TEST(RegionExportFake, AFailingImportPartWayLeavesNothingMapped) {  // R15, R9
  Region r(free_base(), 16 * kMiB, 0, true);
  r.preallocate(8 * kMiB, 2 * kMiB);
  const auto cs = r.export_range(0, 8 * kMiB);
  ASSERT_EQ(cs.size(), 4u);
  std::vector<std::pair<int, uint64_t>> pieces;
  for (const auto& c : cs) pieces.emplace_back(c.fd, c.size);
  const Counts before = counts();
  const int fds_before = open_fds();
  for (const char* step : {"cuMemImportFromShareableHandle:2", "cuMemMap:2", "cuMemSetAccess:3",
                           "cuMemAddressReserve:0"}) {
    Env fail("FAKE_CUDA_FAIL_AFTER", step);
    try {
      (void)SharedBuffer::import_fds(pieces, 0);
      ADD_FAILURE() << step << ": no throw";
    } catch (const vitrify::CudaError& e) {
      const std::string name(step, std::strchr(step, ':'));
      EXPECT_EQ(e.call().rfind(name, 0), 0u) << e.call();
    }
    EXPECT_EQ(counts(), before) << step << ": something stayed mapped, imported or reserved";
    EXPECT_EQ(open_fds(), fds_before) << step;
  }
  // The same pieces import fine afterwards.
  SharedBuffer ok = SharedBuffer::import_fds(pieces, 0);
  EXPECT_EQ(ok.size(), 8 * kMiB);
  EXPECT_EQ(ok.release(), 0);
  EXPECT_EQ(counts(), before);
  close_all(cs);
}

TEST(RegionExportFake, ImportFdsArgumentErrors) {  // R15
  Region r(free_base(), 16 * kMiB, 0, true);
  r.preallocate(4 * kMiB, 4 * kMiB);
  const auto cs = r.export_range(0, 1);
  ASSERT_EQ(cs.size(), 1u);
  const int fd = cs[0].fd;
  const Counts before = counts();
  EXPECT_THROW((void)SharedBuffer::import_fds({}, 0), std::invalid_argument);
  EXPECT_THROW((void)SharedBuffer::import_fds({{-1, G}}, 0), std::invalid_argument);
  EXPECT_THROW((void)SharedBuffer::import_fds({{fd, 0}}, 0), std::invalid_argument);
  EXPECT_THROW((void)SharedBuffer::import_fds({{fd, 4 * kMiB}}, 1), std::invalid_argument);
  const std::string g = message_of<std::invalid_argument>(
      [&] { (void)SharedBuffer::import_fds({{fd, 4 * kMiB}, {fd, kMiB}}, 0); });
  EXPECT_NE(g.find("piece 1"), std::string::npos) << g;
  EXPECT_NE(g.find("not a multiple of the allocation granularity 2097152"), std::string::npos) << g;
  const std::string s =
      message_of<std::invalid_argument>([&] { (void)SharedBuffer::import_fds({{fd, 2 * kMiB}}, 0); });
  EXPECT_NE(s.find("holds 4194304 bytes"), std::string::npos) << s;
  int p[2];
  ASSERT_EQ(::pipe(p), 0);
  ::close(p[0]);
  ::close(p[1]);
  EXPECT_THROW((void)SharedBuffer::import_fds({{fd, 4 * kMiB}, {p[0], 4 * kMiB}}, 0),
               std::system_error);
  EXPECT_EQ(counts(), before);
  close_all(cs);
}

TEST(RegionExportFake, ADeviceWithoutPosixFdHandlesIsNamed) {  // R15
  const Counts before = counts();
  Env off("FAKE_CUDA_POSIX_FD", "0");
  const std::string m =
      message_of<vitrify::Error>([&] { Region r(free_base(), 16 * kMiB, 0, true); });
  EXPECT_NE(m.find("device 0 cannot export memory as a POSIX file descriptor"), std::string::npos)
      << m;
  EXPECT_NE(m.find("CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED"),
            std::string::npos)
      << m;
  EXPECT_NE(m.find("an exportable region"), std::string::npos) << m;
  EXPECT_EQ(counts(), before);
  Region plain(free_base(), 16 * kMiB, 0);  // a plain region does not ask
  EXPECT_EQ(plain.preallocate(2 * kMiB, 2 * kMiB), 2 * kMiB);
}

TEST(RegionExportFake, AMissingExportEntryPointIsDriverUnavailableNamingIt) {  // R15
  EXPECT_EQ(run_child({"VITRIFY_EXPORT_CHILD=missing",
                       "FAKE_CUDA_MISSING=cuMemExportToShareableHandle"}),
            kChildOk)
      << "the child's reason is on stderr";
}
