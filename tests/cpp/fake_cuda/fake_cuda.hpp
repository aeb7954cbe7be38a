// Internal header of the one fake CUDA driver (libvitrify_fake_cuda.so, tests/cpp/fake_cuda/).
// The library exports cuGetProcAddress_v2 (driver.cpp) and the test hooks; every module adds
// its entry points to the one table with FAKE_CUDA_ENTRIES at static-initialization time.
//
// Knobs (environment, read at each call; driver.cpp describes them all):
//   FAKE_CUDA_VERSION  FAKE_CUDA_INIT  FAKE_CUDA_MISSING  FAKE_CUDA_FAIL  FAKE_CUDA_DEVICES
//   FAKE_CUDA_DEVICE_MEMORY  FAKE_CUDA_MAX_REGISTER  FAKE_CUDA_POSIX_FD  FAKE_CUDA_TRACE
#pragma once

#include <cuda.h>

#include <cstdint>
#include <initializer_list>

namespace fake {

// ---- knobs --------------------------------------------------------------------------------
long long env_int(const char* name, long long fallback);
// True when the comma-separated list in environment variable `var` names `symbol`.
bool env_lists(const char* var, const char* symbol);
// FAKE_CUDA_FAIL_AFTER ("name:N,..."): true once `symbol` was called N times since the variable
// took its current value (a failure part-way through a loop of calls).
bool fails_after(const char* symbol);
// FAKE_CUDA_FAIL: the named entry points fail with CUDA_ERROR_UNKNOWN (FAKE_CUDA_FAIL_AFTER: after
// N successful calls).
#define FAKE_FAIL_POINT(name) \
  if (::fake::env_lists("FAKE_CUDA_FAIL", name) || ::fake::fails_after(name)) return CUDA_ERROR_UNKNOWN

// ---- the entry table ----------------------------------------------------------------------
// `min_version`: the entry is handed out for requests of at least that ABI version; of several
// entries with one name the highest min_version not above the request wins (cuMemcpyBatchAsync
// has two ABIs). Entries not in the table resolve to a function returning NOT_SUPPORTED.
struct Entry {
  const char* name;
  void* fn;
  int min_version = 0;
};
bool add_entries(std::initializer_list<Entry> entries);
#define FAKE_CUDA_CONCAT2(a, b) a##b
#define FAKE_CUDA_CONCAT(a, b) FAKE_CUDA_CONCAT2(a, b)
#define FAKE_CUDA_ENTRIES(...) \
  [[maybe_unused]] const bool FAKE_CUDA_CONCAT(fake_entries_, __LINE__) = ::fake::add_entries(__VA_ARGS__)
#define FAKE_FN(f) reinterpret_cast<void*>(&(f))

// ---- devices and the one context model ------------------------------------------------------
// FAKE_CUDA_DEVICES devices (default 0: the driver loads but has no device). Each has one
// primary context, reference counted; when its last reference is released the context is
// reset (as the real driver does): what was made in it (cuMemAlloc blocks, host registrations,
// streams) is gone. The current context is per thread.
constexpr int kMaxDevices = 64;
int device_count();
bool valid_device(int d);
CUcontext context_of(int device);
// CUDA_SUCCESS when this thread's current context is a live primary context (its device in
// *device when non-null); CUDA_ERROR_INVALID_CONTEXT otherwise.
CUresult need_context(int* device = nullptr);
// Called (without driver locks held) with the device whose primary context was reset.
void on_context_reset(void (*fn)(int device));

// ---- device memory (vmm.cpp) ----------------------------------------------------------------
// True when [p, p+n) lies inside one cuMemAlloc block or is covered by accessible mappings.
bool device_range(uint64_t p, uint64_t n);

// ---- streams and events (host.cpp) ----------------------------------------------------------
int live_events();

}  // namespace fake

#define FAKE_EXPORT extern "C" __attribute__((visibility("default")))
