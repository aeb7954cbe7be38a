// Pure bookkeeping of a region (no driver calls): rounding, the cursor policy, chunk liveness,
// checkpoints and the deterministic base search. Invariant numbers refer to DESIGN.md.
#include <algorithm>
#include <cinttypes>
#include <cstdio>
#include <string>

#include "vitrify/region.hpp"

namespace vitrify::region {

std::string hex(uint64_t v) {
  char b[24];
  std::snprintf(b, sizeof b, "0x%" PRIx64, v);
  return b;
}

std::string format_range(uint64_t begin, uint64_t end) {
  std::string s = "[";
  s += hex(begin);
  s += ", ";
  s += hex(end);
  s += ")";
  return s;
}

uint64_t round_up(uint64_t n, uint64_t granularity) {
  VITRIFY_EXPECT(granularity > 0, "granularity must be positive");
  const uint64_t r = n % granularity;
  if (r == 0) return n;
  VITRIFY_EXPECT(n <= UINT64_MAX - (granularity - r),
              "size " + std::to_string(n) + " overflows when rounded up to the granularity " +
                  std::to_string(granularity));
  return n + (granularity - r);
}

uint64_t skip_guards(uint64_t start, uint64_t bytes, uint64_t align) noexcept {
  auto align_up = [align](uint64_t v) -> uint64_t {
    const uint64_t m = align - 1;
    return v > UINT64_MAX - m ? UINT64_MAX : (v + m) & ~m;
  };
  uint64_t o = align_up(start);
  const uint64_t n = std::max<uint64_t>(bytes, 1);
  if (n > kWindow - kGuardBytes) return o;  // no placement avoids every guard
  // The guard at or after o's window phase: at most two moves (past one guard, then aligned).
  for (int i = 0; i < 4 && o != UINT64_MAX; ++i) {
    const uint64_t k = o < kGuardPhase ? 0 : (o - kGuardPhase) / kWindow;
    const uint64_t g = kGuardPhase + k * kWindow;  // the last guard starting at or below o, or the first
    uint64_t next = o;
    if (o >= g && o < g + kGuardBytes) {
      next = g + kGuardBytes;  // starts inside a guard
    } else {
      const uint64_t ng = o < g ? g : g + kWindow;  // the next guard above o
      if (n > ng - o) next = ng + kGuardBytes;     // would run into it
    }
    next = align_up(next);
    if (next == o) return o;
    o = next;
  }
  return o;
}

std::vector<uint64_t> candidate_bases(uint64_t size) {
  std::vector<uint64_t> out;
  if (size == 0 || size > kSearchLimit - kSearchFirst) return out;
  const uint64_t step = round_up(size, kTiB);
  for (int k = 0; k < kSearchMaxCandidates; ++k) {
    const uint64_t b = kSearchFirst + uint64_t(k) * step;
    if (b > kSearchLimit || kSearchLimit - b < size) break;
    out.push_back(b);
  }
  return out;
}

Layout::Layout(uint64_t size, uint64_t granularity) : size_(size), granularity_(granularity) {
  VITRIFY_EXPECT(granularity > 0 && (granularity & (granularity - 1)) == 0,
              "granularity must be a power of two, got " + std::to_string(granularity));
  VITRIFY_EXPECT(size > 0 && size % granularity == 0,
              "region size must be a positive multiple of the granularity " +
                  std::to_string(granularity) + ", got " + std::to_string(size));
}

Layout::AllocPlan Layout::plan_allocate(uint64_t bytes, bool at_cursor) const {
  VITRIFY_EXPECT(bytes > 0, "allocation size must be positive, got 0");
  // R3: round up; an allocation that does not fit is OutOfSpace with the numbers (R5).
  const bool overflow = bytes > UINT64_MAX - granularity_;
  const uint64_t rounded = overflow ? 0 : round_up(bytes, granularity_);
  // R13: past a window guard the allocation would cover.
  const uint64_t start = overflow || at_cursor ? cursor_ : skip_guards(cursor_, rounded, granularity_);
  if (overflow || start > size_ || rounded > size_ - start) {
    throw OutOfSpace("region full: an allocation of " + std::to_string(bytes) +
                     " bytes (rounded to " + (overflow ? std::string("overflow") : std::to_string(rounded)) +
                     ") at offset " + std::to_string(std::min(start, size_)) +
                     " does not fit in the region of " + std::to_string(size_) + " bytes (" +
                     std::to_string(size_ - cursor_) + " bytes left above the cursor)");
  }
  AllocPlan p;
  p.alloc = Span{start, rounded};
  // R7: [cursor, frontier) is mapped; what the allocation needs beyond it is one new chunk (a
  // guard skipped beyond the frontier stays unmapped).
  const uint64_t mapped_to = std::max(start, frontier_);
  if (p.alloc.end() > mapped_to) p.new_chunk = Span{mapped_to, p.alloc.end() - mapped_to};
  return p;
}

std::vector<Span> Layout::commit_allocate(const AllocPlan& p) {
  const bool skipped = p.alloc.offset > cursor_;  // R13 moved it past a guard
  if (p.new_chunk) commit_chunks({*p.new_chunk});
  allocs_.emplace(p.alloc.offset, p.alloc.size);
  // R6 bookkeeping: every chunk overlapping the allocation counts it.
  auto it = chunks_.upper_bound(p.alloc.offset);
  if (it != chunks_.begin()) --it;
  for (; it != chunks_.end() && it->first < p.alloc.end(); ++it)
    if (it->first + it->second.size > p.alloc.offset) ++it->second.live;
  cursor_ = p.alloc.end();  // R1: the cursor only moves forward
  ++counters_.allocations_total;
  // Chunks a guard skip passed over that hold nothing go now (R6).
  return skipped ? release_idle_below_cursor() : std::vector<Span>{};
}

std::vector<Span> Layout::free(uint64_t offset) {
  auto a = allocs_.find(offset);
  VITRIFY_EXPECT(a != allocs_.end(),
              "offset " + std::to_string(offset) + " is not the start of a live region allocation");
  const Span s{a->first, a->second};
  allocs_.erase(a);
  ++counters_.frees_total;
  std::vector<Span> release;
  auto it = chunks_.upper_bound(s.offset);
  if (it != chunks_.begin()) --it;
  while (it != chunks_.end() && it->first < s.end()) {
    const uint64_t cend = it->first + it->second.size;
    if (cend > s.offset) {
      --it->second.live;
      // R6: a chunk goes when nothing lives in it and the cursor is past it.
      if (it->second.live == 0 && cend <= cursor_) {
        release.push_back(Span{it->first, it->second.size});
        ++counters_.chunks_released;
        it = chunks_.erase(it);
        continue;
      }
    }
    ++it;
  }
  return release;
}

std::vector<Span> Layout::plan_preallocate(uint64_t upto, uint64_t chunk_bytes) const {
  VITRIFY_EXPECT(chunk_bytes > 0, "preallocate chunk size must be positive");
  VITRIFY_EXPECT(upto <= size_, "preallocate(upto=" + std::to_string(upto) +
                                 ") is beyond the region size " + std::to_string(size_));
  const uint64_t end = round_up(upto, granularity_);
  const uint64_t chunk = round_up(chunk_bytes, granularity_);
  std::vector<Span> out;
  for (uint64_t o = std::max(cursor_, frontier_); o < end;) {
    const uint64_t n = std::min(chunk, end - o);
    out.push_back(Span{o, n});
    o += n;
  }
  return out;
}

void Layout::commit_chunks(const std::vector<Span>& chunks) {
  for (const Span& c : chunks) {
    chunks_.emplace(c.offset, Chunk{c.size, 0});
    frontier_ = std::max(frontier_, c.end());
    ++counters_.chunks_created;
  }
}

std::vector<Span> Layout::release_idle_below_cursor() {
  std::vector<Span> out;
  for (auto it = chunks_.begin(); it != chunks_.end() && it->first < cursor_;) {
    if (it->second.live == 0 && it->first + it->second.size <= cursor_) {
      out.push_back(Span{it->first, it->second.size});
      ++counters_.chunks_released;
      it = chunks_.erase(it);
    } else {
      ++it;
    }
  }
  return out;
}

std::vector<Span> Layout::set_offset(uint64_t n) {
  VITRIFY_EXPECT(n >= cursor_, "set_offset(" + std::to_string(n) + ") would move the cursor backwards from " +
                                std::to_string(cursor_) + " (the cursor only moves forward)");
  VITRIFY_EXPECT(n <= size_, "set_offset(" + std::to_string(n) + ") is beyond the region size " +
                              std::to_string(size_));
  VITRIFY_EXPECT(n % granularity_ == 0, "set_offset(" + std::to_string(n) +
                                         ") is not a multiple of the granularity " +
                                         std::to_string(granularity_));
  cursor_ = n;
  return release_idle_below_cursor();
}

uint64_t Layout::checkpoint(const std::string& name) {
  VITRIFY_EXPECT(!name.empty(), "checkpoint name must not be empty");
  for (const auto& c : checkpoints_)
    VITRIFY_EXPECT(c.first != name, "checkpoint \"" + name + "\" was already recorded at offset " +
                                     std::to_string(c.second) + " (names are unique)");
  checkpoints_.emplace_back(name, cursor_);
  return cursor_;
}

std::vector<Span> Layout::live_allocations() const {
  std::vector<Span> out;
  out.reserve(allocs_.size());
  for (const auto& [off, size] : allocs_) out.push_back({off, size});
  return out;
}

std::optional<Span> Layout::allocation_containing(uint64_t offset) const {
  auto it = allocs_.upper_bound(offset);
  if (it == allocs_.begin()) return std::nullopt;
  --it;
  if (offset < it->first + it->second) return Span{it->first, it->second};
  return std::nullopt;
}

std::vector<Span> Layout::mapped_chunks() const {
  std::vector<Span> out;
  out.reserve(chunks_.size());
  for (const auto& [o, c] : chunks_) out.push_back(Span{o, c.size});
  return out;
}

LayoutStats Layout::stats() const {
  LayoutStats s = counters_;
  s.size = size_;
  s.granularity = granularity_;
  s.cursor = cursor_;
  s.frontier = frontier_;
  s.chunks = chunks_.size();
  s.mapped_bytes = 0;
  for (const auto& [o, c] : chunks_) s.mapped_bytes += c.size;
  s.live_allocations = allocs_.size();
  s.live_bytes = 0;
  for (const auto& [o, n] : allocs_) s.live_bytes += n;
  return s;
}

}  // namespace vitrify::region
