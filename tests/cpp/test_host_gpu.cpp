// GPU tests of the host tier (ctest label `gpu`): multi-slab registration under a forced small
// ceiling, batched and looped page copies across slab boundaries (byte-exact), segments that
// cannot straddle, and serial vs parallel registration timing. They skip without a driver.
// ctest also runs this binary (label cpu) on the fake driver with one device (fake_cuda/host.cpp
// emulates registration and copies; it refuses batch copies straddling two registrations), with
// both batch ABIs (13000 and 12080).
#include <gtest/gtest.h>

#include <cstdlib>
#include <cstring>
#include <vector>

#include "vitrify/device_memory.hpp"
#include "vitrify/driver.hpp"
#include "vitrify/host.hpp"

using namespace vitrify::host;

// VITRIFY_TEST_REQUIRE_GPU=1 (set when ctest runs these on the host-emulated fake driver) turns the
// skip into a failure, so a driver that did not load cannot pass silently.
#define REQUIRE_GPU()                                                                  \
  do {                                                                                 \
    if (!vitrify::driver::available()) {                                                  \
      if (std::getenv("VITRIFY_TEST_REQUIRE_GPU") != nullptr)                             \
        FAIL() << "VITRIFY_TEST_REQUIRE_GPU is set but: " << vitrify::driver::unavailable_reason(); \
      GTEST_SKIP() << "no CUDA driver: " << vitrify::driver::unavailable_reason();       \
    }                                                                                  \
  } while (0)

namespace {

constexpr size_t KiB = 1024, MiB = 1024 * KiB;

uint8_t pattern(size_t page, size_t i, uint8_t salt) {
  return static_cast<uint8_t>((page * 131 + i * 7 + salt) ^ (i >> 9));
}

void fill_page(HostPool& pool, size_t page, uint8_t salt) {
  uint8_t* p = pool.page_address(page);
  for (size_t i = 0; i < pool.page_bytes(); ++i) p[i] = pattern(page, i, salt);
}

// True when the driver considers [p, p+n) registered host memory (pinned and mapped).
bool is_registered(void* p) {
  vitrify::driver::ContextGuard ctx(0);
  CUdeviceptr dp = 0;
  return vitrify::driver::cu().cuMemHostGetDevicePointer(&dp, p, 0) == CUDA_SUCCESS;
}

HostPoolOptions small_ceiling(size_t ceiling, bool parallel = true) {
  HostPoolOptions o;
  o.max_slab_bytes = ceiling;
  o.registration = Registration::On;
  o.parallel_registration = parallel;
  return o;
}

}  // namespace

TEST(HostPoolGpu, MultiSlabPoolRegistersEverySlab) {
  REQUIRE_GPU();
  // 12 KiB pages do not divide the 64 KiB ceiling: 5 pages (60 KiB) per slab, 8 slabs.
  HostPool pool(40 * 12 * KiB, 12 * KiB, small_ceiling(64 * KiB));
  ASSERT_EQ(pool.num_slabs(), 8u);
  ASSERT_TRUE(pool.registered());
  const auto& t = pool.registration();
  EXPECT_TRUE(t.parallel);
  ASSERT_EQ(t.slab_seconds.size(), 8u);
  for (size_t s = 0; s < pool.num_slabs(); ++s) {
    EXPECT_LE(pool.slabs()[s].map_bytes, 64 * KiB);
    EXPECT_TRUE(is_registered(pool.slab_base(s))) << "slab " << s << " is not registered";
    EXPECT_TRUE(is_registered(pool.slab_base(s) + pool.slabs()[s].bytes - 1)) << "slab " << s;
  }
}

TEST(HostPoolGpu, UnregisteredAfterDestruction) {
  REQUIRE_GPU();
  std::vector<void*> bases;
  {
    HostPool pool(8 * MiB, MiB, small_ceiling(2 * MiB));
    for (size_t s = 0; s < pool.num_slabs(); ++s) bases.push_back(pool.slab_base(s));
  }
  // The memory is unmapped too, so only ask the driver (no access): it must not know it.
  for (void* b : bases) EXPECT_FALSE(is_registered(b));
}

TEST(HostPoolGpu, SegmentsOfATransferCannotStraddle) {
  REQUIRE_GPU();
  HostPool pool(40 * 12 * KiB, 12 * KiB, small_ceiling(64 * KiB));
  // Every page range: each piece lies inside one slab's mapping (one registration).
  for (size_t first = 0; first < pool.num_pages(); ++first)
    for (size_t count = 1; first + count <= pool.num_pages(); ++count) {
      const auto segs = pool.segments(first, count);
      const size_t first_slab = pool.slab_of(first), last_slab = pool.slab_of(first + count - 1);
      ASSERT_EQ(segs.size(), last_slab - first_slab + 1);
      for (const auto& s : segs) {
        const uint8_t* base = pool.slab_base(s.slab);
        ASSERT_GE(s.ptr, base);
        ASSERT_LE(s.ptr + s.bytes, base + pool.slabs()[s.slab].bytes)
            << "pages [" << first << ", +" << count << ") piece at slab " << s.slab << " straddles";
      }
    }
}

namespace {

void transfer_round_trip(TransferPath path) {
  HostPool pool(40 * 12 * KiB, 12 * KiB, small_ceiling(64 * KiB));
  ASSERT_TRUE(pool.registered());
  const size_t pb = pool.page_bytes();
  for (size_t p = 0; p < pool.num_pages(); ++p) fill_page(pool, p, 1);
  Stream stream(0);
  vitrify::DeviceBuffer dev(pool.num_pages() * pb, 0);
  dev.fill(0);

  // H2D: pages [3, 33) cross 6 slab boundaries, plus two single pages placed after them.
  const std::vector<PageRun> runs = {{3, 30, dev.ptr()},
                                     {39, 1, dev.ptr() + 30 * pb},
                                     {0, 1, dev.ptr() + 31 * pb}};
  const TransferStats st = transfer(pool, Direction::HostToDevice, runs, stream.get(), path);
  stream.synchronize();
  EXPECT_EQ(st.path, path);
  EXPECT_EQ(st.bytes, 32 * pb);
  EXPECT_EQ(st.copies, 7u + 1 + 1) << "one copy per slab piece";
  std::vector<uint8_t> back(32 * pb);
  dev.copy_to_host(back.data(), back.size());
  auto expect_page = [&](const uint8_t* got, size_t page, uint8_t salt, const char* what) {
    for (size_t i = 0; i < pb; ++i)
      ASSERT_EQ(got[i], pattern(page, i, salt)) << what << ": page " << page << " byte " << i;
  };
  for (size_t k = 0; k < 30; ++k) expect_page(back.data() + k * pb, 3 + k, 1, "h2d");
  expect_page(back.data() + 30 * pb, 39, 1, "h2d");
  expect_page(back.data() + 31 * pb, 0, 1, "h2d");

  // D2H: new bytes on the device come back into the same pages; the others stay.
  std::vector<uint8_t> fresh(32 * pb);
  for (size_t k = 0; k < 32; ++k) {
    const size_t page = k < 30 ? 3 + k : (k == 30 ? 39 : 0);
    for (size_t i = 0; i < pb; ++i) fresh[k * pb + i] = pattern(page, i, 2);
  }
  dev.copy_from_host(fresh.data(), fresh.size());
  const TransferStats st2 = transfer(pool, Direction::DeviceToHost, runs, stream.get(), path);
  stream.synchronize();
  EXPECT_EQ(st2.bytes, 32 * pb);
  for (size_t p = 0; p < pool.num_pages(); ++p) {
    const bool moved = (p >= 3 && p < 33) || p == 39 || p == 0;
    expect_page(pool.page_address(p), p, moved ? 2 : 1, "d2h");
  }
}

}  // namespace

TEST(HostPoolGpu, BatchedTransfersAcrossSlabsAreByteExact) {
  REQUIRE_GPU();
  if (!batch_copy_available()) GTEST_SKIP() << "driver has no cuMemcpyBatchAsync";
  transfer_round_trip(TransferPath::Batch);
}

TEST(HostPoolGpu, LoopTransfersAcrossSlabsAreByteExact) {
  REQUIRE_GPU();
  transfer_round_trip(TransferPath::Loop);
}

TEST(HostPoolGpu, BatchRefusesTheLegacyStreamAutoFallsBack) {
  REQUIRE_GPU();
  HostPool pool(4 * MiB, MiB, small_ceiling(2 * MiB));
  vitrify::DeviceBuffer dev(4 * MiB, 0);
  const std::vector<PageRun> runs = {{0, 4, dev.ptr()}};
  if (batch_copy_available())
    EXPECT_THROW(transfer(pool, Direction::HostToDevice, runs, nullptr, TransferPath::Batch),
                 std::invalid_argument);
  const auto st = transfer(pool, Direction::HostToDevice, runs, nullptr, TransferPath::Auto);
  EXPECT_EQ(st.path, TransferPath::Loop);
  vitrify::driver::ContextGuard ctx(0);
  VITRIFY_CU(vitrify::driver::cu().cuCtxSynchronize());
}

TEST(HostPoolGpu, RegistrationTimingSerialVsParallel) {
  REQUIRE_GPU();
  // 1 GiB in 8 slabs of 128 MiB: both modes register everything; the figures are recorded
  // (the benchmark compares them, this test does not judge speed).
  double secs[2] = {0, 0};
  for (int parallel = 0; parallel < 2; ++parallel) {
    HostPool pool(size_t(1) << 30, 2 * MiB, small_ceiling(128 * MiB, parallel == 1));
    const auto& t = pool.registration();
    ASSERT_TRUE(t.registered);
    EXPECT_EQ(t.parallel, parallel == 1);
    EXPECT_EQ(t.slab_seconds.size(), 8u);
    for (double s : t.slab_seconds) EXPECT_GT(s, 0.0);
    EXPECT_GT(t.seconds, 0.0);
    secs[parallel] = t.seconds;
  }
  RecordProperty("serial_seconds", std::to_string(secs[0]));
  RecordProperty("parallel_seconds", std::to_string(secs[1]));
  std::printf("registration of 1 GiB in 8 slabs: serial %.3f s, parallel %.3f s (%.2fx)\n", secs[0],
              secs[1], secs[0] / secs[1]);
}

TEST(HostPoolGpu, GuardRefusesOneRegistrationAboveTheCeiling) {
  REQUIRE_GPU();
  std::vector<uint8_t> buf(2 * MiB);
  EXPECT_THROW(HostRegistration(buf.data(), buf.size(), 0, MiB), std::invalid_argument);
  HostRegistration ok(buf.data(), buf.size(), 0, 2 * MiB);
  EXPECT_TRUE(is_registered(buf.data()));
}
