// The pinned host tier: a pool of fixed-size pages split into slabs (each one mmap and at most one
// cuMemHostRegister), page gather/scatter between strided KV layouts and contiguous blobs, and
// batched host<->GPU page copies. Invariants: csrc/src/host/DESIGN.md.
#pragma once

#include <cuda.h>

#include <atomic>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <utility>
#include <vector>

namespace vitrify::host {

constexpr size_t kGiB = size_t(1) << 30;
// The default single-registration ceiling (VITRIFY_MAX_SLAB_GB=480; the Python layer reads the env).
constexpr size_t kDefaultMaxSlabBytes = 480 * kGiB;
// Linux statfs f_type of hugetlbfs.
constexpr uint64_t kHugetlbfsMagic = 0x958458f6;

// ---- slab planning ------------------------------------------------------------------------------

struct SlabPlan {
  size_t index = 0;
  size_t first_page = 0;  // pool page index of the slab's first page
  size_t pages = 0;       // whole pages in this slab
  size_t bytes = 0;       // pages * page_bytes: the part pages use
  size_t map_bytes = 0;   // bytes mapped and registered: `bytes` rounded up to map_align
};

// Splits total_bytes (a positive multiple of page_bytes) into slabs of whole pages such that each
// slab's map_bytes (rounded up to map_align, the mapping's page size) is <= max_slab_bytes. Every
// slab but the last holds the same number of pages. Throws std::invalid_argument with the values
// when a page (rounded to map_align) cannot fit under the ceiling, or on zero/overflowing sizes.
std::vector<SlabPlan> plan_slabs(size_t total_bytes, size_t page_bytes, size_t max_slab_bytes,
                                 size_t map_align);

// ---- hugetlbfs capacity -------------------------------------------------------------------------

struct FsCapacity {
  uint64_t fs_magic = 0;     // statfs f_type
  uint64_t block_size = 0;   // f_bsize: the huge page size on hugetlbfs
  uint64_t free_blocks = 0;  // f_bavail
};
using StatfsFn = std::function<FsCapacity(const std::string& path)>;

// statfs(2) of `path`; throws std::system_error. A hugetlbfs mount without a size= limit
// reports no blocks; then free_blocks comes from the kernel's pool of that page size
// (hugetlb_free_pages).
FsCapacity statfs_capacity(const std::string& path);
// free_hugepages - resv_hugepages of the huge page size `page_bytes` under `sysfs_root`
// (/sys/kernel/mm/hugepages/hugepages-<kB>kB/); 0 when unreadable.
uint64_t hugetlb_free_pages(uint64_t page_bytes,
                            const std::string& sysfs_root = "/sys/kernel/mm/hugepages");
// Throws std::invalid_argument when `cap` is not hugetlbfs, vitrify::OutOfSpace when `needed` bytes
// exceed the free huge pages. Messages say needed vs free, the page size, and what to change.
void check_hugetlbfs_capacity(const std::string& mount, size_t needed, const FsCapacity& cap);

// ---- one registration ---------------------------------------------------------------------------

// cuMemHostRegister(ptr, bytes, PORTABLE | DEVICEMAP, and READ_ONLY for memory mapped without
// write permission) with one owner; unregisters on destruction. Refuses (std::invalid_argument,
// before any driver call) a range larger than `ceiling`.
class HostRegistration {
 public:
  HostRegistration() = default;
  HostRegistration(void* ptr, size_t bytes, int device, size_t ceiling, bool read_only = false);
  ~HostRegistration();
  HostRegistration(HostRegistration&& o) noexcept;
  HostRegistration& operator=(HostRegistration&& o) noexcept;
  HostRegistration(const HostRegistration&) = delete;
  HostRegistration& operator=(const HostRegistration&) = delete;
  void* ptr() const noexcept { return ptr_; }
  size_t bytes() const noexcept { return bytes_; }

 private:
  void release() noexcept;
  void* ptr_ = nullptr;
  size_t bytes_ = 0;
  int device_ = 0;
};

// ---- the pool -----------------------------------------------------------------------------------

enum class Registration { Auto, On, Off };

struct HostPoolOptions {
  size_t max_slab_bytes = kDefaultMaxSlabBytes;
  std::string hugetlbfs_mount;  // "" -> anonymous memory
  Registration registration = Registration::Auto;  // Auto: register when a GPU is present
  bool parallel_registration = true;               // one thread per slab (capped), else serial
  size_t registration_threads = 16;                // cap on parallel registration threads
  bool prefault = true;  // before registering, fault every page in with parallel threads
  int device = 0;                                  // whose primary context registers
  StatfsFn statfs;                                 // injectable; empty -> statfs_capacity
};

struct Segment {
  size_t slab = 0;
  size_t first_page = 0;  // pool page index
  size_t pages = 0;
  uint8_t* ptr = nullptr;  // address of first_page
  size_t bytes = 0;        // pages * page_bytes
};

struct RegistrationTiming {
  bool registered = false;
  bool parallel = false;
  size_t threads = 0;
  double seconds = 0;                // wall time of registering every slab
  double prefault_seconds = 0;       // wall time of the parallel prefault before it (0: none)
  std::vector<double> slab_seconds;  // each slab's cuMemHostRegister
};

// Faults every page of `ranges` into this process's page tables ahead of first use, on up to
// `threads` threads (64 MiB pieces): MADV_POPULATE_WRITE (`write`) or _READ, and where that
// fails, one access per `page` bytes: a write of zero when `zero_fill` (fresh memory, zero
// anyway), a read otherwise. Returns the errno of the first madvise that failed other than
// because the kernel lacks it (EINVAL), 0 otherwise. Never throws.
int populate_ranges(const std::vector<std::pair<uint8_t*, size_t>>& ranges, bool write,
                    bool zero_fill, size_t page, size_t threads) noexcept;

// Registers each of `ranges` (each at most `ceiling` bytes) with its own HostRegistration, on up
// to `max_threads` threads (1: one after another), and fills `timing` (seconds, threads, each
// range's seconds in slab_seconds). On a failure every range registered so far is unregistered
// and the first error propagates.
std::vector<HostRegistration> register_ranges(const std::vector<std::pair<void*, size_t>>& ranges,
                                              int device, size_t ceiling, size_t max_threads,
                                              bool read_only, RegistrationTiming& timing);

class HostPool {
 public:
  HostPool(size_t total_bytes, size_t page_bytes, HostPoolOptions options = {});
  ~HostPool();
  HostPool(const HostPool&) = delete;
  HostPool& operator=(const HostPool&) = delete;

  size_t total_bytes() const noexcept { return total_bytes_; }
  size_t page_bytes() const noexcept { return page_bytes_; }
  size_t num_pages() const noexcept { return total_bytes_ / page_bytes_; }
  size_t num_slabs() const noexcept { return plan_.size(); }
  size_t pages_per_slab() const noexcept { return plan_.front().pages; }
  size_t max_slab_bytes() const noexcept { return options_.max_slab_bytes; }
  size_t map_align() const noexcept { return map_align_; }
  int device() const noexcept { return options_.device; }
  const std::string& hugetlbfs_mount() const noexcept { return options_.hugetlbfs_mount; }
  const std::vector<SlabPlan>& slabs() const noexcept { return plan_; }
  const RegistrationTiming& registration() const noexcept { return timing_; }
  bool registered() const noexcept { return timing_.registered; }

  uint8_t* slab_base(size_t slab) const;
  size_t slab_of(size_t page) const;
  uint8_t* page_address(size_t page) const;
  // Pieces covering pages [first_page, first_page + count), one per slab touched, in order.
  // No piece spans two slabs. count == 0 gives none.
  std::vector<Segment> segments(size_t first_page, size_t count) const;

 private:
  struct Mapping {
    uint8_t* ptr = nullptr;
    size_t bytes = 0;
  };
  void unmap_all() noexcept;
  void prefault_parallel(size_t threads);

  size_t total_bytes_;
  size_t page_bytes_;
  HostPoolOptions options_;
  size_t map_align_ = 4096;
  std::vector<SlabPlan> plan_;
  std::vector<Mapping> maps_;
  std::vector<HostRegistration> regs_;  // empty when unregistered; else one per slab
  RegistrationTiming timing_;
};

// ---- copy threads -------------------------------------------------------------------------------

// A fixed set of worker threads that run indexed tasks; run() blocks until its tasks are done and
// the calling thread works on its own job too. Safe to call from several threads at once.
class ThreadPool {
 public:
  explicit ThreadPool(size_t threads);
  ~ThreadPool();
  ThreadPool(const ThreadPool&) = delete;
  ThreadPool& operator=(const ThreadPool&) = delete;
  size_t threads() const noexcept { return workers_.size() + 1; }  // workers + the caller
  // Calls fn(i) for i in [0, n); rethrows the first exception after all tasks finished.
  void run(size_t n, const std::function<void(size_t)>& fn);

 private:
  struct Job;
  void worker_loop();
  static void work_on(Job& job);
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<std::shared_ptr<Job>> queue_;
  bool stop_ = false;
  std::vector<std::thread> workers_;
};

// ---- KV page layouts and gather/scatter ---------------------------------------------------------

// Where one KV page lives: for each component c (K and V, or one fused KV/latent buffer) and each
// layer l, a slice of slice_bytes at components[c] + l * layer_stride + page * page_stride.
// Each component's memory is [components[c], components[c] + component_bytes).
// The contiguous blob of a page holds slice (c, l) at offset (c * layers + l) * slice_bytes.
struct PageLayout {
  std::vector<uintptr_t> components;
  size_t component_bytes = 0;
  size_t layers = 0;
  size_t pages = 0;
  size_t slice_bytes = 0;
  size_t layer_stride = 0;
  size_t page_stride = 0;

  size_t blob_bytes() const noexcept { return components.size() * layers * slice_bytes; }
  // Throws std::invalid_argument naming the problem: zero sizes, null bases, arithmetic overflow,
  // a slice outside its component, slices of different (layer, page) overlapping, or components
  // overlapping each other.
  void validate() const;

  // [layer][page][token][head][dim] per component (SGLang's host "layer_first").
  static PageLayout layer_first(std::vector<uintptr_t> components, size_t layers, size_t pages,
                                size_t page_tokens, size_t heads, size_t head_dim,
                                size_t item_bytes);
  // [page][layer][token][head][dim] per component.
  static PageLayout page_first(std::vector<uintptr_t> components, size_t layers, size_t pages,
                               size_t page_tokens, size_t heads, size_t head_dim,
                               size_t item_bytes);
};

// Multi-threaded gather/scatter over a ThreadPool. `layout` must be valid (validate() is called).
class Copier {
 public:
  // streaming: copies of >= 8 MiB in total use non-temporal stores (x86-64; memcpy elsewhere).
  explicit Copier(size_t threads = default_threads(), bool streaming = true);
  size_t threads() const noexcept { return pool_.threads(); }
  bool streaming() const noexcept { return streaming_; }
  static size_t default_threads();

  // Copies page `page` into dst[0, blob_bytes); capacity must be >= blob_bytes.
  void gather(const PageLayout& layout, size_t page, void* dst, size_t capacity);
  // Copies src[0, blob_bytes) back into page `page`; src_bytes must be >= blob_bytes.
  void scatter(const void* src, size_t src_bytes, const PageLayout& layout, size_t page);
  // Page pages[i] <-> dst + i * dst_stride (dst_stride >= blob_bytes; capacity covers all).
  void gather_pages(const PageLayout& layout, const std::vector<size_t>& pages, void* dst,
                    size_t dst_stride, size_t capacity);
  void scatter_pages(const void* src, size_t src_stride, size_t src_bytes,
                     const PageLayout& layout, const std::vector<size_t>& pages);
  // Page pages[i] <-> its own buffer dsts[i] / srcs[i] of `each_bytes` (e.g. separate slot
  // buffers, each already offset past its header), all in one parallel copy.
  void gather_each(const PageLayout& layout, const std::vector<size_t>& pages,
                   const std::vector<uintptr_t>& dsts, size_t each_bytes);
  void scatter_each(const std::vector<uintptr_t>& srcs, size_t each_bytes,
                    const PageLayout& layout, const std::vector<size_t>& pages);
  // scatter_each that also returns the CRC32C of each source blob (its blob_bytes), computed
  // on the values copied in the same pass (crc32c_copy): srcs[i] may be memory another process
  // writes, the CRC still describes exactly what landed in page pages[i].
  std::vector<uint32_t> scatter_crc_each(const std::vector<uintptr_t>& srcs, size_t each_bytes,
                                         const PageLayout& layout,
                                         const std::vector<size_t>& pages);
  // Runs copies (dst, src, n) over the threads, balanced by bytes. Ranges must not overlap.
  struct Copy {
    uint8_t* dst;
    const uint8_t* src;
    size_t bytes;
  };
  void copy(const std::vector<Copy>& copies);

 private:
  ThreadPool pool_;
  bool streaming_;
};

// The process-wide copier used by the Python module-level gather/scatter (created on first use).
Copier& default_copier();

// ---- host <-> GPU page transfers ----------------------------------------------------------------

enum class Direction { HostToDevice, DeviceToHost };
enum class TransferPath { Auto, Batch, Loop };

// Pages [first_page, first_page + count) of the pool <-> device memory at device_ptr (contiguous).
struct PageRun {
  size_t first_page = 0;
  size_t count = 0;
  CUdeviceptr device_ptr = 0;
};

struct TransferStats {
  TransferPath path = TransferPath::Loop;  // the one used (Batch or Loop)
  size_t copies = 0;                       // host<->device copies issued
  size_t driver_calls = 0;                 // cuMemcpyBatchAsync or cuMemcpy*Async calls
  size_t bytes = 0;
};

// Enqueues the copies on `stream` (a CUstream of `pool.device()`'s primary context; torch's
// current_stream().cuda_stream works) and returns without synchronizing. Host ranges come from
// pool.segments() only, so no copy spans two registrations. Auto uses cuMemcpyBatchAsync when the
// driver has it and the stream is not the legacy NULL stream (which the batch API refuses), a
// loop of cuMemcpy{HtoD,DtoH}Async otherwise. Batch throws when the batch API is unavailable.
TransferStats transfer(const HostPool& pool, Direction direction, const std::vector<PageRun>& runs,
                       CUstream stream, TransferPath path = TransferPath::Auto);

// Whether the batch entry point (13.0 or 12.8 ABI) was resolved.
bool batch_copy_available();

// Plain synchronous copies, for measuring the pinned-copy limit (benchmarks, tests).
void memcpy_sync(Direction direction, int device, CUdeviceptr device_ptr, void* host, size_t bytes);

// A CUstream of the device's primary context with one owner (tests, benchmarks).
class Stream {
 public:
  explicit Stream(int device);
  ~Stream();
  Stream(const Stream&) = delete;
  Stream& operator=(const Stream&) = delete;
  CUstream get() const noexcept { return stream_; }
  void synchronize() const;

 private:
  int device_;
  CUstream stream_ = nullptr;
};

}  // namespace vitrify::host
