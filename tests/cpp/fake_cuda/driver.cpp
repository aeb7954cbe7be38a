// The one fake libcuda for CPU tests (libvitrify_fake_cuda.so): the driver's loader surface
// (cuGetProcAddress_v2 and the entry table every module adds to), versions and init, error
// names, devices, and the one context model. The other modules:
//   vmm.cpp    VMM and plain device memory emulated on host memory, synchronous copies,
//              fake_cuda_counts()
//   host.cpp   streams, events, host registration, async copies, cuMemcpyBatchAsync (two ABIs)
//   graph.cpp  modules, functions, graphs, executables, launches (fake_graph_* hooks)
//
// Knobs (environment variables, read at each call):
//   FAKE_CUDA_VERSION        driver version reported (default 13000); also picks which
//                            cuMemcpyBatchAsync ABI a request gets (13000 or 12080)
//   FAKE_CUDA_INIT           CUresult cuInit returns (default 0)
//   FAKE_CUDA_MISSING        comma-separated entry points reported as not found
//   FAKE_CUDA_FAIL           comma-separated entry points that fail with CUDA_ERROR_UNKNOWN
//                            (the VMM calls and cuMemAlloc check it)
//   FAKE_CUDA_FAIL_AFTER     comma-separated name:N; the named entry point succeeds N times
//                            (counted from when the variable took its current value), then
//                            fails with CUDA_ERROR_UNKNOWN: a failure part-way through a loop
//   FAKE_CUDA_DEVICES        number of devices (default 0: the driver loads, no device);
//                            tests of regions, the host tier and graphs set 1
//   FAKE_CUDA_DEVICE_MEMORY  bytes of "device memory" per process (default 64 GiB)
//   FAKE_CUDA_MAX_REGISTER   per-call ceiling of cuMemHostRegister (default 1 TiB)
//   FAKE_CUDA_POSIX_FD=0     devices cannot export memory as POSIX fds: the attribute
//                            HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED is 0 and cuMemCreate
//                            asking for that handle type fails with NOT_SUPPORTED
//   FAKE_CUDA_TRACE=1        print primary-context reference counts to stderr
// Every entry point no module implements returns CUDA_ERROR_NOT_SUPPORTED.
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <mutex>
#include <string>
#include <vector>

#include "fake_cuda.hpp"

namespace fake {

// ---- knobs ------------------------------------------------------------------------------------
long long env_int(const char* name, long long fallback) {
  const char* v = std::getenv(name);
  return (v && *v) ? std::atoll(v) : fallback;
}

bool env_lists(const char* var, const char* symbol) {
  const char* v = std::getenv(var);
  if (!v) return false;
  const std::string list = std::string(",") + v + ",";
  return list.find(std::string(",") + symbol + ",") != std::string::npos;
}

bool fails_after(const char* symbol) {
  static std::mutex mu;
  static auto* seen = new std::string();                       // never freed
  static auto* calls = new std::map<std::string, long long>();  // since `seen` was set
  const char* v = std::getenv("FAKE_CUDA_FAIL_AFTER");
  std::lock_guard<std::mutex> lk(mu);
  if (v == nullptr || *v == '\0') {  // unset: the next value counts from zero
    seen->clear();
    return false;
  }
  if (*seen != v) {
    *seen = v;
    calls->clear();
  }
  const std::string list = std::string(",") + v;
  const std::string key = std::string(",") + symbol + ":";
  const size_t at = list.find(key);
  if (at == std::string::npos) return false;
  const long long n = std::strtoll(list.c_str() + at + key.size(), nullptr, 10);
  return (*calls)[symbol]++ >= n;
}

// ---- the entry table ----------------------------------------------------------------------------
namespace {
std::multimap<std::string, Entry>& table() {
  static auto* t = new std::multimap<std::string, Entry>();  // filled before main(); never freed
  return *t;
}
}  // namespace

bool add_entries(std::initializer_list<Entry> entries) {
  for (const Entry& e : entries) table().emplace(e.name, e);
  return true;
}

// ---- devices and contexts -------------------------------------------------------------------
namespace {
struct Context {
  int device;
  int refs;
};
std::mutex ctx_mu;
Context contexts[kMaxDevices];
thread_local CUcontext t_current = nullptr;
std::vector<void (*)(int)>& reset_hooks() {
  static auto* v = new std::vector<void (*)(int)>();
  return *v;
}
int device_of(CUcontext c) {  // -1: not one of ours
  const auto* p = reinterpret_cast<const Context*>(c);
  return p >= contexts && p < contexts + kMaxDevices ? int(p - contexts) : -1;
}
}  // namespace

int device_count() {
  const long long n = env_int("FAKE_CUDA_DEVICES", 0);
  return n < 0 ? 0 : n > kMaxDevices ? kMaxDevices : int(n);
}
bool valid_device(int d) { return d >= 0 && d < device_count(); }
CUcontext context_of(int device) { return reinterpret_cast<CUcontext>(&contexts[device]); }

CUresult need_context(int* device) {
  const int d = device_of(t_current);
  std::lock_guard<std::mutex> lk(ctx_mu);
  if (d < 0 || contexts[d].refs == 0) return CUDA_ERROR_INVALID_CONTEXT;
  if (device) *device = d;
  return CUDA_SUCCESS;
}

void on_context_reset(void (*fn)(int)) { reset_hooks().push_back(fn); }

namespace {

CUresult not_supported() { return CUDA_ERROR_NOT_SUPPORTED; }
CUresult driver_get_version(int* v) {
  *v = int(env_int("FAKE_CUDA_VERSION", 13000));
  return CUDA_SUCCESS;
}
CUresult init(unsigned) { return static_cast<CUresult>(env_int("FAKE_CUDA_INIT", 0)); }

const char* name_of(CUresult r) {
  switch (r) {
#define FAKE_CUDA_NAME(x) \
  case x: return #x;
    FAKE_CUDA_NAME(CUDA_SUCCESS)
    FAKE_CUDA_NAME(CUDA_ERROR_INVALID_VALUE)
    FAKE_CUDA_NAME(CUDA_ERROR_OUT_OF_MEMORY)
    FAKE_CUDA_NAME(CUDA_ERROR_NO_DEVICE)
    FAKE_CUDA_NAME(CUDA_ERROR_INVALID_DEVICE)
    FAKE_CUDA_NAME(CUDA_ERROR_INVALID_IMAGE)
    FAKE_CUDA_NAME(CUDA_ERROR_INVALID_CONTEXT)
    FAKE_CUDA_NAME(CUDA_ERROR_INVALID_HANDLE)
    FAKE_CUDA_NAME(CUDA_ERROR_NOT_FOUND)
    FAKE_CUDA_NAME(CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED)
    FAKE_CUDA_NAME(CUDA_ERROR_HOST_MEMORY_NOT_REGISTERED)
    FAKE_CUDA_NAME(CUDA_ERROR_NOT_SUPPORTED)
    FAKE_CUDA_NAME(CUDA_ERROR_UNKNOWN)
#undef FAKE_CUDA_NAME
    default: return nullptr;
  }
}
CUresult get_error_name(CUresult r, const char** s) {
  *s = name_of(r);
  return *s ? CUDA_SUCCESS : CUDA_ERROR_INVALID_VALUE;
}
CUresult get_error_string(CUresult r, const char** s) {
  *s = name_of(r) ? "fake driver error text" : nullptr;
  return *s ? CUDA_SUCCESS : CUDA_ERROR_INVALID_VALUE;
}

CUresult device_get_count(int* n) {
  *n = device_count();
  return CUDA_SUCCESS;
}
CUresult device_get(CUdevice* d, int ordinal) {
  if (!valid_device(ordinal)) return CUDA_ERROR_INVALID_DEVICE;
  *d = ordinal;
  return CUDA_SUCCESS;
}
CUresult device_get_name(char* name, int len, CUdevice d) {
  if (!valid_device(d)) return CUDA_ERROR_INVALID_DEVICE;
  std::snprintf(name, size_t(len), "vitrify fake device %d", d);
  return CUDA_SUCCESS;
}
CUresult device_get_uuid(CUuuid* u, CUdevice d) {
  if (!valid_device(d)) return CUDA_ERROR_INVALID_DEVICE;
  std::memset(u, 0, sizeof *u);
  u->bytes[15] = char(d);
  return CUDA_SUCCESS;
}
CUresult device_get_attribute(int* v, CUdevice_attribute a, CUdevice d) {
  if (!valid_device(d)) return CUDA_ERROR_INVALID_DEVICE;
  switch (a) {
    case CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED: *v = 1; break;
    case CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR: *v = 9; break;
    case CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR: *v = 0; break;
    case CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT: *v = 132; break;
    case CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED:
      *v = env_int("FAKE_CUDA_POSIX_FD", 1) != 0;
      break;
    default: *v = 0;
  }
  return CUDA_SUCCESS;
}

CUresult primary_retain(CUcontext* c, CUdevice d) {
  if (!valid_device(d)) return CUDA_ERROR_INVALID_DEVICE;
  std::lock_guard<std::mutex> lk(ctx_mu);
  contexts[d].device = d;
  ++contexts[d].refs;
  if (std::getenv("FAKE_CUDA_TRACE")) std::fprintf(stderr, "fake: retain -> %d\n", contexts[d].refs);
  *c = context_of(d);
  return CUDA_SUCCESS;
}
CUresult primary_release(CUdevice d) {
  if (!valid_device(d)) return CUDA_ERROR_INVALID_DEVICE;
  {
    std::lock_guard<std::mutex> lk(ctx_mu);
    if (contexts[d].refs == 0) return CUDA_ERROR_INVALID_CONTEXT;
    --contexts[d].refs;
    if (std::getenv("FAKE_CUDA_TRACE"))
      std::fprintf(stderr, "fake: release -> %d\n", contexts[d].refs);
    if (contexts[d].refs > 0) return CUDA_SUCCESS;
  }
  for (auto fn : reset_hooks()) fn(d);  // reset: everything made in the context is gone
  return CUDA_SUCCESS;
}
CUresult ctx_get_current(CUcontext* c) {
  *c = t_current;
  return CUDA_SUCCESS;
}
CUresult ctx_set_current(CUcontext c) {
  if (c != nullptr && device_of(c) < 0) return CUDA_ERROR_INVALID_CONTEXT;
  t_current = c;
  return CUDA_SUCCESS;
}
CUresult ctx_get_device(CUdevice* d) {
  if (t_current == nullptr) return CUDA_ERROR_INVALID_CONTEXT;
  *d = device_of(t_current);
  return CUDA_SUCCESS;
}
CUresult ctx_synchronize() { return need_context(); }

FAKE_CUDA_ENTRIES({
    {"cuDriverGetVersion", FAKE_FN(driver_get_version)},
    {"cuInit", FAKE_FN(init)},
    {"cuGetErrorName", FAKE_FN(get_error_name)},
    {"cuGetErrorString", FAKE_FN(get_error_string)},
    {"cuDeviceGetCount", FAKE_FN(device_get_count)},
    {"cuDeviceGet", FAKE_FN(device_get)},
    {"cuDeviceGetName", FAKE_FN(device_get_name)},
    {"cuDeviceGetUuid", FAKE_FN(device_get_uuid)},
    {"cuDeviceGetAttribute", FAKE_FN(device_get_attribute)},
    {"cuDevicePrimaryCtxRetain", FAKE_FN(primary_retain)},
    {"cuDevicePrimaryCtxRelease", FAKE_FN(primary_release)},
    {"cuCtxGetCurrent", FAKE_FN(ctx_get_current)},
    {"cuCtxSetCurrent", FAKE_FN(ctx_set_current)},
    {"cuCtxGetDevice", FAKE_FN(ctx_get_device)},
    {"cuCtxSynchronize", FAKE_FN(ctx_synchronize)},
});

}  // namespace
}  // namespace fake

// The driver's one exported entry point (besides the test hooks): the loader resolves every
// other entry through it. A request for an ABI older than every entry of that name (or a name
// in FAKE_CUDA_MISSING) is "symbol not found"; an unknown name is a NOT_SUPPORTED stub.
FAKE_EXPORT CUresult cuGetProcAddress_v2(const char* symbol, void** pfn, int version, cuuint64_t,
                                         CUdriverProcAddressQueryResult* status) {
  *pfn = nullptr;
  if (!fake::env_lists("FAKE_CUDA_MISSING", symbol)) {
    const auto [lo, hi] = fake::table().equal_range(symbol);
    if (lo == hi) {
      *pfn = FAKE_FN(fake::not_supported);
    } else {
      int best = -1;
      for (auto it = lo; it != hi; ++it)
        if (it->second.min_version <= version && it->second.min_version > best) {
          best = it->second.min_version;
          *pfn = it->second.fn;
        }
    }
  }
  if (status) *status = *pfn ? CU_GET_PROC_ADDRESS_SUCCESS : CU_GET_PROC_ADDRESS_SYMBOL_NOT_FOUND;
  return *pfn ? CUDA_SUCCESS : CUDA_ERROR_NOT_FOUND;
}
