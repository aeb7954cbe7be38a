#include "region/vmm.hpp"

#include <string>

#include "vitrify/error.hpp"

namespace vitrify::region::detail {
namespace {

CUmemAllocationProp device_prop(int device, CUmemAllocationHandleType handle_types) {
  CUmemAllocationProp prop{};
  prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
  prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  prop.location.id = device;
  prop.requestedHandleTypes = handle_types;
  return prop;
}

}  // namespace

Reservation::Reservation(uint64_t addr, uint64_t size) : size_(size) {
  CUdeviceptr p = 0;
  VITRIFY_CU(driver::cu().cuMemAddressReserve(&p, size, driver::reserve_alignment(addr), addr, 0));
  ptr_ = p;
}

int Reservation::release() noexcept {
  if (ptr_ == 0) return 0;
  int r = 0;
  try {
    r = driver::cu().cuMemAddressFree(ptr_, size_);
  } catch (...) {
    r = -1;  // the driver table is gone; nothing else to do
  }
  ptr_ = 0;
  return r;
}

PhysicalMemory::PhysicalMemory(uint64_t size, int device, CUmemAllocationHandleType handle_types)
    : size_(size) {
  const CUmemAllocationProp prop = device_prop(device, handle_types);
  VITRIFY_CU(driver::cu().cuMemCreate(&handle_, size, &prop, 0));
}

int PhysicalMemory::release() noexcept {
  if (handle_ == 0) return 0;
  int r = 0;
  try {
    r = driver::cu().cuMemRelease(handle_);
  } catch (...) {
    r = -1;
  }
  handle_ = 0;
  return r;
}

Mapping::Mapping(uint64_t ptr, PhysicalMemory&& mem, int device) : ptr_(ptr), mem_(std::move(mem)) {
  const auto& d = driver::cu();
  VITRIFY_CU(d.cuMemMap(ptr_, mem_.size(), 0, mem_.handle(), 0));
  mapped_ = true;  // from here on the destructor unmaps, including when SetAccess throws
  CUmemAccessDesc access{};
  access.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  access.location.id = device;
  access.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
  try {
    VITRIFY_CU(d.cuMemSetAccess(ptr_, mem_.size(), &access, 1));
  } catch (...) {
    (void)release();  // members' destructors do not run for a throwing constructor's body
    throw;
  }
}

int Mapping::release() noexcept {
  int first = 0;
  if (mapped_) {
    try {
      first = driver::cu().cuMemUnmap(ptr_, mem_.size());
    } catch (...) {
      first = -1;
    }
    mapped_ = false;
  }
  const int r = mem_.release();
  return first != 0 ? first : r;
}

uint64_t granularity(int device, CUmemAllocationHandleType handle_types) {
  const CUmemAllocationProp prop = device_prop(device, handle_types);
  size_t g = 0;
  VITRIFY_CU(driver::cu().cuMemGetAllocationGranularity(&g, &prop, CU_MEM_ALLOC_GRANULARITY_MINIMUM));
  VITRIFY_EXPECT(g > 0 && (g & (g - 1)) == 0,
              "the driver reported an allocation granularity of " + std::to_string(g) +
                  " bytes (not a power of two)");
  return g;
}

void check_fd_support(int device, const char* needed_by) {
  const auto& d = driver::cu();
  CUdevice dev = 0;
  VITRIFY_CU(d.cuDeviceGet(&dev, device));
  int supported = 0;
  VITRIFY_CU(d.cuDeviceGetAttribute(
      &supported, CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED, dev));
  if (supported == 0)
    throw Error("device " + std::to_string(device) +
                " cannot export memory as a POSIX file descriptor "
                "(CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED is 0), which " +
                needed_by + " needs");
}

}  // namespace vitrify::region::detail
