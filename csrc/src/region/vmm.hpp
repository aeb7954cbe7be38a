// Internal: one RAII owner per VMM driver object (invariant R9 in DESIGN.md).
//   Reservation     cuMemAddressReserve  -> cuMemAddressFree
//   PhysicalMemory  cuMemCreate or cuMemImportFromShareableHandle -> cuMemRelease
//   Mapping         cuMemMap (+ SetAccess) -> cuMemUnmap, then its PhysicalMemory is released
// A failed multi-step operation unwinds by letting its local owners die. Destructors never throw.
#pragma once

#include <cstdint>
#include <utility>

#include "vitrify/driver.hpp"

namespace vitrify::region::detail {

class Reservation {
 public:
  // Asks the driver for [addr, addr+size) (addr 0: anywhere). The driver may return another
  // address: the caller compares ptr() with what it asked for.
  Reservation(uint64_t addr, uint64_t size);
  ~Reservation() { (void)release(); }
  Reservation(const Reservation&) = delete;
  Reservation& operator=(const Reservation&) = delete;
  uint64_t ptr() const { return ptr_; }
  uint64_t size() const { return size_; }
  // Frees the range now; returns the CUresult (0 when there was nothing to free).
  int release() noexcept;

 private:
  uint64_t ptr_ = 0, size_ = 0;
};

class PhysicalMemory {
 public:
  // cuMemCreate of `size` bytes on `device`; `handle_types` are the shareable handle types the
  // allocation may later be exported as (CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR: SharedBuffer).
  PhysicalMemory(uint64_t size, int device,
                 CUmemAllocationHandleType handle_types = CU_MEM_HANDLE_TYPE_NONE);
  // Becomes the owner of a handle the caller just obtained from the driver (a successful
  // cuMemImportFromShareableHandle): from here on cuMemRelease is this object's job.
  static PhysicalMemory adopt(CUmemGenericAllocationHandle handle, uint64_t size) noexcept {
    return PhysicalMemory(Adopted{}, handle, size);
  }
  ~PhysicalMemory() { (void)release(); }
  PhysicalMemory(PhysicalMemory&& o) noexcept
      : handle_(std::exchange(o.handle_, 0)), size_(std::exchange(o.size_, 0)) {}
  PhysicalMemory& operator=(PhysicalMemory&&) = delete;
  PhysicalMemory(const PhysicalMemory&) = delete;
  CUmemGenericAllocationHandle handle() const { return handle_; }
  uint64_t size() const { return size_; }
  int release() noexcept;

 private:
  struct Adopted {};
  PhysicalMemory(Adopted, CUmemGenericAllocationHandle handle, uint64_t size) noexcept
      : handle_(handle), size_(size) {}
  CUmemGenericAllocationHandle handle_ = 0;
  uint64_t size_ = 0;
};

class Mapping {
 public:
  // Maps all of `mem` at ptr (inside a live Reservation) and makes it read-write for `device`.
  Mapping(uint64_t ptr, PhysicalMemory&& mem, int device);
  ~Mapping() { (void)release(); }
  Mapping(const Mapping&) = delete;
  Mapping& operator=(const Mapping&) = delete;
  uint64_t ptr() const { return ptr_; }
  uint64_t size() const { return mem_.size(); }
  // The mapped physical memory's handle (0 once released), e.g. for cuMemExportToShareableHandle.
  CUmemGenericAllocationHandle handle() const { return mem_.handle(); }
  // Unmaps, then releases the physical memory; returns the first failing CUresult (or 0).
  int release() noexcept;

 private:
  uint64_t ptr_ = 0;
  bool mapped_ = false;
  PhysicalMemory mem_;
};

// The driver's minimum allocation granularity for pinned device memory on `device` (requested
// with `handle_types`, as PhysicalMemory is).
uint64_t granularity(int device, CUmemAllocationHandleType handle_types = CU_MEM_HANDLE_TYPE_NONE);

// Throws vitrify::Error naming `device` and CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED
// when the device cannot export memory as a POSIX fd; `needed_by` ends the message ("a shared
// buffer"). Needs a current context for `device`.
void check_fd_support(int device, const char* needed_by);

}  // namespace vitrify::region::detail
