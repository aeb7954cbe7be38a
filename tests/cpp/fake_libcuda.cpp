// A stand-in for libcuda.so.1 used by CPU tests of the driver seam. It exports only
// cuGetProcAddress_v2, like the real driver's loader path needs. Knobs (read at each call):
//   FAKE_CUDA_VERSION  driver version reported (default 13000)
//   FAKE_CUDA_INIT     CUresult cuInit returns (default 0)
//   FAKE_CUDA_MISSING  comma-separated entry points reported as not found
//   FAKE_CUDA_DEVICES  number of fake devices (default 0: the driver loads but has no device)
//   FAKE_CUDA_DEVICE_MEMORY  bytes of "device memory" cuMemCreate/cuMemAlloc may hold (default 64 GiB)
//   FAKE_CUDA_FAIL     comma-separated entry points that fail with CUDA_ERROR_UNKNOWN (999)
// With a device, VMM and plain memory are emulated on host memory (the VMM part below):
// reservations are PROT_NONE mmaps at the hint (elsewhere when the hint is taken, like the real
// driver), physical handles are memfds, cuMemMap maps them MAP_SHARED over the reservation,
// cuMemSetAccess makes them read-write, and copies fail with CUDA_ERROR_INVALID_VALUE unless
// their whole range is mapped and accessible. fake_cuda_counts() exports the live objects.
// Every entry point not implemented below returns CUDA_ERROR_NOT_SUPPORTED.
#include <cuda.h>
#include <sys/mman.h>
#include <unistd.h>

#include <cerrno>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <mutex>
#include <string>

namespace {

int env_int(const char* name, int fallback) {
  const char* v = std::getenv(name);
  return (v && *v) ? std::atoi(v) : fallback;
}

bool missing(const char* symbol) {
  const char* v = std::getenv("FAKE_CUDA_MISSING");
  if (!v) return false;
  std::string list = std::string(",") + v + ",";
  return list.find(std::string(",") + symbol + ",") != std::string::npos;
}

CUresult fake_not_supported() { return CUDA_ERROR_NOT_SUPPORTED; }
CUresult fake_driver_get_version(int* v) {
  *v = env_int("FAKE_CUDA_VERSION", 13000);
  return CUDA_SUCCESS;
}
CUresult fake_init(unsigned int) { return static_cast<CUresult>(env_int("FAKE_CUDA_INIT", 0)); }
CUresult fake_device_get_count(int* n) {
  *n = env_int("FAKE_CUDA_DEVICES", 0);
  return CUDA_SUCCESS;
}
const char* name_of(CUresult r) {
  switch (r) {
    case CUDA_SUCCESS: return "CUDA_SUCCESS";
    case CUDA_ERROR_INVALID_VALUE: return "CUDA_ERROR_INVALID_VALUE";
    case CUDA_ERROR_OUT_OF_MEMORY: return "CUDA_ERROR_OUT_OF_MEMORY";
    case CUDA_ERROR_NO_DEVICE: return "CUDA_ERROR_NO_DEVICE";
    case CUDA_ERROR_NOT_SUPPORTED: return "CUDA_ERROR_NOT_SUPPORTED";
    case CUDA_ERROR_INVALID_DEVICE: return "CUDA_ERROR_INVALID_DEVICE";
    case CUDA_ERROR_INVALID_CONTEXT: return "CUDA_ERROR_INVALID_CONTEXT";
    case CUDA_ERROR_UNKNOWN: return "CUDA_ERROR_UNKNOWN";
    default: return nullptr;
  }
}
CUresult fake_get_error_name(CUresult r, const char** s) {
  *s = name_of(r);
  return *s ? CUDA_SUCCESS : CUDA_ERROR_INVALID_VALUE;
}
CUresult fake_get_error_string(CUresult r, const char** s) {
  *s = name_of(r) ? "fake driver error text" : nullptr;
  return *s ? CUDA_SUCCESS : CUDA_ERROR_INVALID_VALUE;
}

}  // namespace

// ---- VMM and plain memory on host memory (active with FAKE_CUDA_DEVICES >= 1) ----------------
namespace {

constexpr uint64_t kGran = uint64_t(2) << 20;  // 2 MiB, like the H200

struct Vmm {
  std::mutex mu;
  std::map<uint64_t, uint64_t> reservations;  // start -> size
  struct Handle { int fd; uint64_t size; };
  std::map<uint64_t, Handle> handles;         // id -> memfd
  uint64_t next_handle = 1;
  struct Map { uint64_t size; bool access; };
  std::map<uint64_t, Map> mappings;           // start -> mapping
  std::map<uint64_t, uint64_t> allocs;        // cuMemAlloc start -> size
  uint64_t physical = 0;                      // bytes held by handles and allocs
};
Vmm& vmm() {
  static Vmm* v = new Vmm();
  return *v;
}
thread_local CUcontext t_current = nullptr;

bool failing(const char* symbol) {
  const char* v = std::getenv("FAKE_CUDA_FAIL");
  if (!v) return false;
  std::string list = std::string(",") + v + ",";
  return list.find(std::string(",") + symbol + ",") != std::string::npos;
}
#define FAKE_FAIL_POINT(name) \
  if (failing(name)) return CUDA_ERROR_UNKNOWN

uint64_t device_memory() {
  const char* v = std::getenv("FAKE_CUDA_DEVICE_MEMORY");
  return (v && *v) ? std::strtoull(v, nullptr, 10) : (uint64_t(64) << 30);
}
bool valid_device(CUdevice d) { return d >= 0 && d < env_int("FAKE_CUDA_DEVICES", 0); }
CUcontext ctx_of(CUdevice d) { return reinterpret_cast<CUcontext>(uintptr_t(0x1000 + 16 * d)); }

// An anonymous PROT_NONE mapping of `size` at a 2 MiB-aligned address the kernel picks.
uint64_t map_anywhere(uint64_t size) {
  void* p = ::mmap(nullptr, size + kGran, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  if (p == MAP_FAILED) return 0;
  const uint64_t raw = reinterpret_cast<uint64_t>(p);
  const uint64_t start = (raw + kGran - 1) / kGran * kGran;
  if (start > raw) ::munmap(p, start - raw);
  const uint64_t tail = raw + size + kGran - (start + size);
  if (tail) ::munmap(reinterpret_cast<void*>(start + size), tail);
  return start;
}

CUresult fake_device_get(CUdevice* d, int ordinal) {
  if (!valid_device(ordinal)) return CUDA_ERROR_INVALID_DEVICE;
  *d = ordinal;
  return CUDA_SUCCESS;
}
CUresult fake_device_get_name(char* name, int len, CUdevice d) {
  if (!valid_device(d)) return CUDA_ERROR_INVALID_DEVICE;
  std::snprintf(name, size_t(len), "vitrify fake device %d", d);
  return CUDA_SUCCESS;
}
CUresult fake_device_get_uuid(CUuuid* u, CUdevice d) {
  if (!valid_device(d)) return CUDA_ERROR_INVALID_DEVICE;
  std::memset(u, 0, sizeof *u);
  u->bytes[15] = char(d);
  return CUDA_SUCCESS;
}
CUresult fake_device_total_mem(size_t* n, CUdevice d) {
  if (!valid_device(d)) return CUDA_ERROR_INVALID_DEVICE;
  *n = device_memory();
  return CUDA_SUCCESS;
}
CUresult fake_device_get_attribute(int* v, CUdevice_attribute a, CUdevice d) {
  if (!valid_device(d)) return CUDA_ERROR_INVALID_DEVICE;
  switch (a) {
    case CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED: *v = 1; break;
    case CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR: *v = 9; break;
    case CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR: *v = 0; break;
    case CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT: *v = 132; break;
    default: *v = 0;
  }
  return CUDA_SUCCESS;
}
CUresult fake_primary_retain(CUcontext* c, CUdevice d) {
  if (!valid_device(d)) return CUDA_ERROR_INVALID_DEVICE;
  *c = ctx_of(d);
  return CUDA_SUCCESS;
}
CUresult fake_primary_release(CUdevice d) { return valid_device(d) ? CUDA_SUCCESS : CUDA_ERROR_INVALID_DEVICE; }
CUresult fake_ctx_get_current(CUcontext* c) {
  *c = t_current;
  return CUDA_SUCCESS;
}
CUresult fake_ctx_set_current(CUcontext c) {
  t_current = c;
  return CUDA_SUCCESS;
}
CUresult fake_ctx_get_device(CUdevice* d) {
  if (t_current == nullptr) return CUDA_ERROR_INVALID_CONTEXT;
  *d = CUdevice((reinterpret_cast<uintptr_t>(t_current) - 0x1000) / 16);
  return CUDA_SUCCESS;
}
CUresult fake_ctx_synchronize() { return t_current ? CUDA_SUCCESS : CUDA_ERROR_INVALID_CONTEXT; }
CUresult fake_mem_get_info(size_t* free_b, size_t* total) {
  Vmm& v = vmm();
  std::lock_guard<std::mutex> lk(v.mu);
  *total = device_memory();
  *free_b = *total > v.physical ? *total - v.physical : 0;
  return CUDA_SUCCESS;
}

CUresult fake_granularity(size_t* g, const CUmemAllocationProp* prop, CUmemAllocationGranularity_flags) {
  if (!prop || prop->location.type != CU_MEM_LOCATION_TYPE_DEVICE || !valid_device(prop->location.id))
    return CUDA_ERROR_INVALID_DEVICE;
  *g = kGran;
  return CUDA_SUCCESS;
}

CUresult fake_address_reserve(CUdeviceptr* ptr, size_t size, size_t, CUdeviceptr addr,
                              unsigned long long) {
  FAKE_FAIL_POINT("cuMemAddressReserve");
  if (size == 0 || size % kGran || addr % kGran) return CUDA_ERROR_INVALID_VALUE;
  uint64_t got = 0;
  if (addr != 0) {
    void* p = ::mmap(reinterpret_cast<void*>(addr), size, PROT_NONE,
                     MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE | MAP_FIXED_NOREPLACE, -1, 0);
    if (p != MAP_FAILED && reinterpret_cast<uint64_t>(p) != addr) ::munmap(p, size);  // old kernel
    else if (p != MAP_FAILED) got = addr;
  }
  if (got == 0) got = map_anywhere(size);  // like the driver: the hint is only a hint
  if (got == 0) return CUDA_ERROR_OUT_OF_MEMORY;
  Vmm& v = vmm();
  std::lock_guard<std::mutex> lk(v.mu);
  v.reservations[got] = size;
  *ptr = got;
  return CUDA_SUCCESS;
}

CUresult fake_address_free(CUdeviceptr ptr, size_t size) {
  FAKE_FAIL_POINT("cuMemAddressFree");
  Vmm& v = vmm();
  std::lock_guard<std::mutex> lk(v.mu);
  auto it = v.reservations.find(ptr);
  if (it == v.reservations.end() || it->second != size) return CUDA_ERROR_INVALID_VALUE;
  auto m = v.mappings.lower_bound(ptr);
  if (m != v.mappings.end() && m->first < ptr + size) return CUDA_ERROR_INVALID_VALUE;  // still mapped
  ::munmap(reinterpret_cast<void*>(ptr), size);
  v.reservations.erase(it);
  return CUDA_SUCCESS;
}

CUresult fake_mem_create(CUmemGenericAllocationHandle* h, size_t size, const CUmemAllocationProp* prop,
                         unsigned long long) {
  FAKE_FAIL_POINT("cuMemCreate");
  if (!prop || prop->location.type != CU_MEM_LOCATION_TYPE_DEVICE || !valid_device(prop->location.id))
    return CUDA_ERROR_INVALID_DEVICE;
  if (size == 0 || size % kGran) return CUDA_ERROR_INVALID_VALUE;
  Vmm& v = vmm();
  std::lock_guard<std::mutex> lk(v.mu);
  if (v.physical + size > device_memory()) return CUDA_ERROR_OUT_OF_MEMORY;
  const int fd = ::memfd_create("vitrify-fake-cuda", MFD_CLOEXEC);
  if (fd < 0) return CUDA_ERROR_OUT_OF_MEMORY;
  if (::ftruncate(fd, off_t(size)) != 0) {
    ::close(fd);
    return CUDA_ERROR_OUT_OF_MEMORY;
  }
  const uint64_t id = v.next_handle++;
  v.handles[id] = Vmm::Handle{fd, size};
  v.physical += size;
  *h = id;
  return CUDA_SUCCESS;
}

CUresult fake_mem_release(CUmemGenericAllocationHandle h) {
  FAKE_FAIL_POINT("cuMemRelease");
  Vmm& v = vmm();
  std::lock_guard<std::mutex> lk(v.mu);
  auto it = v.handles.find(h);
  if (it == v.handles.end()) return CUDA_ERROR_INVALID_VALUE;
  ::close(it->second.fd);  // a live mapping keeps the pages, as with the real driver
  v.physical -= it->second.size;
  v.handles.erase(it);
  return CUDA_SUCCESS;
}

bool inside_reservation(const Vmm& v, uint64_t p, uint64_t n) {
  auto it = v.reservations.upper_bound(p);
  if (it == v.reservations.begin()) return false;
  --it;
  return p >= it->first && p + n <= it->first + it->second;
}

CUresult fake_mem_map(CUdeviceptr ptr, size_t size, size_t offset, CUmemGenericAllocationHandle h,
                      unsigned long long flags) {
  FAKE_FAIL_POINT("cuMemMap");
  Vmm& v = vmm();
  std::lock_guard<std::mutex> lk(v.mu);
  auto hd = v.handles.find(h);
  if (hd == v.handles.end() || flags != 0 || size == 0 || ptr % kGran || size % kGran ||
      offset % kGran || offset + size > hd->second.size || !inside_reservation(v, ptr, size))
    return CUDA_ERROR_INVALID_VALUE;
  auto m = v.mappings.lower_bound(ptr);
  if (m != v.mappings.end() && m->first < ptr + size) return CUDA_ERROR_INVALID_VALUE;  // overlap
  if (m != v.mappings.begin() && std::prev(m)->first + std::prev(m)->second.size > ptr)
    return CUDA_ERROR_INVALID_VALUE;
  void* p = ::mmap(reinterpret_cast<void*>(ptr), size, PROT_NONE, MAP_SHARED | MAP_FIXED,
                   hd->second.fd, off_t(offset));
  if (p == MAP_FAILED) return CUDA_ERROR_OUT_OF_MEMORY;
  v.mappings[ptr] = Vmm::Map{size, false};
  return CUDA_SUCCESS;
}

CUresult fake_mem_set_access(CUdeviceptr ptr, size_t size, const CUmemAccessDesc* desc, size_t count) {
  FAKE_FAIL_POINT("cuMemSetAccess");
  if (count != 1 || desc == nullptr || desc->location.type != CU_MEM_LOCATION_TYPE_DEVICE ||
      !valid_device(desc->location.id) || desc->flags != CU_MEM_ACCESS_FLAGS_PROT_READWRITE)
    return CUDA_ERROR_INVALID_VALUE;
  Vmm& v = vmm();
  std::lock_guard<std::mutex> lk(v.mu);
  // The range must be exactly a run of whole, adjacent mappings.
  uint64_t p = ptr;
  while (p < ptr + size) {
    auto m = v.mappings.find(p);
    if (m == v.mappings.end()) return CUDA_ERROR_INVALID_VALUE;
    p += m->second.size;
  }
  if (p != ptr + size) return CUDA_ERROR_INVALID_VALUE;
  if (::mprotect(reinterpret_cast<void*>(ptr), size, PROT_READ | PROT_WRITE) != 0)
    return CUDA_ERROR_INVALID_VALUE;
  for (p = ptr; p < ptr + size; p += v.mappings[p].size) v.mappings[p].access = true;
  return CUDA_SUCCESS;
}

CUresult fake_mem_unmap(CUdeviceptr ptr, size_t size) {
  FAKE_FAIL_POINT("cuMemUnmap");
  Vmm& v = vmm();
  std::lock_guard<std::mutex> lk(v.mu);
  uint64_t p = ptr;
  while (p < ptr + size) {
    auto m = v.mappings.find(p);
    if (m == v.mappings.end()) return CUDA_ERROR_INVALID_VALUE;  // a partial unmap is refused
    p += m->second.size;
  }
  if (p != ptr + size) return CUDA_ERROR_INVALID_VALUE;
  // Back to a PROT_NONE reservation (the range stays reserved).
  if (::mmap(reinterpret_cast<void*>(ptr), size, PROT_NONE,
             MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE | MAP_FIXED, -1, 0) == MAP_FAILED)
    return CUDA_ERROR_UNKNOWN;
  for (p = ptr; p < ptr + size;) {
    auto m = v.mappings.find(p);
    p += m->second.size;
    v.mappings.erase(m);
  }
  return CUDA_SUCCESS;
}

CUresult fake_mem_alloc(CUdeviceptr* d, size_t size) {
  FAKE_FAIL_POINT("cuMemAlloc");
  if (size == 0) return CUDA_ERROR_INVALID_VALUE;
  Vmm& v = vmm();
  std::lock_guard<std::mutex> lk(v.mu);
  const uint64_t n = (size + 4095) / 4096 * 4096;
  if (v.physical + n > device_memory()) return CUDA_ERROR_OUT_OF_MEMORY;
  void* p = ::mmap(nullptr, n, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (p == MAP_FAILED) return CUDA_ERROR_OUT_OF_MEMORY;
  v.allocs[reinterpret_cast<uint64_t>(p)] = n;
  v.physical += n;
  *d = reinterpret_cast<uint64_t>(p);
  return CUDA_SUCCESS;
}

CUresult fake_mem_free(CUdeviceptr d) {
  Vmm& v = vmm();
  std::lock_guard<std::mutex> lk(v.mu);
  auto it = v.allocs.find(d);
  if (it == v.allocs.end()) return CUDA_ERROR_INVALID_VALUE;
  ::munmap(reinterpret_cast<void*>(d), it->second);
  v.physical -= it->second;
  v.allocs.erase(it);
  return CUDA_SUCCESS;
}

// True when [p, p+n) is covered by accessible mappings and cuMemAlloc blocks (caller locks).
bool accessible(const Vmm& v, uint64_t p, uint64_t n) {
  const uint64_t end = p + n;
  while (p < end) {
    uint64_t next = 0;
    auto m = v.mappings.upper_bound(p);
    if (m != v.mappings.begin()) {
      --m;
      if (p < m->first + m->second.size && m->second.access) next = m->first + m->second.size;
    }
    if (next == 0) {
      auto a = v.allocs.upper_bound(p);
      if (a != v.allocs.begin()) {
        --a;
        if (p < a->first + a->second) next = a->first + a->second;
      }
    }
    if (next == 0) return false;
    p = next;
  }
  return true;
}

CUresult fake_memcpy_htod(CUdeviceptr dst, const void* src, size_t n) {
  Vmm& v = vmm();
  std::lock_guard<std::mutex> lk(v.mu);
  if (!accessible(v, dst, n)) return CUDA_ERROR_INVALID_VALUE;
  std::memcpy(reinterpret_cast<void*>(dst), src, n);
  return CUDA_SUCCESS;
}
CUresult fake_memcpy_dtoh(void* dst, CUdeviceptr src, size_t n) {
  Vmm& v = vmm();
  std::lock_guard<std::mutex> lk(v.mu);
  if (!accessible(v, src, n)) return CUDA_ERROR_INVALID_VALUE;
  std::memcpy(dst, reinterpret_cast<void*>(src), n);
  return CUDA_SUCCESS;
}
CUresult fake_memcpy_dtod(CUdeviceptr dst, CUdeviceptr src, size_t n) {
  Vmm& v = vmm();
  std::lock_guard<std::mutex> lk(v.mu);
  if (!accessible(v, src, n) || !accessible(v, dst, n)) return CUDA_ERROR_INVALID_VALUE;
  std::memmove(reinterpret_cast<void*>(dst), reinterpret_cast<void*>(src), n);
  return CUDA_SUCCESS;
}
CUresult fake_memset_d8(CUdeviceptr dst, unsigned char c, size_t n) {
  Vmm& v = vmm();
  std::lock_guard<std::mutex> lk(v.mu);
  if (!accessible(v, dst, n)) return CUDA_ERROR_INVALID_VALUE;
  std::memset(reinterpret_cast<void*>(dst), c, n);
  return CUDA_SUCCESS;
}

void* fake_vmm_entry(const char* s) {
  static const struct { const char* name; void* fn; } table[] = {
      {"cuDeviceGet", (void*)&fake_device_get},
      {"cuDeviceGetName", (void*)&fake_device_get_name},
      {"cuDeviceGetUuid", (void*)&fake_device_get_uuid},
      {"cuDeviceTotalMem", (void*)&fake_device_total_mem},
      {"cuDeviceGetAttribute", (void*)&fake_device_get_attribute},
      {"cuDevicePrimaryCtxRetain", (void*)&fake_primary_retain},
      {"cuDevicePrimaryCtxRelease", (void*)&fake_primary_release},
      {"cuCtxGetCurrent", (void*)&fake_ctx_get_current},
      {"cuCtxSetCurrent", (void*)&fake_ctx_set_current},
      {"cuCtxGetDevice", (void*)&fake_ctx_get_device},
      {"cuCtxSynchronize", (void*)&fake_ctx_synchronize},
      {"cuMemGetInfo", (void*)&fake_mem_get_info},
      {"cuMemGetAllocationGranularity", (void*)&fake_granularity},
      {"cuMemAddressReserve", (void*)&fake_address_reserve},
      {"cuMemAddressFree", (void*)&fake_address_free},
      {"cuMemCreate", (void*)&fake_mem_create},
      {"cuMemRelease", (void*)&fake_mem_release},
      {"cuMemMap", (void*)&fake_mem_map},
      {"cuMemUnmap", (void*)&fake_mem_unmap},
      {"cuMemSetAccess", (void*)&fake_mem_set_access},
      {"cuMemAlloc", (void*)&fake_mem_alloc},
      {"cuMemFree", (void*)&fake_mem_free},
      {"cuMemcpyHtoD", (void*)&fake_memcpy_htod},
      {"cuMemcpyDtoH", (void*)&fake_memcpy_dtoh},
      {"cuMemcpyDtoD", (void*)&fake_memcpy_dtod},
      {"cuMemsetD8", (void*)&fake_memset_d8},
  };
  for (const auto& e : table)
    if (!std::strcmp(s, e.name)) return e.fn;
  return nullptr;
}

}  // namespace

// Live fake driver objects, for tests that check nothing leaked:
// [reservations, physical handles, mappings, cuMemAlloc blocks, physical bytes].
extern "C" __attribute__((visibility("default"))) void fake_cuda_counts(uint64_t out[5]) {
  Vmm& v = vmm();
  std::lock_guard<std::mutex> lk(v.mu);
  out[0] = v.reservations.size();
  out[1] = v.handles.size();
  out[2] = v.mappings.size();
  out[3] = v.allocs.size();
  out[4] = v.physical;
}

extern "C" __attribute__((visibility("default"))) CUresult cuGetProcAddress_v2(
    const char* symbol, void** pfn, int version, cuuint64_t, CUdriverProcAddressQueryResult* st) {
  (void)version;
  *pfn = nullptr;
  if (missing(symbol)) {
    if (st) *st = CU_GET_PROC_ADDRESS_SYMBOL_NOT_FOUND;
    return CUDA_ERROR_NOT_FOUND;
  }
  if (!std::strcmp(symbol, "cuDriverGetVersion")) *pfn = (void*)&fake_driver_get_version;
  else if (!std::strcmp(symbol, "cuInit")) *pfn = (void*)&fake_init;
  else if (!std::strcmp(symbol, "cuGetErrorName")) *pfn = (void*)&fake_get_error_name;
  else if (!std::strcmp(symbol, "cuGetErrorString")) *pfn = (void*)&fake_get_error_string;
  else if (!std::strcmp(symbol, "cuDeviceGetCount")) *pfn = (void*)&fake_device_get_count;
  else if (void* f = fake_vmm_entry(symbol)) *pfn = f;
  else *pfn = (void*)&fake_not_supported;
  if (st) *st = CU_GET_PROC_ADDRESS_SUCCESS;
  return CUDA_SUCCESS;
}
