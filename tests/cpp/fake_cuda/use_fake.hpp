// For a test binary that runs against the one fake driver (tests/cpp/fake_cuda) with one device:
// including this selects the fake before anything loads the driver, and gives the fake's hooks.
#pragma once

#include <dlfcn.h>
#include <gtest/gtest.h>

#include <cstdint>
#include <cstdlib>

#include "vitrify/driver.hpp"

namespace vitrify::test {

class UseFakeDriver : public ::testing::Environment {
 public:
  void SetUp() override {
    ::setenv("FAKE_CUDA_DEVICES", "1", 1);
    driver::set_library_path(VITRIFY_FAKE_CUDA_PATH);
  }
};
[[maybe_unused]] inline ::testing::Environment* const kUseFakeDriver =
    ::testing::AddGlobalTestEnvironment(new UseFakeDriver);

// A symbol the fake exports for tests (fake_cuda_counts, fake_graph_*), or null.
inline void* fake_symbol(const char* name) {
  static void* h = ::dlopen(VITRIFY_FAKE_CUDA_PATH, RTLD_NOW | RTLD_LOCAL);
  return h != nullptr ? ::dlsym(h, name) : nullptr;
}

// The fake's live objects: reservations, physical handles, mappings, cuMemAlloc blocks,
// physical bytes.
struct FakeCounts {
  uint64_t reservations = 0, handles = 0, mappings = 0, allocs = 0, physical = 0;
  bool operator==(const FakeCounts&) const = default;
};
inline FakeCounts fake_counts() {
  auto f = reinterpret_cast<void (*)(uint64_t*)>(fake_symbol("fake_cuda_counts"));
  EXPECT_NE(f, nullptr) << "the fake driver exports no fake_cuda_counts";
  uint64_t v[5] = {};
  if (f != nullptr) f(v);
  return FakeCounts{v[0], v[1], v[2], v[3], v[4]};
}

}  // namespace vitrify::test
