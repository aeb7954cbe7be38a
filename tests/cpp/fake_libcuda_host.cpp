// A host-emulated CUDA driver for CPU runs of the host tier's GPU tests (tests/cpp/CMakeLists.txt
// runs test_host_gpu against it with label cpu). One "device"; device memory is host memory from
// cuMemAlloc; copies are memcpy done at once. It models the rules the host tier must respect:
//   - cuMemHostRegister refuses overlapping registrations and (FAKE_CUDA_MAX_REGISTER bytes)
//     a range above a per-call ceiling;
//   - cuMemcpyBatchAsync refuses the legacy NULL stream, bad attributes, and any copy whose host
//     range touches a registration without lying inside it (the straddle failure);
//   - async copies need a current context and a device range inside one allocation;
//   - the primary context is reset when its last reference is released (as the real driver
//     does): registrations, allocations and streams made in it are gone.
// FAKE_CUDA_VERSION (default 13000) selects which cuMemcpyBatchAsync ABI is handed out;
// FAKE_CUDA_TRACE=1 prints primary-context reference counts to stderr.
#include <cuda.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <mutex>

namespace {

struct State {
  std::mutex mu;
  int refs = 0;                            // primary context references
  std::map<uintptr_t, size_t> registered;  // host base -> bytes
  std::map<uintptr_t, size_t> device;      // "device" allocation base -> bytes (leaked on reset)
  std::map<uintptr_t, bool> streams;       // live streams
};
State& st() {
  static State* s = new State();
  return *s;
}

int fake_ctx_storage = 0;
CUcontext const kCtx = reinterpret_cast<CUcontext>(&fake_ctx_storage);
thread_local CUcontext t_current = nullptr;

long long env_int(const char* name, long long fallback) {
  const char* v = std::getenv(name);
  return (v && *v) ? std::atoll(v) : fallback;
}

// The registration containing [p, p+n) entirely: 1; touching one without containment: -1; none: 0.
int host_range_state(uintptr_t p, size_t n) {
  auto& m = st().registered;
  auto it = m.upper_bound(p);
  if (it != m.begin()) {
    auto prev = std::prev(it);
    if (p < prev->first + prev->second) return p + n <= prev->first + prev->second ? 1 : -1;
  }
  if (it != m.end() && it->first < p + n) return -1;  // starts before a registration, runs into it
  return 0;
}

bool device_range_ok(uintptr_t p, size_t n) {
  auto& m = st().device;
  auto it = m.upper_bound(p);
  if (it == m.begin()) return false;
  --it;
  return p >= it->first && p + n <= it->first + it->second;
}

CUresult not_supported() { return CUDA_ERROR_NOT_SUPPORTED; }
CUresult driver_get_version(int* v) {
  *v = static_cast<int>(env_int("FAKE_CUDA_VERSION", 13000));
  return CUDA_SUCCESS;
}
CUresult init(unsigned) { return CUDA_SUCCESS; }
const char* name_of(CUresult r) {
  switch (r) {
    case CUDA_SUCCESS: return "CUDA_SUCCESS";
    case CUDA_ERROR_INVALID_VALUE: return "CUDA_ERROR_INVALID_VALUE";
    case CUDA_ERROR_OUT_OF_MEMORY: return "CUDA_ERROR_OUT_OF_MEMORY";
    case CUDA_ERROR_INVALID_CONTEXT: return "CUDA_ERROR_INVALID_CONTEXT";
    case CUDA_ERROR_INVALID_HANDLE: return "CUDA_ERROR_INVALID_HANDLE";
    case CUDA_ERROR_INVALID_DEVICE: return "CUDA_ERROR_INVALID_DEVICE";
    case CUDA_ERROR_NOT_SUPPORTED: return "CUDA_ERROR_NOT_SUPPORTED";
    case CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED: return "CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED";
    case CUDA_ERROR_HOST_MEMORY_NOT_REGISTERED: return "CUDA_ERROR_HOST_MEMORY_NOT_REGISTERED";
    default: return nullptr;
  }
}
CUresult get_error_name(CUresult r, const char** s) {
  *s = name_of(r);
  return *s ? CUDA_SUCCESS : CUDA_ERROR_INVALID_VALUE;
}
CUresult get_error_string(CUresult r, const char** s) {
  *s = name_of(r) ? "fake host-emulated driver error" : nullptr;
  return *s ? CUDA_SUCCESS : CUDA_ERROR_INVALID_VALUE;
}
CUresult device_get_count(int* n) {
  *n = 1;
  return CUDA_SUCCESS;
}
CUresult device_get(CUdevice* d, int ordinal) {
  if (ordinal != 0) return CUDA_ERROR_INVALID_DEVICE;
  *d = 0;
  return CUDA_SUCCESS;
}
CUresult primary_retain(CUcontext* c, CUdevice d) {
  if (d != 0) return CUDA_ERROR_INVALID_DEVICE;
  std::lock_guard<std::mutex> lk(st().mu);
  ++st().refs;
  if (std::getenv("FAKE_CUDA_TRACE")) std::fprintf(stderr, "fake: retain -> %d\n", st().refs);
  *c = kCtx;
  return CUDA_SUCCESS;
}
CUresult primary_release(CUdevice d) {
  if (d != 0) return CUDA_ERROR_INVALID_DEVICE;
  std::lock_guard<std::mutex> lk(st().mu);
  if (st().refs == 0) return CUDA_ERROR_INVALID_CONTEXT;
  --st().refs;
  if (std::getenv("FAKE_CUDA_TRACE")) std::fprintf(stderr, "fake: release -> %d\n", st().refs);
  if (st().refs == 0) {  // reset: everything made in the context is gone
    st().registered.clear();
    st().device.clear();
    st().streams.clear();
  }
  return CUDA_SUCCESS;
}
CUresult ctx_get_current(CUcontext* c) {
  *c = t_current;
  return CUDA_SUCCESS;
}
CUresult ctx_set_current(CUcontext c) {
  t_current = c;
  return CUDA_SUCCESS;
}
CUresult need_ctx() {
  std::lock_guard<std::mutex> lk(st().mu);
  return t_current == kCtx && st().refs > 0 ? CUDA_SUCCESS : CUDA_ERROR_INVALID_CONTEXT;
}
bool stream_ok(CUstream s) {  // caller holds the lock
  return s == nullptr || s == CU_STREAM_LEGACY || s == CU_STREAM_PER_THREAD ||
         st().streams.count(reinterpret_cast<uintptr_t>(s)) != 0;
}
CUresult ctx_synchronize() { return need_ctx(); }

CUresult mem_alloc(CUdeviceptr* p, size_t n) {
  if (need_ctx()) return CUDA_ERROR_INVALID_CONTEXT;
  void* m = std::aligned_alloc(256, (n + 255) / 256 * 256);
  if (!m) return CUDA_ERROR_OUT_OF_MEMORY;
  std::lock_guard<std::mutex> lk(st().mu);
  st().device[reinterpret_cast<uintptr_t>(m)] = n;
  *p = reinterpret_cast<CUdeviceptr>(m);
  return CUDA_SUCCESS;
}
CUresult mem_free(CUdeviceptr p) {
  std::lock_guard<std::mutex> lk(st().mu);
  if (!st().device.erase(static_cast<uintptr_t>(p))) return CUDA_ERROR_INVALID_VALUE;
  std::free(reinterpret_cast<void*>(p));
  return CUDA_SUCCESS;
}
CUresult copy_checked(void* dst, const void* src, size_t n, uintptr_t dev, bool async, CUstream s) {
  if (need_ctx()) return CUDA_ERROR_INVALID_CONTEXT;
  (void)async;
  {
    std::lock_guard<std::mutex> lk(st().mu);
    if (!stream_ok(s)) return CUDA_ERROR_INVALID_HANDLE;
    if (!device_range_ok(dev, n)) return CUDA_ERROR_INVALID_VALUE;
  }
  std::memcpy(dst, src, n);
  return CUDA_SUCCESS;
}
CUresult htod(CUdeviceptr d, const void* h, size_t n) {
  return copy_checked(reinterpret_cast<void*>(d), h, n, d, false, nullptr);
}
CUresult dtoh(void* h, CUdeviceptr d, size_t n) {
  return copy_checked(h, reinterpret_cast<void*>(d), n, d, false, nullptr);
}
CUresult htod_async(CUdeviceptr d, const void* h, size_t n, CUstream s) {
  return copy_checked(reinterpret_cast<void*>(d), h, n, d, true, s);
}
CUresult dtoh_async(void* h, CUdeviceptr d, size_t n, CUstream s) {
  return copy_checked(h, reinterpret_cast<void*>(d), n, d, true, s);
}
CUresult memset_d8(CUdeviceptr d, unsigned char v, size_t n) {
  if (need_ctx()) return CUDA_ERROR_INVALID_CONTEXT;
  std::memset(reinterpret_cast<void*>(d), v, n);
  return CUDA_SUCCESS;
}
CUresult memset_d8_async(CUdeviceptr d, unsigned char v, size_t n, CUstream) {
  return memset_d8(d, v, n);
}

CUresult host_register(void* p, size_t n, unsigned) {
  if (need_ctx()) return CUDA_ERROR_INVALID_CONTEXT;
  if (p == nullptr || n == 0) return CUDA_ERROR_INVALID_VALUE;
  if (n > static_cast<size_t>(env_int("FAKE_CUDA_MAX_REGISTER", 1LL << 40)))
    return CUDA_ERROR_OUT_OF_MEMORY;  // the per-call ceiling real drivers have
  std::lock_guard<std::mutex> lk(st().mu);
  const auto b = reinterpret_cast<uintptr_t>(p);
  if (host_range_state(b, n) != 0) return CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED;
  st().registered[b] = n;
  return CUDA_SUCCESS;
}
CUresult host_unregister(void* p) {
  if (need_ctx()) return CUDA_ERROR_INVALID_CONTEXT;
  std::lock_guard<std::mutex> lk(st().mu);
  if (!st().registered.erase(reinterpret_cast<uintptr_t>(p)))
    return CUDA_ERROR_HOST_MEMORY_NOT_REGISTERED;
  return CUDA_SUCCESS;
}
CUresult host_get_device_pointer(CUdeviceptr* d, void* p, unsigned) {
  if (need_ctx()) return CUDA_ERROR_INVALID_CONTEXT;
  std::lock_guard<std::mutex> lk(st().mu);
  if (host_range_state(reinterpret_cast<uintptr_t>(p), 1) != 1) return CUDA_ERROR_INVALID_VALUE;
  *d = reinterpret_cast<CUdeviceptr>(p);
  return CUDA_SUCCESS;
}

int fake_stream_storage[64];
std::size_t next_stream = 0;
CUresult stream_create(CUstream* s, unsigned) {
  if (need_ctx()) return CUDA_ERROR_INVALID_CONTEXT;
  std::lock_guard<std::mutex> lk(st().mu);
  *s = reinterpret_cast<CUstream>(&fake_stream_storage[next_stream++ % 64]);
  st().streams[reinterpret_cast<uintptr_t>(*s)] = true;
  return CUDA_SUCCESS;
}
CUresult stream_destroy(CUstream s) {
  if (need_ctx()) return CUDA_ERROR_INVALID_CONTEXT;
  std::lock_guard<std::mutex> lk(st().mu);
  return st().streams.erase(reinterpret_cast<uintptr_t>(s)) ? CUDA_SUCCESS
                                                              : CUDA_ERROR_INVALID_HANDLE;
}
CUresult stream_synchronize(CUstream s) {
  if (need_ctx()) return CUDA_ERROR_INVALID_CONTEXT;
  std::lock_guard<std::mutex> lk(st().mu);
  return stream_ok(s) ? CUDA_SUCCESS : CUDA_ERROR_INVALID_HANDLE;
}

CUresult batch(CUdeviceptr* dsts, CUdeviceptr* srcs, size_t* sizes, size_t count,
               CUmemcpyAttributes* attrs, size_t* idxs, size_t num_attrs, size_t* fail,
               CUstream s) {
  if (need_ctx()) return CUDA_ERROR_INVALID_CONTEXT;
  if (s == nullptr || s == CU_STREAM_LEGACY) return CUDA_ERROR_INVALID_VALUE;
  if (count == 0 || num_attrs == 0 || num_attrs > count || idxs[0] != 0)
    return CUDA_ERROR_INVALID_VALUE;
  for (size_t a = 0; a < num_attrs; ++a) {
    if (a > 0 && idxs[a] <= idxs[a - 1]) return CUDA_ERROR_INVALID_VALUE;
    const int order = attrs[a].srcAccessOrder;
    if (order < CU_MEMCPY_SRC_ACCESS_ORDER_STREAM || order > CU_MEMCPY_SRC_ACCESS_ORDER_ANY)
      return CUDA_ERROR_INVALID_VALUE;
  }
  std::lock_guard<std::mutex> lk(st().mu);
  if (!stream_ok(s)) return CUDA_ERROR_INVALID_HANDLE;
  for (size_t i = 0; i < count; ++i) {
    const bool dst_dev = device_range_ok(dsts[i], sizes[i]);
    const bool src_dev = device_range_ok(srcs[i], sizes[i]);
    const uintptr_t host = dst_dev ? srcs[i] : dsts[i];
    if ((!dst_dev && !src_dev) || host_range_state(host, sizes[i]) == -1) {
      if (fail) *fail = i;
      return CUDA_ERROR_INVALID_VALUE;
    }
  }
  for (size_t i = 0; i < count; ++i)
    std::memcpy(reinterpret_cast<void*>(dsts[i]), reinterpret_cast<const void*>(srcs[i]), sizes[i]);
  return CUDA_SUCCESS;
}
CUresult batch_v13(CUdeviceptr* d, CUdeviceptr* s, size_t* n, size_t count, CUmemcpyAttributes* a,
                   size_t* i, size_t na, CUstream st) {
  return batch(d, s, n, count, a, i, na, nullptr, st);
}
CUresult batch_v12(CUdeviceptr* d, CUdeviceptr* s, size_t* n, size_t count, CUmemcpyAttributes* a,
                   size_t* i, size_t na, size_t* fail, CUstream st) {
  return batch(d, s, n, count, a, i, na, fail, st);
}

struct Entry {
  const char* name;
  void* fn;
};

}  // namespace

extern "C" __attribute__((visibility("default"))) CUresult cuGetProcAddress_v2(
    const char* symbol, void** pfn, int version, cuuint64_t, CUdriverProcAddressQueryResult* qs) {
  static const Entry entries[] = {
      {"cuDriverGetVersion", (void*)&driver_get_version},
      {"cuInit", (void*)&init},
      {"cuGetErrorName", (void*)&get_error_name},
      {"cuGetErrorString", (void*)&get_error_string},
      {"cuDeviceGetCount", (void*)&device_get_count},
      {"cuDeviceGet", (void*)&device_get},
      {"cuDevicePrimaryCtxRetain", (void*)&primary_retain},
      {"cuDevicePrimaryCtxRelease", (void*)&primary_release},
      {"cuCtxGetCurrent", (void*)&ctx_get_current},
      {"cuCtxSetCurrent", (void*)&ctx_set_current},
      {"cuCtxSynchronize", (void*)&ctx_synchronize},
      {"cuMemAlloc", (void*)&mem_alloc},
      {"cuMemFree", (void*)&mem_free},
      {"cuMemcpyHtoD", (void*)&htod},
      {"cuMemcpyDtoH", (void*)&dtoh},
      {"cuMemcpyHtoDAsync", (void*)&htod_async},
      {"cuMemcpyDtoHAsync", (void*)&dtoh_async},
      {"cuMemsetD8", (void*)&memset_d8},
      {"cuMemsetD8Async", (void*)&memset_d8_async},
      {"cuMemHostRegister", (void*)&host_register},
      {"cuMemHostUnregister", (void*)&host_unregister},
      {"cuMemHostGetDevicePointer", (void*)&host_get_device_pointer},
      {"cuStreamCreate", (void*)&stream_create},
      {"cuStreamDestroy", (void*)&stream_destroy},
      {"cuStreamSynchronize", (void*)&stream_synchronize},
  };
  *pfn = nullptr;
  if (!std::strcmp(symbol, "cuMemcpyBatchAsync")) {
    *pfn = version >= 13000 ? (void*)&batch_v13 : version >= 12080 ? (void*)&batch_v12 : nullptr;
  } else {
    *pfn = (void*)&not_supported;
    for (const Entry& e : entries)
      if (!std::strcmp(symbol, e.name)) *pfn = e.fn;
  }
  if (qs) *qs = *pfn ? CU_GET_PROC_ADDRESS_SUCCESS : CU_GET_PROC_ADDRESS_SYMBOL_NOT_FOUND;
  return *pfn ? CUDA_SUCCESS : CUDA_ERROR_NOT_FOUND;
}
