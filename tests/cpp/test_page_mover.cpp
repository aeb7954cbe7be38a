// The page mover: host KV pages (a layer_first K/V layout over plain memory) through a real
// disk Store in a temp directory and back. Invariant numbers (D*): csrc/src/disk/DESIGN.md.
#include <fcntl.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstddef>
#include <cstring>
#include <filesystem>
#include <optional>
#include <random>
#include <stdexcept>
#include <thread>
#include <vector>

#include <gtest/gtest.h>

#include "temp_dir.hpp"
#include "vitrify/crc32c.hpp"
#include "vitrify/disk.hpp"
#include "vitrify/host.hpp"
#include "vitrify/page_mover.hpp"

using namespace vitrify::disk;
using vitrify::host::Copier;
using vitrify::host::PageLayout;
using vitrify::test::ShmDir;
using vitrify::test::TempDir;

namespace {

Key key_of(uint64_t i) {
  Key k{};
  std::mt19937_64 g(i * 7919 + 1);
  for (size_t w = 0; w < k.size(); w += 8) {
    const uint64_t v = g();
    std::memcpy(k.data() + w, &v, 8);
  }
  return k;
}

// A host KV pool: K and V components, layer_first, 3 layers of pages of 4 tokens x 2 heads x
// 16 dims x 2 bytes (a 1536-byte gathered page).
struct HostPool {
  static constexpr size_t kLayers = 3, kTokens = 4, kHeads = 2, kDim = 16, kItem = 2;
  std::vector<uint8_t> k, v;
  PageLayout layout;

  HostPool(size_t pages, uint8_t fill_byte)
      : k(kLayers * pages * kTokens * kHeads * kDim * kItem, fill_byte), v(k.size(), fill_byte) {
    layout = PageLayout::layer_first(
        {reinterpret_cast<uintptr_t>(k.data()), reinterpret_cast<uintptr_t>(v.data())}, kLayers,
        pages, kTokens, kHeads, kDim, kItem);
  }
  void randomize(uint64_t seed) {
    std::mt19937_64 g(seed);
    for (auto* m : {&k, &v})
      for (auto& b : *m) b = static_cast<uint8_t>(g());
  }
  size_t blob() const { return layout.blob_bytes(); }
  std::vector<uint8_t> page(Copier& c, size_t p) const {
    std::vector<uint8_t> out(blob());
    c.gather(layout, p, out.data(), out.size());
    return out;
  }
};

StoreConfig store_cfg(const std::string& dir, uint64_t page, uint64_t slots) {
  StoreConfig c;
  c.dirs = {dir};
  c.kinds = {KindConfig{page, 1.0}};
  c.budget_bytes = kFileHeaderBytes + slots * slot_bytes_for(page);
  c.name = "mover";
  return c;
}

std::vector<Key> keys_of(uint64_t from, size_t n) {
  std::vector<Key> out;
  for (size_t i = 0; i < n; ++i) out.push_back(key_of(from + i));
  return out;
}

void expect_idle(const Store& s) {  // D18: nothing of the mover's in flight
  const StoreStats st = s.stats();
  EXPECT_EQ(st.in_flight_writes, 0u);
  EXPECT_EQ(st.write_queue_depth, 0u);
  EXPECT_EQ(st.in_flight_reads, 0u);
  EXPECT_EQ(st.read_queue_depth, 0u);
}

std::vector<bool> all(size_t n, bool v) { return std::vector<bool>(n, v); }

}  // namespace

// D15: pages survive gather -> write -> read -> scatter byte for byte, in several chunks
// (an odd count: the last chunk is short), landing in other host pages than they came from.
TEST(PageMover, RoundTripInSeveralChunks) {
  TempDir d;
  Copier copier(2);
  HostPool src(16, 0), dst(16, 0xEE);
  src.randomize(1);
  Store store(store_cfg(d.path, src.blob(), 64));
  PageMover mover(store.slot_bytes(0), 2, copier);
  const std::vector<size_t> from = {3, 0, 15, 7, 8};
  const std::vector<size_t> to = {1, 14, 2, 9, 0};
  const auto keys = keys_of(100, from.size());

  const PutPagesResult put = mover.put_pages(store, keys, 0, src.layout, from, src.blob());
  EXPECT_EQ(put.present, 0u);
  EXPECT_EQ(put.results, std::vector<PutResult>(from.size(), PutResult::kStored));
  expect_idle(store);
  EXPECT_EQ(store.stats().spills, from.size());

  const GetPagesResult got = mover.get_pages(store, keys, 0, dst.layout, to, dst.blob());
  EXPECT_EQ(got.hits, all(from.size(), true));
  EXPECT_TRUE(got.dropped.empty());
  expect_idle(store);
  for (size_t i = 0; i < from.size(); ++i)
    EXPECT_EQ(dst.page(copier, to[i]), src.page(copier, from[i])) << "key " << i;
  EXPECT_EQ(dst.page(copier, 3), std::vector<uint8_t>(dst.blob(), 0xEE)) << "not asked for";
}

// D16: keys the index holds are neither gathered nor written; the per-key results keep the
// order of the call across chunks, misses included.
TEST(PageMover, SkipsStoredKeysAndKeepsOrderWithMisses) {
  TempDir d;
  Copier copier(2);
  HostPool src(32, 0), dst(32, 0xEE);
  src.randomize(2);
  Store store(store_cfg(d.path, src.blob(), 64));
  PageMover mover(store.slot_bytes(0), 3, copier);
  std::vector<size_t> pages(11);
  for (size_t i = 0; i < pages.size(); ++i) pages[i] = 2 * i + 1;
  const auto keys = keys_of(200, pages.size());

  // Keys 0, 4 and 9 first.
  const PutPagesResult first = mover.put_pages(store, {keys[0], keys[4], keys[9]}, 0, src.layout,
                                               {pages[0], pages[4], pages[9]}, src.blob());
  EXPECT_EQ(first.results, std::vector<PutResult>(3, PutResult::kStored));
  const PutPagesResult put = mover.put_pages(store, keys, 0, src.layout, pages, src.blob());
  EXPECT_EQ(put.present, 3u);
  for (size_t i = 0; i < keys.size(); ++i)
    EXPECT_EQ(put.results[i], i == 0 || i == 4 || i == 9 ? PutResult::kDuplicate
                                                         : PutResult::kStored)
        << i;
  const StoreStats st = store.stats();
  EXPECT_EQ(st.spills, keys.size()) << "each page written once";
  EXPECT_EQ(st.dedup_hits, 0u) << "present keys never reached the store's put path";

  // Read back with unknown keys interleaved: 3 chunks of 3 and a short one of 2 (odd count).
  std::vector<Key> asked;
  std::vector<size_t> into;
  std::vector<bool> want;
  for (size_t i = 0; i < keys.size(); ++i) {
    asked.push_back(keys[i]);
    into.push_back(i);
    want.push_back(true);
    if (i % 4 == 1) {
      asked.push_back(key_of(9000 + i));
      into.push_back(20 + i);
      want.push_back(false);
    }
  }
  const GetPagesResult got = mover.get_pages(store, asked, 0, dst.layout, into, dst.blob());
  EXPECT_EQ(got.hits, want);
  expect_idle(store);
  for (size_t j = 0, i = 0; j < asked.size(); ++j) {
    if (!want[j]) {
      EXPECT_EQ(dst.page(copier, into[j]), std::vector<uint8_t>(dst.blob(), 0xEE)) << j;
      continue;
    }
    EXPECT_EQ(dst.page(copier, into[j]), src.page(copier, pages[i])) << "key " << i;
    ++i;
  }
  EXPECT_EQ(store.stats().misses, asked.size() - keys.size());
}

// D17 / D1: a slot corrupted on disk reads as a miss; its host page is not written and the entry
// leaves the index (D4); the other pages of the chunk are hits.
TEST(PageMover, CorruptedSlotIsAMissAndLeavesTheHostPageAlone) {
  TempDir d;
  Copier copier(2);
  HostPool src(8, 0), dst(8, 0xEE);
  src.randomize(3);
  Store store(store_cfg(d.path, src.blob(), 16));
  PageMover mover(store.slot_bytes(0), 4, copier);
  const auto keys = keys_of(300, 4);
  ASSERT_EQ(mover.put_pages(store, keys, 0, src.layout, {0, 1, 2, 3}, src.blob()).results,
            std::vector<PutResult>(4, PutResult::kStored));
  // Find key 2's slot from the slab headers and flip one payload byte.
  const SlabFile& slab = store.slab(0, 0);
  uint64_t slot = UINT64_MAX;
  for (const ScannedSlot& s : slab.scan())
    if (s.key == keys[2]) slot = s.slot;
  ASSERT_NE(slot, UINT64_MAX);
  const int fd = ::open(slab.path().c_str(), O_RDWR);
  ASSERT_GE(fd, 0);
  const off_t off = static_cast<off_t>(slab.slot_offset(slot) + kSlotHeaderBytes + 100);
  uint8_t b = 0;
  ASSERT_EQ(::pread(fd, &b, 1, off), 1);
  b ^= 0x5A;
  ASSERT_EQ(::pwrite(fd, &b, 1, off), 1);
  ASSERT_EQ(::fsync(fd), 0);
  ::close(fd);

  const GetPagesResult got = mover.get_pages(store, keys, 0, dst.layout, {4, 5, 6, 7}, dst.blob());
  EXPECT_EQ(got.hits, (std::vector<bool>{true, true, false, true}));
  EXPECT_TRUE(got.dropped.empty());
  EXPECT_EQ(dst.page(copier, 6), std::vector<uint8_t>(dst.blob(), 0xEE)) << "host page written";
  EXPECT_EQ(dst.page(copier, 7), src.page(copier, 3));
  EXPECT_EQ(store.stats().verify_failures, 1u);
  EXPECT_FALSE(store.lookup(0, keys[2]).has_value()) << "a slot that fails verification leaves";
  expect_idle(store);
}

// D17: a stored payload of another length than the layout's page is removed and missed.
TEST(PageMover, WrongLengthPageIsRemovedAndMissed) {
  TempDir d;
  Copier copier(2);
  HostPool src(4, 0), dst(4, 0xEE);
  src.randomize(4);
  Store store(store_cfg(d.path, src.blob(), 16));
  PageMover mover(store.slot_bytes(0), 2, copier);
  const auto keys = keys_of(400, 3);
  std::vector<uint8_t> half(src.blob() / 2, 0x11);
  ASSERT_EQ(store.submit_put_copy(0, {keys[1]}, {half.data()}, {half.size()})->wait()[0],
            static_cast<int64_t>(PutResult::kStored));
  // Key 1 is indexed (with the wrong length): the put skips it.
  const PutPagesResult put = mover.put_pages(store, keys, 0, src.layout, {0, 1, 2}, src.blob());
  EXPECT_EQ(put.present, 1u);

  const GetPagesResult got = mover.get_pages(store, keys, 0, dst.layout, {3, 2, 1}, dst.blob());
  EXPECT_EQ(got.hits, (std::vector<bool>{true, false, true}));
  ASSERT_EQ(got.dropped.size(), 1u);
  EXPECT_EQ(got.dropped[0].index, 1u);
  EXPECT_EQ(got.dropped[0].bytes, half.size());
  EXPECT_EQ(dst.page(copier, 2), std::vector<uint8_t>(dst.blob(), 0xEE));
  EXPECT_EQ(dst.page(copier, 1), src.page(copier, 2));
  EXPECT_FALSE(store.lookup(0, keys[1]).has_value()) << "the wrong-length page was removed";
  EXPECT_EQ(store.stats().deletes, 1u);
  // Now the page can be stored properly.
  EXPECT_EQ(mover.put_pages(store, {keys[1]}, 0, src.layout, {1}, src.blob()).results[0],
            PutResult::kStored);
  expect_idle(store);
}

// D18: an error in the middle of a batch (a page index the Copier refuses, in the third chunk)
// propagates only after every chunk already submitted was acknowledged; the mover stays usable.
TEST(PageMover, ErrorMidBatchLeavesNothingInFlight) {
  TempDir d;
  Copier copier(2);
  HostPool src(8, 0), dst(8, 0xEE);
  src.randomize(5);
  StoreConfig cfg = store_cfg(d.path, src.blob(), 32);
  cfg.write_threads = 1;
  cfg.read_threads = 1;
  Store store(cfg);
  PageMover mover(store.slot_bytes(0), 2, copier);
  const auto keys = keys_of(500, 6);
  const std::vector<size_t> bad = {0, 1, 2, 3, 99, 5};  // 99: no such page
  EXPECT_THROW(mover.put_pages(store, keys, 0, src.layout, bad, src.blob()),
               std::invalid_argument);
  expect_idle(store);
  for (size_t i = 0; i < 4; ++i) EXPECT_TRUE(store.lookup(0, keys[i]).has_value()) << i;
  for (size_t i = 4; i < 6; ++i) EXPECT_FALSE(store.lookup(0, keys[i]).has_value()) << i;

  const std::vector<size_t> good = {0, 1, 2, 3, 4, 5};
  const PutPagesResult put = mover.put_pages(store, keys, 0, src.layout, good, src.blob());
  EXPECT_EQ(put.present, 4u);
  EXPECT_EQ(put.results[5], PutResult::kStored);

  // Reads: chunk 1 (pages 2, 3) fails to scatter while chunk 2 is already being read.
  const std::vector<size_t> bad_to = {0, 1, 2, 77, 4, 5};
  EXPECT_THROW(mover.get_pages(store, keys, 0, dst.layout, bad_to, dst.blob()),
               std::invalid_argument);
  expect_idle(store);
  EXPECT_EQ(dst.page(copier, 0), src.page(copier, 0)) << "chunk 0 was scattered before";
  EXPECT_EQ(dst.page(copier, 4), std::vector<uint8_t>(dst.blob(), 0xEE)) << "chunk 2 never was";
  const GetPagesResult got = mover.get_pages(store, keys, 0, dst.layout, good, dst.blob());
  EXPECT_EQ(got.hits, all(6, true));
  for (size_t p : good) EXPECT_EQ(dst.page(copier, p), src.page(copier, p)) << p;

  // A read-only store refuses the write (EROFS) at its first chunk; nothing is queued.
  StoreConfig rcfg = cfg;
  rcfg.read_only = true;
  Store reader(rcfg);
  EXPECT_THROW(mover.put_pages(reader, keys_of(600, 3), 0, src.layout, {0, 1, 2}, src.blob()),
               std::system_error);
  expect_idle(reader);
  EXPECT_EQ(mover.get_pages(reader, keys, 0, dst.layout, good, dst.blob()).hits, all(6, true));
}

// D19: two threads share one mover's put staging (and two others its get staging); every page of
// every call lands right.
TEST(PageMover, ConcurrentCallsShareOneMover) {
  TempDir d;
  Copier copier(2);
  HostPool src(64, 0), dst(64, 0xEE);
  src.randomize(6);
  Store store(store_cfg(d.path, src.blob(), 256));
  PageMover mover(store.slot_bytes(0), 3, copier);
  constexpr size_t kRounds = 8, kPer = 4;  // per thread: 8 calls of 4 pages (2 chunks)
  auto writer = [&](size_t t) {
    for (size_t r = 0; r < kRounds; ++r) {
      std::vector<size_t> pages;
      for (size_t j = 0; j < kPer; ++j) pages.push_back(t * 32 + r * kPer + j);
      const auto res =
          mover.put_pages(store, keys_of(1000 + pages[0], kPer), 0, src.layout, pages, src.blob());
      for (PutResult x : res.results) EXPECT_EQ(x, PutResult::kStored);
    }
  };
  std::thread a(writer, 0), b(writer, 1);
  a.join();
  b.join();
  auto reader = [&](size_t t) {
    for (size_t r = 0; r < kRounds; ++r) {
      std::vector<size_t> pages;
      for (size_t j = 0; j < kPer; ++j) pages.push_back(t * 32 + r * kPer + j);
      const auto res =
          mover.get_pages(store, keys_of(1000 + pages[0], kPer), 0, dst.layout, pages, dst.blob());
      EXPECT_EQ(res.hits, all(kPer, true));
    }
  };
  std::thread c(reader, 0), e(reader, 1);
  c.join();
  e.join();
  for (size_t p = 0; p < 64; ++p) EXPECT_EQ(dst.page(copier, p), src.page(copier, p)) << p;
  expect_idle(store);
}

TEST(PageMover, RefusesBadArguments) {
  TempDir d;
  Copier copier(1);
  HostPool src(4, 0);
  Store store(store_cfg(d.path, src.blob(), 8));
  EXPECT_THROW(PageMover(store.slot_bytes(0), 0, copier), std::invalid_argument);
  EXPECT_THROW(PageMover(4096 + 100, 2, copier), std::invalid_argument);
  EXPECT_THROW(PageMover(64, 2, copier), std::invalid_argument);
  PageMover mover(store.slot_bytes(0), 2, copier);
  const auto keys = keys_of(700, 2);
  EXPECT_THROW(mover.put_pages(store, keys, 0, src.layout, {0}, src.blob()),
               std::invalid_argument);  // 2 keys, 1 page
  EXPECT_THROW(mover.get_pages(store, keys, 0, src.layout, {0, 1}, src.blob() - 1),
               std::invalid_argument);  // not the layout's page size
  EXPECT_THROW(mover.put_pages(store, keys, 1, src.layout, {0, 1}, src.blob()),
               std::invalid_argument);  // no kind 1
  TempDir d2;
  Store big(store_cfg(d2.path, 3 * 4096, 8));
  EXPECT_THROW(mover.get_pages(big, keys, 0, src.layout, {0, 1}, src.blob()),
               std::invalid_argument);  // the kind's slots are larger than the staging slots
  EXPECT_TRUE(mover.put_pages(store, {}, 0, src.layout, {}, src.blob()).results.empty());
  expect_idle(store);
}

// ---- host stores: straight out of the mapping (D21) ------------------------------------------

namespace {

StoreConfig host_cfg(const std::string& dir, uint64_t page, uint64_t slots,
                     bool read_only = false) {
  StoreConfig c = store_cfg(dir, page, slots);
  c.host = true;
  c.read_only = read_only;
  return c;
}

uint64_t slot_of(const Store& store, const Key& key) {
  for (const ScannedSlot& s : store.slab(0, 0).scan())
    if (s.key == key) return s.slot;
  throw std::runtime_error("key not in the slab");
}

// Overwrites `len` bytes at `at` bytes into `slot` of the store's slab file (its mapping sees it).
void poke(const Store& store, uint64_t slot, size_t at, const void* bytes, size_t len) {
  const SlabFile& slab = store.slab(0, 0);
  const int fd = ::open(slab.path().c_str(), O_RDWR);
  ASSERT_GE(fd, 0);
  ASSERT_EQ(::pwrite(fd, bytes, len, static_cast<off_t>(slab.slot_offset(slot) + at)),
            static_cast<ssize_t>(len));
  ::close(fd);
}

}  // namespace

// Hits land byte for byte (in a writer and in a reader of the same slabs); a flipped payload
// byte and a zeroed header are misses counted as verify failures and dropped; a page of another
// length is dropped and removed, as from disk.
TEST(PageMover, HostStoreCopiesFromTheMappingAndMissesBadSlots) {
  ShmDir d;
  Copier copier(3);
  HostPool src(8, 0), dst(8, 0xEE);
  src.randomize(21);
  Store store(host_cfg(d.path, src.blob(), 16));
  ASSERT_TRUE(store.host());
  PageMover mover(store.slot_bytes(0), 2, copier);
  const auto keys = keys_of(2100, 6);
  ASSERT_EQ(mover.put_pages(store, keys, 0, src.layout, {0, 1, 2, 3, 4, 5}, src.blob()).results,
            std::vector<PutResult>(6, PutResult::kStored));
  {
    Store reader(host_cfg(d.path, src.blob(), 16, true));
    HostPool mirror(8, 0xEE);
    const GetPagesResult r = mover.get_pages(reader, keys, 0, mirror.layout, {0, 1, 2, 3, 4, 5},
                                             mirror.blob());
    EXPECT_EQ(r.hits, all(6, true));
    for (size_t p = 0; p < 6; ++p) EXPECT_EQ(mirror.page(copier, p), src.page(copier, p)) << p;
    expect_idle(reader);
  }
  const uint8_t flip = 0x5A;
  uint8_t b = 0;
  const uint64_t s1 = slot_of(store, keys[1]);
  const SlabFile& slab = store.slab(0, 0);
  {
    const int fd = ::open(slab.path().c_str(), O_RDONLY);
    ASSERT_EQ(::pread(fd, &b, 1, static_cast<off_t>(slab.slot_offset(s1) + kSlotHeaderBytes + 77)), 1);
    ::close(fd);
  }
  b ^= flip;
  poke(store, s1, kSlotHeaderBytes + 77, &b, 1);
  const std::vector<uint8_t> zero(kSlotHeaderBytes, 0);
  poke(store, slot_of(store, keys[3]), 0, zero.data(), zero.size());
  std::vector<uint8_t> half(src.blob() / 2, 0x11);
  const Key odd = key_of(2199);
  ASSERT_EQ(store.submit_put_copy(0, {odd}, {half.data()}, {half.size()})->wait()[0],
            static_cast<int64_t>(PutResult::kStored));

  std::vector<Key> ask = keys;
  ask.push_back(odd);
  ask.push_back(key_of(2198));  // never stored
  const GetPagesResult got =
      mover.get_pages(store, ask, 0, dst.layout, {7, 6, 5, 4, 3, 2, 1, 0}, dst.blob());
  EXPECT_EQ(got.hits, (std::vector<bool>{true, false, true, false, true, true, false, false}));
  ASSERT_EQ(got.dropped.size(), 1u);
  EXPECT_EQ(got.dropped[0].index, 6u);
  EXPECT_EQ(got.dropped[0].bytes, half.size());
  for (size_t i : {0u, 2u, 4u, 5u}) EXPECT_EQ(dst.page(copier, 7 - i), src.page(copier, i)) << i;
  EXPECT_EQ(dst.page(copier, 4), std::vector<uint8_t>(dst.blob(), 0xEE))
      << "a header that does not verify: nothing copied";
  const StoreStats st = store.stats();
  EXPECT_EQ(st.verify_failures, 2u);
  EXPECT_FALSE(store.lookup(0, keys[1]).has_value());
  EXPECT_FALSE(store.lookup(0, keys[3]).has_value());
  EXPECT_FALSE(store.lookup(0, odd).has_value()) << "the wrong-length page was removed";
  EXPECT_TRUE(store.lookup(0, keys[0]).has_value());
  expect_idle(store);
}

// The second look (H4's reader side): a slot whose header changes while its payload is copied
// (a writer reusing or rewriting it: the header torn, or whole with another seq) is a plain miss
// and its entry stays, even though the copied bytes match the old CRC; a CRC that differs under
// an unchanged header is corrupt (a verify failure, dropped, D1); a declined item is a plain
// miss; an exception of the copy propagates with the counters settled; a disk store has no
// mapping to read.
TEST(PageMover, HostStoreReadMappedChecksTheHeaderAgainAfterTheCopy) {
  ShmDir d;
  Copier copier(2);
  HostPool src(5, 0);
  src.randomize(22);
  Store store(host_cfg(d.path, src.blob(), 8));
  PageMover mover(store.slot_bytes(0), 2, copier);
  const auto keys = keys_of(2200, 5);
  mover.put_pages(store, keys, 0, src.layout, {0, 1, 2, 3, 4}, src.blob());
  const uint64_t s0 = slot_of(store, keys[0]), s3 = slot_of(store, keys[3]);
  std::vector<uint8_t> out(src.blob());
  const std::vector<int64_t> r = store.read_mapped(
      0, keys, SIZE_MAX, [&](const std::vector<Store::MappedPayload>& items) {
        std::vector<std::optional<uint32_t>> crcs;
        for (const Store::MappedPayload& it : items) {
          crcs.push_back(vitrify::crc32c_copy(out.data(), it.data, it.bytes));
          if (it.index == 0) {  // torn after the copy: its header no longer verifies
            const uint32_t seq = 0xABCD;
            poke(store, s0, 20, &seq, sizeof seq);
          }
          if (it.index == 2) crcs.back().reset();  // declined
          if (it.index == 3) {  // rewritten whole after the copy: a valid header, another seq
            SlotHeader h;
            std::memcpy(&h, it.data - kSlotHeaderBytes, sizeof h);
            h.seq += 1000;
            h.header_crc = vitrify::crc32c(&h, offsetof(SlotHeader, header_crc));
            poke(store, s3, 0, &h, sizeof h);
          }
          if (it.index == 4) *crcs.back() ^= 1;  // bytes that do not match the header
        }
        return crcs;
      });
  const int64_t blob = static_cast<int64_t>(src.blob());
  EXPECT_EQ(r, (std::vector<int64_t>{-1, blob, -1, -1, -1}));
  StoreStats st = store.stats();
  EXPECT_EQ(st.reloads, 1u);
  EXPECT_EQ(st.misses, 3u) << "torn, declined and rewritten";
  EXPECT_EQ(st.verify_failures, 1u) << "only the CRC mismatch under an unchanged header";
  for (size_t i : {0u, 2u, 3u})
    EXPECT_TRUE(store.lookup(0, keys[i]).has_value()) << "key " << i << ": not corrupt, kept";
  EXPECT_FALSE(store.lookup(0, keys[4]).has_value()) << "corrupt: dropped";
  EXPECT_THROW(store.read_mapped(0, {keys[1]}, SIZE_MAX,
                                 [](const std::vector<Store::MappedPayload>&)
                                     -> std::vector<std::optional<uint32_t>> {
                                   throw std::runtime_error("copy failed");
                                 }),
               std::runtime_error);
  EXPECT_TRUE(store.lookup(0, keys[1]).has_value()) << "an error is not a verify failure";
  expect_idle(store);

  TempDir disk_dir;
  Store disk(store_cfg(disk_dir.path, src.blob(), 4));
  EXPECT_THROW(disk.read_mapped(0, keys, SIZE_MAX,
                                [](const std::vector<Store::MappedPayload>&) {
                                  return std::vector<std::optional<uint32_t>>{};
                                }),
               std::invalid_argument);
}

// A writer reusing slots (GC) while a reader of the same slabs copies pages out of the mapping:
// every page the reader reports as a hit holds exactly the bytes of its key, never a mix.
TEST(PageMover, HostStoreReaderNeverSeesAPageBeingRewritten) {
  ShmDir d;
  Copier wc(1), rc(2);
  HostPool src(1, 0), dst(4, 0);
  const size_t blob = src.blob();
  const auto fill = [&](uint64_t id) {
    std::mt19937_64 g(id);
    for (auto* m : {&src.k, &src.v})
      for (auto& b : *m) b = static_cast<uint8_t>(g());
  };
  const auto expected = [&](uint64_t id) {
    fill(id);
    return src.page(wc, 0);
  };
  Store writer(host_cfg(d.path, blob, 12));
  PageMover wm(writer.slot_bytes(0), 1, wc);
  fill(0);
  ASSERT_EQ(wm.put_pages(writer, {key_of(0)}, 0, src.layout, {0}, blob).results[0],
            PutResult::kStored);
  Store reader(host_cfg(d.path, blob, 12, true));
  PageMover rm(reader.slot_bytes(0), 1, rc);
  std::atomic<uint64_t> written{1};
  std::atomic<bool> stop{false};
  HostPool wsrc(1, 0);  // the writer's own page (expected() uses src on the reader's side)
  std::thread w([&] {
    for (uint64_t id = 1; !stop.load() && id < 200000; ++id) {
      std::mt19937_64 g(id);
      for (auto* m : {&wsrc.k, &wsrc.v})
        for (auto& b : *m) b = static_cast<uint8_t>(g());
      wm.put_pages(writer, {key_of(id)}, 0, wsrc.layout, {0}, blob);
      written.store(id + 1);
    }
  });
  size_t hits = 0, misses = 0, wrong = 0;
  const auto until = std::chrono::steady_clock::now() + std::chrono::milliseconds(1500);
  while (std::chrono::steady_clock::now() < until) {
    reader.refresh();
    const uint64_t top = written.load();
    std::vector<Key> keys;
    std::vector<uint64_t> ids;
    for (uint64_t i = 0; i < 4; ++i) {  // the oldest pages still stored: GC takes them next
      const uint64_t id = top > 8 + i ? top - 8 - i : 0;
      ids.push_back(id);
      keys.push_back(key_of(id));
    }
    const GetPagesResult r = rm.get_pages(reader, keys, 0, dst.layout, {0, 1, 2, 3}, blob);
    for (size_t i = 0; i < 4; ++i) {
      if (!r.hits[i]) {
        ++misses;
        continue;
      }
      ++hits;
      if (dst.page(rc, i) != expected(ids[i])) ++wrong;
    }
  }
  stop.store(true);
  w.join();
  EXPECT_EQ(wrong, 0u);
  EXPECT_GT(hits, 0u);
  EXPECT_GT(written.load(), 12u) << "the writer reused slots";
  std::printf("reader: %zu hits, %zu misses over %llu pages written\n", hits, misses,
              static_cast<unsigned long long>(written.load()));
}
