// Slab files and the disk Store on a real filesystem (ext4 here; VITRIFY_TEST_DIR to choose).
// Invariant numbers refer to csrc/src/disk/DESIGN.md.
#include <fcntl.h>
#include <signal.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <random>
#include <set>
#include <thread>

#include <gtest/gtest.h>

#include "temp_dir.hpp"
#include "vitrify/disk.hpp"
#include "vitrify/error.hpp"
#include "vitrify/file_io.hpp"
#include "vitrify/fs.hpp"
#include "vitrify/log.hpp"

namespace fs = std::filesystem;
using namespace vitrify::disk;
using vitrify::file_io::DirectIo;

namespace {

using vitrify::test::TempDir;

uint64_t mix(uint64_t x) {
  x += 0x9E3779B97F4A7C15ull;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}

Key key_of(uint64_t i) {
  Key k{};
  for (int w = 0; w < 4; ++w) {
    const uint64_t v = mix(i * 4 + w);
    std::memcpy(k.data() + 8 * w, &v, 8);
  }
  return k;
}

// Deterministic content of key i (the store is content-addressed: one key, one content).
size_t len_of(uint64_t i, size_t max_len) { return max_len == 0 ? 0 : mix(i ^ 0xABCD) % (max_len + 1); }
void fill(uint64_t i, uint8_t* p, size_t n) {
  uint64_t s = mix(i + 77);
  for (size_t j = 0; j < n; ++j) {
    if (j % 8 == 0) s = mix(s);
    p[j] = static_cast<uint8_t>(s >> (8 * (j % 8)));
  }
}
bool content_ok(uint64_t i, const uint8_t* p, size_t n, size_t max_len) {
  if (n != len_of(i, max_len)) return false;
  std::vector<uint8_t> want(n);
  fill(i, want.data(), n);
  return n == 0 || std::memcmp(want.data(), p, n) == 0;
}

SlabGeometry geo(uint64_t slot_bytes, uint64_t count, const char* name = "t") {
  return SlabGeometry{3, slot_bytes, count, store_tag(name)};
}

void poke(const std::string& path, uint64_t off, const void* bytes, size_t n) {
  const int fd = ::open(path.c_str(), O_WRONLY);
  ASSERT_GE(fd, 0);
  ASSERT_EQ(::pwrite(fd, bytes, n, static_cast<off_t>(off)), static_cast<ssize_t>(n));
  ::close(fd);
}
uint8_t peek(const std::string& path, uint64_t off) {
  uint8_t b = 0;
  const int fd = ::open(path.c_str(), O_RDONLY);
  EXPECT_EQ(::pread(fd, &b, 1, static_cast<off_t>(off)), 1);
  ::close(fd);
  return b;
}

StoreConfig store_cfg(const std::vector<std::string>& dirs, uint64_t page, uint64_t slots_per_drive,
                      ColdStart cs = ColdStart::kClear) {
  StoreConfig c;
  c.dirs = dirs;
  c.kinds = {KindConfig{page, 1.0}};
  c.budget_bytes = (kFileHeaderBytes + slots_per_drive * slot_bytes_for(page)) * dirs.size();
  c.cold_start = cs;
  c.name = "unit";
  return c;
}

std::vector<int64_t> put_range(Store& s, uint64_t from, uint64_t to, size_t max_len) {
  std::vector<PutItem> items;
  for (uint64_t i = from; i < to; ++i) {
    auto b = s.make_buffer(0);
    const size_t n = len_of(i, max_len);
    fill(i, b->data() + kSlotHeaderBytes, n);
    items.push_back(PutItem{key_of(i), b, n});
  }
  return s.submit_put(0, std::move(items))->wait();
}

// Read key i; returns 1 exact, 0 miss, -1 wrong bytes (must never happen).
int read_check(Store& s, uint64_t i, size_t max_len) {
  std::vector<uint8_t> dst(max_len + 1);
  GetItem g{key_of(i), dst.data(), dst.size(), false};
  const int64_t r = s.submit_get(0, {g})->wait()[0];
  if (r < 0) return 0;
  return content_ok(i, dst.data(), static_cast<size_t>(r), max_len) ? 1 : -1;
}

}  // namespace

// ------------------------------------------------------------------------------- parsing
TEST(DiskParse, ModesAndErrors) {  // direct_io: test_file_io.cpp
  EXPECT_EQ(parse_cold_start("clear"), ColdStart::kClear);
  EXPECT_EQ(parse_cold_start("load"), ColdStart::kLoad);
  try {
    parse_cold_start("warm");
    FAIL();
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("warm"), std::string::npos);
  }
  EXPECT_EQ(slot_bytes_for(1 << 20), (1u << 20) + 4096);
  EXPECT_EQ(slot_bytes_for(4096 - 64), 4096u);
}

// ------------------------------------------------------------------------------- slab
TEST(Slab, RoundTripManySizesDirectAndBuffered) {
  TempDir d;
  for (DirectIo mode : {DirectIo::kAuto, DirectIo::kOff}) {
    const std::string path = d.path + (mode == DirectIo::kOff ? "/b.slab" : "/a.slab");
    SlabFile f(path, geo(3 * 4096, 8), ColdStart::kClear, mode);
    // auto: O_DIRECT exactly where the probe says the filesystem accepts it (ext4: yes)
    EXPECT_EQ(f.direct(), mode == DirectIo::kAuto && vitrify::fs::probe_direct_io(d.path).supported);
    EXPECT_EQ(fs::file_size(path), 4096u + 8 * 3 * 4096);
    vitrify::AlignedBuffer buf(3 * 4096), back(3 * 4096);
    const size_t sizes[] = {0, 1, 63, 64, 4031, 4032, 4033, 8000, 3 * 4096 - 64};
    uint64_t slot = 0;
    for (size_t n : sizes) {
      fill(n, buf.data() + 64, n);
      f.write_aligned(slot % 8, key_of(n), buf.data(), n, 1);
      auto r = f.read_into(slot % 8, key_of(n), back.data(), back.size());
      ASSERT_TRUE(r.has_value()) << n;
      EXPECT_EQ(*r, n);
      EXPECT_EQ(std::memcmp(back.data() + 64, buf.data() + 64, n), 0);
      // With the exact expected length too; a wrong expectation is a miss.
      EXPECT_EQ(f.read_into(slot % 8, key_of(n), back.data(), back.size(), n), n);
      if (n + 4096 <= 3 * 4096 - 64)
        EXPECT_FALSE(f.read_into(slot % 8, key_of(n), back.data(), back.size(), n + 4096));
      ++slot;
    }
    EXPECT_THROW(f.write_aligned(8, key_of(1), buf.data(), 1, 1), std::invalid_argument);
    EXPECT_THROW(f.write_aligned(0, key_of(1), buf.data(), 3 * 4096, 1), std::invalid_argument);
  }
}

TEST(Slab, VerifyOnReadMisses) {
  TempDir d;
  const std::string path = d.path + "/v.slab";
  const uint64_t sb = 2 * 4096;
  SlabFile f(path, geo(sb, 4), ColdStart::kClear, DirectIo::kAuto);
  vitrify::AlignedBuffer buf(sb), back(sb);
  fill(5, buf.data() + 64, 5000);
  f.write_aligned(1, key_of(5), buf.data(), 5000, 9);
  ASSERT_TRUE(f.read_into(1, key_of(5), back.data(), sb));
  EXPECT_FALSE(f.read_into(0, key_of(5), back.data(), sb));  // absent (never written)
  EXPECT_FALSE(f.read_into(1, key_of(6), back.data(), sb));  // wrong key
  EXPECT_FALSE(f.read_into(9, key_of(5), back.data(), sb));  // out of range
  EXPECT_FALSE(f.read_into(1, key_of(5), back.data(), 4096));  // buffer too small
  EXPECT_FALSE(f.read_into(1, key_of(5), back.data() + 64, sb - 64));  // unaligned (O_DIRECT)
  // The slot copied to another position: wrong slot index.
  poke(path, f.slot_offset(2), buf.data(), sb);
  EXPECT_FALSE(f.read_into(2, key_of(5), back.data(), sb));
  // Flip one bit anywhere in the header or the payload: a miss.
  const uint64_t base = f.slot_offset(1);
  for (uint64_t off : {0ul, 5ul, 9ul, 13ul, 17ul, 21ul, 30ul, 57ul, 61ul, 64ul, 2000ul, 5063ul}) {
    const uint8_t orig = peek(path, base + off);
    const uint8_t flipped = orig ^ 0x10;
    poke(path, base + off, &flipped, 1);
    EXPECT_FALSE(f.read_into(1, key_of(5), back.data(), sb)) << "offset " << off;
    poke(path, base + off, &orig, 1);
    ASSERT_TRUE(f.read_into(1, key_of(5), back.data(), sb));
  }
  // Torn write: the new header with the old tail.
  vitrify::AlignedBuffer other(sb);
  fill(7, other.data() + 64, 5000);
  f.write_aligned(3, key_of(7), other.data(), 5000, 10);
  poke(path, base, other.data(), 4096);  // first block of key 7 over slot 1 ...
  EXPECT_FALSE(f.read_into(1, key_of(7), back.data(), sb));  // ... wrong slot index anyway
  EXPECT_FALSE(f.read_into(1, key_of(5), back.data(), sb));
}

TEST(Slab, ClearMakesOldSlotsInertAndLoadKeepsThem) {
  TempDir d;
  const std::string path = d.path + "/c.slab";
  vitrify::AlignedBuffer buf(4096), back(4096);
  fill(1, buf.data() + 64, 100);
  uint32_t first_id;
  {
    SlabFile f(path, geo(4096, 2), ColdStart::kClear, DirectIo::kAuto);
    first_id = f.slab_id();
    f.write_aligned(0, key_of(1), buf.data(), 100, 1);
  }
  {
    SlabFile f(path, geo(4096, 2), ColdStart::kLoad, DirectIo::kAuto);
    EXPECT_FALSE(f.formatted());
    EXPECT_EQ(f.slab_id(), first_id);
    EXPECT_EQ(f.read_into(0, key_of(1), back.data(), 4096), 100u);
    ASSERT_EQ(f.scan().size(), 1u);
  }
  {
    SlabFile f(path, geo(4096, 2), ColdStart::kClear, DirectIo::kAuto);
    EXPECT_TRUE(f.formatted());
    EXPECT_NE(f.slab_id(), first_id);
    EXPECT_FALSE(f.read_into(0, key_of(1), back.data(), 4096));
    EXPECT_TRUE(f.scan().empty());
  }
  // Another store's file at this path, or another geometry: load refuses naming both values
  // and changes nothing (issue 32: it used to format the slab, losing its pages); only clear
  // wipes it.
  uint32_t id;
  {
    SlabFile f(path, geo(4096, 2), ColdStart::kLoad, DirectIo::kAuto);
    f.write_aligned(1, key_of(2), buf.data(), 100, 1);
    id = f.slab_id();
  }
  const auto refusal = [&](const SlabGeometry& g) {
    try {
      SlabFile f(path, g, ColdStart::kLoad, DirectIo::kAuto);
    } catch (const std::invalid_argument& e) {
      return std::string(e.what());
    }
    return std::string("opened");
  };
  std::string m = refusal(geo(4096, 2, "other-store"));
  EXPECT_NE(m.find("cold_start=\"load\" refuses slab file \"" + path +
                   "\": it belongs to another store"), std::string::npos) << m;
  m = refusal(geo(4096, 3));
  EXPECT_NE(m.find("on disk kind 3, slot_bytes 4096, 2 slots, requested kind 3, slot_bytes 4096, "
                   "3 slots"), std::string::npos) << m;
  m = refusal(geo(8192, 2));
  EXPECT_NE(m.find("slot_bytes 4096, 2 slots, requested kind 3, slot_bytes 8192"),
            std::string::npos) << m;
  EXPECT_EQ(m.find('\n'), std::string::npos) << m;
  EXPECT_EQ(std::filesystem::file_size(path), kFileHeaderBytes + 2 * 4096);
  {
    SlabFile f(path, geo(4096, 2), ColdStart::kLoad, DirectIo::kAuto);
    EXPECT_FALSE(f.formatted());
    EXPECT_EQ(f.slab_id(), id);
    EXPECT_EQ(f.read_into(1, key_of(2), back.data(), 4096), 100u);
  }
  {
    SlabFile f(path, geo(4096, 3, "other-store"), ColdStart::kClear, DirectIo::kAuto);
    EXPECT_TRUE(f.formatted());
    EXPECT_TRUE(f.scan().empty());
  }
}

TEST(Slab, ForeignSlabBytesNeverVerify) {
  TempDir d;
  vitrify::AlignedBuffer buf(4096), back(4096);
  SlabFile a(d.path + "/a.slab", geo(4096, 2), ColdStart::kClear, DirectIo::kAuto);
  SlabFile b(d.path + "/b.slab", geo(4096, 2), ColdStart::kClear, DirectIo::kAuto);
  fill(1, buf.data() + 64, 10);
  a.write_aligned(0, key_of(1), buf.data(), 10, 1);
  // Copy a's slot image into b at the same slot: b's slab id differs, so it is a miss.
  const int fd = ::open((d.path + "/a.slab").c_str(), O_RDONLY);
  ASSERT_EQ(::pread(fd, back.data(), 4096, 4096), 4096);
  ::close(fd);
  poke(d.path + "/b.slab", 4096, back.data(), 4096);
  ASSERT_NE(a.slab_id(), b.slab_id());
  EXPECT_FALSE(b.read_into(0, key_of(1), back.data(), 4096));
}

// ------------------------------------------------------------------------------- store
TEST(Store, RoundTripDedupDeleteAcrossDrives) {
  TempDir d1, d2;
  const size_t page = 20000;
  Store s(store_cfg({d1.path, d2.path}, page, 16));
  const auto r = put_range(s, 0, 24, page);
  for (auto v : r) EXPECT_EQ(v, static_cast<int64_t>(PutResult::kStored));
  for (uint64_t i = 0; i < 24; ++i) EXPECT_EQ(read_check(s, i, page), 1) << i;
  // Dedup: a second put of present keys is acknowledged and writes nothing.
  const auto before = s.stats();
  for (auto v : put_range(s, 0, 24, page)) EXPECT_EQ(v, static_cast<int64_t>(PutResult::kDuplicate));
  const auto after = s.stats();
  EXPECT_EQ(after.spills, before.spills);
  EXPECT_EQ(after.dedup_hits, before.dedup_hits + 24);
  // Both drives hold data.
  EXPECT_FALSE(s.slab(0, 0).scan().empty());
  EXPECT_FALSE(s.slab(0, 1).scan().empty());
  EXPECT_TRUE(s.remove(0, key_of(3)));
  EXPECT_FALSE(s.remove(0, key_of(3)));
  EXPECT_EQ(read_check(s, 3, page), 0);
  EXPECT_FALSE(s.exists(0, key_of(3)));
  EXPECT_EQ(s.lookup(0, key_of(4)), len_of(4, page));
  const auto st = s.stats();
  EXPECT_EQ(st.kinds[0].entries, 23u);
  EXPECT_EQ(st.kinds[0].slots_used, 23u);
  EXPECT_EQ(st.kinds[0].slots_total, 32u);
  EXPECT_EQ(st.direct_io, vitrify::fs::probe_direct_io(d1.path).supported);
  // Zero-copy read into a slot buffer.
  auto sb = s.make_buffer(0);
  GetItem g{key_of(5), sb->data(), sb->size(), true};
  const int64_t n = s.submit_get(0, {g})->wait()[0];
  ASSERT_GE(n, 0);
  EXPECT_TRUE(content_ok(5, sb->data() + 64, static_cast<size_t>(n), page));
  // A destination that is too small is an argument error, not a miss.
  uint8_t tiny[4];
  EXPECT_THROW(s.submit_get(0, {GetItem{key_of(5), tiny, 4, false}}), std::invalid_argument);
}

TEST(Store, CopyingPutAndFullPoolFailsCleanly) {
  TempDir d;
  StoreConfig c = store_cfg({d.path}, 4000, 4);
  c.gc_high = 1.0;  // only the "full" path reclaims
  c.gc_low = 0.5;
  Store s(c);
  std::vector<uint8_t> src(4000, 0x5A);
  std::vector<Key> keys;
  std::vector<const void*> srcs;
  std::vector<size_t> lens;
  for (int i = 0; i < 4; ++i) {
    keys.push_back(key_of(100 + i));
    srcs.push_back(src.data());
    lens.push_back(4000);
  }
  for (auto v : s.submit_put_copy(0, keys, srcs, lens)->wait())
    EXPECT_EQ(v, static_cast<int64_t>(PutResult::kStored));
  // Full: the next put runs GC first (reclaims down to half), then succeeds.
  auto r = s.submit_put_copy(0, {key_of(200)}, {src.data()}, {4000})->wait();
  EXPECT_EQ(r[0], static_cast<int64_t>(PutResult::kStored));
  EXPECT_GE(s.stats().gc_reclaims, 2u);
  EXPECT_THROW(s.submit_put_copy(0, {key_of(1)}, {src.data()}, {4001}), std::invalid_argument);
}

TEST(Store, WriteErrorsAreCountedAndFreeTheirSlots) {
  TempDir d;
  const size_t page = 4000;  // one 4 KiB slot each
  StoreConfig c = store_cfg({d.path}, page, 16);
  c.write_threads = 1;
  Store s(c);
  // Writes at or past 4096 + 4 slots fail with EFBIG (RLIMIT_FSIZE), like a failing device.
  struct rlimit old{};
  ASSERT_EQ(::getrlimit(RLIMIT_FSIZE, &old), 0);
  auto prev = ::signal(SIGXFSZ, SIG_IGN);
  struct rlimit lim = old;
  lim.rlim_cur = 4096 + 4 * 4096;
  ASSERT_EQ(::setrlimit(RLIMIT_FSIZE, &lim), 0);
  const auto r = put_range(s, 0, 8, page);  // slots are handed out in order: 0..7
  ::setrlimit(RLIMIT_FSIZE, &old);
  ::signal(SIGXFSZ, prev);
  for (int i = 0; i < 4; ++i) EXPECT_EQ(r[i], static_cast<int64_t>(PutResult::kStored)) << i;
  for (int i = 4; i < 8; ++i) EXPECT_EQ(r[i], static_cast<int64_t>(PutResult::kError)) << i;
  auto st = s.stats();
  EXPECT_EQ(st.write_errors, 4u);
  EXPECT_EQ(st.kinds[0].slots_used, 4u);
  EXPECT_EQ(st.kinds[0].entries, 4u);
  for (uint64_t i = 0; i < 8; ++i) EXPECT_EQ(read_check(s, i, page), i < 4 ? 1 : 0) << i;
  // The failed slots went back to the pool: the same keys store fine now.
  for (auto v : put_range(s, 4, 8, page)) EXPECT_EQ(v, static_cast<int64_t>(PutResult::kStored));
  for (uint64_t i = 0; i < 8; ++i) EXPECT_EQ(read_check(s, i, page), 1) << i;
}

TEST(Store, SmallCallerBuffersAreNeverReusedForLargerCopies) {
  TempDir d;
  const size_t page = 3 * 4096;
  Store s(store_cfg({d.path}, page, 16));
  {  // a caller buffer that only fits a small payload, released to the store
    auto small = std::make_shared<vitrify::AlignedBuffer>(4096);
    fill(1, small->data() + 64, 100);
    std::vector<PutItem> items{PutItem{key_of(1), std::move(small), 100}};
    EXPECT_EQ(s.submit_put(0, std::move(items))->wait()[0], static_cast<int64_t>(PutResult::kStored));
  }
  // Full-size copying puts afterwards must get full-size buffers.
  std::vector<uint8_t> big(page);
  for (uint64_t i = 10; i < 20; ++i) {
    fill(i, big.data(), page);
    EXPECT_EQ(s.submit_put_copy(0, {key_of(i)}, {big.data()}, {page})->wait()[0],
              static_cast<int64_t>(PutResult::kStored));
  }
  std::vector<uint8_t> back(page);
  for (uint64_t i = 10; i < 20; ++i) {
    std::vector<uint8_t> want(page);
    fill(i, want.data(), page);
    ASSERT_EQ(s.submit_get(0, {GetItem{key_of(i), back.data(), page, false}})->wait()[0],
              static_cast<int64_t>(page));
    EXPECT_EQ(back, want);
  }
}

TEST(Store, FullPoolOfInFlightWritesReportsFull) {
  TempDir d;
  StoreConfig c = store_cfg({d.path}, 4000, 2);
  c.write_threads = 1;
  Store s(c);
  std::vector<PutItem> items;
  for (int i = 0; i < 6; ++i) {
    auto b = s.make_buffer(0);
    items.push_back(PutItem{key_of(i), b, 100});
  }
  // Six distinct keys, two slots and nothing indexed yet to reclaim: some report kFull.
  const auto r = s.submit_put(0, std::move(items))->wait();
  int stored = 0, full = 0;
  for (auto v : r) {
    stored += v == static_cast<int64_t>(PutResult::kStored);
    full += v == static_cast<int64_t>(PutResult::kFull);
  }
  EXPECT_EQ(stored + full, 6);
  EXPECT_GE(full, 1);
  EXPECT_EQ(s.stats().put_failures, static_cast<uint64_t>(full));
  const auto st = s.stats();
  EXPECT_LE(st.kinds[0].slots_used, 2u);
}

TEST(Store, ClearStartsEmptyLoadRebuildsExactlyTheLiveSet) {
  TempDir d1, d2;
  const size_t page = 9000;
  std::set<uint64_t> live;
  {
    Store s(store_cfg({d1.path, d2.path}, page, 20));
    put_range(s, 0, 30, page);
    for (uint64_t i = 0; i < 30; ++i) live.insert(i);
    for (uint64_t i : {2, 7, 11}) {
      ASSERT_TRUE(s.remove(0, key_of(i)));
      live.erase(i);
    }
    put_range(s, 100, 103, page);  // reuses freed slots
    for (uint64_t i = 100; i < 103; ++i) live.insert(i);
    ASSERT_TRUE(s.remove(0, key_of(100)));
    live.erase(100);
  }
  {
    Store s(store_cfg({d1.path, d2.path}, page, 20, ColdStart::kLoad));
    const auto st = s.stats();
    // close() zeroed the headers of freed slots: exactly the live set comes back (D5).
    EXPECT_EQ(st.loaded_entries, live.size());
    EXPECT_EQ(st.kinds[0].entries, live.size());
    EXPECT_EQ(st.kinds[0].slots_used, live.size());
    for (uint64_t i = 0; i < 110; ++i) EXPECT_EQ(read_check(s, i, page), live.count(i) ? 1 : 0) << i;
    // New writes after load go to free slots and never clobber live ones.
    put_range(s, 200, 205, page);
    for (uint64_t i : live) EXPECT_EQ(read_check(s, i, page), 1) << i;
  }
  {
    Store s(store_cfg({d1.path, d2.path}, page, 20, ColdStart::kClear));
    EXPECT_EQ(s.stats().kinds[0].entries, 0u);
    for (uint64_t i = 0; i < 110; ++i) EXPECT_EQ(read_check(s, i, page), 0);
  }
  {  // old bytes stay inert after clear
    Store s(store_cfg({d1.path, d2.path}, page, 20, ColdStart::kLoad));
    EXPECT_EQ(s.stats().kinds[0].entries, 0u);
  }
}

TEST(Store, GcReclaimsColdestFirstAndNeverLeaks) {
  TempDir d;
  const size_t page = 4000;
  StoreConfig c = store_cfg({d.path}, page, 20);
  c.write_threads = 1;
  c.max_batch = 1;
  Store s(c);
  // Fill 17 (< 0.90 * 20 = 18), one at a time so ticks follow key order.
  for (uint64_t i = 0; i < 17; ++i) put_range(s, i, i + 1, page);
  // Touch the oldest five: they become the hottest.
  for (uint64_t i = 0; i < 5; ++i) ASSERT_EQ(read_check(s, i, page), 1);
  put_range(s, 17, 18, page);  // 18 used -> GC down to 17 (floor(0.85 * 20))
  const auto st = s.stats();
  EXPECT_EQ(st.gc_reclaims, 1u);
  EXPECT_EQ(st.kinds[0].slots_used, 17u);
  EXPECT_EQ(read_check(s, 5, page), 0) << "key 5 was the coldest";
  for (uint64_t i = 0; i < 5; ++i) EXPECT_EQ(read_check(s, i, page), 1) << i;
  for (uint64_t i = 6; i < 18; ++i) EXPECT_EQ(read_check(s, i, page), 1) << i;
  // Many more rounds: used + free always equals total, entries == used when idle.
  for (uint64_t round = 0; round < 10; ++round) put_range(s, 1000 + round * 7, 1007 + round * 7, page);
  const auto st2 = s.stats();
  EXPECT_EQ(st2.kinds[0].slots_used, st2.kinds[0].entries);
  EXPECT_LE(st2.kinds[0].slots_used, 20u);
  // Delete everything: all slots come back.
  for (uint64_t i = 0; i < 2000; ++i) s.remove(0, key_of(i));
  EXPECT_EQ(s.stats().kinds[0].slots_used, 0u);
  put_range(s, 5000, 5017, page);
  EXPECT_EQ(s.stats().kinds[0].entries, 17u);
}

TEST(Store, ConcurrentPutGetGcDeleteBoundedTimeNoDeadlock) {
  TempDir d1, d2;
  const size_t page = 12000;
  StoreConfig c = store_cfg({d1.path, d2.path}, page, 24);
  c.queue_capacity = 4;
  c.max_batch = 3;
  Store s(c);
  std::atomic<bool> stop{false};
  std::atomic<int> wrong{0};
  std::atomic<uint64_t> ops{0};
  std::vector<std::thread> ts;
  for (int t = 0; t < 6; ++t) {
    ts.emplace_back([&, t] {
      std::mt19937_64 rng(t);
      while (!stop.load()) {
        const uint64_t i = rng() % 200;
        switch (rng() % 4) {
          case 0:
          case 1: put_range(s, i, i + 1 + rng() % 3, page); break;
          case 2:
            if (read_check(s, i, page) < 0) ++wrong;
            break;
          default: s.remove(0, key_of(i));
        }
        ++ops;
      }
    });
  }
  std::this_thread::sleep_for(std::chrono::milliseconds(1500));
  stop = true;
  for (auto& t : ts) t.join();
  EXPECT_EQ(wrong.load(), 0);
  EXPECT_GT(ops.load(), 50u);
  const auto st = s.stats();
  EXPECT_EQ(st.in_flight_writes, 0u);
  EXPECT_EQ(st.write_queue_depth, 0u);
  EXPECT_EQ(st.kinds[0].slots_used, st.kinds[0].entries) << "a slot leaked";
  EXPECT_GT(st.gc_reclaims, 0u);
}

TEST(Store, CorruptionUnderALiveStoreIsAMissNeverWrongBytes) {
  // verify_stage 0: CRC on the reading thread; 1: on the verify stage (also with 2 readers);
  // -1 with one read thread: the staged default. Batched reads exercise the overlap.
  for (const auto [stage, readers] : {std::pair{0, 2u}, std::pair{1, 2u}, std::pair{-1, 1u}}) {
    TempDir d;
    const size_t page = 6000;
    StoreConfig c = store_cfg({d.path}, page, 32);
    c.verify_stage = stage;
    c.read_threads = readers;
    Store s(c);
    put_range(s, 0, 32, page);
    const SlabFile& f = s.slab(0, 0);
    std::mt19937_64 rng(42);
    int misses = 0;
    for (int trial = 0; trial < 200; ++trial) {
      const uint64_t slot = rng() % 32;
      const uint64_t off = f.slot_offset(slot) + rng() % slot_bytes_for(page);
      uint8_t b = static_cast<uint8_t>(rng() | 1);
      if (rng() % 2) b = peek(f.path(), off) ^ static_cast<uint8_t>(1u << (rng() % 8));
      poke(f.path(), off, &b, 1);
      if (trial % 2 == 0) {
        for (uint64_t i = 0; i < 32; ++i) {
          const int r = read_check(s, i, page);
          ASSERT_GE(r, 0) << "wrong bytes for key " << i << " at trial " << trial;
          misses += r == 0;
        }
      } else {  // one batch: half into plain buffers, half into slot buffers
        std::vector<std::vector<uint8_t>> plain(32);
        std::vector<SlotBufferPtr> slots(32);
        std::vector<GetItem> gets;
        for (uint64_t i = 0; i < 32; ++i) {
          if (i % 2) {
            slots[i] = s.make_buffer(0);
            gets.push_back(GetItem{key_of(i), slots[i]->data(), slots[i]->size(), true});
          } else {
            plain[i].resize(page);
            gets.push_back(GetItem{key_of(i), plain[i].data(), page, false});
          }
        }
        const auto r = s.submit_get(0, std::move(gets))->wait();
        for (uint64_t i = 0; i < 32; ++i) {
          if (r[i] < 0) {
            ++misses;
            continue;
          }
          const uint8_t* p = i % 2 ? slots[i]->data() + kSlotHeaderBytes : plain[i].data();
          ASSERT_TRUE(content_ok(i, p, static_cast<size_t>(r[i]), page))
              << "wrong bytes for key " << i << " at trial " << trial << ", stage " << stage;
        }
      }
      put_range(s, 0, 32, page);  // re-store what went missing
    }
    EXPECT_GT(misses, 0);
    EXPECT_GT(s.stats().verify_failures, 0u);
    const auto st = s.stats();
    EXPECT_EQ(st.in_flight_reads, 0u);
    EXPECT_EQ(st.kinds[0].slots_used, st.kinds[0].entries);
  }
}

TEST(Store, TruncatedSlabReadsAsMissesThenLoadRecovers) {
  TempDir d;
  const size_t page = 6000;
  std::string path;
  {
    Store s(store_cfg({d.path}, page, 16));  // 10 of 16 used: below the GC threshold
    put_range(s, 0, 10, page);
    path = s.slab(0, 0).path();
    ASSERT_EQ(::truncate(path.c_str(), static_cast<off_t>(4096 + 5 * slot_bytes_for(page) + 100)), 0);
    int hits = 0;
    for (uint64_t i = 0; i < 10; ++i) {
      const int r = read_check(s, i, page);
      ASSERT_GE(r, 0);
      hits += r;
    }
    EXPECT_EQ(hits, 5);  // keys 0-4 live in the whole slots 0-4
  }
  Store s(store_cfg({d.path}, page, 16, ColdStart::kLoad));
  EXPECT_EQ(fs::file_size(path), 4096 + 16 * slot_bytes_for(page));  // preallocated again
  // Slots 0-4 are whole; slot 5 kept its header (the scan reads headers only) but not its
  // payload, so it may be indexed and then reads as a miss.
  EXPECT_GE(s.stats().kinds[0].entries, 5u);
  EXPECT_LE(s.stats().kinds[0].entries, 6u);
  int hits = 0;
  for (uint64_t i = 0; i < 10; ++i) {
    const int r = read_check(s, i, page);
    ASSERT_GE(r, 0);
    hits += r;
  }
  EXPECT_EQ(hits, 5);
  EXPECT_EQ(s.stats().kinds[0].entries, 5u);
}

TEST(Store, BadConfigIsAnErrorNamingTheValue) {
  TempDir d;
  StoreConfig c = store_cfg({d.path}, 4000, 4);
  c.budget_bytes = 1000;
  try {
    Store s(c);
    FAIL();
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("1000"), std::string::npos) << e.what();
  }
  // A budget whose slots one slab file cannot index (issue 32): one line naming budget_bytes,
  // its value and the valid range; nothing is created.
  c = store_cfg({d.path}, 4000, 4);
  c.budget_bytes = uint64_t{1} << 62;
  try {
    Store s(c);
    FAIL();
  } catch (const std::invalid_argument& e) {
    const std::string m = e.what();
    EXPECT_NE(m.find("budget_bytes=4611686018427387904 gives kind 0 1125899906842623 slots of "
                     "4096 bytes per drive, more than the 4294967295 one slab file holds: "
                     "budget_bytes must be in [8192, 17592186048511] for these kinds and 1 drive"),
              std::string::npos) << m;
    EXPECT_EQ(m.find('\n'), std::string::npos) << m;
    EXPECT_FALSE(std::filesystem::exists(d.path + "/unit.kind0.slab"));
  }
  c = store_cfg({d.path}, 4000, 4);
  c.gc_low = 0.95;
  EXPECT_THROW(Store{c}, std::invalid_argument);
  c = store_cfg({d.path}, 4000, 4);
  c.dirs = {d.path + "/missing"};
  EXPECT_THROW(Store{c}, std::system_error);
  c = store_cfg({d.path}, 4000, 4);
  c.name = "a/b";
  EXPECT_THROW(Store{c}, std::invalid_argument);
}

TEST(Store, BudgetSplitsAcrossKindsAndDrives) {
  TempDir d1, d2;
  StoreConfig c;
  c.dirs = {d1.path, d2.path};
  c.kinds = {KindConfig{4096 - 64, 3.0}, KindConfig{2 * 4096 - 64, 1.0}};
  c.budget_bytes = 4 * (4096 + 30 * 4096);
  Store s(c);
  const auto st = s.stats();
  // kind 0: 3/4 of the budget = 1.5 * (4096 + 30*4096) per drive -> 45 slots + change
  EXPECT_EQ(st.kinds[0].slots_total, 2u * ((3 * (4096 + 30 * 4096) / 2 - 4096) / 4096));
  EXPECT_EQ(st.kinds[1].slots_total, 2u * (((4096 + 30 * 4096) / 2 - 4096) / 8192));
  EXPECT_TRUE(fs::exists(d1.path + "/vitrify.kind1.slab"));
  EXPECT_TRUE(fs::exists(d2.path + "/vitrify.kind0.slab"));
}

// Crash between data write and index entry: kill a child at random points, then load.
TEST(Store, KillChildAtRandomPointsThenLoadIsExactOrMiss) {
  TempDir d;
  const size_t page = 10000;
  const int trials = 12;
  std::mt19937_64 rng(7);
  uint64_t next = 0;
  std::set<uint64_t> acked_all;
  for (int t = 0; t < trials; ++t) {
    int fds[2];
    ASSERT_EQ(::pipe(fds), 0);
    const uint64_t base = next;
    const pid_t pid = ::fork();
    ASSERT_GE(pid, 0);
    if (pid == 0) {
      ::close(fds[0]);
      try {
        Store s(store_cfg({d.path}, page, 64, t == 0 ? ColdStart::kClear : ColdStart::kLoad));
        for (uint64_t i = base;; ++i) {
          const auto r = put_range(s, i, i + 1, page);
          if (r[0] == static_cast<int64_t>(PutResult::kStored)) {
            if (::write(fds[1], &i, sizeof i) != sizeof i) ::_exit(3);
          }
        }
      } catch (...) {
        ::_exit(2);
      }
    }
    ::close(fds[1]);
    std::this_thread::sleep_for(std::chrono::microseconds(2000 + rng() % 40000));
    ::kill(pid, SIGKILL);
    int status = 0;
    ::waitpid(pid, &status, 0);
    ASSERT_TRUE(WIFSIGNALED(status)) << "child exited early with " << WEXITSTATUS(status);
    std::vector<uint64_t> acked;
    uint64_t v;
    while (::read(fds[0], &v, sizeof v) == sizeof v) acked.push_back(v);
    ::close(fds[0]);
    next = base + acked.size() + 1000;
    Store s(store_cfg({d.path}, page, 64, ColdStart::kLoad));
    // GC may have reclaimed older keys; the last acknowledged ones are always there.
    for (size_t j = acked.size() > 5 ? acked.size() - 5 : 0; j < acked.size(); ++j)
      EXPECT_EQ(read_check(s, acked[j], page), 1) << "acknowledged key lost: " << acked[j];
    for (uint64_t i = 0; i < base + acked.size() + 2; i += (i < base ? 7 : 1))
      ASSERT_GE(read_check(s, i, page), 0) << "wrong bytes for key " << i;
    const auto st = s.stats();
    EXPECT_EQ(st.kinds[0].entries, st.kinds[0].slots_used);
  }
}

// ------------------------------------------------------------------------------- parallel load
namespace {
std::vector<std::tuple<uint64_t, Key, uint32_t, uint32_t>> flat(const std::vector<ScannedSlot>& v) {
  std::vector<std::tuple<uint64_t, Key, uint32_t, uint32_t>> out;
  for (const auto& s : v) out.emplace_back(s.slot, s.key, s.payload_len, s.seq);
  return out;
}
}  // namespace

TEST(Slab, ParallelScanEqualsSerialScanForSmallAndLargeSlots) {
  TempDir d;
  // 4 KiB slots take the batched path (many headers per read); 200 KiB slots one read each.
  for (const uint64_t slot_bytes : {uint64_t{4096}, uint64_t{200 * 1024}}) {
    const uint64_t count = 1100;
    const std::string path = d.path + "/scan" + std::to_string(slot_bytes) + ".slab";
    std::set<uint64_t> written;
    {
      SlabFile f(path, geo(slot_bytes, count), ColdStart::kClear, DirectIo::kAuto);
      vitrify::AlignedBuffer b(kBlock);
      for (uint64_t s = 0; s < count; s += 1 + s % 3) {
        const size_t n = 1 + s % 200;
        fill(s, b.data() + kSlotHeaderBytes, n);
        f.write_aligned(s, key_of(s), b.data(), n, static_cast<uint32_t>(5000 - s));
        written.insert(s);
      }
      f.sync();
    }
    // A torn header in the middle of a worker's range is skipped by every worker count.
    const uint64_t torn = *std::next(written.begin(), static_cast<long>(written.size() / 2));
    const uint8_t junk = 0xEE;
    poke(path, kFileHeaderBytes + torn * slot_bytes + 30, &junk, 1);
    written.erase(torn);
    SlabFile f(path, geo(slot_bytes, count), ColdStart::kLoad, DirectIo::kAuto);
    ASSERT_FALSE(f.formatted());
    const auto serial = f.scan(1);
    ASSERT_EQ(serial.size(), written.size()) << slot_bytes;
    size_t i = 0;
    for (uint64_t s : written) {
      EXPECT_EQ(serial[i].slot, s);
      EXPECT_EQ(serial[i].key, key_of(s));
      EXPECT_EQ(serial[i].payload_len, 1 + s % 200);
      EXPECT_EQ(serial[i].seq, 5000 - s);
      ++i;
    }
    for (unsigned t : {2u, 3u, 8u, 64u}) EXPECT_EQ(flat(f.scan(t)), flat(serial)) << t << " threads";
    EXPECT_THROW(f.scan(0), std::invalid_argument);
  }
}

TEST(Store, LoadOfManySmallSlotsRebuildsExactlyTheLiveSetInParallel) {
  TempDir d;
  const size_t page = 4000;  // 4 KiB slots
  const uint64_t n = 20000;
  std::set<uint64_t> live;
  {
    StoreConfig c = store_cfg({d.path}, page, 24000);
    c.write_threads = 2;
    c.queue_capacity = 512;
    Store s(c);
    std::vector<PutItem> items;
    for (uint64_t i = 0; i < n; ++i) {
      auto b = s.make_buffer(0);
      const size_t len = len_of(i, page);
      fill(i, b->data() + kSlotHeaderBytes, len);
      items.push_back(PutItem{key_of(i), b, len});
    }
    for (auto v : s.submit_put(0, std::move(items))->wait())
      ASSERT_EQ(v, static_cast<int64_t>(PutResult::kStored));
    for (uint64_t i = 0; i < n; ++i) live.insert(i);
    for (uint64_t i = 0; i < n; i += 37) {
      ASSERT_TRUE(s.remove(0, key_of(i)));
      live.erase(i);
    }
  }
  for (unsigned threads : {0u, 1u}) {
    StoreConfig c = store_cfg({d.path}, page, 24000, ColdStart::kLoad);
    c.load_threads = threads;
    Store s(c);
    const auto st = s.stats();
    EXPECT_EQ(st.loaded_entries, live.size()) << threads;
    EXPECT_EQ(st.kinds[0].slots_used, live.size());
    size_t wrong = 0;
    for (uint64_t i = 0; i < n; ++i) wrong += s.exists(0, key_of(i)) != (live.count(i) == 1);
    EXPECT_EQ(wrong, 0u) << threads << " load threads";
    for (uint64_t i = 1; i < n; i += 997) EXPECT_EQ(read_check(s, i, page), live.count(i) ? 1 : 0) << i;
  }
  StoreConfig bad = store_cfg({d.path}, page, 24000, ColdStart::kLoad);
  bad.load_threads = 100000;
  EXPECT_THROW(Store{bad}, std::invalid_argument);
}

// ------------------------------------------------------------------------------- clear
TEST(Store, ClearDropsEverythingKeepsFilesAndThreadsAndLoadSeesOnlyLaterPuts) {
  TempDir d1, d2;
  const size_t page = 9000;
  {
    Store s(store_cfg({d1.path, d2.path}, page, 20));
    put_range(s, 0, 30, page);
    ASSERT_TRUE(s.remove(0, key_of(4)));
    const uint32_t id0 = s.slab(0, 0).slab_id(), id1 = s.slab(0, 1).slab_id();
    s.clear();
    EXPECT_EQ(s.slab(0, 0).slab_id(), id0 + 1);  // exactly as cold start `clear` (D7)
    EXPECT_EQ(s.slab(0, 1).slab_id(), id1 + 1);
    auto st = s.stats();
    EXPECT_EQ(st.clears, 1u);
    EXPECT_EQ(st.kinds[0].entries, 0u);
    EXPECT_EQ(st.kinds[0].slots_used, 0u);
    EXPECT_TRUE(s.slab(0, 0).scan().empty());
    EXPECT_TRUE(s.slab(0, 1).scan().empty());
    for (uint64_t i = 0; i < 30; ++i) EXPECT_EQ(read_check(s, i, page), 0) << i;
    // The same threads store again; an old key is a new put, not a duplicate.
    for (auto v : put_range(s, 0, 2, page)) EXPECT_EQ(v, static_cast<int64_t>(PutResult::kStored));
    for (auto v : put_range(s, 100, 110, page)) EXPECT_EQ(v, static_cast<int64_t>(PutResult::kStored));
    for (uint64_t i : {0, 1, 100, 105, 109}) EXPECT_EQ(read_check(s, i, page), 1) << i;
    st = s.stats();
    EXPECT_EQ(st.kinds[0].entries, 12u);
    EXPECT_EQ(st.kinds[0].slots_used, 12u);
    // Every slot of the pool is usable again: fill it to the GC mark without a failure.
    EXPECT_EQ(st.put_failures, 0u);
  }
  Store s(store_cfg({d1.path, d2.path}, page, 20, ColdStart::kLoad));
  EXPECT_EQ(s.stats().loaded_entries, 12u);
  for (uint64_t i = 0; i < 110; ++i)
    EXPECT_EQ(read_check(s, i, page), (i < 2 || i >= 100) ? 1 : 0) << i;
  s.close();
  EXPECT_NO_THROW(s.clear());  // closed: nothing to do
}

TEST(Store, ClearCancelsQueuedPutsAndRacesWithTrafficWithoutLeaks) {
  TempDir d;
  const size_t page = 4000;
  StoreConfig c = store_cfg({d.path}, page, 400);
  c.write_threads = 1;
  c.read_threads = 1;  // reads go through the verify stage (verify_stage -1)
  c.max_batch = 1;
  c.queue_capacity = 1000;
  Store s(c);
  {  // a queue of puts, then clear: every put is acknowledged, none survives
    std::vector<PutItem> items;
    for (uint64_t i = 0; i < 200; ++i) {
      auto b = s.make_buffer(0);
      fill(i, b->data() + kSlotHeaderBytes, len_of(i, page));
      items.push_back(PutItem{key_of(i), b, len_of(i, page)});
    }
    Ticket t = s.submit_put(0, std::move(items));
    s.clear();
    size_t cancelled = 0;
    for (auto v : t->wait()) {
      EXPECT_TRUE(v == static_cast<int64_t>(PutResult::kStored) ||
                  v == static_cast<int64_t>(PutResult::kCancelled)) << v;
      cancelled += v == static_cast<int64_t>(PutResult::kCancelled);
    }
    const auto st = s.stats();
    EXPECT_EQ(st.in_flight_writes, 0u);
    EXPECT_EQ(st.write_queue_depth, 0u);
    EXPECT_EQ(st.kinds[0].entries, 0u);
    EXPECT_EQ(st.kinds[0].slots_used, 0u);
    for (uint64_t i = 0; i < 200; i += 17) EXPECT_EQ(read_check(s, i, page), 0) << i;
    std::printf("clear cancelled %zu of 200 queued puts\n", cancelled);
  }
  // Puts, reads, deletes and clears from several threads for a bounded time.
  std::atomic<bool> stop{false};
  std::atomic<int> wrong{0};
  std::vector<std::thread> ts;
  for (int t = 0; t < 4; ++t)
    ts.emplace_back([&, t] {
      std::mt19937_64 rng(t + 10);
      while (!stop.load()) {
        const uint64_t i = rng() % 300;
        switch (rng() % 3) {
          case 0: put_range(s, i, i + 1 + rng() % 4, page); break;
          case 1:
            if (read_check(s, i, page) < 0) ++wrong;
            break;
          default: s.remove(0, key_of(i));
        }
      }
    });
  ts.emplace_back([&] {
    while (!stop.load()) {
      s.clear();
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
  });
  std::this_thread::sleep_for(std::chrono::milliseconds(1000));
  stop = true;
  for (auto& t : ts) t.join();
  EXPECT_EQ(wrong.load(), 0);
  const auto st = s.stats();
  EXPECT_GT(st.clears, 2u);
  EXPECT_EQ(st.in_flight_writes, 0u);
  EXPECT_EQ(st.write_queue_depth, 0u);
  EXPECT_EQ(st.read_queue_depth, 0u);
  EXPECT_EQ(st.kinds[0].slots_used, st.kinds[0].entries) << "a slot leaked";
  // Every slot is accounted for: fill the free ones (below the GC mark) without a failure.
  const uint64_t room = static_cast<uint64_t>(0.85 * static_cast<double>(st.kinds[0].slots_total)) -
                        std::min<uint64_t>(st.kinds[0].slots_used, 340);
  for (auto v : put_range(s, 10000, 10000 + room, page))
    EXPECT_NE(v, static_cast<int64_t>(PutResult::kFull));
}

TEST(Store, InFlightWritesCountsFromSubmitToAcknowledgement) {
  TempDir d;
  const size_t page = 4000;
  StoreConfig c = store_cfg({d.path}, page, 200);
  c.write_threads = 1;
  c.max_batch = 1;  // one fdatasync per put: the queue drains slowly enough to watch
  c.queue_capacity = 1000;
  Store s(c);
  const uint64_t n = 100;
  std::vector<PutItem> items;
  for (uint64_t i = 0; i < n; ++i) {
    auto b = s.make_buffer(0);
    items.push_back(PutItem{key_of(i), b, 100});
  }
  Ticket t = s.submit_put(0, std::move(items));
  // Not waited yet: every put is either acknowledged (and counted in spills) or in flight,
  // queued ones included — at every instant (stats() is one consistent snapshot).
  uint64_t polls = 0, seen_in_flight = 0;
  while (!t->done()) {
    const auto st = s.stats();
    ASSERT_EQ(st.spills + st.in_flight_writes, n) << "after " << polls << " polls";
    seen_in_flight = std::max(seen_in_flight, st.in_flight_writes);
    ++polls;
  }
  t->wait();
  // Acknowledged: no longer counted, at once (not decremented late).
  const auto st = s.stats();
  EXPECT_EQ(st.in_flight_writes, 0u);
  EXPECT_EQ(st.spills, n);
  std::printf("%lu polls, up to %lu puts in flight\n", static_cast<unsigned long>(polls),
              static_cast<unsigned long>(seen_in_flight));
  // Duplicates never count as in flight.
  std::vector<PutItem> dup{PutItem{key_of(0), s.make_buffer(0), 100}};
  Ticket t2 = s.submit_put(0, std::move(dup));
  EXPECT_EQ(s.stats().in_flight_writes, 0u);
  EXPECT_EQ(t2->wait()[0], static_cast<int64_t>(PutResult::kDuplicate));
}

// ------------------------------------------------------------------------------- cold start log
namespace {
std::vector<std::pair<int, std::string>>* g_log = nullptr;
void capture(int level, const char* msg) noexcept {
  if (g_log) g_log->emplace_back(level, msg);
}
struct LogCapture {
  std::vector<std::pair<int, std::string>> lines;
  LogCapture() {
    g_log = &lines;
    vitrify::log::set_sink(&capture, vitrify::log::kDebug);
  }
  ~LogCapture() {
    vitrify::log::set_sink(nullptr, vitrify::log::kWarning);
    g_log = nullptr;
  }
  int count(int level, const std::string& part) const {
    int n = 0;
    for (const auto& [l, m] : lines) n += l == level && m.find(part) != std::string::npos;
    return n;
  }
};
}  // namespace

TEST(Store, LoadOnFirstStartLogsInfoAndAnUnusableFileWarns) {
  TempDir d;
  const std::string path = d.path + "/unit.kind0.slab";
  {
    LogCapture log;
    Store s(store_cfg({d.path}, 4000, 8, ColdStart::kLoad));
    EXPECT_EQ(log.count(vitrify::log::kInfo, path + " is new"), 1);
    EXPECT_EQ(log.count(vitrify::log::kWarning, path), 0);
  }
  const uint8_t junk = 0x11;
  poke(path, 4, &junk, 1);  // the magic stays, the header no longer verifies
  try {  // load refuses it (its pages cannot be trusted); it is never wiped silently
    Store s(store_cfg({d.path}, 4000, 8, ColdStart::kLoad));
    ADD_FAILURE() << "load of a slab with a damaged header went on";
  } catch (const std::exception& e) {
    EXPECT_NE(std::string(e.what()).find("its header is damaged"), std::string::npos) << e.what();
  }
  {  // clear wipes it (it is vitrify's own file)
    Store s(store_cfg({d.path}, 4000, 8, ColdStart::kClear));
  }
  const std::vector<uint8_t> zeros(4096, 0);
  poke(path, 0, zeros.data(), zeros.size());  // a creation that stopped before its header
  {
    LogCapture log;
    Store s(store_cfg({d.path}, 4000, 8, ColdStart::kLoad));
    EXPECT_EQ(log.count(vitrify::log::kWarning, path + " has a zeroed header"), 1);
    EXPECT_EQ(log.count(vitrify::log::kInfo, path + " is new"), 0);
  }
}
