// Span snapshots: dump the bytes of a span of a VMM region (the "warmup gap") to host memory or
// to a span file, and restore them later, possibly in a fresh process.
//
// ORDERING (freeze): dump the span BEFORE the engine empties its caching allocator
// (torch.cuda.empty_cache()). After that, blocks the allocator freed are unmapped, holes appear
// in the span, and the bytes they held are gone. dump() tolerates holes (it keeps only what is
// mapped) but cannot bring back what was released.
//
// Addresses vs offsets: a span is given as offsets [start, end) from `base` (the region's base);
// intervals are offsets too, so a snapshot restores at another base (relocation) unchanged.
//
// The design note with the span-file format and the numbered invariants is
// csrc/src/snapshot/DESIGN.md.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "vitrify/aligned.hpp"
#include "vitrify/error.hpp"
#include "vitrify/file_io.hpp"

namespace vitrify::snapshot {

// ---- interval arithmetic (pure) ---------------------------------------------------------------

// A half-open range [begin, end) of region offsets. Empty when begin >= end.
struct Interval {
  uint64_t begin = 0;
  uint64_t end = 0;
  uint64_t size() const noexcept { return end > begin ? end - begin : 0; }
  bool empty() const noexcept { return end <= begin; }
  friend bool operator==(const Interval&, const Interval&) = default;
};
using Intervals = std::vector<Interval>;

// Sorted by begin, empty intervals dropped, overlapping and touching intervals merged.
Intervals merge(Intervals v);
// Each interval cut to [0, ceiling); what lies at or above `ceiling` is dropped. Order kept.
Intervals clamp(const Intervals& v, uint64_t ceiling);
// Intersection of every interval with [lo, hi). Order kept; empty results dropped.
Intervals intersect(const Intervals& v, uint64_t lo, uint64_t hi);
// Sum of sizes.
uint64_t total_bytes(const Intervals& v) noexcept;
// [start, end) split where (base + offset) crosses a multiple of `granularity`: the trial-copy
// pieces of dump(). First and last pieces may be partial. Empty for an empty span.
Intervals split_aligned(uint64_t base, uint64_t start, uint64_t end, uint64_t granularity);
// True when the intervals are sorted, non-empty, and neither overlap nor touch (merge's output).
bool is_normalized(const Intervals& v) noexcept;

// ---- copy backends ------------------------------------------------------------------------------

// Keeps host memory registered for asynchronous copies; unregisters on destruction.
class Pinned {
 public:
  virtual ~Pinned() = default;
};

// How dump/restore reach device memory. The driver backend is the real one; HostBackend stands
// in for a device on CPU-only machines (tests), with holes that behave like unmapped pages.
class CopyBackend {
 public:
  virtual ~CopyBackend() = default;
  // Device [src, src+n) -> host dst, synchronous. False when part of the range is not mapped
  // (the driver's synchronous CUDA_ERROR_INVALID_VALUE; nothing is left broken); any other
  // failure throws. dst's content is unspecified after a false return.
  virtual bool try_to_host(void* dst, uint64_t src, size_t n) = 0;
  // Host src -> device [dst, dst+n), synchronous; throws on any failure (unmapped included).
  virtual void to_device(uint64_t dst, const void* src, size_t n) = 0;
  // Asynchronous host -> device on `lane` (0 or 1); src must stay untouched until wait(lane).
  // n == 0 copies nothing but still marks the lane, so wait(lane) orders after earlier copies.
  virtual void to_device_async(uint64_t dst, const void* src, size_t n, int lane) = 0;
  // Block until every copy issued on `lane` has completed; throws a copy's failure.
  virtual void wait(int lane) = 0;
  // Register [p, p+n) for fast (DMA) copies for the returned object's lifetime.
  virtual std::unique_ptr<Pinned> pin(void* p, size_t n) = 0;
};

// The CUDA driver: cuMemcpyDtoH / cuMemcpyHtoD, cuMemcpyHtoDAsync on one stream with an event per
// lane, cuMemHostRegister for pinning. Makes the device's primary context current for its
// lifetime; use it on one thread.
std::unique_ptr<CopyBackend> make_driver_backend(int device);

// Host memory posing as a device: addresses [base(), base()+size()) with `holes` (offsets)
// unmapped. A copy touching a hole or leaving the range fails like the driver's (try_to_host ->
// false, to_device -> throws CudaError CUDA_ERROR_INVALID_VALUE) and writes nothing. base() is
// aligned to `alignment` (like a VMM reservation to its granularity).
class HostBackend final : public CopyBackend {
 public:
  HostBackend(size_t size, Intervals holes, size_t alignment = 2u << 20);
  uint64_t base() const noexcept { return reinterpret_cast<uint64_t>(mem_.data()); }
  size_t size() const noexcept { return size_; }
  uint8_t* data() noexcept { return mem_.data(); }
  const Intervals& holes() const noexcept { return holes_; }
  // Counters, for tests: synchronous device->host attempts (failed ones included) and bytes
  // written to the "device".
  uint64_t to_host_calls() const noexcept { return to_host_calls_; }
  uint64_t bytes_to_device() const noexcept { return bytes_to_device_; }
  // Deferred mode: to_device_async only queues the copy and wait(lane) performs it, reading the
  // source then — so a pipeline that reuses a staging buffer before wait() restores wrong bytes.
  void set_deferred_async(bool on) noexcept { deferred_ = on; }

  bool try_to_host(void* dst, uint64_t src, size_t n) override;
  void to_device(uint64_t dst, const void* src, size_t n) override;
  void to_device_async(uint64_t dst, const void* src, size_t n, int lane) override;
  void wait(int lane) override;
  std::unique_ptr<Pinned> pin(void* p, size_t n) override;

 private:
  bool mapped(uint64_t addr, size_t n) const noexcept;
  AlignedBuffer mem_;
  size_t size_;
  Intervals holes_;
  uint64_t to_host_calls_ = 0;
  uint64_t bytes_to_device_ = 0;
  bool deferred_ = false;
  struct Pending { uint64_t dst; const void* src; size_t n; };
  std::vector<Pending> lanes_[2];
};

// ---- in-memory snapshots -------------------------------------------------------------------------

// The bytes of the mapped parts of a span: `intervals` (normalized offsets) and their bytes back
// to back in `data` (interval i starts at the sum of the sizes before it).
struct Snapshot {
  uint64_t base = 0;  // where it was dumped from (informational; restore takes its own base)
  uint64_t start = 0, end = 0;  // the span that was asked for
  uint64_t granularity = 0;
  Intervals intervals;
  AlignedBuffer data;            // capacity >= total_bytes(intervals)
  std::unique_ptr<Pinned> pin;   // keeps `data` registered when dump(pin=true); released first
  uint64_t bytes() const noexcept { return total_bytes(intervals); }

  Snapshot() = default;
  Snapshot(Snapshot&&) noexcept = default;
  Snapshot& operator=(Snapshot&& o) noexcept {
    pin.reset();
    base = o.base; start = o.start; end = o.end; granularity = o.granularity;
    intervals = std::move(o.intervals);
    data = std::move(o.data);
    pin = std::move(o.pin);
    return *this;
  }
  ~Snapshot() { pin.reset(); }  // unregister before the buffer is freed
};

// Copy the mapped parts of [base+start, base+end) to host memory. One contiguous copy when the
// whole span is mapped (one interval); otherwise trial copies per `granularity`-aligned piece,
// keeping the runs that copied cleanly. `pin` registers the host buffer (restore then copies at
// DMA speed). Call BEFORE the engine empties its caching allocator (see the top of this file).
Snapshot dump(CopyBackend& be, uint64_t base, uint64_t start, uint64_t end,
              uint64_t granularity = 2ull << 20, bool pin = false);

struct RestoreStats {
  uint64_t bytes_written = 0;   // copied to the device
  uint64_t bytes_dropped = 0;   // at or above the ceiling, never written
  uint64_t intervals_written = 0;
};

// Copy every interval of `snap` to base + offset, clamped to [0, ceiling): bytes at or above the
// ceiling (the last mapped offset of the region) are dropped, never written. The caller then
// sets the region's cursor.
RestoreStats restore(CopyBackend& be, const Snapshot& snap, uint64_t base, uint64_t ceiling);

// ---- span files (the bulk path) ------------------------------------------------------------------

// A span file is corrupt, truncated, or not a span file. Names the file and the part (header,
// table, chunk index) that failed.
class SpanFileError : public Error {
 public:
  using Error::Error;
};

// Called after each chunk with (bytes done, bytes total); no vitrify lock is held during the call.
using Progress = std::function<void(uint64_t done, uint64_t total)>;

struct FileOptions {
  uint64_t chunk_bytes = 64ull << 20;   // staging buffer size; multiple of 4096
  uint64_t granularity = 2ull << 20;    // trial-copy piece size on a span with holes
  file_io::DirectIo direct_io = file_io::DirectIo::kAuto;
  // restore: concurrent reads per staging chunk (parts of chunk_bytes / read_lanes), 1..64
  unsigned read_lanes = 4;
  Progress progress;                    // optional
};

// What a span file's header and tables say.
struct SpanFileInfo {
  uint32_t version = 0;
  uint64_t base = 0, start = 0, end = 0;
  uint64_t chunk_bytes = 0, granularity = 0;
  Intervals intervals;
  uint64_t data_bytes = 0;
  std::vector<uint32_t> chunk_crcs;
  uint64_t file_bytes = 0;  // what the header says the file's size is
};

struct FileStats {
  uint64_t bytes = 0;            // span bytes written to / read from the file
  uint64_t bytes_written = 0;    // restore: copied to the device
  uint64_t bytes_dropped = 0;    // restore: above the ceiling, never written
  Intervals intervals;           // dump: what was mapped; restore: what was written
  bool direct_io = false;        // O_DIRECT was used
  double seconds = 0;
  uint64_t file_bytes = 0;       // dump: the file's size
  uint32_t file_crc32c = 0;      // dump: CRC32C of the whole file (= file_crc32c(path))
};

// Dump the mapped parts of [base+start, base+end) into a new span file at `path` (replaced if
// it exists; written in place, durable (fdatasync) before returning). Pipelined: device ->
// staging buffer A while a writer thread checksums and writes staging buffer B.
FileStats dump_to_file(CopyBackend& be, uint64_t base, uint64_t start, uint64_t end,
                       const std::string& path, const FileOptions& opt = {});

// The readers below open their file with file_io::open_for_reading: a symbolic link at `path`
// is never followed (std::system_error ELOOP) and a FIFO, socket, device (EINVAL) or directory
// (EISDIR) is refused without blocking, one line naming the path.
//
// Restore a span file to base + offset, clamped to [0, ceiling). Pipelined: a reader thread
// fills staging buffer A from the file while buffer B's bytes, once their chunk CRC verified,
// copy to the device asynchronously. A CRC mismatch throws SpanFileError naming the chunk; the
// bad chunk is never written (earlier chunks were: the span is then undefined, fall back).
FileStats restore_from_file(CopyBackend& be, const std::string& path, uint64_t base,
                            uint64_t ceiling, const FileOptions& opt = {});

// Header + tables only (checks magic, version, header and table CRCs, file size).
SpanFileInfo read_span_file_info(const std::string& path);

// Read the whole file and verify every chunk CRC; throws SpanFileError on the first mismatch.
void verify_span_file(const std::string& path, const FileOptions& opt = {});

// CRC32C of a whole file, read in large blocks (for archive manifests). Throws OSError.
uint32_t file_crc32c(const std::string& path);

// ---- a VMM span for tests and benchmarks ---------------------------------------------------------

// A reservation of `size` bytes (hint `base_hint`, 0 = anywhere) with the granules whose
// `mapped[i]` is true backed by physical memory (runs of mapped granules share one allocation).
// The region allocator is the production owner of VMM memory; this exists so snapshot tests and
// benchmarks can build spans with holes at chosen places.
class ScratchSpan {
 public:
  ScratchSpan(int device, uint64_t size, uint64_t base_hint, const std::vector<bool>& mapped);
  ~ScratchSpan();
  ScratchSpan(const ScratchSpan&) = delete;
  ScratchSpan& operator=(const ScratchSpan&) = delete;
  uint64_t base() const noexcept { return base_; }
  uint64_t size() const noexcept { return size_; }
  uint64_t granularity() const noexcept { return granularity_; }
  int device() const noexcept { return device_; }
  // Plain synchronous copies at an offset (throw CudaError over a hole).
  void write(uint64_t offset, const void* src, size_t n);
  void read(uint64_t offset, void* dst, size_t n) const;

 private:
  struct Owners;  // the region's VMM owners (src/region/vmm.hpp): one reservation, its mappings
  int device_;
  uint64_t base_ = 0, size_ = 0, granularity_ = 0;
  std::unique_ptr<Owners> owners_;
};

// The hardware baseline for restore benchmarks: seconds of the fastest of `reps` single
// cuMemcpyHtoD calls of `bytes` from one registered (pinned) host buffer to device address
// `dst` (registration not timed).
double measure_pinned_h2d(int device, uint64_t dst, uint64_t bytes, int reps = 3);

}  // namespace vitrify::snapshot
