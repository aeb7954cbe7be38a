// The driver seam on machines without a GPU: a missing library, and a fake libcuda that can
// pretend to be old, incomplete, or without devices.
#include <gtest/gtest.h>

#include <cstdio>
#include <cstdlib>
#include <stdexcept>
#include <string>

#include "driver/loader.hpp"
#include "vitrify/driver.hpp"

using vitrify::driver::load_table;

namespace {
struct Env {
  Env(const char* k, const char* v) : key(k) { ::setenv(k, v, 1); }
  ~Env() { ::unsetenv(key); }
  const char* key;
};
}  // namespace

TEST(DriverSeam, MissingLibraryIsAReasonNotACrash) {
  const auto r = load_table("/nonexistent/libcuda.so.1");
  EXPECT_FALSE(r.ok);
  EXPECT_NE(r.reason.find("dlopen(\"/nonexistent/libcuda.so.1\") failed"), std::string::npos)
      << r.reason;
}

TEST(DriverSeam, LibraryWithoutGetProcAddress) {
  const auto r = load_table("libm.so.6");
  EXPECT_FALSE(r.ok);
  EXPECT_NE(r.reason.find("cuGetProcAddress_v2"), std::string::npos) << r.reason;
}

TEST(DriverSeam, FakeDriverLoadsEveryEntry) {
  const auto r = load_table(VITRIFY_FAKE_CUDA_PATH);
  ASSERT_TRUE(r.ok) << r.reason;
  EXPECT_EQ(r.table.driver_version, 13000);
  EXPECT_NE(r.table.cuMemMap, nullptr);
  EXPECT_NE(r.table.cuMemcpyBatchAsync, nullptr);
  EXPECT_NE(r.table.cuMemcpyBatchAsync_v12080, nullptr);
  int n = -1;
  EXPECT_EQ(r.table.cuDeviceGetCount(&n), CUDA_SUCCESS);
  EXPECT_EQ(n, 0);
}

TEST(DriverSeam, EntriesNewerThanTheDriverAreAbsent) {
  Env v("FAKE_CUDA_VERSION", "12040");
  const auto r = load_table(VITRIFY_FAKE_CUDA_PATH);
  ASSERT_TRUE(r.ok) << r.reason;
  EXPECT_EQ(r.table.driver_version, 12040);
  EXPECT_EQ(r.table.cuMemcpyBatchAsync, nullptr);        // 13.0 ABI
  EXPECT_EQ(r.table.cuMemcpyBatchAsync_v12080, nullptr);  // 12.8 ABI
  EXPECT_NE(r.table.cuMemCreate, nullptr);
}

TEST(DriverSeam, Driver128HasOnlyTheOldBatchAbi) {
  Env v("FAKE_CUDA_VERSION", "12080");
  const auto r = load_table(VITRIFY_FAKE_CUDA_PATH);
  ASSERT_TRUE(r.ok) << r.reason;
  EXPECT_EQ(r.table.cuMemcpyBatchAsync, nullptr);
  EXPECT_NE(r.table.cuMemcpyBatchAsync_v12080, nullptr);
}

TEST(DriverSeam, MissingRequiredEntryIsNamed) {
  Env m("FAKE_CUDA_MISSING", "cuMemMap,cuMemSetAccess");
  const auto r = load_table(VITRIFY_FAKE_CUDA_PATH);
  EXPECT_FALSE(r.ok);
  EXPECT_NE(r.reason.find("cuMemMap (ABI 10020)"), std::string::npos) << r.reason;
  EXPECT_NE(r.reason.find("cuMemSetAccess"), std::string::npos) << r.reason;
}

TEST(DriverSeam, MissingOptionalEntryIsFine) {
  Env m("FAKE_CUDA_MISSING", "cuMemcpyBatchAsync");
  const auto r = load_table(VITRIFY_FAKE_CUDA_PATH);
  ASSERT_TRUE(r.ok) << r.reason;
  EXPECT_EQ(r.table.cuMemcpyBatchAsync, nullptr);
}

TEST(DriverSeam, InitFailureNamesTheResult) {
  Env i("FAKE_CUDA_INIT", "100");  // CUDA_ERROR_NO_DEVICE
  const auto r = load_table(VITRIFY_FAKE_CUDA_PATH);
  EXPECT_FALSE(r.ok);
  EXPECT_NE(r.reason.find("cuInit(0) failed: CUDA_ERROR_NO_DEVICE (100)"), std::string::npos)
      << r.reason;
}

TEST(DriverSeam, ResultNamesWithoutADriverFallBackToNumbers) {
  // In this process the global table may or may not be loaded; either way a name comes back.
  const std::string n = vitrify::driver::result_name(1);
  EXPECT_TRUE(n == "CUDA_ERROR_INVALID_VALUE" || n == "CUresult 1") << n;
}

TEST(DriverSeam, LibraryPathIsChosenBeforeTheFirstLoadOnly) {
  // In a fresh child process (threadsafe style re-runs this binary), so that neither this
  // binary's other tests nor main()'s VITRIFY_LIBCUDA_PATH have loaded the driver yet.
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  const std::string path = "/nonexistent/libcuda-chosen.so.1";
  EXPECT_EXIT(
      {
        using namespace vitrify::driver;
        set_library_path(path);
        bool ok = library_path() == path && !available() &&
                  unavailable_reason().find(path) != std::string::npos;
        set_library_path(path);  // the same path again is fine
        try {
          set_library_path("");  // libcuda.so.1: too late
          ok = false;
        } catch (const std::invalid_argument& e) {
          ok = ok && std::string(e.what()).find("libcuda_path") != std::string::npos &&
               std::string(e.what()).find(path) != std::string::npos;
        }
        std::fputs(ok ? "chosen path used\n" : "wrong\n", stderr);
        std::_Exit(ok ? 0 : 1);
      },
      ::testing::ExitedWithCode(0), "chosen path used");
}

TEST(DriverSeam, ReserveAlignmentHonoursHints) {
  using vitrify::driver::reserve_alignment;
  EXPECT_EQ(reserve_alignment(0), 0u);
  EXPECT_EQ(reserve_alignment(0x600000000000ull), 1ull << 30);  // capped at 1 GiB
  EXPECT_EQ(reserve_alignment(0x7f0000200000ull), 2ull << 20);  // lowest set bit
  EXPECT_EQ(reserve_alignment(0x40000000ull), 1ull << 30);
  EXPECT_EQ(reserve_alignment(0x1000ull), 0x1000u);
}
