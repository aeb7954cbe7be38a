// CRC32C (Castagnoli), as used by iSCSI/ext4/RocksDB: polynomial 0x1EDC6F41 (reflected
// 0x82F63B78), initial value and final xor 0xFFFFFFFF. crc32c("123456789") == 0xE3069283.
// SSE4.2's crc32 instruction when the CPU has it (checked once at run time), else a
// slicing-by-8 table.
#pragma once

#include <cstddef>
#include <cstdint>

namespace vitrify {

// Extend `crc` (the value a previous call returned; 0 to start) over [data, data+n).
uint32_t crc32c(const void* data, size_t n, uint32_t crc = 0) noexcept;

// The portable implementation, exposed so tests can compare both paths on the same bytes.
uint32_t crc32c_software(const void* data, size_t n, uint32_t crc = 0) noexcept;

// Copies [src, src+n) to dst (the ranges must not overlap) and extends `crc` over the bytes
// copied, in one pass: the CRC is of the values stored, so it describes dst even if src changes
// meanwhile. `streaming`: non-temporal stores (x86-64), for destinations this CPU will not read
// back soon (fenced before returning).
uint32_t crc32c_copy(void* dst, const void* src, size_t n, uint32_t crc = 0,
                     bool streaming = false) noexcept;

// crc32c(A || B) from crc32c(A), crc32c(B) and |B| = len_b, without the bytes.
uint32_t crc32c_combine(uint32_t crc_a, uint32_t crc_b, size_t len_b) noexcept;

// True when crc32c() uses the SSE4.2 instruction on this CPU.
bool crc32c_hardware() noexcept;

}  // namespace vitrify
