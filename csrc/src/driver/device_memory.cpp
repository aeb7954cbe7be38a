#include "vitrify/device_memory.hpp"

#include <string>
#include <utility>

namespace vitrify {

DeviceBuffer::DeviceBuffer(size_t bytes, int device) : size_(bytes), device_(device) {
  VITRIFY_EXPECT(bytes > 0, "DeviceBuffer size must be positive");
  driver::ContextGuard ctx(device);
  VITRIFY_CU(driver::cu().cuMemAlloc(&ptr_, bytes));
}

DeviceBuffer::~DeviceBuffer() { release(); }

void DeviceBuffer::release() noexcept {
  if (ptr_ == 0) return;
  try {
    driver::ContextGuard ctx(device_);
    (void)driver::cu().cuMemFree(ptr_);
  } catch (...) {
    // Destructors never throw; a failure here means the context is already gone.
  }
  ptr_ = 0;
}

DeviceBuffer::DeviceBuffer(DeviceBuffer&& o) noexcept
    : ptr_(std::exchange(o.ptr_, 0)), size_(std::exchange(o.size_, 0)), device_(o.device_) {}

DeviceBuffer& DeviceBuffer::operator=(DeviceBuffer&& o) noexcept {
  if (this != &o) {
    release();
    ptr_ = std::exchange(o.ptr_, 0);
    size_ = std::exchange(o.size_, 0);
    device_ = o.device_;
  }
  return *this;
}

static void check_range(size_t offset, size_t bytes, size_t size) {
  VITRIFY_EXPECT(offset <= size && bytes <= size - offset,
              "copy of " + std::to_string(bytes) + " bytes at offset " + std::to_string(offset) +
                  " exceeds the " + std::to_string(size) + "-byte device buffer");
}

void DeviceBuffer::copy_from_host(const void* src, size_t bytes, size_t offset) {
  check_range(offset, bytes, size_);
  driver::ContextGuard ctx(device_);
  VITRIFY_CU(driver::cu().cuMemcpyHtoD(ptr_ + offset, src, bytes));
}

void DeviceBuffer::copy_to_host(void* dst, size_t bytes, size_t offset) const {
  check_range(offset, bytes, size_);
  driver::ContextGuard ctx(device_);
  VITRIFY_CU(driver::cu().cuMemcpyDtoH(dst, ptr_ + offset, bytes));
}

void DeviceBuffer::fill(uint8_t value) {
  driver::ContextGuard ctx(device_);
  VITRIFY_CU(driver::cu().cuMemsetD8(ptr_, value, size_));
  VITRIFY_CU(driver::cu().cuCtxSynchronize());
}

}  // namespace vitrify
