// The region's pure bookkeeping (no driver): rounding, cursor policy, chunk liveness,
// checkpoints, the deterministic base search. R<n> = invariant n in csrc/src/region/DESIGN.md.
#include <gtest/gtest.h>

#include <random>
#include <set>
#include <string>

#include "vitrify/region.hpp"

using vitrify::region::candidate_bases;
using vitrify::region::kGiB;
using vitrify::region::kMiB;
using vitrify::region::kTiB;
using vitrify::region::Layout;
using vitrify::region::round_up;
using vitrify::region::skip_guards;
using vitrify::region::Span;
using vitrify::region::kGuardBytes;
using vitrify::region::kGuardPhase;
using vitrify::region::kWindow;

namespace {
constexpr uint64_t G = 2 * kMiB;

uint64_t alloc(Layout& l, uint64_t n) {
  const auto p = l.plan_allocate(n);
  l.commit_allocate(p);
  return p.alloc.offset;
}

template <class F>
std::string error_of(F&& f) {
  try {
    f();
  } catch (const std::exception& e) {
    return e.what();
  }
  return "<no exception>";
}
}  // namespace

TEST(RegionRounding, RoundUp) {
  EXPECT_EQ(round_up(0, G), 0u);
  EXPECT_EQ(round_up(1, G), G);
  EXPECT_EQ(round_up(G, G), G);
  EXPECT_EQ(round_up(G + 1, G), 2 * G);
  EXPECT_THROW(round_up(1, 0), std::invalid_argument);
  EXPECT_THROW(round_up(UINT64_MAX, G), std::invalid_argument);
}

TEST(RegionSearch, CandidatesAreDeterministicDisjointAndInsideTheWindow) {  // R2
  const auto a = candidate_bases(64 * kGiB);
  EXPECT_EQ(a, candidate_bases(64 * kGiB));
  ASSERT_EQ(a.size(), size_t(vitrify::region::kSearchMaxCandidates));
  EXPECT_EQ(a[0], vitrify::region::kSearchFirst);
  for (size_t i = 1; i < a.size(); ++i) EXPECT_EQ(a[i] - a[i - 1], kTiB);
  const auto big = candidate_bases(3 * kTiB + 1);  // step rounds up to 4 TiB
  ASSERT_GE(big.size(), 2u);
  EXPECT_EQ(big[1] - big[0], 4 * kTiB);
  for (uint64_t b : big) EXPECT_LE(b + 3 * kTiB + 1, vitrify::region::kSearchLimit);
  EXPECT_TRUE(candidate_bases(0).empty());
  EXPECT_TRUE(candidate_bases(64 * kTiB).empty());  // larger than the whole window
  EXPECT_EQ(candidate_bases(30 * kTiB).size(), 1u);
  EXPECT_TRUE(candidate_bases(31 * kTiB).empty());  // the window starts 6 GiB above 96 TiB
  // Every candidate is 2 GiB into a 4 GiB address window, so window starts fall on the guards.
  for (uint64_t b : a) EXPECT_EQ((b + kGuardPhase) % kWindow, 0u) << std::hex << b;
}

namespace {
bool overlaps_a_guard(uint64_t o, uint64_t n) {
  const uint64_t first = o < kGuardPhase ? 0 : (o - kGuardPhase) / kWindow;
  for (uint64_t k = first; kGuardPhase + k * kWindow < o + n; ++k) {
    const uint64_t g = kGuardPhase + k * kWindow;
    if (g < o + n && o < g + kGuardBytes) return true;
  }
  return false;
}
}  // namespace

TEST(RegionGuards, SkipGuardsPlacesAllocationsPastEachWindowStart) {  // R13
  EXPECT_EQ(skip_guards(0, G, G), 0u);
  EXPECT_EQ(skip_guards(kGuardPhase - G, G, G), kGuardPhase - G);  // ends where the guard starts
  EXPECT_EQ(skip_guards(kGuardPhase - G, 2 * G, G), kGuardPhase + kGuardBytes);
  EXPECT_EQ(skip_guards(kGuardPhase, G, G), kGuardPhase + kGuardBytes);
  EXPECT_EQ(skip_guards(kGuardPhase + 1, 1, 4096), kGuardPhase + kGuardBytes);
  EXPECT_EQ(skip_guards(kGuardPhase + kGuardBytes, kWindow - kGuardBytes, G),
            kGuardPhase + kGuardBytes);  // exactly fills the space between two guards
  EXPECT_EQ(skip_guards(kGuardPhase + kGuardBytes + G, kWindow - kGuardBytes, G),
            kGuardPhase + kWindow + kGuardBytes);
  EXPECT_EQ(skip_guards(kGuardPhase + kWindow + 100, 1, 4096), kGuardPhase + kWindow + kGuardBytes);
  EXPECT_EQ(skip_guards(5, kWindow, G), G);  // too large to avoid a guard: only aligned
  EXPECT_EQ(skip_guards(UINT64_MAX - 5, 1, G), UINT64_MAX);
}

TEST(RegionGuards, RandomPlacementsAvoidEveryGuardAndNeverMoveBack) {  // R13
  std::mt19937_64 rng(99);
  for (int i = 0; i < 200000; ++i) {
    const uint64_t align = uint64_t(1) << (rng() % 23);  // 1 B .. 4 MiB
    const uint64_t start = rng() % (40 * kGiB);
    const uint64_t bytes = i % 3 == 0 ? 1 + rng() % (5 * kGiB) : 1 + rng() % (64 * kMiB);
    const uint64_t o = skip_guards(start, bytes, align);
    ASSERT_GE(o, start);
    ASSERT_EQ(o % align, 0u);
    if (bytes <= kWindow - kGuardBytes) {
      ASSERT_FALSE(overlaps_a_guard(o, bytes)) << start << " " << bytes << " " << align;
      // Least: the aligned start itself is taken whenever it is clear of every guard.
      const uint64_t a0 = (start + align - 1) / align * align;
      if (!overlaps_a_guard(a0, bytes)) ASSERT_EQ(o, a0);
    } else {
      ASSERT_EQ(o, (start + align - 1) / align * align);
    }
  }
}

TEST(RegionGuards, LayoutSkipsAGuardAndReleasesTheIdleChunksItPassed) {  // R13, R6, R7
  Layout l(16 * kGiB, G);
  l.commit_chunks(l.plan_preallocate(kGuardPhase + kGiB, kGiB));  // [0,1G) [1G,2G) [2G,3G)
  EXPECT_EQ(alloc(l, G), 0u);
  l.set_offset(kGuardPhase - 4 * G);
  auto p = l.plan_allocate(8 * G);
  EXPECT_EQ(p.alloc.offset, kGuardPhase + kGuardBytes);
  EXPECT_FALSE(p.new_chunk.has_value());  // inside the preallocated [2G, 3G)
  const std::vector<Span> released = l.commit_allocate(p);
  ASSERT_EQ(released.size(), 1u);  // [1G, 2G): idle, now behind the cursor; [0,1G) holds offset 0
  EXPECT_EQ(released[0].offset, kGiB);
  EXPECT_EQ(l.cursor(), kGuardPhase + kGuardBytes + 8 * G);
  EXPECT_FALSE(l.allocation_containing(kGuardPhase).has_value());
  // Beyond the frontier the skipped guard is not mapped at all.
  Layout m(16 * kGiB, G);
  m.set_offset(kGuardPhase + kWindow - G);
  p = m.plan_allocate(2 * G);
  EXPECT_EQ(p.alloc.offset, kGuardPhase + kWindow + kGuardBytes);
  ASSERT_TRUE(p.new_chunk.has_value());
  EXPECT_EQ(p.new_chunk->offset, p.alloc.offset);
  EXPECT_TRUE(m.commit_allocate(p).empty());
  // Larger than the space between two guards: placed at the cursor, across the guard.
  EXPECT_EQ(alloc(m, 5 * kGiB), kGuardPhase + kWindow + kGuardBytes + 2 * G);
  // THAW claims a frozen range exactly at the cursor, guard or not.
  Layout c(16 * kGiB, G);
  c.set_offset(kGuardPhase - G);
  p = c.plan_allocate(3 * G, /*at_cursor=*/true);
  EXPECT_EQ(p.alloc.offset, kGuardPhase - G);
  EXPECT_TRUE(c.commit_allocate(p).empty());
  EXPECT_TRUE(c.allocation_containing(kGuardPhase).has_value());
  // Out of space is judged after the skip, and changes nothing.
  Layout n(kGuardPhase + 2 * kGuardBytes, G);
  n.set_offset(kGuardPhase - G);
  EXPECT_THROW(n.plan_allocate(3 * kGuardBytes), vitrify::OutOfSpace);
  EXPECT_EQ(n.cursor(), kGuardPhase - G);
}

TEST(RegionLayout, ConstructorValidates) {
  EXPECT_THROW(Layout(0, G), std::invalid_argument);
  EXPECT_THROW(Layout(G + 1, G), std::invalid_argument);
  EXPECT_THROW(Layout(4 * G, 3 * kMiB), std::invalid_argument);  // not a power of two
}

TEST(RegionLayout, AllocationsAreRoundedAndBumpTheCursor) {  // R1, R3
  Layout l(64 * G, G);
  EXPECT_EQ(alloc(l, 1), 0u);
  EXPECT_EQ(l.cursor(), G);
  EXPECT_EQ(alloc(l, G + 1), G);
  EXPECT_EQ(l.cursor(), 3 * G);
  EXPECT_THROW(l.plan_allocate(0), std::invalid_argument);
  const auto s = l.stats();
  EXPECT_EQ(s.live_allocations, 2u);
  EXPECT_EQ(s.live_bytes, 3 * G);
  EXPECT_EQ(s.chunks, 2u);  // one on-demand chunk per allocation
  EXPECT_EQ(s.mapped_bytes, 3 * G);
}

TEST(RegionLayout, PlanDoesNotMutate) {  // R9
  Layout l(8 * G, G);
  const auto p = l.plan_allocate(G);
  EXPECT_EQ(l.cursor(), 0u);
  EXPECT_EQ(l.stats().chunks, 0u);
  ASSERT_TRUE(p.new_chunk.has_value());
  EXPECT_EQ(*p.new_chunk, (Span{0, G}));
  EXPECT_EQ(l.plan_allocate(G).alloc, p.alloc);  // a failed driver step leaves the same plan
}

TEST(RegionLayout, FreeReleasesChunkAndNeverReusesAddresses) {  // R1, R6
  Layout l(16 * G, G);
  const uint64_t a = alloc(l, G);
  const uint64_t b = alloc(l, 2 * G);
  const auto rel = l.free(a);
  ASSERT_EQ(rel.size(), 1u);
  EXPECT_EQ(rel[0], (Span{a, G}));
  const uint64_t c = alloc(l, G);
  EXPECT_EQ(c, 3 * G);  // after b, not at a
  EXPECT_NE(c, a);
  EXPECT_EQ(l.free(b).size(), 1u);
  EXPECT_THROW(l.free(b), std::invalid_argument);  // double free
  EXPECT_NE(error_of([&] { l.free(c + 1); }).find("not the start of a live region allocation"),
            std::string::npos);
  const auto s = l.stats();
  EXPECT_EQ(s.frees_total, 2u);
  EXPECT_EQ(s.chunks_released, 2u);
}

TEST(RegionLayout, OutOfSpaceNamesTheNumbers) {  // R5
  Layout l(4 * G, G);
  alloc(l, 3 * G);
  try {
    l.plan_allocate(G + 1);
    FAIL() << "no throw";
  } catch (const vitrify::OutOfSpace& e) {
    const std::string m = e.what();
    EXPECT_NE(m.find("allocation of " + std::to_string(G + 1) + " bytes"), std::string::npos) << m;
    EXPECT_NE(m.find("rounded to " + std::to_string(2 * G)), std::string::npos) << m;
    EXPECT_NE(m.find("at offset " + std::to_string(3 * G)), std::string::npos) << m;
    EXPECT_NE(m.find(std::to_string(G) + " bytes left"), std::string::npos) << m;
  }
  EXPECT_EQ(l.cursor(), 3 * G);  // nothing moved
  EXPECT_EQ(alloc(l, G), 3 * G);  // exactly full is fine
  EXPECT_THROW(l.plan_allocate(1), vitrify::OutOfSpace);
  EXPECT_THROW(l.plan_allocate(UINT64_MAX), vitrify::OutOfSpace);
}

TEST(RegionLayout, PreallocationMakesLaterAllocationsABump) {  // R7
  Layout l(1024 * G, G);
  const auto plan = l.plan_preallocate(100 * G, 32 * G);
  ASSERT_EQ(plan.size(), 4u);  // 32 + 32 + 32 + 4
  EXPECT_EQ(plan[3], (Span{96 * G, 4 * G}));
  l.commit_chunks(plan);
  for (int i = 0; i < 10; ++i) {
    const auto p = l.plan_allocate(3 * G);
    EXPECT_FALSE(p.new_chunk.has_value()) << i;
    l.commit_allocate(p);
  }
  // Crossing the mapped frontier maps only the part beyond it.
  const auto p = l.plan_allocate(80 * G);
  ASSERT_TRUE(p.new_chunk.has_value());
  EXPECT_EQ(*p.new_chunk, (Span{100 * G, 10 * G}));  // cursor 30G + 80G = 110G
  EXPECT_TRUE(l.plan_preallocate(10 * G, G).empty());  // already mapped
  EXPECT_THROW(l.plan_preallocate(1025 * G, G), std::invalid_argument);
  EXPECT_THROW(l.plan_preallocate(G, 0), std::invalid_argument);
}

TEST(RegionLayout, AChunkGoesWhenAllItsAllocationsAreFreedAndTheCursorPassed) {  // R6
  Layout l(64 * G, G);
  l.commit_chunks(l.plan_preallocate(8 * G, 4 * G));  // chunks [0,4G) [4G,8G)
  const uint64_t a = alloc(l, G), b = alloc(l, 2 * G), c = alloc(l, 2 * G);  // c straddles
  EXPECT_TRUE(l.free(a).empty());  // b still lives in chunk 0
  EXPECT_TRUE(l.free(c).empty());  // chunk 0 has b; chunk 1 is ahead of the cursor
  const auto rel = l.free(b);
  ASSERT_EQ(rel.size(), 1u);
  EXPECT_EQ(rel[0], (Span{0, 4 * G}));
  EXPECT_EQ(l.stats().chunks, 1u);  // chunk 1 stays: the cursor (5G) is inside it
  // Memory ahead of the cursor is used by the next allocation without mapping.
  EXPECT_FALSE(l.plan_allocate(3 * G).new_chunk.has_value());
}

TEST(RegionLayout, SetOffsetIsForwardOnlyAndReleasesSkippedIdleChunks) {  // R4
  Layout l(64 * G, G);
  l.commit_chunks(l.plan_preallocate(8 * G, 2 * G));
  alloc(l, G);
  EXPECT_NE(error_of([&] { l.set_offset(0); }).find("backwards"), std::string::npos);
  EXPECT_NE(error_of([&] { l.set_offset(3 * G + 1); }).find("granularity"), std::string::npos);
  EXPECT_NE(error_of([&] { l.set_offset(65 * G); }).find("beyond the region size"),
            std::string::npos);
  EXPECT_TRUE(l.set_offset(G).empty());  // same place: a no-op
  const auto rel = l.set_offset(5 * G);  // skips [2G,4G) (idle); [4G,6G) straddles
  ASSERT_EQ(rel.size(), 1u);
  EXPECT_EQ(rel[0], (Span{2 * G, 2 * G}));
  EXPECT_EQ(alloc(l, G), 5 * G);
  // Beyond the frontier the next allocation starts at the cursor, leaving a hole.
  l.set_offset(20 * G);
  const auto p = l.plan_allocate(G);
  ASSERT_TRUE(p.new_chunk.has_value());
  EXPECT_EQ(*p.new_chunk, (Span{20 * G, G}));
}

TEST(RegionLayout, CheckpointsRecordTheCursorOnceEach) {  // R10
  Layout l(64 * G, G);
  EXPECT_EQ(l.checkpoint("start"), 0u);
  alloc(l, 5 * G);
  EXPECT_EQ(l.checkpoint("weights"), 5 * G);
  EXPECT_NE(error_of([&] { l.checkpoint("weights"); }).find("already recorded at offset " +
                                                            std::to_string(5 * G)),
            std::string::npos);
  EXPECT_THROW(l.checkpoint(""), std::invalid_argument);
  ASSERT_EQ(l.checkpoints().size(), 2u);
  EXPECT_EQ(l.checkpoints()[1].first, "weights");
}

TEST(RegionLayout, AllocationContaining) {
  Layout l(64 * G, G);
  const uint64_t a = alloc(l, 3 * G);
  EXPECT_EQ(l.allocation_containing(a + G + 7), (Span{a, 3 * G}));
  EXPECT_FALSE(l.allocation_containing(3 * G).has_value());
  l.free(a);
  EXPECT_FALSE(l.allocation_containing(a).has_value());
}

// Randomized model check of R1, R6, R7: mapped chunks never overlap, every live allocation is
// fully covered by mapped chunks, [cursor, frontier) is mapped, idle chunks behind the cursor
// are gone, and no address is handed out twice.
TEST(RegionLayout, RandomSequencesKeepTheInvariants) {
  std::mt19937_64 rng(1234);
  for (int round = 0; round < 40; ++round) {
    Layout l(8192 * G, G);
    if (round % 2) l.set_offset(kGuardPhase - 16 * G);  // half the rounds cross the first guard
    std::vector<Span> live;
    std::set<uint64_t> handed_out;
    for (int step = 0; step < 300; ++step) {
      const int op = int(rng() % 10);
      try {
        if (op < 5) {
          const auto p = l.plan_allocate(1 + rng() % (5 * G));
          l.commit_allocate(p);
          EXPECT_TRUE(handed_out.insert(p.alloc.offset).second) << "address reused";
          EXPECT_FALSE(overlaps_a_guard(p.alloc.offset, p.alloc.size)) << "allocation on a guard";
          live.push_back(p.alloc);
        } else if (op < 8 && !live.empty()) {
          const size_t i = rng() % live.size();
          l.free(live[i].offset);
          live.erase(live.begin() + long(i));
        } else if (op == 8) {
          l.commit_chunks(l.plan_preallocate(std::min<uint64_t>(l.size(), l.cursor() + (rng() % 20) * G),
                                             (1 + rng() % 4) * G));
        } else {
          l.set_offset(std::min<uint64_t>(l.size(), l.cursor() + (rng() % 3) * G));
        }
      } catch (const vitrify::OutOfSpace&) {
      }
      const auto chunks = l.mapped_chunks();
      for (size_t i = 1; i < chunks.size(); ++i) ASSERT_LE(chunks[i - 1].end(), chunks[i].offset);
      auto covered = [&](uint64_t b, uint64_t e) {
        for (const Span& c : chunks) {
          if (c.offset <= b && b < c.end()) b = c.end();
        }
        return b >= e;
      };
      for (const Span& a : live) ASSERT_TRUE(covered(a.offset, a.end())) << "unmapped live memory";
      const auto st = l.stats();
      ASSERT_TRUE(st.frontier <= st.cursor || covered(st.cursor, st.frontier));
      for (const Span& c : chunks) {
        bool used = false;
        for (const Span& a : live) used |= a.offset < c.end() && c.offset < a.end();
        ASSERT_TRUE(used || c.end() > st.cursor) << "idle chunk behind the cursor kept";
      }
    }
  }
}
