// In-memory span snapshots: dump (one copy, or trial copies around holes) and clamped restore.
#include <string>

#include "vitrify/log.hpp"
#include "vitrify/snapshot.hpp"

namespace vitrify::snapshot {

namespace {
void check_span(uint64_t base, uint64_t start, uint64_t end, uint64_t granularity) {
  VITRIFY_EXPECT(start <= end, "span start " + std::to_string(start) + " is past its end " +
                                std::to_string(end));
  VITRIFY_EXPECT(granularity > 0 && (granularity & (granularity - 1)) == 0,
              "granularity must be a power of two, got " + std::to_string(granularity));
  VITRIFY_EXPECT(base + end >= base, "span end " + std::to_string(end) + " overflows base " +
                                      std::to_string(base));
}
}  // namespace

Snapshot dump(CopyBackend& be, uint64_t base, uint64_t start, uint64_t end, uint64_t granularity,
              bool pin) {
  check_span(base, start, end, granularity);
  Snapshot s;
  s.base = base;
  s.start = start;
  s.end = end;
  s.granularity = granularity;
  const uint64_t n = end - start;
  if (n == 0) return s;
  s.data = AlignedBuffer(n, 4096);
  if (pin) s.pin = be.pin(s.data.data(), s.data.size());

  // Invariant 2: a fully mapped span is one copy and one interval.
  if (be.try_to_host(s.data.data(), base + start, n)) {
    s.intervals.push_back({start, end});
    return s;
  }
  // Invariant 3: otherwise, granule-aligned trial copies; successful pieces are packed back to
  // back into `data` in span order, so the packed bytes are exactly the merged intervals' bytes.
  uint64_t packed = 0;
  Intervals got;
  for (const Interval& piece : split_aligned(base, start, end, granularity)) {
    if (be.try_to_host(s.data.data() + packed, base + piece.begin, piece.size())) {
      got.push_back(piece);
      packed += piece.size();
    }
  }
  s.intervals = merge(std::move(got));
  if (log::enabled(log::kInfo))
    log::info("snapshot: span [" + std::to_string(start) + ", " + std::to_string(end) +
              ") has holes; kept " + std::to_string(packed) + " bytes in " +
              std::to_string(s.intervals.size()) + " intervals");
  return s;
}

RestoreStats restore(CopyBackend& be, const Snapshot& snap, uint64_t base, uint64_t ceiling) {
  VITRIFY_EXPECT(is_normalized(snap.intervals), "snapshot intervals are not normalized");
  VITRIFY_EXPECT(snap.data.size() >= snap.bytes(),
              "snapshot holds " + std::to_string(snap.data.size()) + " bytes but its intervals "
              "need " + std::to_string(snap.bytes()));
  RestoreStats st;
  uint64_t src = 0;  // offset into snap.data of the current interval
  for (const Interval& i : snap.intervals) {
    const Interval c{i.begin, std::min(i.end, ceiling)};
    if (!c.empty()) {  // Invariant 4: nothing at or above the ceiling is written
      be.to_device(base + c.begin, snap.data.data() + src, c.size());
      st.bytes_written += c.size();
      ++st.intervals_written;
    }
    st.bytes_dropped += i.size() - c.size();
    src += i.size();
  }
  return st;
}

}  // namespace vitrify::snapshot
