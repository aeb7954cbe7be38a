// The region on a real GPU (ctest label `gpu`; skips, saying why, without a driver).
// R<n> = invariant n in csrc/src/region/DESIGN.md.
#include <gtest/gtest.h>

#include <cstring>
#include <vector>

#include "vitrify/driver.hpp"
#include "vitrify/region.hpp"

#define REQUIRE_GPU()                                                                  \
  do {                                                                                 \
    if (!vitrify::driver::available())                                                    \
      GTEST_SKIP() << "no CUDA driver: " << vitrify::driver::unavailable_reason();       \
  } while (0)

using vitrify::Region;
using vitrify::region::kGiB;
using vitrify::region::kMiB;

TEST(RegionGpu, ExactBaseHonouredOrAClearError) {  // R2
  REQUIRE_GPU();
  const uint64_t base = vitrify::region::candidate_bases(4 * kGiB).at(0);
  try {
    Region r(base, 4 * kGiB, 0);
    EXPECT_EQ(r.base(), base);
    // The same range twice in one process cannot be granted: a clear error naming it.
    try {
      Region again(base, 4 * kGiB, 0);
      FAIL() << "a second reservation of " << r.describe() << " succeeded at " << again.base();
    } catch (const vitrify::AddressUnavailable& e) {
      EXPECT_NE(std::string(e.what()).find(vitrify::region::format_range(base, base + 4 * kGiB)),
                std::string::npos) << e.what();
    }
  } catch (const vitrify::AddressUnavailable& e) {
    EXPECT_NE(std::string(e.what()).find(vitrify::region::format_range(base, base + 4 * kGiB)),
              std::string::npos) << e.what();
  }
}

TEST(RegionGpu, AllocateCopyFreeNeverReuses) {  // R1, R6
  REQUIRE_GPU();
  Region r(std::nullopt, 4 * kGiB, 0);
  const uint64_t a = r.allocate(64 * kMiB);
  std::vector<uint8_t> src(64 * kMiB), back(64 * kMiB);
  for (size_t i = 0; i < src.size(); ++i) src[i] = uint8_t(i * 2654435761u >> 11);
  r.write(a, src.data(), src.size());
  r.read(a, back.data(), back.size());
  EXPECT_EQ(std::memcmp(src.data(), back.data(), src.size()), 0);
  r.free(a);
  // Freed memory is unmapped: a raw copy from it fails, and the context stays healthy.
  {
    vitrify::driver::ContextGuard ctx(0);
    EXPECT_NE(vitrify::driver::cu().cuMemcpyDtoH(back.data(), a, 4096), CUDA_SUCCESS);
    EXPECT_EQ(vitrify::driver::cu().cuCtxSynchronize(), CUDA_SUCCESS);
  }
  const uint64_t b = r.allocate(64 * kMiB);
  EXPECT_EQ(b, a + 64 * kMiB);
}

TEST(RegionGpu, PreallocatedBumpAndOutOfSpace) {  // R5, R7
  REQUIRE_GPU();
  Region r(std::nullopt, 2 * kGiB, 0);
  EXPECT_EQ(r.preallocate(kGiB), kGiB);
  const auto before = r.stats().layout.chunks_created;
  std::vector<uint64_t> ptrs;
  for (int i = 0; i < 16; ++i) ptrs.push_back(r.allocate(32 * kMiB));
  EXPECT_EQ(r.stats().layout.chunks_created, before);
  const uint32_t v = 0xC0FFEE;
  r.write(ptrs.back() + 32 * kMiB - 4, &v, 4);
  EXPECT_THROW(r.allocate(2 * kGiB), vitrify::OutOfSpace);
}
