#include "vitrify/crc32c.hpp"

#include <algorithm>
#include <array>
#include <cstdint>
#include <cstring>

#if defined(__x86_64__)
#include <emmintrin.h>
#include <nmmintrin.h>
#endif

namespace vitrify {
namespace {

constexpr uint32_t kPoly = 0x82F63B78u;

struct Tables {
  std::array<std::array<uint32_t, 256>, 8> t{};
  constexpr Tables() {
    for (uint32_t i = 0; i < 256; ++i) {
      uint32_t c = i;
      for (int k = 0; k < 8; ++k) c = (c & 1) ? (c >> 1) ^ kPoly : c >> 1;
      t[0][i] = c;
    }
    for (uint32_t i = 0; i < 256; ++i)
      for (int s = 1; s < 8; ++s) t[s][i] = (t[s - 1][i] >> 8) ^ t[0][t[s - 1][i] & 0xFF];
  }
};
constexpr Tables kTables{};

uint32_t sw_raw(const uint8_t* p, size_t n, uint32_t c) noexcept {
  const auto& t = kTables.t;
  while (n >= 8) {
    uint64_t w;
    std::memcpy(&w, p, 8);
    w ^= c;
    c = t[7][w & 0xFF] ^ t[6][(w >> 8) & 0xFF] ^ t[5][(w >> 16) & 0xFF] ^
        t[4][(w >> 24) & 0xFF] ^ t[3][(w >> 32) & 0xFF] ^ t[2][(w >> 40) & 0xFF] ^
        t[1][(w >> 48) & 0xFF] ^ t[0][w >> 56];
    p += 8;
    n -= 8;
  }
  while (n--) c = (c >> 8) ^ t[0][(c ^ *p++) & 0xFF];
  return c;
}

// GF(2) arithmetic modulo the CRC polynomial, reflected bit order (bit 31 is x^0). Used to
// combine the CRCs of adjacent blocks: raw(A||B) = raw(A) * x^(8|B|) + raw_from_zero(B).
uint32_t gf2_mul(uint32_t a, uint32_t b) noexcept {
  uint32_t prod = 0;
  for (int i = 0; i < 32; ++i) {
    if (a & 0x80000000u) prod ^= b;
    a <<= 1;
    b = (b & 1) ? (b >> 1) ^ kPoly : b >> 1;
  }
  return prod;
}

// x^(8*bytes) modulo the polynomial, by square-and-multiply from x^8.
uint32_t x_pow_bytes(size_t bytes) noexcept {
  uint32_t result = 0x80000000u;  // x^0
  uint32_t power = 0x00800000u;   // x^8
  while (bytes) {
    if (bytes & 1) result = gf2_mul(result, power);
    power = gf2_mul(power, power);
    bytes >>= 1;
  }
  return result;
}

#if defined(__x86_64__)
// Stores one 8-byte word: an ordinary or a non-temporal store.
template <bool kStream>
__attribute__((target("sse4.2"))) inline void put_word(uint8_t* d, uint64_t w) noexcept {
  if constexpr (kStream) {
    _mm_stream_si64(reinterpret_cast<long long*>(d), static_cast<long long>(w));
  } else {
    std::memcpy(d, &w, 8);
  }
}

// The raw CRC over [p, p+n), copying the words to dst on the way when kCopy.
template <bool kCopy, bool kStream>
__attribute__((target("sse4.2"))) uint32_t hw_raw_t(uint8_t* dst, const uint8_t* p, size_t n,
                                                     uint32_t c) noexcept {
  uint64_t c64 = c;
  // Three independent streams hide the instruction's 3-cycle latency on large buffers.
  constexpr size_t kBlock = 4096;
  while (n >= 3 * kBlock) {
    uint64_t a = c64, b = 0, d = 0;
    const uint8_t* p1 = p + kBlock;
    const uint8_t* p2 = p + 2 * kBlock;
    for (size_t i = 0; i < kBlock; i += 8) {
      uint64_t w0, w1, w2;
      std::memcpy(&w0, p + i, 8);
      std::memcpy(&w1, p1 + i, 8);
      std::memcpy(&w2, p2 + i, 8);
      if constexpr (kCopy) {
        put_word<kStream>(dst + i, w0);
        put_word<kStream>(dst + kBlock + i, w1);
        put_word<kStream>(dst + 2 * kBlock + i, w2);
      }
      a = _mm_crc32_u64(a, w0);
      b = _mm_crc32_u64(b, w1);
      d = _mm_crc32_u64(d, w2);
    }
    static const uint32_t kShift = x_pow_bytes(kBlock);
    uint32_t r = gf2_mul(static_cast<uint32_t>(a), kShift) ^ static_cast<uint32_t>(b);
    r = gf2_mul(r, kShift) ^ static_cast<uint32_t>(d);
    c64 = r;
    p += 3 * kBlock;
    if constexpr (kCopy) dst += 3 * kBlock;
    n -= 3 * kBlock;
  }
  while (n >= 8) {
    uint64_t w;
    std::memcpy(&w, p, 8);
    if constexpr (kCopy) {
      put_word<kStream>(dst, w);
      dst += 8;
    }
    c64 = _mm_crc32_u64(c64, w);
    p += 8;
    n -= 8;
  }
  uint32_t c32 = static_cast<uint32_t>(c64);
  while (n--) {
    const uint8_t byte = *p++;
    if constexpr (kCopy) *dst++ = byte;
    c32 = _mm_crc32_u8(c32, byte);
  }
  return c32;
}

uint32_t hw_raw(const uint8_t* p, size_t n, uint32_t c) noexcept {
  return hw_raw_t<false, false>(nullptr, p, n, c);
}

// dst <- src with non-temporal 16-byte stores from the first 64-byte boundary of dst on.
void stream_copy(uint8_t* dst, const uint8_t* src, size_t n) noexcept {
  const size_t head = std::min(n, (64 - reinterpret_cast<uintptr_t>(dst) % 64) % 64);
  std::memcpy(dst, src, head);
  dst += head;
  src += head;
  n -= head;
  for (; n >= 64; n -= 64, dst += 64, src += 64)
    for (size_t k = 0; k < 64; k += 16)
      _mm_stream_si128(reinterpret_cast<__m128i*>(dst + k),
                       _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + k)));
  std::memcpy(dst, src, n);
}
#endif

// crc32c_copy loads each word once, checksums it and stores it (hw_raw_t<true, ...>), unless
// dst lies at or a little above src modulo 4096: then the loop's loads keep hitting addresses
// whose low 12 bits equal those of stores still in flight, and the CPU stalls on "4K aliasing"
// (measured on a 2-core VM through the page mover: 0.4-3 GB/s instead of ~10; a slot payload
// at +64 copied into a torch tensor's page at +64 is such a case). Those go through a bounce buffer of one 3 x 4 KiB round
// (L1-resident) instead: src -> bounce (memcpy), CRC of the bounce, bounce -> dst, the
// bounce's offset chosen at least 1 KiB from both src and dst modulo 4096. Either way the CRC
// is of exactly the bytes stored.
constexpr size_t kRound = 3 * 4096;

// Whether dst - src modulo 4096 falls where direct loads meet in-flight stores: from 0 up to
// 1 KiB (the loads run ahead of the stores). Measured on a 2-core VM, direct: 3.0 GB/s at 0,
// 0.4 at 16 and 80, 8.8 at 2000, 10.8 at 4048.
bool aliases(const uint8_t* src, const uint8_t* dst) noexcept {
  return (reinterpret_cast<uintptr_t>(dst) - reinterpret_cast<uintptr_t>(src)) % 4096 < 1024;
}

uint8_t* bounce_for(uint8_t* base, const uint8_t* src, const uint8_t* dst) noexcept {
  const size_t delta = (reinterpret_cast<uintptr_t>(dst) - reinterpret_cast<uintptr_t>(src)) % 4096;
  const size_t x = (delta <= 1024 || delta >= 3072) ? 2048 : (delta >= 2048 ? 1024 : 3072);
  const size_t want = (reinterpret_cast<uintptr_t>(src) + x) % 4096 / 64 * 64;
  const size_t off = (want + 4096 - reinterpret_cast<uintptr_t>(base) % 4096) % 4096;
  return base + off;
}

bool detect_hw() noexcept {
#if defined(__x86_64__)
  return __builtin_cpu_supports("sse4.2");
#else
  return false;
#endif
}

const bool kHw = detect_hw();

}  // namespace

uint32_t crc32c_software(const void* data, size_t n, uint32_t crc) noexcept {
  return ~sw_raw(static_cast<const uint8_t*>(data), n, ~crc);
}

uint32_t crc32c(const void* data, size_t n, uint32_t crc) noexcept {
#if defined(__x86_64__)
  if (kHw) return ~hw_raw(static_cast<const uint8_t*>(data), n, ~crc);
#endif
  return crc32c_software(data, n, crc);
}

uint32_t crc32c_copy(void* dst, const void* src, size_t n, uint32_t crc,
                     bool streaming) noexcept {
  auto* d = static_cast<uint8_t*>(dst);
  const auto* s = static_cast<const uint8_t*>(src);
#if defined(__x86_64__)
  if (kHw && !aliases(s, d)) {
    // Non-temporal 8-byte stores need 8-byte aligned addresses: ordinary stores up to there.
    const size_t head = streaming ? std::min(n, (8 - reinterpret_cast<uintptr_t>(d) % 8) % 8) : 0;
    uint32_t c = hw_raw_t<true, false>(d, s, head, ~crc);
    if (!streaming) return ~hw_raw_t<true, false>(d + head, s + head, n - head, c);
    c = hw_raw_t<true, true>(d + head, s + head, n - head, c);
    _mm_sfence();  // streaming stores are weakly ordered: visible before returning
    return ~c;
  }
#endif
  alignas(64) uint8_t bounce[kRound + 4096];
  uint8_t* buf = bounce_for(bounce, s, d);
  while (n > 0) {
    const size_t m = std::min(n, kRound);
    std::memcpy(buf, s, m);
    crc = crc32c(buf, m, crc);
#if defined(__x86_64__)
    if (streaming) {
      stream_copy(d, buf, m);
    } else {
      std::memcpy(d, buf, m);
    }
#else
    std::memcpy(d, buf, m);
#endif
    s += m;
    d += m;
    n -= m;
  }
#if defined(__x86_64__)
  if (streaming) _mm_sfence();
#else
  (void)streaming;
#endif
  return crc;
}

uint32_t crc32c_combine(uint32_t crc_a, uint32_t crc_b, size_t len_b) noexcept {
  return gf2_mul(crc_a, x_pow_bytes(len_b)) ^ crc_b;
}

bool crc32c_hardware() noexcept { return kHw; }

}  // namespace vitrify
