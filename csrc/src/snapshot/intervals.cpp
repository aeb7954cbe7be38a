// Interval arithmetic for span snapshots: pure functions, no state (DESIGN.md, S1).
#include <algorithm>

#include "vitrify/snapshot.hpp"

namespace vitrify::snapshot {

Intervals merge(Intervals v) {
  std::erase_if(v, [](const Interval& i) { return i.empty(); });
  std::sort(v.begin(), v.end(),
            [](const Interval& a, const Interval& b) { return a.begin < b.begin; });
  Intervals out;
  out.reserve(v.size());
  for (const Interval& i : v) {
    if (!out.empty() && i.begin <= out.back().end)
      out.back().end = std::max(out.back().end, i.end);
    else
      out.push_back(i);
  }
  return out;
}

Intervals intersect(const Intervals& v, uint64_t lo, uint64_t hi) {
  Intervals out;
  for (const Interval& i : v) {
    const Interval c{std::max(i.begin, lo), std::min(i.end, hi)};
    if (!c.empty()) out.push_back(c);
  }
  return out;
}

Intervals clamp(const Intervals& v, uint64_t ceiling) { return intersect(v, 0, ceiling); }

uint64_t total_bytes(const Intervals& v) noexcept {
  uint64_t n = 0;
  for (const Interval& i : v) n += i.size();
  return n;
}

Intervals split_aligned(uint64_t base, uint64_t start, uint64_t end, uint64_t granularity) {
  VITRIFY_EXPECT(granularity > 0, "granularity must be positive");
  VITRIFY_EXPECT(base + end >= base, "span end " + std::to_string(end) + " overflows base " +
                                      std::to_string(base));
  Intervals out;
  uint64_t off = start;
  while (off < end) {
    const uint64_t addr = base + off;
    const uint64_t next_boundary = addr - addr % granularity + granularity;  // may wrap at 2^64
    const uint64_t piece_end =
        (next_boundary <= addr) ? end : std::min(end, off + (next_boundary - addr));
    out.push_back({off, piece_end});
    off = piece_end;
  }
  return out;
}

bool is_normalized(const Intervals& v) noexcept {
  for (size_t i = 0; i < v.size(); ++i) {
    if (v[i].empty()) return false;
    if (i > 0 && v[i].begin <= v[i - 1].end) return false;
  }
  return true;
}

}  // namespace vitrify::snapshot
