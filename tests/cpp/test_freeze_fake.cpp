// The layers together as a freeze and a thaw drive them, on CPU against the one fake driver
// (tests/cpp/fake_cuda/: VMM, streams, registration and batch copies emulated on host memory):
//   region A (Region on the fake's VMM) gets allocations and bytes, one allocation freed;
//   FREEZE: a span file of A's [0, cursor) (snapshot::dump_to_file through the driver backend);
//   THAW:   region B at another base, the same allocations, restore_from_file, byte-for-byte;
//   host tier: B's pages move into a registered multi-slab HostPool (transfer, batch path);
//   disk tier: the pool's pages go into a disk Store (O_DIRECT slab, buffered fallback where the
//   filesystem refuses it), read back after a cold start `load`, into the wiped pool, and from
//   there back into B's zeroed allocations: every byte is A's again; nothing leaks in the fake.
#include <dlfcn.h>
#include <gtest/gtest.h>

#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <string>
#include <vector>

#include "temp_dir.hpp"
#include "vitrify/disk.hpp"
#include "fake_cuda/use_fake.hpp"
#include "vitrify/driver.hpp"
#include "vitrify/host.hpp"
#include "vitrify/region.hpp"
#include "vitrify/snapshot.hpp"

using vitrify::Region;
using vitrify::region::kMiB;
namespace disk = vitrify::disk;
namespace host = vitrify::host;
namespace snapshot = vitrify::snapshot;

namespace {

using vitrify::test::TempDir;

uint8_t pattern(uint64_t offset, uint8_t salt) {
  return static_cast<uint8_t>((offset * 131 + salt) ^ (offset >> 11));
}

disk::Key key_of(size_t page) {
  disk::Key k{};
  for (size_t i = 0; i < k.size(); ++i) k[i] = static_cast<uint8_t>(page * 37 + i);
  return k;
}

// The bytes of [addr, addr + n) through the driver (a copy backend: what FREEZE reads with).
std::vector<uint8_t> device_bytes(snapshot::CopyBackend& be, uint64_t addr, size_t n) {
  std::vector<uint8_t> v(n);
  EXPECT_TRUE(be.try_to_host(v.data(), addr, n)) << "not mapped: " << addr << " +" << n;
  return v;
}

}  // namespace

TEST(FreezeOnFakeDriver, RegionSpanFileHostPoolAndDiskRoundTrip) {
  ASSERT_NE(vitrify::test::kUseFakeDriver, nullptr);  // the fake driver is selected
  ASSERT_TRUE(vitrify::driver::available()) << vitrify::driver::unavailable_reason();
  const vitrify::test::FakeCounts before = vitrify::test::fake_counts();
  TempDir dir;
  {
    // ---- region A: allocations and bytes; the middle one freed (its bytes need not survive)
    Region a(0x610000000000ull, 64 * kMiB, 0);
    const std::vector<uint64_t> sizes = {3 * kMiB, 5 * kMiB + 123, kMiB, 2 * kMiB};
    std::vector<uint64_t> pa;
    for (uint64_t n : sizes) pa.push_back(a.allocate(n));
    for (size_t i = 0; i < pa.size(); ++i) {
      std::vector<uint8_t> bytes(sizes[i]);
      for (uint64_t k = 0; k < sizes[i]; ++k) bytes[k] = pattern(pa[i] - a.base() + k, 1);
      a.write(pa[i], bytes.data(), bytes.size());
    }
    a.free(pa[1]);
    const std::vector<size_t> live = {0, 2, 3};

    // ---- FREEZE: span file of [0, cursor)
    auto be = snapshot::make_driver_backend(0);
    snapshot::FileOptions opt;
    opt.chunk_bytes = kMiB;  // several chunks, each with its CRC
    const std::string span = dir.path + "/region.span";
    const snapshot::FileStats ds = snapshot::dump_to_file(*be, a.base(), 0, a.offset(), span, opt);
    EXPECT_GE(ds.bytes, (sizes[0] + sizes[2] + sizes[3]));
    EXPECT_LE(ds.bytes, a.offset());
    EXPECT_NO_THROW(snapshot::verify_span_file(span, opt));
    EXPECT_EQ(snapshot::read_span_file_info(span).intervals, ds.intervals);

    // ---- THAW: region B elsewhere, the same allocation sequence, then the span file
    Region b(0x620000000000ull, 64 * kMiB, 0);
    ASSERT_NE(b.base(), a.base());
    std::vector<uint64_t> pb;
    for (uint64_t n : sizes) pb.push_back(b.allocate(n));
    b.free(pb[1]);
    for (size_t i = 0; i < pa.size(); ++i) ASSERT_EQ(pb[i] - b.base(), pa[i] - a.base()) << i;
    ASSERT_EQ(b.offset(), a.offset());
    const snapshot::FileStats rs = snapshot::restore_from_file(*be, span, b.base(), b.size(), opt);
    EXPECT_EQ(rs.bytes_written, ds.bytes);
    EXPECT_EQ(rs.intervals, ds.intervals);
    for (const snapshot::Interval& iv : ds.intervals)  // every dumped byte, B against A
      ASSERT_EQ(device_bytes(*be, b.base() + iv.begin, iv.size()),
                device_bytes(*be, a.base() + iv.begin, iv.size()))
          << "[" << iv.begin << ", " << iv.end << ")";
    for (size_t i : live) {  // and the live allocations hold what was written into A
      std::vector<uint8_t> got(sizes[i]);
      b.read(pb[i], got.data(), got.size());
      for (uint64_t k = 0; k < sizes[i]; ++k)
        ASSERT_EQ(got[k], pattern(pa[i] - a.base() + k, 1)) << "allocation " << i << " byte " << k;
    }

    // ---- host tier: allocations 0 (3 MiB) and 2 (1 MiB) of B into a 4-slab registered pool
    constexpr size_t kPage = 256 * 1024;
    host::HostPoolOptions ho;
    ho.max_slab_bytes = kMiB;
    ho.registration = host::Registration::On;
    host::HostPool pool(16 * kPage, kPage, ho);
    ASSERT_TRUE(pool.registered());
    ASSERT_EQ(pool.num_slabs(), 4u);
    const std::vector<host::PageRun> runs = {{0, 12, pb[0]}, {12, 4, pb[2]}};  // crosses slabs
    host::Stream stream(0);
    const auto path = host::batch_copy_available() ? host::TransferPath::Batch
                                                   : host::TransferPath::Loop;
    const host::TransferStats st = host::transfer(pool, host::Direction::DeviceToHost, runs,
                                                  stream.get(), path);
    stream.synchronize();
    EXPECT_EQ(st.bytes, 16 * kPage);
    std::vector<std::vector<uint8_t>> pages(pool.num_pages());  // what the pages must hold
    for (size_t p = 0; p < pool.num_pages(); ++p) {
      const uint64_t at = p < 12 ? pa[0] + p * kPage : pa[2] + (p - 12) * kPage;
      pages[p].resize(kPage);
      for (size_t k = 0; k < kPage; ++k) pages[p][k] = pattern(at - a.base() + k, 1);
      ASSERT_EQ(std::memcmp(pool.page_address(p), pages[p].data(), kPage), 0) << "page " << p;
    }

    // ---- disk tier: the pool's pages into a Store, read back after a cold start `load`
    disk::StoreConfig cfg;
    cfg.dirs = {dir.path};
    cfg.kinds = {disk::KindConfig{kPage, 1.0}};
    cfg.budget_bytes = 4096 + 24 * disk::slot_bytes_for(kPage);
    cfg.name = "freeze";
    std::vector<disk::Key> keys;
    std::vector<const void*> srcs;
    std::vector<size_t> lens;
    for (size_t p = 0; p < pool.num_pages(); ++p) {
      keys.push_back(key_of(p));
      srcs.push_back(pool.page_address(p));
      lens.push_back(kPage);
    }
    {
      disk::Store store(cfg);
      for (int64_t r : store.submit_put_copy(0, keys, srcs, lens)->wait())
        ASSERT_EQ(r, int64_t(disk::PutResult::kStored));
      const disk::SlabFile& slab = store.slab(0, 0);
      EXPECT_TRUE(slab.direct() || !slab.buffered_reason().empty())
          << "buffered I/O without a reason";
    }
    cfg.cold_start = disk::ColdStart::kLoad;
    disk::Store store(cfg);
    EXPECT_EQ(store.stats().loaded_entries, pool.num_pages());
    for (size_t s = 0; s < pool.num_slabs(); ++s)
      std::memset(pool.slab_base(s), 0, pool.slabs()[s].bytes);
    std::vector<disk::GetItem> gets;
    for (size_t p = 0; p < pool.num_pages(); ++p)
      gets.push_back(disk::GetItem{key_of(p), pool.page_address(p), kPage, false, false});
    for (int64_t r : store.submit_get(0, gets)->wait()) ASSERT_EQ(r, int64_t(kPage));
    for (size_t p = 0; p < pool.num_pages(); ++p)
      ASSERT_EQ(std::memcmp(pool.page_address(p), pages[p].data(), kPage), 0) << "page " << p;
    EXPECT_EQ(store.stats().verify_failures, 0u);

    // ---- back up: pool -> B's zeroed allocations -> the bytes A had
    std::vector<uint8_t> zeros(sizes[0]);
    b.write(pb[0], zeros.data(), sizes[0]);
    b.write(pb[2], zeros.data(), sizes[2]);
    host::transfer(pool, host::Direction::HostToDevice, runs, stream.get(), path);
    stream.synchronize();
    for (size_t i : {size_t(0), size_t(2)}) {
      std::vector<uint8_t> got(sizes[i]);
      b.read(pb[i], got.data(), got.size());
      for (uint64_t k = 0; k < sizes[i]; ++k)
        ASSERT_EQ(got[k], pattern(pa[i] - a.base() + k, 1)) << "allocation " << i << " byte " << k;
    }
  }
  // Regions, pool registrations and the backend's stream are gone: the fake holds what it held.
  EXPECT_EQ(vitrify::test::fake_counts(), before);
}
