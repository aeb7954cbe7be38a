// The CUDA driver seam: libcuda.so.1 is dlopen()ed on first use (set_library_path() chooses
// another library; the Python layer passes VITRIFY_LIBCUDA_PATH through it at import) and every
// entry point is resolved through cuGetProcAddress into one typed table.
// Nothing here links libcuda, so programs using vitrify_core run on machines without a GPU;
// `available()` says whether the driver loaded and `unavailable_reason()` why not.
#pragma once

#include <cuda.h>
#include <cudaTypedefs.h>

#include <string>

#include "vitrify/error.hpp"

namespace vitrify::driver {

struct Table {
#define VITRIFY_CU_REQUIRED(name, version) PFN_##name##_v##version name = nullptr;
#define VITRIFY_CU_OPTIONAL(name, version) PFN_##name##_v##version name = nullptr;
#define VITRIFY_CU_OPTIONAL_AS(field, name, version) PFN_##name##_v##version field = nullptr;
#include "vitrify/driver_entries.inc"
#undef VITRIFY_CU_REQUIRED
#undef VITRIFY_CU_OPTIONAL
#undef VITRIFY_CU_OPTIONAL_AS
  int driver_version = 0;  // cuDriverGetVersion, e.g. 13000
  std::string library_path;  // what dlopen() was given
};

// The library the first load dlopen()s: "libcuda.so.1" unless set_library_path() chose another.
std::string library_path();
// Chooses the library to dlopen() ("" restores "libcuda.so.1"). Only before the first load: once
// anything has loaded the driver, a different path throws std::invalid_argument naming
// libcuda_path (the same path again is accepted). The core reads no environment variable.
void set_library_path(const std::string& path);

// Loads the driver and runs cuInit(0) once; never throws. False on machines without a GPU.
bool available() noexcept;
// Why available() is false ("" when it is true).
std::string unavailable_reason();
// The table; throws DriverUnavailable (with the reason) when the driver could not be loaded.
const Table& table();
// Shorthand used by the core: vitrify::driver::cu().cuMemMap(...)
inline const Table& cu() { return table(); }

// CUresult -> "CUDA_ERROR_INVALID_VALUE"; works without a driver (falls back to the number).
std::string result_name(int result);
std::string result_string(int result);

// The device's primary context, retained once for the life of the process (never released:
// releasing the last reference would destroy every allocation made in it).
CUcontext primary_context(int device);

// Makes the device's primary context current on this thread for the guard's lifetime; the
// previous current context is restored afterwards.
class ContextGuard {
 public:
  explicit ContextGuard(int device);
  ~ContextGuard();
  ContextGuard(const ContextGuard&) = delete;
  ContextGuard& operator=(const ContextGuard&) = delete;
  CUcontext context() const noexcept { return ctx_; }

 private:
  CUcontext ctx_ = nullptr;
  CUcontext prev_ = nullptr;
};

// The alignment to pass to cuMemAddressReserve together with the hint `addr` so that the driver
// honours the hint: the largest power of two dividing `addr`, capped at 1 GiB (0 for addr 0).
// Measured on an H200 (driver 580, CUDA 13.0): with alignment 0 or 2 MiB, reservations of up to
// 64 MiB land inside the driver's own heap whatever the hint; with alignment 1 GiB every hint
// tried (16 TiB .. 127.5 TiB, 2 MiB .. 256 GiB) came back exact. Bases should therefore be
// multiples of 1 GiB.
uint64_t reserve_alignment(uint64_t addr) noexcept;

// Facts about one device, for `vitrify doctor` and archive fingerprints.
struct DeviceInfo {
  int ordinal = 0;
  std::string name;
  std::string uuid;  // "GPU-xxxxxxxx-xxxx-..."
  int sm_major = 0, sm_minor = 0;
  int multiprocessors = 0;
  size_t total_bytes = 0;
  bool vmm_supported = false;
  size_t granularity_min = 0;          // cuMemGetAllocationGranularity MINIMUM (0 without VMM)
  size_t granularity_recommended = 0;  // ... RECOMMENDED
  int pci_bus = 0, pci_device = 0, pci_domain = 0;
};
int device_count();
DeviceInfo device_info(int ordinal);

}  // namespace vitrify::driver
