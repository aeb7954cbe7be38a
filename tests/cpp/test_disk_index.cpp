// SlotIndex: the disk tier's pure per-kind bookkeeping (index.cpp), without files or threads.
// Invariant numbers refer to csrc/src/disk/DESIGN.md.
#include <cstring>
#include <list>
#include <map>
#include <optional>
#include <random>
#include <set>
#include <stdexcept>
#include <vector>

#include <gtest/gtest.h>

#include "vitrify/disk.hpp"

using namespace vitrify::disk;

namespace {

Key key_of(uint64_t i) {
  Key k{};
  std::memcpy(k.data(), &i, sizeof i);
  k[31] = 0x5A;
  return k;
}

using Plan = SlotIndex::PutPlan;

// Plans, allocates and publishes key i as the Store does for a put whose write succeeded.
SlotLocation put_now(SlotIndex& x, uint64_t i, uint32_t len = 100) {
  const Key k = key_of(i);
  const Plan p = x.plan_put(k);
  EXPECT_EQ(p.action, Plan::kAllocate);
  const uint64_t slot = x.allocate(k, p);
  const SlotIndex::PutOutcome out = x.finish_put(k, p.drive, slot, len, true);
  EXPECT_TRUE(out.published);
  return SlotLocation{p.drive, slot, len};
}

uint64_t free_total(const SlotIndex& x) {
  uint64_t n = 0;
  for (uint32_t d = 0; d < x.drives(); ++d) n += x.free_slots(d);
  return n;
}

}  // namespace

TEST(SlotIndex, RejectsBadConfiguration) {
  EXPECT_THROW(SlotIndex({}, 0.9, 0.85), std::invalid_argument);
  EXPECT_THROW(SlotIndex({4, 0}, 0.9, 0.85), std::invalid_argument);
  EXPECT_THROW(SlotIndex({4}, 0.8, 0.85), std::invalid_argument);
  EXPECT_THROW(SlotIndex({4}, 1.1, 0.85), std::invalid_argument);
  EXPECT_THROW(SlotIndex({4}, 0.9, 0.0), std::invalid_argument);
}

TEST(SlotIndex, StartsFreeAndAllocatesFromTheDriveWithMostFreeSlots) {
  SlotIndex x({2, 3}, 0.9, 0.5);
  EXPECT_EQ(x.slots_total(), 5u);
  EXPECT_EQ(x.slots_used(), 0u);
  EXPECT_EQ(free_total(x), 5u);
  Plan p = x.plan_put(key_of(1));
  ASSERT_EQ(p.action, Plan::kAllocate);
  EXPECT_EQ(p.drive, 1u);                       // 3 free beats 2
  EXPECT_EQ(x.allocate(key_of(1), p), 0u);      // lowest slot first
  p = x.plan_put(key_of(2));
  EXPECT_EQ(p.drive, 0u);                       // 2 and 2: the lower drive
  EXPECT_EQ(x.allocate(key_of(2), p), 0u);
  EXPECT_EQ(x.slots_used(), 2u);                // D10: in flight counts as used
  EXPECT_EQ(x.entries(), 0u);
  EXPECT_EQ(x.pending(), 2u);
  // A plan that no longer applies is refused, and planning mutates nothing.
  EXPECT_THROW(x.allocate(key_of(1), Plan{Plan::kAllocate, 0}), std::invalid_argument);
  EXPECT_THROW(x.allocate(key_of(3), Plan{Plan::kAllocate, 7}), std::invalid_argument);
  EXPECT_THROW(x.allocate(key_of(3), Plan{Plan::kFull, 0}), std::invalid_argument);
  EXPECT_EQ(x.slots_used(), 2u);
}

TEST(SlotIndex, DedupJoinsInFlightAndTouchesIndexed) {
  SlotIndex x({4}, 0.9, 0.5);
  auto ticket = std::make_shared<Completion>(3);
  const Key k = key_of(7);
  const Plan p = x.plan_put(k);
  const uint64_t slot = x.allocate(k, p);
  EXPECT_EQ(x.plan_put(k).action, Plan::kJoin);  // D2: one write per key in flight
  x.join(k, Joiner{ticket, 1});
  x.join(k, Joiner{ticket, 2});
  EXPECT_THROW(x.join(key_of(8), Joiner{ticket, 0}), std::invalid_argument);
  EXPECT_FALSE(x.find(k));  // D3: not visible before finish_put
  const SlotIndex::PutOutcome out = x.finish_put(k, p.drive, slot, 33, true);
  EXPECT_TRUE(out.published);
  EXPECT_FALSE(out.cancelled);
  ASSERT_EQ(out.joiners.size(), 2u);
  EXPECT_EQ(out.joiners[0].second, 1u);
  EXPECT_EQ(out.joiners[1].second, 2u);
  EXPECT_EQ(x.find(k), (SlotLocation{0, slot, 33}));
  EXPECT_EQ(x.plan_put(k).action, Plan::kDuplicate);  // D6
  EXPECT_TRUE(x.touch(k));
  EXPECT_FALSE(x.touch(key_of(8)));
  EXPECT_EQ(x.slots_used(), 1u);
  EXPECT_EQ(x.entries(), 1u);
  EXPECT_EQ(x.pending(), 0u);
}

TEST(SlotIndex, RemovedOrFailedWritesFreeTheirSlot) {
  SlotIndex x({4}, 0.9, 0.5);
  const Key a = key_of(1), b = key_of(2), c = key_of(3);
  const uint64_t sa = x.allocate(a, x.plan_put(a));
  const uint64_t sb = x.allocate(b, x.plan_put(b));
  const uint64_t sc = x.allocate(c, x.plan_put(c));
  EXPECT_TRUE(x.remove(a));   // cancels the pending put
  EXPECT_FALSE(x.remove(a));  // already cancelled
  SlotIndex::PutOutcome out = x.finish_put(a, 0, sa, 10, true);
  EXPECT_FALSE(out.published);
  EXPECT_TRUE(out.cancelled);
  EXPECT_FALSE(x.find(a));
  EXPECT_EQ(x.stale(0).count(sa), 1u);
  // A duplicate that joins a removed put un-cancels it.
  EXPECT_TRUE(x.remove(b));
  x.join(b, Joiner{std::make_shared<Completion>(1), 0});
  out = x.finish_put(b, 0, sb, 10, true);
  EXPECT_TRUE(out.published);
  EXPECT_TRUE(x.find(b));
  // A write or sync error (not durable) frees the slot (D3).
  out = x.finish_put(c, 0, sc, 10, false);
  EXPECT_FALSE(out.published);
  EXPECT_FALSE(out.cancelled);
  EXPECT_FALSE(x.find(c));
  EXPECT_EQ(x.stale(0).count(sc), 1u);
  EXPECT_EQ(x.slots_used(), 1u);
  EXPECT_EQ(free_total(x), 3u);
  // Reallocating a stale slot takes it out of the stale set (the write replaces its header).
  const Key d = key_of(4);
  const uint64_t sd = x.allocate(d, x.plan_put(d));
  EXPECT_EQ(sd, sc);  // the stack: the last freed slot first
  EXPECT_EQ(x.stale(0).count(sd), 0u);
  x.clear_stale(0);
  EXPECT_TRUE(x.stale(0).empty());
}

// D4: a slot goes back to the pool only after its entry is unpublished; until then no put can
// get it, even when the pool is empty.
TEST(SlotIndex, FreeSlotReusedOnlyAfterUnpublish) {
  SlotIndex x({3, 2}, 1.0, 0.5);
  std::map<uint64_t, SlotLocation> at;
  for (uint64_t i = 0; i < 5; ++i) at[i] = put_now(x, i);
  std::set<std::pair<uint32_t, uint64_t>> slots;
  for (auto& [i, l] : at) slots.insert({l.drive, l.slot});
  EXPECT_EQ(slots.size(), 5u);  // one key, one slot
  EXPECT_EQ(x.plan_put(key_of(9)).action, Plan::kFull);  // D9
  EXPECT_EQ(free_total(x), 0u);
  // A stale location (another slot) does not unpublish anything.
  EXPECT_FALSE(x.drop_if_at(key_of(3), SlotLocation{at[3].drive, at[3].slot + 1, 100}));
  EXPECT_EQ(x.plan_put(key_of(9)).action, Plan::kFull);
  EXPECT_TRUE(x.drop_if_at(key_of(3), at[3]));  // a read that failed verification (D1)
  EXPECT_FALSE(x.find(key_of(3)));
  Plan p = x.plan_put(key_of(9));
  ASSERT_EQ(p.action, Plan::kAllocate);
  EXPECT_EQ(p.drive, at[3].drive);
  EXPECT_EQ(x.allocate(key_of(9), p), at[3].slot);
  EXPECT_EQ(x.plan_put(key_of(10)).action, Plan::kFull);
  EXPECT_TRUE(x.remove(key_of(1)));
  p = x.plan_put(key_of(10));
  ASSERT_EQ(p.action, Plan::kAllocate);
  EXPECT_EQ(p.drive, at[1].drive);
  EXPECT_EQ(x.allocate(key_of(10), p), at[1].slot);
  EXPECT_EQ(x.slots_used(), x.slots_total());
}

// D8: GC evicts least recently used first (a read or duplicate put touches), down to the target,
// and never reclaims a slot in flight.
TEST(SlotIndex, GcReclaimsLeastRecentlyUsedDownToTarget) {
  SlotIndex x({60, 40}, 0.90, 0.85);
  EXPECT_EQ(x.gc_target(), 85u);
  for (uint64_t i = 0; i < 89; ++i) put_now(x, i);
  EXPECT_FALSE(x.gc_due());
  put_now(x, 89);
  EXPECT_TRUE(x.gc_due());
  for (uint64_t i : {0, 2, 4}) EXPECT_TRUE(x.touch(key_of(i)));  // now the newest
  EXPECT_EQ(x.collect(), 5u);
  EXPECT_EQ(x.slots_used(), 85u);
  EXPECT_FALSE(x.gc_due());
  for (uint64_t i : {1, 3, 5, 6, 7}) EXPECT_FALSE(x.find(key_of(i))) << i;
  for (uint64_t i : {0, 2, 4, 8, 9, 89}) EXPECT_TRUE(x.find(key_of(i))) << i;
  // The touched keys are the newest now (after 89, put before the touches): 8..88 go first,
  // then 89, then the touched ones, oldest touch first.
  EXPECT_EQ(x.collect_to(4), 81u);
  for (uint64_t i : {0, 2, 4, 89}) EXPECT_TRUE(x.find(key_of(i))) << i;
  EXPECT_EQ(x.collect_to(2), 2u);
  EXPECT_FALSE(x.find(key_of(89)));
  EXPECT_FALSE(x.find(key_of(0)));
  EXPECT_TRUE(x.find(key_of(2)));
  EXPECT_TRUE(x.find(key_of(4)));
  // In-flight slots are not GC's to take.
  const Key k = key_of(500);
  x.allocate(k, x.plan_put(k));
  EXPECT_EQ(x.collect_to(0), 2u);
  EXPECT_EQ(x.slots_used(), 1u);
  EXPECT_EQ(x.pending(), 1u);
  EXPECT_EQ(x.entries(), 0u);
  EXPECT_EQ(free_total(x), 99u);
}

TEST(SlotIndex, HeapStaysBoundedUnderTouches) {
  SlotIndex x({64}, 0.95, 0.5);
  for (uint64_t i = 0; i < 32; ++i) put_now(x, i);
  for (int round = 0; round < 200; ++round) {
    for (uint64_t i = 0; i < 32; ++i) x.touch(key_of(i));
    ASSERT_EQ(x.collect_to(31), 1u);  // each collect re-files the touched ones
    put_now(x, 1000 + round);
    // The re-filed key of this round stays, so key 1000 + round replaced the coldest.
    EXPECT_LE(x.heap_size(), 2 * x.entries() + 1024 + 1);
  }
  EXPECT_EQ(x.entries(), 32u);
}

// D7: load keeps the newest copy of a key, frees (and marks stale) the older ones, orders GC by
// seq, and continues the write sequence after the highest seq.
TEST(SlotIndex, LoadKeepsNewestCopyAndOrdersGcBySeq) {
  SlotIndex x({4, 4}, 0.9, 0.5);
  auto found = [](uint32_t drive, uint64_t slot, uint64_t key, uint32_t seq, uint32_t len) {
    return FoundSlot{drive, ScannedSlot{slot, key_of(key), len, seq}};
  };
  std::vector<FoundSlot> f = {
      found(0, 0, 1, 10, 11), found(1, 3, 1, 12, 13),  // key 1: the seq-12 copy wins
      found(0, 2, 2, 5, 20),                           // key 2: oldest
      found(1, 1, 3, 7, 30), found(0, 3, 3, 7, 31),    // key 3: same seq, (1, 1) wins
      found(1, 0, 4, 9, 40),
  };
  uint32_t next_seq = 3;
  EXPECT_EQ(x.load(f, next_seq), 4u);
  EXPECT_EQ(next_seq, 13u);
  EXPECT_EQ(x.find(key_of(1)), (SlotLocation{1, 3, 13}));
  EXPECT_EQ(x.find(key_of(3)), (SlotLocation{1, 1, 30}));
  EXPECT_EQ(x.slots_used(), 4u);
  EXPECT_EQ(free_total(x), 4u);
  EXPECT_EQ(x.stale(0), (std::unordered_set<uint64_t>{0, 3}));
  EXPECT_TRUE(x.stale(1).empty());
  EXPECT_EQ(x.free_slots(0), 3u);  // slots 0, 1, 3
  EXPECT_EQ(x.free_slots(1), 1u);  // slot 2
  // GC order is seq order: 2 (5), 3 (7), 4 (9), 1 (12).
  EXPECT_EQ(x.collect_to(3), 1u);
  EXPECT_FALSE(x.find(key_of(2)));
  EXPECT_EQ(x.collect_to(1), 2u);
  EXPECT_FALSE(x.find(key_of(3)));
  EXPECT_FALSE(x.find(key_of(4)));
  EXPECT_TRUE(x.find(key_of(1)));
  // The seq wraps: UINT32_MAX + 1 is 0 and does not lower next_seq.
  SlotIndex y({2}, 0.9, 0.5);
  next_seq = 0;
  EXPECT_EQ(y.load({found(0, 1, 5, UINT32_MAX, 1)}, next_seq), 1u);
  EXPECT_EQ(next_seq, 0u);
  EXPECT_THROW(y.load({found(0, 2, 5, 1, 1)}, next_seq), std::invalid_argument);
  EXPECT_THROW(y.load({found(1, 0, 5, 1, 1)}, next_seq), std::invalid_argument);
}

TEST(SlotIndex, ClearFreesEverythingAndReturnsJoiners) {
  SlotIndex x({3}, 0.9, 0.5);
  put_now(x, 1);
  x.remove(key_of(1));
  put_now(x, 2);
  const Key k = key_of(3);
  x.allocate(k, x.plan_put(k));
  auto t = std::make_shared<Completion>(1);
  x.join(k, Joiner{t, 0});
  const std::vector<Joiner> j = x.clear();
  ASSERT_EQ(j.size(), 1u);
  EXPECT_EQ(j[0].first, t);
  EXPECT_EQ(x.entries(), 0u);
  EXPECT_EQ(x.pending(), 0u);
  EXPECT_EQ(x.slots_used(), 0u);
  EXPECT_EQ(x.free_slots(0), 3u);
  EXPECT_TRUE(x.stale(0).empty());
  const Plan p = x.plan_put(k);
  ASSERT_EQ(p.action, Plan::kAllocate);
  EXPECT_EQ(x.allocate(k, p), 0u);  // lowest slot first again
}

// Randomized model check against a plain reference: std::map for the index, std::list for the
// LRU order, std::set for the free slots. Thousands of operations per seed, every step checked.
namespace {

struct Model {
  struct Pend {
    uint32_t drive;
    uint64_t slot;
    bool cancelled = false;
    size_t joiners = 0;
  };
  std::vector<uint64_t> counts;
  std::map<uint64_t, SlotLocation> index;
  std::list<uint64_t> lru;  // front: coldest
  std::map<uint64_t, Pend> pending;
  std::vector<std::set<uint64_t>> free, stale;

  explicit Model(std::vector<uint64_t> c) : counts(std::move(c)) { clear(); }
  void clear() {
    index.clear();
    lru.clear();
    pending.clear();
    free.assign(counts.size(), {});
    stale.assign(counts.size(), {});
    for (size_t d = 0; d < counts.size(); ++d)
      for (uint64_t s = 0; s < counts[d]; ++s) free[d].insert(s);
  }
  uint64_t used() const { return index.size() + pending.size(); }
  void touch(uint64_t k) {
    lru.remove(k);
    lru.push_back(k);
  }
  void release(uint32_t d, uint64_t s) {
    free[d].insert(s);
    stale[d].insert(s);
  }
  void unpublish(uint64_t k) {
    const SlotLocation l = index.at(k);
    index.erase(k);
    lru.remove(k);
    release(l.drive, l.slot);
  }
  int best_drive() const {
    int best = -1;
    for (size_t d = 0; d < free.size(); ++d)
      if (!free[d].empty() && (best < 0 || free[d].size() > free[best].size())) best = static_cast<int>(d);
    return best;
  }
  size_t collect_to(uint64_t target) {
    size_t n = 0;
    while (used() > target && !lru.empty()) {
      unpublish(lru.front());
      ++n;
    }
    return n;
  }
};

void check_same(const SlotIndex& x, const Model& m, uint64_t keys) {
  ASSERT_EQ(x.entries(), m.index.size());
  ASSERT_EQ(x.pending(), m.pending.size());
  ASSERT_EQ(x.slots_used(), m.used());
  uint64_t free = 0;
  for (uint32_t d = 0; d < x.drives(); ++d) {
    ASSERT_EQ(x.free_slots(d), m.free[d].size()) << "drive " << d;
    ASSERT_EQ(x.stale(d), (std::unordered_set<uint64_t>(m.stale[d].begin(), m.stale[d].end())));
    free += x.free_slots(d);
  }
  ASSERT_EQ(free + x.slots_used(), x.slots_total());  // D10
  for (uint64_t k = 0; k < keys; ++k) {
    auto it = m.index.find(k);
    const std::optional<SlotLocation> got = x.find(key_of(k));
    if (it == m.index.end())
      ASSERT_FALSE(got) << "key " << k;
    else
      ASSERT_EQ(got, it->second) << "key " << k;
  }
}

}  // namespace

TEST(SlotIndex, RandomizedAgainstReferenceModel) {
  const std::vector<uint64_t> counts = {7, 5, 9};
  constexpr uint64_t kKeys = 48;
  constexpr int kOps = 6000;
  for (uint32_t seed = 1; seed <= 8; ++seed) {
    SCOPED_TRACE("seed " + std::to_string(seed));
    std::mt19937 rng(seed);
    SlotIndex x(counts, 0.90, 0.60);
    Model m(counts);
    const uint64_t total = 21;
    size_t reclaims = 0, fulls = 0, publishes = 0;
    for (int op = 0; op < kOps; ++op) {
      const uint64_t k = rng() % kKeys;
      const Key key = key_of(k);
      switch (rng() % 9) {
        case 0:
        case 1:
        case 2: {  // a put, as the Store submits it (GC at once when full, D9)
          Plan p = x.plan_put(key);
          if (p.action == Plan::kFull) {
            ASSERT_FALSE(m.index.count(k) || m.pending.count(k));
            ASSERT_LT(m.best_drive(), 0);
            const size_t n = x.collect();
            ASSERT_EQ(n, m.collect_to(x.gc_target()));
            reclaims += n;
            p = x.plan_put(key);
          }
          if (m.index.count(k)) {
            ASSERT_EQ(p.action, Plan::kDuplicate);
            ASSERT_TRUE(x.touch(key));
            m.touch(k);
          } else if (m.pending.count(k)) {
            ASSERT_EQ(p.action, Plan::kJoin);
            x.join(key, Joiner{nullptr, 0});
            m.pending[k].cancelled = false;
            ++m.pending[k].joiners;
          } else if (m.best_drive() < 0) {
            ASSERT_EQ(p.action, Plan::kFull);
            ++fulls;
          } else {
            ASSERT_EQ(p.action, Plan::kAllocate);
            ASSERT_EQ(p.drive, static_cast<uint32_t>(m.best_drive()));
            const uint64_t slot = x.allocate(key, p);
            // Only a free slot: never one an entry or another put still holds (D4).
            ASSERT_EQ(m.free[p.drive].erase(slot), 1u) << "slot " << slot << " was not free";
            m.stale[p.drive].erase(slot);
            m.pending[k] = Model::Pend{p.drive, slot};
          }
          break;
        }
        case 3:
        case 4: {  // a write finishes (mostly durable)
          if (m.pending.empty()) break;
          auto it = m.pending.begin();
          std::advance(it, rng() % m.pending.size());
          const uint64_t pk = it->first;
          const Model::Pend pe = it->second;
          const bool durable = rng() % 8 != 0;
          const uint32_t len = static_cast<uint32_t>(pk * 3);
          const SlotIndex::PutOutcome out = x.finish_put(key_of(pk), pe.drive, pe.slot, len, durable);
          m.pending.erase(it);
          ASSERT_EQ(out.cancelled, pe.cancelled);
          ASSERT_EQ(out.joiners.size(), pe.joiners);
          ASSERT_EQ(out.published, durable && !pe.cancelled);
          if (out.published) {
            m.index[pk] = SlotLocation{pe.drive, pe.slot, len};
            m.lru.push_back(pk);
            ++publishes;
          } else {
            m.release(pe.drive, pe.slot);
          }
          break;
        }
        case 5: {  // a read touches
          ASSERT_EQ(x.touch(key), m.index.count(k) == 1);
          if (m.index.count(k)) m.touch(k);
          break;
        }
        case 6: {  // delete
          bool want = false;
          if (m.index.count(k)) {
            m.unpublish(k);
            want = true;
          } else if (auto p = m.pending.find(k); p != m.pending.end() && !p->second.cancelled) {
            p->second.cancelled = true;
            want = true;
          }
          ASSERT_EQ(x.remove(key), want);
          break;
        }
        case 7: {  // GC after a write batch, or a read that failed verification
          if (rng() % 2) {
            const bool due = static_cast<double>(m.used()) >= 0.90 * static_cast<double>(total);
            ASSERT_EQ(x.gc_due(), due);
            if (due) {
              const size_t n = x.collect();
              ASSERT_EQ(n, m.collect_to(x.gc_target()));
              reclaims += n;
            }
          } else if (m.index.count(k)) {
            SlotLocation at = m.index.at(k);
            if (rng() % 2) {
              at.slot = (at.slot + 1) % counts[at.drive];  // a stale location: no effect
              ASSERT_FALSE(x.drop_if_at(key, at));
            } else {
              ASSERT_TRUE(x.drop_if_at(key, at));
              m.unpublish(k);
            }
          }
          break;
        }
        case 8: {  // a GC to a random target, rarely a clear
          if (rng() % 200 == 0) {
            size_t joiners = 0;
            for (auto& [pk, pe] : m.pending) joiners += pe.joiners;
            ASSERT_EQ(x.clear().size(), joiners);
            m.clear();
          } else {
            const uint64_t target = rng() % (total + 1);
            const size_t n = x.collect_to(target);
            ASSERT_EQ(n, m.collect_to(target));
            reclaims += n;
          }
          break;
        }
      }
      ASSERT_NO_FATAL_FAILURE(check_same(x, m, kKeys)) << "after op " << op;
      ASSERT_LE(x.heap_size(), 2 * x.entries() + 1024 + 1);
    }
    // The run exercised every path.
    EXPECT_GT(reclaims, 100u);
    EXPECT_GT(fulls, 0u);
    EXPECT_GT(publishes, 500u);
  }
}

// D24: a dirty entry (a write-back page the disk has not acknowledged) is in no GC order: GC
// reclaims every clean entry first and never a dirty one, however cold; mark_clean puts it
// back as the newest entry. load keeps dirty slots dirty; delete removes a dirty entry.
TEST(SlotIndex, DirtyEntriesAreNeverCollectedUntilMarkedClean) {
  SlotIndex x({10}, 0.90, 0.50);
  std::vector<SlotLocation> at;
  for (uint64_t i = 0; i < 10; ++i) {
    const Key k = key_of(i);
    const Plan p = x.plan_put(k);
    const uint64_t slot = x.allocate(k, p);
    ASSERT_TRUE(x.finish_put(k, p.drive, slot, 100, true, /*dirty=*/i < 6).published);
    at.push_back({p.drive, slot, 100});
  }
  EXPECT_EQ(x.dirty_count(), 6u);
  EXPECT_EQ(x.keys(true).size(), 6u);
  EXPECT_EQ(x.keys(false).size(), 10u);
  for (uint64_t i = 0; i < 10; ++i) EXPECT_EQ(x.dirty(key_of(i)), i < 6) << i;
  x.touch(key_of(7));
  EXPECT_EQ(x.collect_to(0), 4u) << "only the clean ones";
  for (uint64_t i = 0; i < 6; ++i) EXPECT_TRUE(x.find(key_of(i))) << i;
  EXPECT_EQ(x.collect_to(0), 0u);
  EXPECT_EQ(x.plan_put(key_of(99)).action, Plan::kAllocate);  // 4 slots free again
  // Clean: evictable again, as the newest entries, in the order they were cleaned.
  EXPECT_EQ(x.mark_clean(key_of(3)), std::optional<SlotLocation>(at[3]));
  EXPECT_EQ(x.mark_clean(key_of(3)), std::nullopt) << "already clean";
  EXPECT_EQ(x.mark_clean(key_of(77)), std::nullopt) << "not indexed";
  EXPECT_TRUE(x.mark_clean(key_of(1)));
  EXPECT_EQ(x.dirty_count(), 4u);
  EXPECT_EQ(x.collect_to(5), 1u);
  EXPECT_FALSE(x.find(key_of(3)));
  EXPECT_TRUE(x.find(key_of(1)));
  EXPECT_TRUE(x.remove(key_of(0)));  // a delete removes a dirty entry
  EXPECT_EQ(x.dirty_count(), 3u);
  // The heap never holds a dirty entry, however many touches (rebuilds included).
  for (int n = 0; n < 5000; ++n) x.touch(key_of(2));
  EXPECT_EQ(x.collect_to(0), 1u);  // key 1, the only clean entry left
  EXPECT_EQ(x.entries(), 3u);
  // load: dirty slots stay dirty and out of GC order.
  SlotIndex y({10}, 0.90, 0.50);
  uint32_t seq = 0;
  std::vector<FoundSlot> found;
  for (uint64_t i = 0; i < 4; ++i)
    found.push_back({0, ScannedSlot{i, key_of(i), 50, static_cast<uint32_t>(i), i % 2 == 0}});
  EXPECT_EQ(y.load(found, seq), 4u);
  EXPECT_EQ(y.dirty_count(), 2u);
  EXPECT_EQ(y.collect_to(0), 2u);
  EXPECT_TRUE(y.find(key_of(0)));
  EXPECT_TRUE(y.find(key_of(2)));
}

// D5, D14: with held slots, a freed slot is on no free stack (and still counted as used) until
// released, so it is never handed out before the Store zeroed it; a clear or load starts a new
// generation, and a release from the old one does nothing (no slot is freed twice).
TEST(SlotIndex, HeldSlotsComeBackOnlyWhenReleasedNeverTwice) {
  SlotIndex x({3}, 0.90, 0.50);
  x.hold_freed_slots();
  const SlotLocation a = put_now(x, 1), b = put_now(x, 2);
  put_now(x, 3);
  EXPECT_EQ(x.plan_put(key_of(4)).action, Plan::kFull);
  EXPECT_TRUE(x.remove(key_of(1)));
  EXPECT_TRUE(x.drop_if_at(key_of(2), b));
  EXPECT_EQ(x.slots_used(), 3u) << "held slots count as used";
  EXPECT_EQ(x.slots_out(), 2u);
  EXPECT_EQ(x.plan_put(key_of(4)).action, Plan::kFull) << "held: not free yet";
  SlotIndex::Held h = x.take_held();
  EXPECT_FALSE(x.has_held());
  ASSERT_EQ(h.slots.size(), 2u);
  EXPECT_EQ(x.collect_to(0), 1u);  // key 3: held too
  x.release_held(h.generation, h.slots[0].first, h.slots[0].second, true);
  x.release_held(h.generation, h.slots[1].first, h.slots[1].second, false);  // could not zero
  EXPECT_EQ(x.slots_out(), 1u);
  EXPECT_EQ(x.slots_used(), 1u);
  EXPECT_EQ(free_total(x), 2u);
  EXPECT_EQ(x.stale(0).size(), 1u) << "the one not zeroed is stale (close zeroes it)";
  EXPECT_EQ(x.stale(0).count(b.slot), 1u);
  EXPECT_EQ(x.stale(0).count(a.slot), 0u);
  SlotIndex::Held h3 = x.take_held();
  ASSERT_EQ(h3.slots.size(), 1u);
  x.clear();  // every slot free now, the held one included
  EXPECT_EQ(free_total(x), 3u);
  x.release_held(h3.generation, h3.slots[0].first, h3.slots[0].second, true);  // ignored
  EXPECT_EQ(free_total(x), 3u);
  EXPECT_EQ(x.slots_used(), 0u);
  EXPECT_EQ(x.slots_out(), 0u);
}
