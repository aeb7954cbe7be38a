// GPU tests of span snapshots over real VMM mappings (ctest label `gpu`; skip without a driver).
// Each test builds its own ScratchSpan: a reservation with chosen 2 MiB granules mapped.
#include <gtest/gtest.h>

#include <cstring>
#include <unistd.h>

#include <filesystem>
#include <random>
#include <vector>

#include "vitrify/driver.hpp"
#include "vitrify/snapshot.hpp"

using namespace vitrify::snapshot;

#define REQUIRE_GPU()                                                                  \
  do {                                                                                 \
    if (!vitrify::driver::available())                                                    \
      GTEST_SKIP() << "no CUDA driver: " << vitrify::driver::unavailable_reason();       \
  } while (0)

namespace {

std::vector<uint8_t> pattern(size_t n, uint32_t seed) {
  std::vector<uint8_t> v(n);
  std::mt19937 rng(seed);
  for (auto& b : v) b = static_cast<uint8_t>(rng());
  return v;
}

// Writes `host` to the mapped granules of the span (holes skipped).
void write_mapped(const ScratchSpan& s, const std::vector<bool>& mapped,
                  const std::vector<uint8_t>& host) {
  vitrify::driver::ContextGuard ctx(s.device());
  const uint64_t g = s.granularity();
  for (size_t i = 0; i < mapped.size(); ++i)
    if (mapped[i]) VITRIFY_CU(vitrify::driver::cu().cuMemcpyHtoD(s.base() + i * g, host.data() + i * g, g));
}

std::vector<uint8_t> read_granule(const ScratchSpan& s, size_t i) {
  vitrify::driver::ContextGuard ctx(s.device());
  std::vector<uint8_t> out(s.granularity());
  VITRIFY_CU(vitrify::driver::cu().cuMemcpyDtoH(out.data(), s.base() + i * s.granularity(), out.size()));
  return out;
}

void expect_context_healthy(const ScratchSpan& s, size_t mapped_granule) {
  vitrify::driver::ContextGuard ctx(s.device());
  ASSERT_EQ(vitrify::driver::cu().cuCtxSynchronize(), CUDA_SUCCESS)
      << "the context is broken after copies over a hole";
  std::vector<uint8_t> tmp(4096);
  ASSERT_EQ(vitrify::driver::cu().cuMemcpyDtoH(tmp.data(),
                                            s.base() + mapped_granule * s.granularity(), 4096),
            CUDA_SUCCESS)
      << "a copy after the failed trial copies did not succeed";
}

}  // namespace

TEST(SnapshotGpu, FullyMappedSpanIsOneIntervalAndRestoresBitExact) {
  REQUIRE_GPU();
  const std::vector<bool> mapped(16, true);
  ScratchSpan s(0, 16 * (2 << 20), 0, mapped);
  ASSERT_EQ(s.granularity(), 2u << 20) << "the tests assume the H200's 2 MiB granularity";
  const uint64_t g = s.granularity();
  const auto host = pattern(s.size(), 11);
  write_mapped(s, mapped, host);
  auto be = make_driver_backend(0);
  const Snapshot snap = dump(*be, s.base(), 0, s.size(), g, /*pin=*/true);
  ASSERT_EQ(snap.intervals, (Intervals{{0, s.size()}}));
  ASSERT_EQ(std::memcmp(snap.data.data(), host.data(), s.size()), 0);
  write_mapped(s, mapped, pattern(s.size(), 12));  // overwrite, then restore
  const RestoreStats st = restore(*be, snap, s.base(), s.size());
  EXPECT_EQ(st.bytes_written, s.size());
  for (size_t i = 0; i < 16; ++i)
    ASSERT_EQ(std::memcmp(read_granule(s, i).data(), host.data() + i * g, g), 0) << "granule " << i;
}

TEST(SnapshotGpu, HolesAreSkippedAndTheContextStaysHealthy) {
  REQUIRE_GPU();
  // granules: 0 hole | 1 2 mapped | 3 4 hole | 5..8 mapped | 9 hole
  const std::vector<bool> mapped{false, true, true, false, false, true, true, true, true, false};
  ScratchSpan s(0, mapped.size() * (2 << 20), 0, mapped);
  const uint64_t g = s.granularity();
  const auto host = pattern(s.size(), 21);
  write_mapped(s, mapped, host);
  auto be = make_driver_backend(0);
  // The single copy over the whole span must fail (proves the fallback path runs here).
  {
    std::vector<uint8_t> tmp(s.size());
    EXPECT_FALSE(be->try_to_host(tmp.data(), s.base(), s.size()))
        << "cuMemcpyDtoH over unmapped granules did not fail with CUDA_ERROR_INVALID_VALUE";
  }
  expect_context_healthy(s, 1);
  const Snapshot snap = dump(*be, s.base(), 0, s.size(), g);
  ASSERT_EQ(snap.intervals, (Intervals{{g, 3 * g}, {5 * g, 9 * g}}));
  EXPECT_EQ(std::memcmp(snap.data.data(), host.data() + g, 2 * g), 0);
  EXPECT_EQ(std::memcmp(snap.data.data() + 2 * g, host.data() + 5 * g, 4 * g), 0);
  expect_context_healthy(s, 5);
  // Unaligned span edges inside mapped granules.
  const Snapshot u = dump(*be, s.base(), g + 4096, 6 * g + 100, g);
  EXPECT_EQ(u.intervals, (Intervals{{g + 4096, 3 * g}, {5 * g, 6 * g + 100}}));
  expect_context_healthy(s, 8);
}

TEST(SnapshotGpu, RestoreIsClampedBelowTheCeiling) {
  REQUIRE_GPU();
  const std::vector<bool> mapped(8, true);
  ScratchSpan s(0, 8 * (2 << 20), 0, mapped);
  const uint64_t g = s.granularity();
  const auto a = pattern(s.size(), 31), b = pattern(s.size(), 32);
  write_mapped(s, mapped, a);
  auto be = make_driver_backend(0);
  const Snapshot snap = dump(*be, s.base(), 0, s.size(), g, true);
  write_mapped(s, mapped, b);
  const uint64_t ceiling = 5 * g + 12345;
  const RestoreStats st = restore(*be, snap, s.base(), ceiling);
  EXPECT_EQ(st.bytes_written, ceiling);
  EXPECT_EQ(st.bytes_dropped, s.size() - ceiling);
  std::vector<uint8_t> back(s.size());
  {
    vitrify::driver::ContextGuard ctx(0);
    VITRIFY_CU(vitrify::driver::cu().cuMemcpyDtoH(back.data(), s.base(), s.size()));
  }
  EXPECT_EQ(std::memcmp(back.data(), a.data(), ceiling), 0) << "below the ceiling: the snapshot";
  EXPECT_EQ(std::memcmp(back.data() + ceiling, b.data() + ceiling, s.size() - ceiling), 0)
      << "at/above the ceiling: untouched";
}

TEST(SnapshotGpu, SpanFileRoundTripWithHoles) {
  REQUIRE_GPU();
  const std::vector<bool> mapped{true, true, false, true, true, true, false, false, true, true};
  ScratchSpan s(0, mapped.size() * (2 << 20), 0, mapped);
  const uint64_t g = s.granularity();
  const auto host = pattern(s.size(), 41);
  write_mapped(s, mapped, host);
  auto be = make_driver_backend(0);
  const auto dir = std::filesystem::temp_directory_path() / ("vitrify-gpu-span-" + std::to_string(::getpid()));
  std::filesystem::create_directories(dir);
  const std::string path = (dir / "s.span").string();
  FileOptions opt;
  opt.chunk_bytes = 3 * g;  // chunks straddle holes
  opt.granularity = g;
  const FileStats ds = dump_to_file(*be, s.base(), 0, s.size(), path, opt);
  const Intervals want{{0, 2 * g}, {3 * g, 6 * g}, {8 * g, 10 * g}};
  EXPECT_EQ(ds.intervals, want);
  write_mapped(s, mapped, pattern(s.size(), 42));
  const FileStats rs = restore_from_file(*be, path, s.base(), s.size(), opt);
  EXPECT_EQ(rs.intervals, want);
  for (size_t i = 0; i < mapped.size(); ++i)
    if (mapped[i])
      ASSERT_EQ(std::memcmp(read_granule(s, i).data(), host.data() + i * g, g), 0) << "granule " << i;
  expect_context_healthy(s, 0);
  std::filesystem::remove_all(dir);
}
