// Device memory of the fake driver, emulated on host memory: VMM reservations are PROT_NONE
// mmaps at the hint (elsewhere when the hint is taken, like the real driver), physical handles
// are memfds, cuMemMap maps them MAP_SHARED over the reservation, cuMemSetAccess makes them
// read-write. A handle created with CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR exports as a dup
// of its memfd (cuMemExportToShareableHandle); importing such an fd (in this or another process)
// makes a handle of its own holding a dup, so every process that maps it sees the same bytes.
// cuMemAlloc blocks are private mmaps that belong to the current context's device
// (gone when its primary context is reset). Synchronous copies need a current context and fail
// with CUDA_ERROR_INVALID_VALUE unless their device range lies inside one cuMemAlloc block or
// is covered by accessible mappings. fake_cuda_counts() exports the live objects.
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstdlib>
#include <cstring>
#include <iterator>
#include <map>
#include <mutex>

#include "fake_cuda.hpp"

namespace fake {
namespace {

constexpr uint64_t kGran = uint64_t(2) << 20;  // 2 MiB, like the H200

struct Vmm {
  std::mutex mu;
  std::map<uint64_t, uint64_t> reservations;  // start -> size
  struct Handle {
    int fd;
    uint64_t size;
    bool exportable;  // created with CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, or imported
    bool imported;    // its bytes are counted in the exporting process's `physical`
  };
  std::map<uint64_t, Handle> handles;         // id -> memfd (or a dup of an imported one)
  uint64_t next_handle = 1;
  struct Map { uint64_t size; bool access; };
  std::map<uint64_t, Map> mappings;           // start -> mapping
  struct Alloc { uint64_t size; uint64_t mapped; int device; };
  std::map<uint64_t, Alloc> allocs;           // cuMemAlloc start -> block
  uint64_t physical = 0;                      // bytes held by handles and allocs
};
Vmm& vmm() {
  static Vmm* v = new Vmm();
  return *v;
}

uint64_t device_memory() {
  const char* v = std::getenv("FAKE_CUDA_DEVICE_MEMORY");
  return (v && *v) ? std::strtoull(v, nullptr, 10) : (uint64_t(64) << 30);
}

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

bool inside_reservation(const Vmm& v, uint64_t p, uint64_t n) {
  auto it = v.reservations.upper_bound(p);
  if (it == v.reservations.begin()) return false;
  --it;
  return p >= it->first && p + n <= it->first + it->second;
}

// True when [p, p+n) lies inside one cuMemAlloc block, or is covered by adjacent accessible
// mappings (caller locks).
bool accessible(const Vmm& v, uint64_t p, uint64_t n) {
  auto a = v.allocs.upper_bound(p);
  if (a != v.allocs.begin()) {
    --a;
    if (p >= a->first && p + n <= a->first + a->second.size) return true;
  }
  const uint64_t end = p + n;
  while (p < end) {
    auto m = v.mappings.upper_bound(p);
    if (m == v.mappings.begin()) return false;
    --m;
    if (p >= m->first + m->second.size || !m->second.access) return false;
    p = m->first + m->second.size;
  }
  return true;
}

// The range must be exactly a run of whole, adjacent mappings (caller locks).
bool whole_mappings(const Vmm& v, uint64_t ptr, uint64_t size) {
  uint64_t p = ptr;
  while (p < ptr + size) {
    auto m = v.mappings.find(p);
    if (m == v.mappings.end()) return false;
    p += m->second.size;
  }
  return p == ptr + size;
}

void reset_allocs(int device) {  // the context of `device` was reset: its cuMemAlloc blocks go
  Vmm& v = vmm();
  std::lock_guard<std::mutex> lk(v.mu);
  for (auto it = v.allocs.begin(); it != v.allocs.end();) {
    if (it->second.device != device) {
      ++it;
      continue;
    }
    ::munmap(reinterpret_cast<void*>(it->first), it->second.mapped);
    v.physical -= it->second.mapped;
    it = v.allocs.erase(it);
  }
}
[[maybe_unused]] const bool registered_reset = (on_context_reset(&reset_allocs), true);

// ---- info and granularity -------------------------------------------------------------------
CUresult device_total_mem(size_t* n, CUdevice d) {
  if (!valid_device(d)) return CUDA_ERROR_INVALID_DEVICE;
  *n = device_memory();
  return CUDA_SUCCESS;
}
CUresult mem_get_info(size_t* free_b, size_t* total) {
  Vmm& v = vmm();
  std::lock_guard<std::mutex> lk(v.mu);
  *total = device_memory();
  *free_b = *total > v.physical ? *total - v.physical : 0;
  return CUDA_SUCCESS;
}
CUresult granularity(size_t* g, const CUmemAllocationProp* prop, CUmemAllocationGranularity_flags) {
  if (!prop || prop->location.type != CU_MEM_LOCATION_TYPE_DEVICE || !valid_device(prop->location.id))
    return CUDA_ERROR_INVALID_DEVICE;
  *g = kGran;
  return CUDA_SUCCESS;
}

// ---- VMM --------------------------------------------------------------------------------------
CUresult address_reserve(CUdeviceptr* ptr, size_t size, size_t, CUdeviceptr addr, unsigned long long) {
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

CUresult address_free(CUdeviceptr ptr, size_t size) {
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

CUresult mem_create(CUmemGenericAllocationHandle* h, size_t size, const CUmemAllocationProp* prop,
                    unsigned long long) {
  FAKE_FAIL_POINT("cuMemCreate");
  if (!prop || prop->location.type != CU_MEM_LOCATION_TYPE_DEVICE || !valid_device(prop->location.id))
    return CUDA_ERROR_INVALID_DEVICE;
  if (size == 0 || size % kGran) return CUDA_ERROR_INVALID_VALUE;
  const auto types = prop->requestedHandleTypes;
  if (types != CU_MEM_HANDLE_TYPE_NONE && types != CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR)
    return CUDA_ERROR_NOT_SUPPORTED;
  if (types == CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR && env_int("FAKE_CUDA_POSIX_FD", 1) == 0)
    return CUDA_ERROR_NOT_SUPPORTED;
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
  v.handles[id] = Vmm::Handle{fd, size, types == CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, false};
  v.physical += size;
  *h = id;
  return CUDA_SUCCESS;
}

// A dup of the handle's memfd, without FD_CLOEXEC (the caller decides).
CUresult export_handle(void* out, CUmemGenericAllocationHandle h, CUmemAllocationHandleType type,
                       unsigned long long flags) {
  FAKE_FAIL_POINT("cuMemExportToShareableHandle");
  if (out == nullptr || type != CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR || flags != 0)
    return CUDA_ERROR_INVALID_VALUE;
  Vmm& v = vmm();
  std::lock_guard<std::mutex> lk(v.mu);
  auto it = v.handles.find(h);
  if (it == v.handles.end() || !it->second.exportable) return CUDA_ERROR_INVALID_VALUE;
  const int fd = ::fcntl(it->second.fd, F_DUPFD, 0);
  if (fd < 0) return CUDA_ERROR_OUT_OF_MEMORY;
  *static_cast<int*>(out) = fd;
  return CUDA_SUCCESS;
}

// The fd (passed by value in the pointer) is not consumed: the new handle holds a dup of it.
CUresult import_handle(CUmemGenericAllocationHandle* h, void* os_handle,
                       CUmemAllocationHandleType type) {
  FAKE_FAIL_POINT("cuMemImportFromShareableHandle");
  if (h == nullptr || type != CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR)
    return CUDA_ERROR_INVALID_VALUE;
  const int fd = static_cast<int>(reinterpret_cast<uintptr_t>(os_handle));
  struct stat st {};
  if (::fstat(fd, &st) != 0 || !S_ISREG(st.st_mode) || st.st_size <= 0 ||
      uint64_t(st.st_size) % kGran != 0)
    return CUDA_ERROR_INVALID_VALUE;  // not an fd this driver exported
  const int own = ::fcntl(fd, F_DUPFD_CLOEXEC, 0);
  if (own < 0) return CUDA_ERROR_OUT_OF_MEMORY;
  Vmm& v = vmm();
  std::lock_guard<std::mutex> lk(v.mu);
  const uint64_t id = v.next_handle++;
  v.handles[id] = Vmm::Handle{own, uint64_t(st.st_size), true, true};
  *h = id;
  return CUDA_SUCCESS;
}

CUresult mem_release(CUmemGenericAllocationHandle h) {
  FAKE_FAIL_POINT("cuMemRelease");
  Vmm& v = vmm();
  std::lock_guard<std::mutex> lk(v.mu);
  auto it = v.handles.find(h);
  if (it == v.handles.end()) return CUDA_ERROR_INVALID_VALUE;
  ::close(it->second.fd);  // a live mapping keeps the pages, as with the real driver
  if (!it->second.imported) v.physical -= it->second.size;
  v.handles.erase(it);
  return CUDA_SUCCESS;
}

CUresult mem_map(CUdeviceptr ptr, size_t size, size_t offset, CUmemGenericAllocationHandle h,
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

CUresult mem_set_access(CUdeviceptr ptr, size_t size, const CUmemAccessDesc* desc, size_t count) {
  FAKE_FAIL_POINT("cuMemSetAccess");
  if (count != 1 || desc == nullptr || desc->location.type != CU_MEM_LOCATION_TYPE_DEVICE ||
      !valid_device(desc->location.id) || desc->flags != CU_MEM_ACCESS_FLAGS_PROT_READWRITE)
    return CUDA_ERROR_INVALID_VALUE;
  Vmm& v = vmm();
  std::lock_guard<std::mutex> lk(v.mu);
  if (!whole_mappings(v, ptr, size)) return CUDA_ERROR_INVALID_VALUE;
  if (::mprotect(reinterpret_cast<void*>(ptr), size, PROT_READ | PROT_WRITE) != 0)
    return CUDA_ERROR_INVALID_VALUE;
  for (uint64_t p = ptr; p < ptr + size; p += v.mappings[p].size) v.mappings[p].access = true;
  return CUDA_SUCCESS;
}

CUresult mem_unmap(CUdeviceptr ptr, size_t size) {
  FAKE_FAIL_POINT("cuMemUnmap");
  Vmm& v = vmm();
  std::lock_guard<std::mutex> lk(v.mu);
  if (!whole_mappings(v, ptr, size)) return CUDA_ERROR_INVALID_VALUE;  // a partial unmap is refused
  // Back to a PROT_NONE reservation (the range stays reserved).
  if (::mmap(reinterpret_cast<void*>(ptr), size, PROT_NONE,
             MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE | MAP_FIXED, -1, 0) == MAP_FAILED)
    return CUDA_ERROR_UNKNOWN;
  for (uint64_t p = ptr; p < ptr + size;) {
    auto m = v.mappings.find(p);
    p += m->second.size;
    v.mappings.erase(m);
  }
  return CUDA_SUCCESS;
}

// ---- plain memory -----------------------------------------------------------------------------
CUresult mem_alloc(CUdeviceptr* d, size_t size) {
  FAKE_FAIL_POINT("cuMemAlloc");
  int device = 0;
  if (need_context(&device) != CUDA_SUCCESS) return CUDA_ERROR_INVALID_CONTEXT;
  if (size == 0) return CUDA_ERROR_INVALID_VALUE;
  Vmm& v = vmm();
  std::lock_guard<std::mutex> lk(v.mu);
  const uint64_t n = (size + 4095) / 4096 * 4096;
  if (v.physical + n > device_memory()) return CUDA_ERROR_OUT_OF_MEMORY;
  void* p = ::mmap(nullptr, n, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (p == MAP_FAILED) return CUDA_ERROR_OUT_OF_MEMORY;
  v.allocs[reinterpret_cast<uint64_t>(p)] = Vmm::Alloc{size, n, device};
  v.physical += n;
  *d = reinterpret_cast<uint64_t>(p);
  return CUDA_SUCCESS;
}

CUresult mem_free(CUdeviceptr d) {
  Vmm& v = vmm();
  std::lock_guard<std::mutex> lk(v.mu);
  auto it = v.allocs.find(d);
  if (it == v.allocs.end()) return CUDA_ERROR_INVALID_VALUE;
  ::munmap(reinterpret_cast<void*>(d), it->second.mapped);
  v.physical -= it->second.mapped;
  v.allocs.erase(it);
  return CUDA_SUCCESS;
}

// ---- synchronous copies -----------------------------------------------------------------------
CUresult memcpy_htod(CUdeviceptr dst, const void* src, size_t n) {
  if (need_context() != CUDA_SUCCESS) return CUDA_ERROR_INVALID_CONTEXT;
  Vmm& v = vmm();
  std::lock_guard<std::mutex> lk(v.mu);
  if (!accessible(v, dst, n)) return CUDA_ERROR_INVALID_VALUE;
  std::memcpy(reinterpret_cast<void*>(dst), src, n);
  return CUDA_SUCCESS;
}
CUresult memcpy_dtoh(void* dst, CUdeviceptr src, size_t n) {
  FAKE_FAIL_POINT("cuMemcpyDtoH");
  if (need_context() != CUDA_SUCCESS) return CUDA_ERROR_INVALID_CONTEXT;
  Vmm& v = vmm();
  std::lock_guard<std::mutex> lk(v.mu);
  if (!accessible(v, src, n)) return CUDA_ERROR_INVALID_VALUE;
  std::memcpy(dst, reinterpret_cast<void*>(src), n);
  return CUDA_SUCCESS;
}
CUresult memcpy_dtod(CUdeviceptr dst, CUdeviceptr src, size_t n) {
  if (need_context() != CUDA_SUCCESS) return CUDA_ERROR_INVALID_CONTEXT;
  Vmm& v = vmm();
  std::lock_guard<std::mutex> lk(v.mu);
  if (!accessible(v, src, n) || !accessible(v, dst, n)) return CUDA_ERROR_INVALID_VALUE;
  std::memmove(reinterpret_cast<void*>(dst), reinterpret_cast<void*>(src), n);
  return CUDA_SUCCESS;
}
CUresult memset_d8(CUdeviceptr dst, unsigned char c, size_t n) {
  if (need_context() != CUDA_SUCCESS) return CUDA_ERROR_INVALID_CONTEXT;
  Vmm& v = vmm();
  std::lock_guard<std::mutex> lk(v.mu);
  if (!accessible(v, dst, n)) return CUDA_ERROR_INVALID_VALUE;
  std::memset(reinterpret_cast<void*>(dst), c, n);
  return CUDA_SUCCESS;
}

FAKE_CUDA_ENTRIES({
    {"cuDeviceTotalMem", FAKE_FN(device_total_mem)},
    {"cuMemGetInfo", FAKE_FN(mem_get_info)},
    {"cuMemGetAllocationGranularity", FAKE_FN(granularity)},
    {"cuMemAddressReserve", FAKE_FN(address_reserve)},
    {"cuMemAddressFree", FAKE_FN(address_free)},
    {"cuMemCreate", FAKE_FN(mem_create)},
    {"cuMemRelease", FAKE_FN(mem_release)},
    {"cuMemExportToShareableHandle", FAKE_FN(export_handle)},
    {"cuMemImportFromShareableHandle", FAKE_FN(import_handle)},
    {"cuMemMap", FAKE_FN(mem_map)},
    {"cuMemUnmap", FAKE_FN(mem_unmap)},
    {"cuMemSetAccess", FAKE_FN(mem_set_access)},
    {"cuMemAlloc", FAKE_FN(mem_alloc)},
    {"cuMemFree", FAKE_FN(mem_free)},
    {"cuMemcpyHtoD", FAKE_FN(memcpy_htod)},
    {"cuMemcpyDtoH", FAKE_FN(memcpy_dtoh)},
    {"cuMemcpyDtoD", FAKE_FN(memcpy_dtod)},
    {"cuMemsetD8", FAKE_FN(memset_d8)},
});

}  // namespace

bool device_range(uint64_t p, uint64_t n) {
  Vmm& v = vmm();
  std::lock_guard<std::mutex> lk(v.mu);
  return accessible(v, p, n);
}

}  // namespace fake

// Live fake driver objects, for tests that check nothing leaked:
// [reservations, physical handles (created or imported), mappings, cuMemAlloc blocks, physical
// bytes (of created handles and cuMemAlloc blocks: an imported handle's bytes count where they
// were created)].
FAKE_EXPORT void fake_cuda_counts(uint64_t out[5]) {
  fake::Vmm& v = fake::vmm();
  std::lock_guard<std::mutex> lk(v.mu);
  out[0] = v.reservations.size();
  out[1] = v.handles.size();
  out[2] = v.mappings.size();
  out[3] = v.allocs.size();
  out[4] = v.physical;
}
