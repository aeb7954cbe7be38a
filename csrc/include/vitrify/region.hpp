// The VMM region allocator: one reserved virtual range [base, base+size) per Region, physical
// memory mapped into it at a monotonic cursor, so the same allocation sequence lands at the same
// addresses in every process (the determinism FREEZE/THAW relies on).
// Invariants are numbered in csrc/src/region/DESIGN.md (R1..R15); tests cite them.
//
//   region::Layout   pure bookkeeping (cursor, rounding, chunks, checkpoints): no driver calls
//   Region           Layout + the driver objects (reservation, physical handles, mappings)
//   C ABI            vitrify_region_malloc / vitrify_region_free route to the active region of a device
//                    (for torch.cuda.memory.CUDAPluggableAllocator)
#pragma once

#include <sys/types.h>

#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "vitrify/error.hpp"

namespace vitrify {

// The driver would not reserve the exact range asked for (it is in use, or the driver picked
// another address). Python: vitrify.RegionAddressError (a RuntimeError).
class AddressUnavailable : public Error {
 public:
  using Error::Error;
};

namespace region {

constexpr uint64_t kMiB = uint64_t(1) << 20;
constexpr uint64_t kGiB = uint64_t(1) << 30;
// The least address space a Region reserves, whatever its size (see reserve_exact, R2).
constexpr uint64_t kMinReservation = kGiB;
constexpr uint64_t kTiB = uint64_t(1) << 40;

// The deterministic base search (base=None), invariant R2: candidates are
// kSearchFirst + k * round_up(size, 1 TiB) for k = 0, 1, ..., at most kSearchMaxCandidates of
// them, each ending at or below kSearchLimit. The first candidate the driver reserves exactly wins.
// kSearchFirst sits 2 GiB into a 4 GiB window (upper address half 0x6001 = 24577): a pair of
// 32-bit integers (x, 24577) with x < 2 GiB reads as an address *below* the region, and the next
// window starts at region offset kGuardPhase, where R13 keeps the first kGuardBytes free. Graph
// relocation still classifies words by parameter layout and live allocations (graph DESIGN.md);
// this layout is what keeps integer pairs from pointing into a live allocation.
constexpr uint64_t kSearchFirst = 0x600180000000ull;  // 96 TiB + 6 GiB
constexpr uint64_t kSearchLimit = 0x7f0000000000ull;  // 127 TiB (exclusive end)
constexpr int kSearchMaxCandidates = 16;
// Default chunk for preallocate(): one cuMemMap per GiB (~110 µs on H200 vs ~53 µs per 2 MiB).
constexpr uint64_t kDefaultPreallocChunk = kGiB;

// R13 window guards. Where a 4 GiB address window starts, a word holding two 32-bit integers
// (x, w) reads as window w's start + x: a dimension w (24577) next to a small x is the pattern
// relocation must never mistake for a pointer. Region offsets kGuardPhase + k * kWindow (the
// window starts when the base is 2 GiB into a window, as every default base is) begin a guard of
// kGuardBytes that no allocation covers, so such words point into no live allocation and stay
// integers. An allocation larger than kWindow - kGuardBytes cannot avoid a guard and is placed at
// the cursor (relocation then refuses ambiguous words there; graph DESIGN.md).
constexpr uint64_t kWindow = uint64_t(4) << 30;
constexpr uint64_t kGuardPhase = uint64_t(2) << 30;
constexpr uint64_t kGuardBytes = 2 * kMiB;
// The least offset o >= start, a multiple of `align` (a power of two), at which [o, o + bytes)
// overlaps no guard; `start` rounded up to `align` where no such placement exists (bytes too
// large). Pure; never overflows (returns UINT64_MAX when rounding would).
uint64_t skip_guards(uint64_t start, uint64_t bytes, uint64_t align) noexcept;

// n rounded up to a multiple of `granularity` (> 0). Throws std::invalid_argument on overflow.
uint64_t round_up(uint64_t n, uint64_t granularity);
// The candidate bases for a region of `size` bytes (pure; empty when size > the search window).
std::vector<uint64_t> candidate_bases(uint64_t size);
// "[0x600000000000, 0x600040000000)"
std::string format_range(uint64_t begin, uint64_t end);
std::string hex(uint64_t v);

// One mapped chunk of an exportable region, exported (Region::export_range, R15 in DESIGN.md):
// [offset, offset + size) relative to the region's base, as a new close-on-exec POSIX fd that
// the caller owns and closes.
struct ExportedChunk {
  uint64_t offset = 0;
  uint64_t size = 0;
  int fd = -1;
};

// An offset range inside the region.
struct Span {
  uint64_t offset = 0;
  uint64_t size = 0;
  uint64_t end() const { return offset + size; }
  bool operator==(const Span&) const = default;
};

struct LayoutStats {
  uint64_t size = 0, granularity = 0;
  uint64_t cursor = 0;         // next allocation offset
  uint64_t frontier = 0;       // end of the highest chunk ever created (0 when none)
  uint64_t mapped_bytes = 0;   // bytes in chunks still mapped
  uint64_t chunks = 0;         // chunks still mapped
  uint64_t live_allocations = 0, live_bytes = 0;
  uint64_t allocations_total = 0, frees_total = 0;
  uint64_t chunks_created = 0, chunks_released = 0;
};

// Pure bookkeeping of one region: cursor policy, rounding, chunk liveness, checkpoints.
// Planning never mutates; commit_* apply a plan after the driver work succeeded (invariant R9).
class Layout {
 public:
  Layout(uint64_t size, uint64_t granularity);

  struct AllocPlan {
    Span alloc;                      // where the allocation goes (the cursor, or past a guard: R13)
    std::optional<Span> new_chunk;   // the part beyond the mapped frontier, to map now
  };
  // Throws std::invalid_argument for bytes == 0, vitrify::OutOfSpace when it does not fit.
  // at_cursor: exactly at the cursor even over a window guard (THAW claiming a frozen range,
  // R13); otherwise past any guard the allocation would cover.
  AllocPlan plan_allocate(uint64_t bytes, bool at_cursor = false) const;
  // Returns the chunks to release now: idle ones that a guard skip (R13) moved the cursor past.
  std::vector<Span> commit_allocate(const AllocPlan& plan);
  // Frees the allocation starting at `offset`; returns the chunks that must be released now
  // (R6). Throws std::invalid_argument when no live allocation starts there.
  std::vector<Span> free(uint64_t offset);

  // The chunks to map so that [cursor, upto) is mapped, in pieces of chunk_bytes (R7).
  std::vector<Span> plan_preallocate(uint64_t upto, uint64_t chunk_bytes) const;
  void commit_chunks(const std::vector<Span>& chunks);

  // Moves the cursor forward to n (R4); returns the chunks that must be released now.
  std::vector<Span> set_offset(uint64_t n);

  // Records the cursor under `name` (R10); returns it.
  uint64_t checkpoint(const std::string& name);
  const std::vector<std::pair<std::string, uint64_t>>& checkpoints() const { return checkpoints_; }

  // The live allocation containing `offset`, if any.
  std::optional<Span> allocation_containing(uint64_t offset) const;
  // Every live allocation, ascending.
  std::vector<Span> live_allocations() const;
  std::vector<Span> mapped_chunks() const;
  LayoutStats stats() const;
  uint64_t cursor() const { return cursor_; }
  uint64_t size() const { return size_; }
  uint64_t granularity() const { return granularity_; }

 private:
  struct Chunk {
    uint64_t size;
    uint64_t live;  // live allocations overlapping it
  };
  std::vector<Span> release_idle_below_cursor();

  uint64_t size_, granularity_;
  uint64_t cursor_ = 0;
  uint64_t frontier_ = 0;
  std::map<uint64_t, Chunk> chunks_;       // offset -> chunk, mapped only
  std::map<uint64_t, uint64_t> allocs_;    // offset -> size, live only
  std::vector<std::pair<std::string, uint64_t>> checkpoints_;
  LayoutStats counters_;
};

}  // namespace region

struct RegionStats {
  uint64_t base = 0;
  int device = 0;
  bool stopped = false;
  region::LayoutStats layout;
  uint64_t fallback_live = 0, fallback_bytes = 0;  // ordinary allocations made while stopped
  // R17: chunks whose physical memory is released (release_memory), and the host bytes kept
  // for their restore
  uint64_t released_chunks = 0, released_bytes = 0, kept_bytes = 0;
};

namespace region {
// One chunk whose physical memory release_memory gave back (R17): [offset, offset + size)
// relative to the base; kept: its bytes wait in host memory for restore_memory.
struct ReleasedChunk {
  uint64_t offset = 0;
  uint64_t size = 0;
  bool kept = false;
};
}  // namespace region

namespace region::detail {
class Mapping;
class Reservation;
}  // namespace region::detail

// One VMM reservation and the physical memory mapped into it. Thread-safe. Not movable: the
// C ABI registry holds its address.
class Region {
 public:
  // base: the exact start to reserve (multiple of the granularity), or nullopt for the
  // deterministic search over region::candidate_bases(size). size is rounded up to the
  // granularity. Throws AddressUnavailable naming the range when the driver returns another
  // address (the stray reservation is freed first).
  // exportable: every physical chunk is created exportable as a POSIX fd (and the granularity
  // queried for that handle type), so export_range can hand the chunks to another process (R15).
  // The device's support is checked here: vitrify::Error naming the device and the attribute when
  // it cannot; DriverUnavailable naming cuMemExportToShareableHandle when the driver lacks it.
  Region(std::optional<uint64_t> base, uint64_t size, int device, bool exportable = false);
  ~Region();
  Region(const Region&) = delete;
  Region& operator=(const Region&) = delete;

  // Unmaps and releases everything, frees the reservation, leaves the C ABI registry.
  // Idempotent; every later call except the getters throws.
  void close() noexcept;
  bool closed() const;

  uint64_t base() const { return base_; }
  uint64_t size() const { return size_; }
  uint64_t end() const { return base_ + size_; }
  uint64_t granularity() const { return granularity_; }
  int device() const { return device_; }
  bool contains(uint64_t ptr) const { return ptr >= base_ && ptr < base_ + size_; }
  bool exportable() const { return exportable_; }

  // The mapped chunks covering [offset, offset + nbytes) (offsets relative to base), whole and
  // ascending, each exported (cuMemExportToShareableHandle) as a new FD_CLOEXEC fd that the
  // caller owns and closes; the peer maps them as one range with SharedBuffer::import_fds (R15).
  // Errors: vitrify::Error when the region is not exportable or closed; std::invalid_argument
  // for nbytes 0, a range outside the region, or a range not wholly mapped (naming the first
  // unmapped offset); CudaError for a failing export, after closing the fds already made.
  std::vector<region::ExportedChunk> export_range(uint64_t offset, uint64_t nbytes) const;

  // `bytes` rounded up to the granularity at the cursor (past a window guard it would cover,
  // R13, unless at_cursor); maps what is not mapped yet.
  // While stopped: an ordinary cuMemAlloc allocation, cursor untouched (R8).
  uint64_t allocate(uint64_t bytes, bool at_cursor = false);
  // Frees an allocation of this region (its start address) or a fallback allocation.
  void free(uint64_t ptr);
  // True when `ptr` is the start of a live allocation of this region or a fallback one.
  bool owns(uint64_t ptr) const;

  // stop(): route allocations to the ordinary allocator; returns whether it was stopped before.
  bool stop();
  bool resume();
  bool stopped() const;

  uint64_t offset() const;
  void set_offset(uint64_t n);
  // Maps [cursor, upto) in chunks of chunk_bytes; returns the bytes newly mapped.
  uint64_t preallocate(uint64_t upto, uint64_t chunk_bytes = region::kDefaultPreallocChunk);
  uint64_t checkpoint(const std::string& name);
  std::vector<std::pair<std::string, uint64_t>> checkpoints() const;
  RegionStats stats() const;
  // The live allocations of the region (not fallback ones), ascending offsets.
  std::vector<region::Span> live_allocations() const;

  // R17 (DESIGN.md): gives the physical memory behind the chunks of [offset, offset + nbytes)
  // back to the driver (cuMemUnmap + cuMemRelease) and keeps the addresses: the reservation,
  // the cursor, the live allocations and the checkpoints are unchanged, so graphs captured
  // against them stay valid once restore_memory maps memory there again. The range must cover
  // whole mapped chunks (std::invalid_argument naming a chunk it cuts, or an offset no chunk
  // maps); chunks released already are skipped. keep: each chunk's bytes are copied to pinned
  // host memory first, for restore_memory (a failing copy leaves everything mapped). Returns the
  // bytes newly released. Nothing may touch the range meanwhile (the caller pauses its engine).
  uint64_t release_memory(uint64_t offset, uint64_t nbytes, bool keep);
  // Maps new physical memory at the same addresses for every released chunk of the range and
  // copies back what release_memory kept (zeros where it kept nothing); all or nothing.
  // Returns the bytes restored (0 when nothing in the range was released).
  uint64_t restore_memory(uint64_t offset, uint64_t nbytes);
  // The chunks released now, ascending.
  std::vector<region::ReleasedChunk> released() const;

  // Synchronous copies into / out of one live allocation (checked: ValueError otherwise).
  void write(uint64_t dst, const void* src, size_t n);
  void read(uint64_t src, void* dst, size_t n) const;

  std::string describe() const;  // "[0x..., 0x...) on device 0"

 private:
  void check_open() const;
  std::unique_ptr<region::detail::Mapping> map_chunk(const region::Span& s) const;
  // Unmaps the chunks the Layout gave up (R6); returns "" or the failures, for one warning
  // logged after the lock is dropped. Caller holds mu_.
  std::string release_chunks(const std::vector<region::Span>& release);
  // Locates the live allocation (region or fallback) holding [ptr, ptr+n).
  void check_live_range(uint64_t ptr, size_t n, const char* what) const;

  mutable std::mutex mu_;
  int device_ = 0;
  uint64_t granularity_ = 0;
  bool exportable_ = false;
  uint64_t base_ = 0, size_ = 0;
  bool stopped_ = false;
  bool closed_ = false;
  std::unique_ptr<region::detail::Reservation> reservation_;
  std::unique_ptr<region::Layout> layout_;
  std::map<uint64_t, std::unique_ptr<region::detail::Mapping>> mappings_;  // chunk offset -> mapping
  struct Fallback;
  std::map<uint64_t, std::unique_ptr<Fallback>> fallback_;  // ptr -> ordinary allocation
  // R17: chunk offset -> its size and the host copy release_memory kept (null: none)
  struct Released;
  std::map<uint64_t, std::unique_ptr<Released>> released_;
  // std::invalid_argument unless 0 < nbytes and [offset, offset + nbytes) lies in the region.
  void check_inside(const char* what, uint64_t offset, uint64_t nbytes) const;
  // The mapped chunks of [offset, end), whole, ascending; the released ones in it go to
  // *released (may be null). std::invalid_argument for a chunk the range cuts or a hole.
  std::vector<uint64_t> chunks_of(uint64_t offset, uint64_t end, const char* what,
                                  std::vector<uint64_t>* released) const;
};

namespace region {
// The C ABI's routing (R11): vitrify_region_malloc on `device` allocates from the active region of
// that device; vitrify_region_free finds the live region owning the pointer.
void set_active(Region* r, int device);  // nullptr clears
Region* active(int device);
// The last error the C ABI hit on this thread: set by a failing malloc or free, cleared by a
// successful malloc (a successful free leaves it).
std::string last_abi_error();
// Registry of live regions (Region's constructor / close() call these).
void register_region(Region* r);
void unregister_region(Region* r) noexcept;
}  // namespace region

}  // namespace vitrify

// For torch.cuda.memory.CUDAPluggableAllocator (exported with default visibility from the
// Python extension): never throw; failures return nullptr / are logged and kept for
// vitrify::region::last_abi_error().
extern "C" {
__attribute__((visibility("default"))) void* vitrify_region_malloc(ssize_t size, int device,
                                                                void* stream);
__attribute__((visibility("default"))) void vitrify_region_free(void* ptr, ssize_t size, int device,
                                                             void* stream);
}
