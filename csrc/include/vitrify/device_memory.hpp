// A plain device allocation (cuMemAlloc/cuMemFree) with one owner, plus host<->device copies.
// Used by tests, benchmarks and staging; the region allocator has its own VMM owners.
#pragma once

#include <cstddef>
#include <cstdint>

#include "vitrify/driver.hpp"

namespace vitrify {

class DeviceBuffer {
 public:
  DeviceBuffer() = default;
  // Allocates `bytes` on `device` (its primary context is made current for the call).
  DeviceBuffer(size_t bytes, int device);
  ~DeviceBuffer();
  DeviceBuffer(DeviceBuffer&& o) noexcept;
  DeviceBuffer& operator=(DeviceBuffer&& o) noexcept;
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;

  CUdeviceptr ptr() const noexcept { return ptr_; }
  size_t size() const noexcept { return size_; }
  int device() const noexcept { return device_; }

  // Synchronous copies; offsets and sizes are checked against the allocation.
  void copy_from_host(const void* src, size_t bytes, size_t offset = 0);
  void copy_to_host(void* dst, size_t bytes, size_t offset = 0) const;
  void fill(uint8_t value);

 private:
  void release() noexcept;
  CUdeviceptr ptr_ = 0;
  size_t size_ = 0;
  int device_ = 0;
};

}  // namespace vitrify
