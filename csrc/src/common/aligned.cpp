#include "vitrify/aligned.hpp"

#include <cstdlib>
#include <cstring>
#include <new>
#include <utility>

#include "vitrify/error.hpp"

namespace vitrify {

AlignedBuffer::AlignedBuffer(size_t bytes, size_t alignment) {
  VITRIFY_EXPECT(alignment != 0 && (alignment & (alignment - 1)) == 0 && alignment >= sizeof(void*),
              "alignment must be a power of two >= " + std::to_string(sizeof(void*)) + ", got " +
                  std::to_string(alignment));
  const size_t n = round_up(bytes == 0 ? alignment : bytes, alignment);
  void* p = nullptr;
  if (::posix_memalign(&p, alignment, n) != 0) throw std::bad_alloc();
  std::memset(p, 0, n);
  data_ = static_cast<uint8_t*>(p);
  size_ = round_up(bytes, alignment);
  alignment_ = alignment;
}

AlignedBuffer::~AlignedBuffer() { std::free(data_); }

AlignedBuffer::AlignedBuffer(AlignedBuffer&& o) noexcept
    : data_(std::exchange(o.data_, nullptr)),
      size_(std::exchange(o.size_, 0)),
      alignment_(std::exchange(o.alignment_, 0)) {}

AlignedBuffer& AlignedBuffer::operator=(AlignedBuffer&& o) noexcept {
  if (this != &o) {
    std::free(data_);
    data_ = std::exchange(o.data_, nullptr);
    size_ = std::exchange(o.size_, 0);
    alignment_ = std::exchange(o.alignment_, 0);
  }
  return *this;
}

}  // namespace vitrify
