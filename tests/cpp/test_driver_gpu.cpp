// GPU tests of the driver seam (ctest label `gpu`). They skip, saying why, without a driver.
#include <gtest/gtest.h>

#include <cstring>
#include <vector>

#include "vitrify/device_memory.hpp"
#include "vitrify/driver.hpp"

#define REQUIRE_GPU()                                                                  \
  do {                                                                                 \
    if (!vitrify::driver::available())                                                    \
      GTEST_SKIP() << "no CUDA driver: " << vitrify::driver::unavailable_reason();       \
  } while (0)

TEST(DriverGpu, DeviceInfo) {
  REQUIRE_GPU();
  ASSERT_GE(vitrify::driver::device_count(), 1);
  const auto i = vitrify::driver::device_info(0);
  EXPECT_FALSE(i.name.empty());
  EXPECT_GE(i.sm_major, 7);
  EXPECT_GT(i.total_bytes, size_t(1) << 30);
  if (i.vmm_supported) {
    EXPECT_GT(i.granularity_min, 0u);
    EXPECT_EQ(i.granularity_min & (i.granularity_min - 1), 0u) << "power of two";
  }
  EXPECT_THROW(vitrify::driver::device_info(vitrify::driver::device_count()), std::invalid_argument);
}

TEST(DriverGpu, AllocCopyFreeThroughTheTable) {
  REQUIRE_GPU();
  const size_t n = 64 << 20;
  std::vector<uint8_t> src(n), back(n);
  for (size_t i = 0; i < n; ++i) src[i] = static_cast<uint8_t>(i * 2654435761u >> 13);
  {
    vitrify::DeviceBuffer b(n, 0);
    EXPECT_NE(b.ptr(), 0u);
    b.copy_from_host(src.data(), n);
    b.copy_to_host(back.data(), n);
    EXPECT_EQ(std::memcmp(src.data(), back.data(), n), 0);
    b.fill(0xAB);
    b.copy_to_host(back.data(), 4096, n - 4096);
    for (size_t i = 0; i < 4096; ++i) ASSERT_EQ(back[i], 0xAB);
    EXPECT_THROW(b.copy_to_host(back.data(), 2, n - 1), std::invalid_argument);
  }
  // Free returned the memory: a driver error here would mean the free did not happen.
  size_t free_b = 0, total_b = 0;
  vitrify::driver::ContextGuard ctx(0);
  VITRIFY_CU(vitrify::driver::cu().cuMemGetInfo(&free_b, &total_b));
  EXPECT_GT(free_b, 0u);
}

TEST(DriverGpu, ErrorsCarryTheResultName) {
  REQUIRE_GPU();
  vitrify::driver::ContextGuard ctx(0);
  try {
    // A copy from an address nobody mapped fails synchronously with a driver error.
    std::vector<uint8_t> dst(16);
    VITRIFY_CU(vitrify::driver::cu().cuMemcpyDtoH(dst.data(), CUdeviceptr(0x10), 16));
    FAIL() << "no throw";
  } catch (const vitrify::CudaError& e) {
    EXPECT_NE(e.name().find("CUDA_ERROR_"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("cuMemcpyDtoH"), std::string::npos) << e.what();
  }
  VITRIFY_CU(vitrify::driver::cu().cuCtxSynchronize());  // context still healthy
}
