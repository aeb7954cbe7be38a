// Streams, events, host registration and asynchronous copies of the fake driver. Copies are
// memcpy done at once. The rules the host tier must respect are modelled:
//   - cuMemHostRegister refuses overlapping registrations and (FAKE_CUDA_MAX_REGISTER bytes)
//     a range above a per-call ceiling;
//   - cuMemcpyBatchAsync refuses the legacy NULL stream, bad attributes, and any copy whose host
//     range touches a registration without lying inside it (the straddle failure);
//   - async copies need a current context, a live stream and a device range the driver knows
//     (fake::device_range);
//   - registrations and streams belong to the primary context: they are gone when it is reset.
// cuMemcpyBatchAsync is handed out in two ABIs, 13000 and 12080 (the request's version picks).
#include <cstdint>
#include <cstring>
#include <iterator>
#include <map>
#include <mutex>
#include <set>

#include "fake_cuda.hpp"

namespace fake {
namespace {

struct State {
  std::mutex mu;
  std::map<uintptr_t, size_t> registered;  // host base -> bytes
  std::set<uintptr_t> streams;             // live streams (each a heap byte, for a unique address)
  std::set<uintptr_t> events;              // live events
};
State& st() {
  static State* s = new State();
  return *s;
}

void reset(int) {  // one device in practice; registrations and streams are per process here
  std::lock_guard<std::mutex> lk(st().mu);
  st().registered.clear();
  for (uintptr_t s : st().streams) delete reinterpret_cast<char*>(s);
  st().streams.clear();
}
[[maybe_unused]] const bool registered_reset = (on_context_reset(&reset), true);

// The registration containing [p, p+n) entirely: 1; touching one without containment: -1; none: 0.
int host_range_state(uintptr_t p, size_t n) {  // caller locks
  auto& m = st().registered;
  auto it = m.upper_bound(p);
  if (it != m.begin()) {
    auto prev = std::prev(it);
    if (p < prev->first + prev->second) return p + n <= prev->first + prev->second ? 1 : -1;
  }
  if (it != m.end() && it->first < p + n) return -1;  // starts before a registration, runs into it
  return 0;
}

bool stream_ok(CUstream s) {  // caller locks
  return s == nullptr || s == CU_STREAM_LEGACY || s == CU_STREAM_PER_THREAD ||
         st().streams.count(reinterpret_cast<uintptr_t>(s)) != 0;
}

// ---- streams and events -------------------------------------------------------------------------
CUresult stream_create(CUstream* s, unsigned) {
  if (need_context() != CUDA_SUCCESS) return CUDA_ERROR_INVALID_CONTEXT;
  std::lock_guard<std::mutex> lk(st().mu);
  *s = reinterpret_cast<CUstream>(new char);
  st().streams.insert(reinterpret_cast<uintptr_t>(*s));
  return CUDA_SUCCESS;
}
CUresult stream_destroy(CUstream s) {
  if (need_context() != CUDA_SUCCESS) return CUDA_ERROR_INVALID_CONTEXT;
  std::lock_guard<std::mutex> lk(st().mu);
  if (!st().streams.erase(reinterpret_cast<uintptr_t>(s))) return CUDA_ERROR_INVALID_HANDLE;
  delete reinterpret_cast<char*>(s);
  return CUDA_SUCCESS;
}
CUresult stream_synchronize(CUstream s) {
  if (need_context() != CUDA_SUCCESS) return CUDA_ERROR_INVALID_CONTEXT;
  std::lock_guard<std::mutex> lk(st().mu);
  return stream_ok(s) ? CUDA_SUCCESS : CUDA_ERROR_INVALID_HANDLE;
}

CUresult event_create(CUevent* e, unsigned) {
  std::lock_guard<std::mutex> lk(st().mu);
  *e = reinterpret_cast<CUevent>(new char);
  st().events.insert(reinterpret_cast<uintptr_t>(*e));
  return CUDA_SUCCESS;
}
CUresult event_destroy(CUevent e) {
  std::lock_guard<std::mutex> lk(st().mu);
  if (!st().events.erase(reinterpret_cast<uintptr_t>(e))) return CUDA_ERROR_INVALID_HANDLE;
  delete reinterpret_cast<char*>(e);
  return CUDA_SUCCESS;
}
CUresult event_record(CUevent e, CUstream s) {  // work completes at once: nothing to record
  if (need_context() != CUDA_SUCCESS) return CUDA_ERROR_INVALID_CONTEXT;
  std::lock_guard<std::mutex> lk(st().mu);
  if (!st().events.count(reinterpret_cast<uintptr_t>(e)) || !stream_ok(s))
    return CUDA_ERROR_INVALID_HANDLE;
  return CUDA_SUCCESS;
}
CUresult event_synchronize(CUevent e) {
  std::lock_guard<std::mutex> lk(st().mu);
  return st().events.count(reinterpret_cast<uintptr_t>(e)) ? CUDA_SUCCESS : CUDA_ERROR_INVALID_HANDLE;
}

// ---- async copies -------------------------------------------------------------------------------
CUresult copy_checked(void* dst, const void* src, size_t n, uintptr_t dev, CUstream s) {
  if (need_context() != CUDA_SUCCESS) return CUDA_ERROR_INVALID_CONTEXT;
  {
    std::lock_guard<std::mutex> lk(st().mu);
    if (!stream_ok(s)) return CUDA_ERROR_INVALID_HANDLE;
  }
  if (!device_range(dev, n)) return CUDA_ERROR_INVALID_VALUE;
  std::memcpy(dst, src, n);
  return CUDA_SUCCESS;
}
CUresult htod_async(CUdeviceptr d, const void* h, size_t n, CUstream s) {
  return copy_checked(reinterpret_cast<void*>(d), h, n, d, s);
}
CUresult dtoh_async(void* h, CUdeviceptr d, size_t n, CUstream s) {
  return copy_checked(h, reinterpret_cast<void*>(d), n, d, s);
}
CUresult memset_d8_async(CUdeviceptr d, unsigned char v, size_t n, CUstream s) {
  if (need_context() != CUDA_SUCCESS) return CUDA_ERROR_INVALID_CONTEXT;
  {
    std::lock_guard<std::mutex> lk(st().mu);
    if (!stream_ok(s)) return CUDA_ERROR_INVALID_HANDLE;
  }
  if (!device_range(d, n)) return CUDA_ERROR_INVALID_VALUE;
  std::memset(reinterpret_cast<void*>(d), v, n);
  return CUDA_SUCCESS;
}

// ---- host registration --------------------------------------------------------------------------
CUresult host_register(void* p, size_t n, unsigned) {
  if (need_context() != CUDA_SUCCESS) return CUDA_ERROR_INVALID_CONTEXT;
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
  if (need_context() != CUDA_SUCCESS) return CUDA_ERROR_INVALID_CONTEXT;
  std::lock_guard<std::mutex> lk(st().mu);
  if (!st().registered.erase(reinterpret_cast<uintptr_t>(p)))
    return CUDA_ERROR_HOST_MEMORY_NOT_REGISTERED;
  return CUDA_SUCCESS;
}
CUresult host_get_device_pointer(CUdeviceptr* d, void* p, unsigned) {
  if (need_context() != CUDA_SUCCESS) return CUDA_ERROR_INVALID_CONTEXT;
  std::lock_guard<std::mutex> lk(st().mu);
  if (host_range_state(reinterpret_cast<uintptr_t>(p), 1) != 1) return CUDA_ERROR_INVALID_VALUE;
  *d = reinterpret_cast<CUdeviceptr>(p);
  return CUDA_SUCCESS;
}

// ---- cuMemcpyBatchAsync -------------------------------------------------------------------------
CUresult batch(CUdeviceptr* dsts, CUdeviceptr* srcs, size_t* sizes, size_t count,
               CUmemcpyAttributes* attrs, size_t* idxs, size_t num_attrs, size_t* fail, CUstream s) {
  if (need_context() != CUDA_SUCCESS) return CUDA_ERROR_INVALID_CONTEXT;
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
    const bool dst_dev = device_range(dsts[i], sizes[i]);
    const bool src_dev = device_range(srcs[i], sizes[i]);
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
                   size_t* i, size_t na, CUstream stream) {
  return batch(d, s, n, count, a, i, na, nullptr, stream);
}
CUresult batch_v12(CUdeviceptr* d, CUdeviceptr* s, size_t* n, size_t count, CUmemcpyAttributes* a,
                   size_t* i, size_t na, size_t* fail, CUstream stream) {
  return batch(d, s, n, count, a, i, na, fail, stream);
}

FAKE_CUDA_ENTRIES({
    {"cuStreamCreate", FAKE_FN(stream_create)},
    {"cuStreamDestroy", FAKE_FN(stream_destroy)},
    {"cuStreamSynchronize", FAKE_FN(stream_synchronize)},
    {"cuEventCreate", FAKE_FN(event_create)},
    {"cuEventDestroy", FAKE_FN(event_destroy)},
    {"cuEventRecord", FAKE_FN(event_record)},
    {"cuEventSynchronize", FAKE_FN(event_synchronize)},
    {"cuMemcpyHtoDAsync", FAKE_FN(htod_async)},
    {"cuMemcpyDtoHAsync", FAKE_FN(dtoh_async)},
    {"cuMemsetD8Async", FAKE_FN(memset_d8_async)},
    {"cuMemHostRegister", FAKE_FN(host_register)},
    {"cuMemHostUnregister", FAKE_FN(host_unregister)},
    {"cuMemHostGetDevicePointer", FAKE_FN(host_get_device_pointer)},
    {"cuMemcpyBatchAsync", FAKE_FN(batch_v12), 12080},
    {"cuMemcpyBatchAsync", FAKE_FN(batch_v13), 13000},
});

}  // namespace

int live_events() {
  std::lock_guard<std::mutex> lk(st().mu);
  return int(st().events.size());
}

}  // namespace fake
