// The Region class itself on the fake driver (tests/cpp/fake_cuda/vmm.cpp emulates VMM on host
// memory), so reservation, mapping, unwinding and the C ABI run on machines without a GPU.
// R<n> = invariant n in csrc/src/region/DESIGN.md.
#include <dlfcn.h>
#include <gtest/gtest.h>

#include <cstdlib>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

#include "fake_cuda/use_fake.hpp"
#include "vitrify/driver.hpp"
#include "vitrify/region.hpp"
#include "vitrify/snapshot.hpp"

using vitrify::Region;
using vitrify::region::kGiB;
using vitrify::region::kMiB;

namespace {
constexpr uint64_t G = 2 * kMiB;

struct Env {
  Env(const char* k, const char* v) : key(k) { ::setenv(k, v, 1); }
  ~Env() { ::unsetenv(key); }
  const char* key;
};

using Counts = vitrify::test::FakeCounts;
Counts counts() { return vitrify::test::fake_counts(); }

uint64_t free_base() {  // a base nobody else in this process uses
  static uint64_t next = 0x500000000000ull;
  next += 64 * kGiB;
  return next;
}
}  // namespace

TEST(RegionFake, ExactBaseAndRoundedSize) {  // R2, R3
  ASSERT_NE(vitrify::test::kUseFakeDriver, nullptr);  // the fake driver is selected
  const uint64_t base = free_base();
  Region r(base, 10 * kMiB + 1, 0);
  EXPECT_EQ(r.base(), base);
  EXPECT_EQ(r.size(), 12 * kMiB);
  EXPECT_EQ(r.granularity(), G);
  EXPECT_EQ(r.describe(), vitrify::region::format_range(base, base + 12 * kMiB) + " on device 0");
}

TEST(RegionFake, TakenBaseIsAClearErrorAndLeavesNothingBehind) {  // R2
  const uint64_t base = free_base();
  Region a(base, 1 * kGiB, 0);
  const Counts before = counts();
  try {
    Region b(base + 512 * kMiB, 1 * kGiB, 0);  // overlaps a: the fake returns another address
    FAIL() << "no throw";
  } catch (const vitrify::AddressUnavailable& e) {
    const std::string m = e.what();
    EXPECT_NE(m.find(vitrify::region::format_range(base + 512 * kMiB, base + 512 * kMiB + kGiB)),
              std::string::npos) << m;
    EXPECT_NE(m.find("the driver returned [0x"), std::string::npos) << m;
  }
  EXPECT_EQ(counts(), before);  // the stray reservation was freed
}

TEST(RegionFake, ArgumentsAreValidated) {
  EXPECT_THROW(Region(free_base() + 4096, kGiB, 0), std::invalid_argument);  // unaligned
  EXPECT_THROW(Region(free_base(), 0, 0), std::invalid_argument);
  EXPECT_THROW(Region(free_base(), kGiB, 1), std::invalid_argument);  // one fake device
  EXPECT_THROW(Region(free_base(), kGiB, -1), std::invalid_argument);
}

TEST(RegionFake, SearchTakesTheFirstFreeCandidate) {  // R2
  Region a(std::nullopt, kGiB, 0);
  EXPECT_EQ(a.base(), vitrify::region::kSearchFirst);
  Region b(std::nullopt, kGiB, 0);  // the first candidate is taken by a
  EXPECT_EQ(b.base(), vitrify::region::kSearchFirst + vitrify::region::kTiB);
}

TEST(RegionFake, AllocateWriteReadFree) {  // R1, R6
  const Counts before = counts();
  {
    Region r(free_base(), kGiB, 0);
    const uint64_t a = r.allocate(3 * kMiB);
    const uint64_t b = r.allocate(1);
    EXPECT_EQ(a, r.base());
    EXPECT_EQ(b, r.base() + 4 * kMiB);
    std::vector<char> src(3 * kMiB), back(3 * kMiB);
    for (size_t i = 0; i < src.size(); ++i) src[i] = char(i * 7);
    r.write(a, src.data(), src.size());
    r.read(a, back.data(), back.size());
    EXPECT_EQ(src, back);
    EXPECT_THROW(r.write(a + 4 * kMiB - 1, src.data(), 2), std::invalid_argument);  // past a's end
    EXPECT_THROW(r.read(r.base() + 100 * kMiB, back.data(), 1), std::invalid_argument);
    r.free(a);
    EXPECT_THROW(r.read(a, back.data(), 1), std::invalid_argument);  // freed
    const uint64_t c = r.allocate(kMiB);
    EXPECT_EQ(c, r.base() + 6 * kMiB);  // never reused
    EXPECT_THROW(r.free(a), std::invalid_argument);
    EXPECT_THROW(r.free(r.base() - G), std::invalid_argument);
    const auto s = r.stats();
    EXPECT_EQ(s.layout.live_allocations, 2u);
    EXPECT_EQ(s.layout.chunks, 2u);
    EXPECT_EQ(counts().mappings, before.mappings + 2);
  }
  EXPECT_EQ(counts(), before);  // close released every mapping, handle and the reservation
}

TEST(RegionFake, OutOfSpaceIsNotAFallback) {  // R5
  Region r(free_base(), 8 * kMiB, 0);
  r.allocate(6 * kMiB);
  const Counts before = counts();
  EXPECT_THROW(r.allocate(4 * kMiB), vitrify::OutOfSpace);
  EXPECT_EQ(counts(), before);  // no cuMemAlloc happened
  EXPECT_EQ(r.offset(), 6 * kMiB);
}

TEST(RegionFake, StopRoutesToOrdinaryMemoryWithoutMovingTheCursor) {  // R8
  Region r(free_base(), kGiB, 0);
  r.allocate(G);
  EXPECT_FALSE(r.stop());
  EXPECT_TRUE(r.stopped());
  const uint64_t p = r.allocate(G);
  EXPECT_FALSE(r.contains(p));
  EXPECT_TRUE(r.owns(p));
  EXPECT_EQ(r.offset(), G);
  const char msg[] = "outside";
  r.write(p, msg, sizeof msg);
  EXPECT_EQ(r.stats().fallback_live, 1u);
  EXPECT_TRUE(r.resume());
  EXPECT_EQ(r.allocate(G), r.base() + G);
  r.free(p);  // a fallback allocation is freed after resume too
  EXPECT_EQ(r.stats().fallback_live, 0u);
  EXPECT_FALSE(r.owns(p));
}

TEST(RegionFake, FailedMapUnwindsCleanly) {  // R9
  Region r(free_base(), kGiB, 0);
  const Counts before = counts();
  for (const char* entry : {"cuMemCreate", "cuMemMap", "cuMemSetAccess"}) {
    Env fail("FAKE_CUDA_FAIL", entry);
    EXPECT_THROW(r.allocate(G), vitrify::CudaError) << entry;
    EXPECT_EQ(counts(), before) << entry;
    EXPECT_EQ(r.offset(), 0u) << entry;
  }
  EXPECT_EQ(r.allocate(G), r.base());  // and works again afterwards
}

TEST(RegionFake, PreallocateIsAllOrNothing) {  // R7, R9
  Region r(free_base(), 4 * kGiB, 0);
  const Counts before = counts();
  {
    Env mem("FAKE_CUDA_DEVICE_MEMORY", std::to_string(before.physical + 5 * G).c_str());
    EXPECT_THROW(r.preallocate(8 * G, 2 * G), vitrify::CudaOutOfMemory);  // the 3rd chunk fails
    EXPECT_EQ(counts(), before);
    EXPECT_EQ(r.stats().layout.mapped_bytes, 0u);
  }
  EXPECT_EQ(r.preallocate(8 * G, 2 * G), 8 * G);
  EXPECT_EQ(counts().mappings, before.mappings + 4);
  const auto handles = counts().handles;
  for (int i = 0; i < 8; ++i) r.allocate(G);  // a pointer bump: no driver object created
  EXPECT_EQ(counts().handles, handles);
  EXPECT_EQ(r.preallocate(8 * G), 0u);
}

TEST(RegionFake, SetOffsetAndCheckpoints) {  // R4, R10
  Region r(free_base(), kGiB, 0);
  r.allocate(G);
  EXPECT_EQ(r.checkpoint("weights"), G);
  r.set_offset(10 * G);
  EXPECT_EQ(r.allocate(G), r.base() + 10 * G);
  EXPECT_THROW(r.set_offset(2 * G), std::invalid_argument);
  EXPECT_EQ(r.checkpoint("warmup"), 11 * G);
  ASSERT_EQ(r.checkpoints().size(), 2u);
}

TEST(RegionFake, ClosedRegionRefusesWork) {
  Region r(free_base(), kGiB, 0);
  r.allocate(G);
  r.close();
  r.close();  // idempotent
  EXPECT_TRUE(r.closed());
  EXPECT_THROW(r.allocate(G), vitrify::Error);
  EXPECT_EQ(r.stats().layout.mapped_bytes, 0u);
}

TEST(RegionFake, ThreadsGetDistinctAddresses) {  // R1 under concurrency
  Region r(free_base(), 4 * kGiB, 0);
  constexpr int kThreads = 4, kEach = 100;
  std::vector<std::vector<uint64_t>> got(kThreads);
  std::vector<std::thread> ts;
  for (int t = 0; t < kThreads; ++t)
    ts.emplace_back([&, t] {
      for (int i = 0; i < kEach; ++i) {
        const uint64_t p = r.allocate(G);
        got[t].push_back(p);
        if (i % 3 == 0) r.free(p);
      }
    });
  for (auto& t : ts) t.join();
  std::vector<uint64_t> all;
  for (auto& g : got) all.insert(all.end(), g.begin(), g.end());
  std::sort(all.begin(), all.end());
  EXPECT_EQ(std::adjacent_find(all.begin(), all.end()), all.end());
  EXPECT_EQ(r.offset(), uint64_t(kThreads * kEach) * G);
}

TEST(RegionFake, CAbiRoutesToTheActiveRegion) {  // R11
  Region r(free_base(), kGiB, 0);
  EXPECT_EQ(vitrify_region_malloc(G, 0, nullptr), nullptr);  // nothing active
  EXPECT_NE(vitrify::region::last_abi_error().find("no active region for device 0"), std::string::npos);
  vitrify::region::set_active(&r, 0);
  void* p = vitrify_region_malloc(3 * kMiB, 0, nullptr);
  EXPECT_EQ(reinterpret_cast<uint64_t>(p), r.base());
  EXPECT_EQ(vitrify::region::last_abi_error(), "");
  vitrify::region::set_active(nullptr, 0);
  vitrify_region_free(p, 3 * kMiB, 0, nullptr);  // found by address, not by the active region
  EXPECT_EQ(r.stats().layout.live_allocations, 0u);
  vitrify_region_free(p, 3 * kMiB, 0, nullptr);  // unknown now: logged, no crash
  EXPECT_NE(vitrify::region::last_abi_error().find("belongs to no live region"), std::string::npos);
  vitrify::region::set_active(&r, 0);
  EXPECT_EQ(vitrify_region_malloc(2 * kGiB, 0, nullptr), nullptr);  // full: no fallback
  EXPECT_NE(vitrify::region::last_abi_error().find("region full"), std::string::npos);
  void* q = vitrify_region_malloc(G, 0, nullptr);
  EXPECT_EQ(vitrify::region::last_abi_error(), "");  // a successful malloc clears it
  EXPECT_NE(vitrify_region_malloc(2 * kGiB, 0, nullptr), q);
  vitrify_region_free(q, G, 0, nullptr);  // a successful free keeps the reason of the failure
  EXPECT_NE(vitrify::region::last_abi_error().find("region full"), std::string::npos);
  r.close();  // leaves the registry: the device has no active region any more
  EXPECT_EQ(vitrify::region::active(0), nullptr);
  EXPECT_THROW(vitrify::region::set_active(&r, 0), std::invalid_argument);
}

TEST(RegionFake, AllocationsSkipTheWindowGuardAndMapNothingThere) {  // R13
  const uint64_t base = free_base() + vitrify::region::kGuardPhase;  // a default-phase base
  Region r(base, 4 * kGiB, 0);
  const Counts before = counts();
  r.set_offset(vitrify::region::kGuardPhase - G);
  const uint64_t p = r.allocate(2 * G);  // would cover the window start at base + 2 GiB
  EXPECT_EQ(p, base + vitrify::region::kGuardPhase + vitrify::region::kGuardBytes);
  EXPECT_EQ(p % (4 * kGiB), vitrify::region::kGuardBytes);  // 2 MiB past a 4 GiB window start
  EXPECT_EQ(counts().mappings, before.mappings + 1);  // one chunk, at p: the guard stays unmapped
  const auto live = r.live_allocations();
  ASSERT_EQ(live.size(), 1u);
  EXPECT_EQ(live[0].offset, p - base);
  EXPECT_EQ(r.offset(), p - base + 2 * G);
  r.free(p);
}

// ScratchSpan (snapshot tests and benchmarks) holds its reservation and mappings through the
// region's VMM owners: one mapping per mapped run, everything returned when it goes.
TEST(RegionFake, ScratchSpanMapsEachRunOnceAndReturnsEverything) {  // R9
  const Counts before = counts();
  {
    const std::vector<bool> mapped = {true, true, false, true, false, false, true, true};
    vitrify::snapshot::ScratchSpan s(0, mapped.size() * G, free_base(), mapped);
    EXPECT_EQ(s.granularity(), G);
    EXPECT_EQ(counts().reservations, before.reservations + 1);
    EXPECT_EQ(counts().mappings, before.mappings + 3);  // runs [0,2), [3,4), [6,8)
    std::vector<uint8_t> src(G, 0x5a), back(G, 0);
    s.write(3 * G, src.data(), src.size());
    s.read(3 * G, back.data(), back.size());
    EXPECT_EQ(back, src);
    EXPECT_THROW(s.write(7 * G + 1, src.data(), G), std::invalid_argument);  // leaves the span
    EXPECT_THROW(vitrify::snapshot::ScratchSpan(0, 3 * G, 0, {true, false}), std::invalid_argument);
  }
  EXPECT_EQ(counts(), before);
}

// Any granularity-aligned base is honoured: the reservation starts at the 1 GiB boundary at or
// below it (the driver honours hints with a 1 GiB alignment), the region starts at the base.
TEST(RegionFake, AGranuleAlignedBaseIsExact) {  // R2
  const uint64_t base = free_base() + 3 * G;
  Region r(base, 4 * kMiB, 0);
  EXPECT_EQ(r.base(), base);
  EXPECT_EQ(r.allocate(G), base);
  EXPECT_THROW(Region(base + 2 * G, G, 0), vitrify::AddressUnavailable);  // inside r's reservation
}

// R17: physical memory given back and taken again at the same addresses.
TEST(RegionFake, ReleasedMemoryComesBackAtTheSameAddressesWithItsBytes) {  // R17
  Region r(free_base(), kGiB, 0);
  ASSERT_EQ(r.preallocate(6 * G, 2 * G), 6 * G);  // three chunks of two granules
  const uint64_t a = r.allocate(2 * G), b = r.allocate(2 * G), c = r.allocate(2 * G);
  std::vector<uint8_t> pa(2 * G), pb(2 * G);
  for (size_t i = 0; i < pa.size(); ++i) pa[i] = uint8_t(i * 7 + 1), pb[i] = uint8_t(i * 13 + 5);
  r.write(a, pa.data(), pa.size());
  r.write(b, pb.data(), pb.size());
  const Counts before = counts();
  const auto cursor = r.offset();
  // the first chunk kept on the host, the second not: each chunk's physical memory goes
  EXPECT_EQ(r.release_memory(0, 2 * G, true), 2 * G);
  EXPECT_EQ(r.release_memory(2 * G, 2 * G, false), 2 * G);
  EXPECT_EQ(r.release_memory(0, 4 * G, true), 0u);  // released already: skipped
  EXPECT_EQ(counts().physical, before.physical - 4 * G);
  EXPECT_EQ(counts().mappings, before.mappings - 2);
  EXPECT_EQ(counts().reservations, before.reservations);  // the addresses stay reserved
  const auto st = r.stats();
  EXPECT_EQ(st.released_chunks, 2u);
  EXPECT_EQ(st.released_bytes, 4 * G);
  EXPECT_EQ(st.kept_bytes, 2 * G);
  EXPECT_EQ(st.layout.mapped_bytes, 2 * G);
  EXPECT_EQ(r.offset(), cursor);
  EXPECT_EQ(r.live_allocations().size(), 3u);
  const auto rel = r.released();
  ASSERT_EQ(rel.size(), 2u);
  EXPECT_TRUE(rel[0].offset == 0 && rel[0].size == 2 * G && rel[0].kept);
  EXPECT_TRUE(rel[1].offset == 2 * G && !rel[1].kept);
  // nothing reads or writes a released chunk
  std::vector<uint8_t> got(2 * G);
  EXPECT_THROW(r.read(a, got.data(), 16), std::invalid_argument);
  EXPECT_THROW(r.write(b + 8, pb.data(), 8), std::invalid_argument);
  r.read(c, got.data(), 16);  // the third chunk is untouched
  // back at the same addresses: the kept bytes, zeros where nothing was kept
  EXPECT_EQ(r.restore_memory(0, 6 * G), 4 * G);
  EXPECT_EQ(counts(), before);
  r.read(a, got.data(), got.size());
  EXPECT_EQ(got, pa);
  r.read(b, got.data(), got.size());
  EXPECT_EQ(got, std::vector<uint8_t>(2 * G, 0));
  EXPECT_EQ(r.stats().released_bytes, 0u);
  EXPECT_EQ(r.restore_memory(0, 6 * G), 0u);  // nothing released: nothing to do
}

TEST(RegionFake, AReleaseCoversWholeChunksOrNothing) {  // R17
  Region r(free_base(), kGiB, 0);
  ASSERT_EQ(r.preallocate(4 * G, 2 * G), 4 * G);
  r.allocate(4 * G);
  const Counts before = counts();
  for (auto [off, n] : {std::pair<uint64_t, uint64_t>{0, G}, {G, 2 * G}, {0, 6 * G}}) {
    try {
      r.release_memory(off, n, true);
      FAIL() << off << "+" << n;
    } catch (const std::invalid_argument& e) {
      const std::string m = e.what();
      EXPECT_TRUE(m.find("cuts the chunk") != std::string::npos ||
                  m.find("is in no chunk") != std::string::npos) << m;
    }
    EXPECT_EQ(counts(), before);
  }
  EXPECT_THROW(r.release_memory(0, 0, true), std::invalid_argument);
  EXPECT_THROW(r.release_memory(kGiB, 2 * G, true), std::invalid_argument);  // outside
  // a failing copy or unmap: the copy leaves everything mapped
  {
    Env fail("FAKE_CUDA_FAIL", "cuMemcpyDtoH");
    EXPECT_THROW(r.release_memory(0, 4 * G, true), vitrify::CudaError);
    EXPECT_EQ(counts(), before);
    EXPECT_EQ(r.stats().released_chunks, 0u);
  }
  // a failing map at restore: nothing is mapped, the chunks stay released with their copies
  ASSERT_EQ(r.release_memory(0, 4 * G, true), 4 * G);
  const Counts released = counts();
  {
    Env fail("FAKE_CUDA_FAIL_AFTER", "cuMemMap:1");
    EXPECT_THROW(r.restore_memory(0, 4 * G), vitrify::CudaError);
    EXPECT_EQ(counts(), released);
    EXPECT_EQ(r.stats().kept_bytes, 4 * G);
  }
  EXPECT_EQ(r.restore_memory(0, 4 * G), 4 * G);
  EXPECT_EQ(counts(), before);
}

TEST(RegionFake, ReleasedChunksAreNeitherAllocatedIntoNorLeakedAtClose) {  // R17, R6, R9
  const Counts start = counts();
  {
    Region r(free_base(), kGiB, 0);
    ASSERT_EQ(r.preallocate(4 * G, 2 * G), 4 * G);  // [0, 2G) and [2G, 4G), cursor 0
    const uint64_t a = r.allocate(2 * G);
    ASSERT_EQ(r.release_memory(2 * G, 2 * G, true), 2 * G);  // preallocated, unused
    EXPECT_THROW(r.allocate(2 * G), vitrify::Error);  // would land in it
    EXPECT_EQ(r.offset(), 2 * G);
    r.free(a);  // its chunk is mapped: released normally (R6)
    EXPECT_EQ(r.restore_memory(2 * G, 2 * G), 2 * G);
    EXPECT_EQ(r.allocate(2 * G), r.base() + 2 * G);
    ASSERT_EQ(r.release_memory(2 * G, 2 * G, true), 2 * G);  // released at close
  }
  EXPECT_EQ(counts(), start);
}
