#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "vitrify/crc32c.hpp"

TEST(Crc32c, KnownVectors) {
  // RFC 3720 B.4 and the common check value.
  EXPECT_EQ(vitrify::crc32c("123456789", 9), 0xE3069283u);
  std::vector<uint8_t> zeros(32, 0), ones(32, 0xFF), inc(32), dec(32);
  for (int i = 0; i < 32; ++i) {
    inc[i] = static_cast<uint8_t>(i);
    dec[i] = static_cast<uint8_t>(31 - i);
  }
  EXPECT_EQ(vitrify::crc32c(zeros.data(), 32), 0x8A9136AAu);
  EXPECT_EQ(vitrify::crc32c(ones.data(), 32), 0x62A8AB43u);
  EXPECT_EQ(vitrify::crc32c(inc.data(), 32), 0x46DD794Eu);
  EXPECT_EQ(vitrify::crc32c(dec.data(), 32), 0x113FDB5Cu);
  EXPECT_EQ(vitrify::crc32c(nullptr, 0), 0u);
}

TEST(Crc32c, HardwareMatchesSoftwareAtEverySizeAndOffset) {
  std::mt19937_64 rng(42);
  std::vector<uint8_t> buf(3 * 4096 * 3 + 123);
  for (auto& b : buf) b = static_cast<uint8_t>(rng());
  // Sizes straddling the 3x4 KiB interleaved block of the hardware path.
  for (size_t n : {0, 1, 7, 8, 9, 63, 4096, 12287, 12288, 12289, 24576, 24577, 36864}) {
    for (size_t off : {0, 1, 3, 8}) {
      if (off + n > buf.size()) continue;
      EXPECT_EQ(vitrify::crc32c(buf.data() + off, n), vitrify::crc32c_software(buf.data() + off, n))
          << "n=" << n << " off=" << off;
    }
  }
}

TEST(Crc32c, ChainingEqualsOneShot) {
  std::string s(100000, 'x');
  for (size_t i = 0; i < s.size(); ++i) s[i] = static_cast<char>(i * 131 + 17);
  const uint32_t whole = vitrify::crc32c(s.data(), s.size());
  for (size_t cut : {0, 1, 4095, 12288, 50000, 99999, 100000}) {
    uint32_t c = vitrify::crc32c(s.data(), cut);
    c = vitrify::crc32c(s.data() + cut, s.size() - cut, c);
    EXPECT_EQ(c, whole) << "cut=" << cut;
  }
}

TEST(Crc32c, DetectsSingleBitFlips) {
  std::vector<uint8_t> buf(8192, 0x5A);
  const uint32_t base = vitrify::crc32c(buf.data(), buf.size());
  for (size_t bit = 0; bit < buf.size() * 8; bit += 997) {
    buf[bit / 8] ^= static_cast<uint8_t>(1u << (bit % 8));
    EXPECT_NE(vitrify::crc32c(buf.data(), buf.size()), base) << "bit " << bit;
    buf[bit / 8] ^= static_cast<uint8_t>(1u << (bit % 8));
  }
}

TEST(Crc32c, CopyStoresTheBytesAndReturnsTheirCrc) {
  std::mt19937_64 rng(7);
  std::vector<uint8_t> src(3 * 4096 * 3 + 200);
  for (auto& b : src) b = static_cast<uint8_t>(rng());
  for (bool streaming : {false, true}) {
    for (size_t n : {0, 1, 7, 8, 9, 4095, 12288, 12289, 24577, 36864}) {
      for (size_t src_off : {0, 3}) {
        for (size_t dst_off : {0, 1, 5, 8}) {
          if (src_off + n > src.size()) continue;
          std::vector<uint8_t> dst(n + 16, 0xEE);
          const uint32_t seed = static_cast<uint32_t>(n * 2654435761u);
          const uint32_t c = vitrify::crc32c_copy(dst.data() + dst_off, src.data() + src_off, n,
                                                  seed, streaming);
          EXPECT_EQ(c, vitrify::crc32c_software(src.data() + src_off, n, seed))
              << "n=" << n << " streaming=" << streaming;
          EXPECT_TRUE(std::equal(dst.begin() + dst_off, dst.begin() + dst_off + n,
                                 src.begin() + src_off))
              << "n=" << n << " dst_off=" << dst_off << " streaming=" << streaming;
          // Nothing written around the destination range.
          for (size_t i = 0; i < dst_off; ++i) EXPECT_EQ(dst[i], 0xEE);
          for (size_t i = dst_off + n; i < dst.size(); ++i) EXPECT_EQ(dst[i], 0xEE);
        }
      }
    }
  }
}

TEST(Crc32c, CombineEqualsTheCrcOfTheConcatenation) {
  std::mt19937_64 rng(11);
  std::vector<uint8_t> buf(70000);
  for (auto& b : buf) b = static_cast<uint8_t>(rng());
  for (size_t cut : {0, 1, 4096, 12288, 33333, 69999, 70000}) {
    const uint32_t a = vitrify::crc32c(buf.data(), cut);
    const uint32_t b = vitrify::crc32c(buf.data() + cut, buf.size() - cut);
    EXPECT_EQ(vitrify::crc32c_combine(a, b, buf.size() - cut), vitrify::crc32c(buf.data(), buf.size()))
        << "cut=" << cut;
  }
}

// Both of crc32c_copy's paths: direct, and through the bounce buffer where dst - src modulo
// 4096 would make direct loads and stores alias.
TEST(Crc32c, CopyAtEveryDistanceModulo4096) {
  std::mt19937_64 rng(13);
  std::vector<uint8_t> mem(3 * 65536);
  for (size_t delta : {0, 8, 16, 64, 1000, 1024, 1500, 2048, 3000, 4000, 4032, 4064, 4090}) {
    for (size_t n : {100, 12288, 40000}) {
      for (bool streaming : {false, true}) {
        uint8_t* src = mem.data() + 64;
        uint8_t* dst = mem.data() + 65536 + 64 + delta;
        for (size_t i = 0; i < n; ++i) src[i] = static_cast<uint8_t>(rng());
        std::fill(dst, dst + n, 0);
        EXPECT_EQ(vitrify::crc32c_copy(dst, src, n, 7, streaming),
                  vitrify::crc32c_software(src, n, 7))
            << "delta " << delta << " n " << n;
        EXPECT_EQ(std::memcmp(dst, src, n), 0) << "delta " << delta << " n " << n;
      }
    }
  }
}
