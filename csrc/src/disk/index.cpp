// SlotIndex: the disk tier's pure bookkeeping per payload kind (index, pending puts, free-slot
// stacks, stale sets, GC order). No file I/O and no threads; store.cpp holds it under its mutex
// and does the I/O. Invariants (numbered as in DESIGN.md) are cited where they are kept.
#include <algorithm>
#include <cmath>
#include <functional>

#include "vitrify/disk.hpp"
#include "vitrify/error.hpp"

namespace vitrify::disk {

SlotIndex::SlotIndex(std::vector<uint64_t> slots_per_drive, double gc_high, double gc_low)
    : slot_counts_(std::move(slots_per_drive)), gc_high_(gc_high), gc_low_(gc_low) {
  VITRIFY_EXPECT(!slot_counts_.empty(), "a slot index needs at least one drive");
  VITRIFY_EXPECT(gc_low_ > 0 && gc_low_ < gc_high_ && gc_high_ <= 1.0,
                 "need 0 < gc_low < gc_high <= 1, got gc_low=" + std::to_string(gc_low_) +
                     " gc_high=" + std::to_string(gc_high_));
  for (size_t d = 0; d < slot_counts_.size(); ++d) {
    VITRIFY_EXPECT(slot_counts_[d] >= 1, "drive " + std::to_string(d) + " has no slot");
    slots_total_ += slot_counts_[d];
  }
  free_.resize(slot_counts_.size());
  stale_.resize(slot_counts_.size());
  reset_pool();
}

// Every slot free, lowest on top of each stack.
void SlotIndex::reset_pool() {
  for (size_t d = 0; d < slot_counts_.size(); ++d) {
    free_[d].clear();
    for (uint64_t slot = slot_counts_[d]; slot-- > 0;) free_[d].push_back(slot);
  }
}

SlotIndex::PutPlan SlotIndex::plan_put(const Key& key) const noexcept {
  if (index_.count(key) != 0) return {PutPlan::kDuplicate};  // D6
  if (pending_.count(key) != 0) return {PutPlan::kJoin};     // D2
  int best = -1;
  for (size_t d = 0; d < free_.size(); ++d)
    if (!free_[d].empty() && (best < 0 || free_[d].size() > free_[best].size()))
      best = static_cast<int>(d);
  if (best < 0) return {PutPlan::kFull};  // D9
  return {PutPlan::kAllocate, static_cast<uint32_t>(best)};
}

uint64_t SlotIndex::allocate(const Key& key, const PutPlan& plan) {
  VITRIFY_EXPECT(plan.action == PutPlan::kAllocate && plan.drive < free_.size() &&
                     !free_[plan.drive].empty() && index_.count(key) == 0 &&
                     pending_.count(key) == 0,
                 "allocate: the plan is not an allocation that still applies");
  std::vector<uint64_t>& pool = free_[plan.drive];
  const uint64_t slot = pool.back();
  pool.pop_back();
  stale_[plan.drive].erase(slot);  // the write replaces its header
  ++slots_used_;
  pending_.emplace(key, Pending{});
  return slot;
}

void SlotIndex::join(const Key& key, Joiner joiner) {
  auto p = pending_.find(key);
  VITRIFY_EXPECT(p != pending_.end(), "join: no write of the key is in flight");
  // Same key, same content: join the write in flight (un-cancelling a removed one).
  p->second.cancelled = false;
  p->second.joiners.push_back(std::move(joiner));
}

SlotIndex::PutOutcome SlotIndex::finish_put(const Key& key, uint32_t drive, uint64_t slot,
                                            uint32_t len, bool durable, bool dirty) {
  PutOutcome out;
  if (auto it = pending_.find(key); it != pending_.end()) {
    out.cancelled = it->second.cancelled;
    out.joiners = std::move(it->second.joiners);
    pending_.erase(it);
  }
  out.published = durable && !out.cancelled;
  if (!out.published) {
    free_slot(drive, slot);
    return out;
  }
  // Durable before visible (D3): the caller synced the slab already.
  const uint64_t t = ++tick_;
  if (dirty) {  // D24: in no heap element, so GC never reaches it
    index_[key] = Entry{SlotLocation{drive, slot, len}, t, 0, true};
    ++dirty_count_;
    return out;
  }
  index_[key] = Entry{SlotLocation{drive, slot, len}, t, t};
  heap_.push_back(HeapItem{t, key});
  std::push_heap(heap_.begin(), heap_.end(), std::greater<HeapItem>());
  if (heap_.size() > 2 * index_.size() + 1024) rebuild_heap();  // drop stale elements (D8)
  return out;
}

std::optional<SlotLocation> SlotIndex::mark_clean(const Key& key) {
  auto e = index_.find(key);
  if (e == index_.end() || !e->second.dirty) return std::nullopt;
  Entry& en = e->second;
  en.dirty = false;
  --dirty_count_;
  en.last_access = ++tick_;  // back in GC order as the newest entry
  en.heap_tick = en.last_access;
  heap_.push_back(HeapItem{en.heap_tick, key});
  std::push_heap(heap_.begin(), heap_.end(), std::greater<HeapItem>());
  if (heap_.size() > 2 * index_.size() + 1024) rebuild_heap();
  return en.at;
}

bool SlotIndex::dirty(const Key& key) const {
  auto e = index_.find(key);
  return e != index_.end() && e->second.dirty;
}

std::vector<Key> SlotIndex::keys(bool dirty_only) const {
  std::vector<Key> out;
  out.reserve(dirty_only ? dirty_count_ : index_.size());
  for (const auto& [key, e] : index_)
    if (!dirty_only || e.dirty) out.push_back(key);
  return out;
}

SlotIndex::Held SlotIndex::take_held() {
  Held h;
  h.generation = generation_;
  h.slots.swap(held_);
  return h;
}

void SlotIndex::release_held(uint64_t generation, uint32_t drive, uint64_t slot, bool zeroed) {
  if (generation != generation_) return;  // a clear or load made it part of the fresh pool
  VITRIFY_EXPECT(drive < free_.size() && slot < slot_counts_[drive],
                 "release_held: slot " + std::to_string(slot) + " of drive " +
                     std::to_string(drive) + " is out of range");
  free_[drive].push_back(slot);
  if (!zeroed) stale_[drive].insert(slot);
  --held_out_;
}

void SlotIndex::rebuild_heap() {
  heap_.clear();
  for (auto& [key, e] : index_) {
    if (e.dirty) continue;  // D24: never in GC order
    e.heap_tick = e.last_access;
    heap_.push_back(HeapItem{e.heap_tick, key});
  }
  std::make_heap(heap_.begin(), heap_.end(), std::greater<HeapItem>());
}

std::optional<SlotLocation> SlotIndex::find(const Key& key) const {
  auto e = index_.find(key);
  if (e == index_.end()) return std::nullopt;
  return e->second.at;
}

bool SlotIndex::touch(const Key& key) {
  auto e = index_.find(key);
  if (e == index_.end()) return false;
  e->second.last_access = ++tick_;  // reads and duplicate puts only bump it (D8)
  return true;
}

void SlotIndex::free_slot(uint32_t drive, uint64_t slot) {
  --slots_used_;
  if (hold_) {  // zeroed by the Store, then release_held (D5, D14); still counted as used
    held_.emplace_back(drive, slot);
    ++held_out_;
    return;
  }
  free_[drive].push_back(slot);
  stale_[drive].insert(slot);  // its header may still verify until close() zeroes it (D5)
}

void SlotIndex::erase_entry(std::unordered_map<Key, Entry, KeyHash>::iterator e) {
  if (e->second.dirty) --dirty_count_;
  index_.erase(e);
}

bool SlotIndex::remove(const Key& key) {
  if (auto e = index_.find(key); e != index_.end()) {
    const SlotLocation at = e->second.at;
    erase_entry(e);  // index entry first, then the slot (D4)
    free_slot(at.drive, at.slot);
    return true;
  }
  if (auto p = pending_.find(key); p != pending_.end() && !p->second.cancelled) {
    p->second.cancelled = true;
    return true;
  }
  return false;
}

bool SlotIndex::drop_if_at(const Key& key, const SlotLocation& at) {
  auto e = index_.find(key);
  if (e == index_.end() || e->second.at.drive != at.drive || e->second.at.slot != at.slot)
    return false;
  erase_entry(e);  // index entry first, then the slot (D4)
  free_slot(at.drive, at.slot);
  return true;
}

bool SlotIndex::gc_due() const noexcept {
  return static_cast<double>(slots_used_) >= gc_high_ * static_cast<double>(slots_total_);
}

uint64_t SlotIndex::gc_target() const noexcept {
  return static_cast<uint64_t>(std::floor(gc_low_ * static_cast<double>(slots_total_)));
}

// Reclaim coldest entries until `target_used` slots are allocated (D4, D8).
size_t SlotIndex::collect_to(uint64_t target_used) {
  const auto cmp = std::greater<HeapItem>();
  size_t reclaimed = 0;
  while (slots_used_ > target_used && !heap_.empty()) {
    std::pop_heap(heap_.begin(), heap_.end(), cmp);
    const HeapItem item = heap_.back();
    heap_.pop_back();
    auto it = index_.find(item.key);
    if (it == index_.end() || it->second.heap_tick != item.tick) continue;  // stale element
    Entry& e = it->second;
    if (e.last_access > item.tick) {  // touched since it was pushed: re-file it
      e.heap_tick = e.last_access;
      heap_.push_back(HeapItem{e.heap_tick, item.key});
      std::push_heap(heap_.begin(), heap_.end(), cmp);
      continue;
    }
    if (e.dirty) continue;  // D24: never reclaimed (not in the heap; defensive)
    const SlotLocation victim = e.at;
    index_.erase(it);  // index entry first, then the slot (D4)
    free_slot(victim.drive, victim.slot);
    ++reclaimed;
  }
  return reclaimed;
}

// Rebuild the index, slot pool and GC order from the scanned slot headers (D7).
size_t SlotIndex::load(std::vector<FoundSlot> found, uint32_t& next_seq) {
  index_.clear();
  pending_.clear();
  heap_.clear();
  held_.clear();
  held_out_ = 0;
  ++generation_;
  dirty_count_ = 0;
  for (auto& s : stale_) s.clear();
  std::vector<std::vector<bool>> used(slot_counts_.size());
  for (size_t d = 0; d < slot_counts_.size(); ++d) used[d].assign(slot_counts_[d], false);
  for (const FoundSlot& f : found)
    VITRIFY_EXPECT(f.drive < slot_counts_.size() && f.s.slot < slot_counts_[f.drive],
                   "load: slot " + std::to_string(f.s.slot) + " of drive " +
                       std::to_string(f.drive) + " is out of range");
  // Oldest writes first: they become the coldest GC entries; a later duplicate wins. Ties
  // (only possible after seq wrapped) break on (drive, slot), so the result is deterministic.
  std::sort(found.begin(), found.end(), [](const FoundSlot& a, const FoundSlot& b) {
    if (a.s.seq != b.s.seq) return a.s.seq < b.s.seq;
    if (a.drive != b.drive) return a.drive < b.drive;
    return a.s.slot < b.s.slot;
  });
  for (const FoundSlot& f : found) {
    next_seq = std::max(next_seq, f.s.seq + 1);
    auto it = index_.find(f.s.key);
    if (it != index_.end()) {  // an older copy of the same key: its slot is free again
      used[it->second.at.drive][it->second.at.slot] = false;
      stale_[it->second.at.drive].insert(it->second.at.slot);
    }
    const uint64_t t = ++tick_;
    index_[f.s.key] = Entry{SlotLocation{f.drive, f.s.slot, f.s.payload_len}, t,
                            f.s.dirty ? 0 : t, f.s.dirty};
    used[f.drive][f.s.slot] = true;
  }
  for (auto& [key, e] : index_) {
    if (e.dirty) {
      ++dirty_count_;
      continue;  // D24: out of GC order
    }
    heap_.push_back(HeapItem{e.heap_tick, key});
  }
  std::make_heap(heap_.begin(), heap_.end(), std::greater<HeapItem>());
  slots_used_ = index_.size();
  for (size_t d = 0; d < slot_counts_.size(); ++d) {
    free_[d].clear();
    for (uint64_t s = used[d].size(); s-- > 0;)
      if (!used[d][s]) free_[d].push_back(s);
  }
  return index_.size();
}

std::vector<Joiner> SlotIndex::clear() {
  std::vector<Joiner> joiners;
  for (auto& [key, p] : pending_)
    for (Joiner& j : p.joiners) joiners.push_back(std::move(j));
  pending_.clear();
  index_.clear();
  heap_.clear();
  held_.clear();
  held_out_ = 0;
  ++generation_;
  dirty_count_ = 0;
  slots_used_ = 0;
  reset_pool();
  for (auto& s : stale_) s.clear();  // the new slab id makes every old slot inert (D7)
  return joiners;
}

}  // namespace vitrify::disk
