// Page-aligned host buffers (for O_DIRECT I/O and registration). Move-only, one owner.
#pragma once

#include <cstddef>
#include <cstdint>

namespace vitrify {

class AlignedBuffer {
 public:
  AlignedBuffer() = default;
  // `bytes` rounded up to a multiple of `alignment`; zero-filled. Throws std::bad_alloc.
  explicit AlignedBuffer(size_t bytes, size_t alignment = 4096);
  ~AlignedBuffer();
  AlignedBuffer(AlignedBuffer&& o) noexcept;
  AlignedBuffer& operator=(AlignedBuffer&& o) noexcept;
  AlignedBuffer(const AlignedBuffer&) = delete;
  AlignedBuffer& operator=(const AlignedBuffer&) = delete;

  uint8_t* data() noexcept { return data_; }
  const uint8_t* data() const noexcept { return data_; }
  size_t size() const noexcept { return size_; }
  size_t alignment() const noexcept { return alignment_; }

 private:
  uint8_t* data_ = nullptr;
  size_t size_ = 0;
  size_t alignment_ = 0;
};

constexpr size_t round_up(size_t n, size_t multiple) noexcept {
  return multiple == 0 ? n : (n + multiple - 1) / multiple * multiple;
}
constexpr bool is_aligned(uintptr_t v, size_t alignment) noexcept {
  return alignment != 0 && v % alignment == 0;
}

}  // namespace vitrify
