#include <gtest/gtest.h>

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
