// HostPool: slab planning, one mmap per slab (anonymous or hugetlbfs), parallel registration,
// and segments(). See DESIGN.md for the invariants.
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/statfs.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <exception>
#include <string>
#include <thread>
#include <utility>

#include "vitrify/aligned.hpp"
#include "vitrify/driver.hpp"
#include "vitrify/error.hpp"
#include "vitrify/file_io.hpp"
#include "vitrify/host.hpp"
#include "vitrify/log.hpp"

namespace vitrify::host {

namespace {

std::string n(size_t v) { return std::to_string(v); }

std::string human(size_t bytes) {
  char buf[64];
  if (bytes >= kGiB)
    std::snprintf(buf, sizeof buf, "%.2f GiB", double(bytes) / double(kGiB));
  else if (bytes >= (size_t(1) << 20))
    std::snprintf(buf, sizeof buf, "%.2f MiB", double(bytes) / double(1 << 20));
  else
    std::snprintf(buf, sizeof buf, "%zu B", bytes);
  return std::string(buf) + " (" + n(bytes) + " bytes)";
}

double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

}  // namespace

// ---- planning -----------------------------------------------------------------------------------

std::vector<SlabPlan> plan_slabs(size_t total_bytes, size_t page_bytes, size_t max_slab_bytes,
                                 size_t map_align) {
  VITRIFY_EXPECT(page_bytes > 0, "page_bytes must be positive, got 0");
  VITRIFY_EXPECT(total_bytes > 0, "total_bytes must be positive, got 0");
  VITRIFY_EXPECT(total_bytes % page_bytes == 0,
              "total_bytes " + n(total_bytes) + " is not a multiple of page_bytes " +
                  n(page_bytes) + " (a pool holds whole pages; use " +
                  n(total_bytes / page_bytes * page_bytes) + " or " +
                  n((total_bytes / page_bytes + 1) * page_bytes) + ")");
  VITRIFY_EXPECT(map_align > 0 && (map_align & (map_align - 1)) == 0,
              "map_align must be a power of two, got " + n(map_align));
  VITRIFY_EXPECT(max_slab_bytes > 0, "max_slab_bytes must be positive, got 0");
  // One page, rounded to the mapping granularity, must fit under the ceiling.
  VITRIFY_EXPECT(page_bytes <= SIZE_MAX - map_align && round_up(page_bytes, map_align) <= max_slab_bytes,
              "page_bytes " + human(page_bytes) + " (mapped as " +
                  human(round_up(page_bytes, map_align)) +
                  ") does not fit under the single-registration ceiling max_slab_bytes " +
                  human(max_slab_bytes) + ": raise VITRIFY_MAX_SLAB_GB or use smaller pages");
  const size_t total_pages = total_bytes / page_bytes;
  // The largest page count whose mapping fits: floor(floor(ceiling/align)*align / page_bytes).
  const size_t usable = max_slab_bytes / map_align * map_align;
  size_t per_slab = std::max<size_t>(1, usable / page_bytes);
  per_slab = std::min(per_slab, total_pages);
  std::vector<SlabPlan> out;
  out.reserve((total_pages + per_slab - 1) / per_slab);
  for (size_t first = 0; first < total_pages; first += per_slab) {
    SlabPlan s;
    s.index = out.size();
    s.first_page = first;
    s.pages = std::min(per_slab, total_pages - first);
    s.bytes = s.pages * page_bytes;
    s.map_bytes = round_up(s.bytes, map_align);
    out.push_back(s);
  }
  return out;
}

// ---- hugetlbfs ----------------------------------------------------------------------------------

FsCapacity statfs_capacity(const std::string& path) {
  struct statfs st{};
  VITRIFY_SYSCALL(::statfs(path.c_str(), &st), path);
  FsCapacity c;
  c.fs_magic = static_cast<uint64_t>(st.f_type);
  c.block_size = static_cast<uint64_t>(st.f_bsize);
  c.free_blocks = static_cast<uint64_t>(st.f_bavail);
  if (c.fs_magic == kHugetlbfsMagic && st.f_blocks == 0 && c.block_size > 0)
    c.free_blocks = hugetlb_free_pages(c.block_size);  // no size= limit: the kernel's pool
  return c;
}

uint64_t hugetlb_free_pages(uint64_t page_bytes, const std::string& sysfs_root) {
  const std::string dir = sysfs_root + "/hugepages-" + std::to_string(page_bytes / 1024) + "kB/";
  auto read = [&](const char* name) -> long long {
    FILE* f = std::fopen((dir + name).c_str(), "re");
    if (f == nullptr) return -1;
    long long v = -1;
    if (std::fscanf(f, "%lld", &v) != 1) v = -1;
    std::fclose(f);
    return v;
  };
  const long long free = read("free_hugepages");
  const long long resv = read("resv_hugepages");
  if (free < 0) return 0;
  const long long avail = free - (resv > 0 ? resv : 0);
  return avail > 0 ? static_cast<uint64_t>(avail) : 0;
}

void check_hugetlbfs_capacity(const std::string& mount, size_t needed, const FsCapacity& cap) {
  char magic[32];
  std::snprintf(magic, sizeof magic, "0x%llx", static_cast<unsigned long long>(cap.fs_magic));
  VITRIFY_EXPECT(cap.fs_magic == kHugetlbfsMagic,
              "hugetlbfs_mount \"" + mount + "\" is not a hugetlbfs mount (statfs type " + magic +
                  "): mount one (mount -t hugetlbfs none /dev/hugepages) or pass no mount to "
                  "use ordinary pages");
  VITRIFY_EXPECT(cap.block_size > 0, "hugetlbfs mount \"" + mount + "\" reports a page size of 0");
  const unsigned __int128 free_bytes =
      static_cast<unsigned __int128>(cap.free_blocks) * cap.block_size;
  if (free_bytes >= needed) return;
  const size_t pages_needed = (needed + cap.block_size - 1) / cap.block_size;
  const std::string page_kb = n(cap.block_size / 1024);
  throw OutOfSpace(
      "hugetlbfs at \"" + mount + "\" has " + human(size_t(free_bytes)) + " free (" +
      n(cap.free_blocks) + " huge pages of " + human(cap.block_size) + "), the host pool needs " +
      human(needed) + " (" + n(pages_needed) + " huge pages): add " +
      n(pages_needed - cap.free_blocks) + " or more huge pages (e.g. echo " + n(pages_needed) +
      " > /sys/kernel/mm/hugepages/hugepages-" + page_kb +
      "kB/nr_hugepages, or raise the mount's size= option), make the pool smaller, or pass no "
      "hugetlbfs mount to use ordinary pages");
}

// ---- one registration ---------------------------------------------------------------------------

HostRegistration::HostRegistration(void* ptr, size_t bytes, int device, size_t ceiling,
                                   bool read_only)
    : device_(device) {
  VITRIFY_EXPECT(ptr != nullptr && bytes > 0, "cannot register an empty host range");
  VITRIFY_EXPECT(bytes <= ceiling,
              "refusing to register " + human(bytes) +
                  " of host memory in one cuMemHostRegister: the single-registration ceiling "
                  "is " + human(ceiling) +
                  " (VITRIFY_MAX_SLAB_GB); drivers fail larger registrations. Split the memory "
                  "into slabs (HostPool does) or raise VITRIFY_MAX_SLAB_GB if this driver allows it");
  driver::ContextGuard ctx(device);
  // PORTABLE: pinned for every context; DEVICEMAP: mapped, so cuMemHostGetDevicePointer works.
  // READ_ONLY: the range is mapped without write permission (a reader's view of a slab).
  VITRIFY_CU(driver::cu().cuMemHostRegister(
      ptr, bytes,
      CU_MEMHOSTREGISTER_PORTABLE | CU_MEMHOSTREGISTER_DEVICEMAP |
          (read_only ? CU_MEMHOSTREGISTER_READ_ONLY : 0u)));
  ptr_ = ptr;
  bytes_ = bytes;
}

HostRegistration::~HostRegistration() { release(); }

void HostRegistration::release() noexcept {
  if (ptr_ == nullptr) return;
  try {
    driver::ContextGuard ctx(device_);
    const CUresult r = driver::cu().cuMemHostUnregister(ptr_);
    if (r != CUDA_SUCCESS)
      log::write(log::kWarning, "cuMemHostUnregister failed: " + driver::result_name(r));
  } catch (...) {
    // Destructors never throw; the context is gone (process exit), nothing left to undo.
  }
  ptr_ = nullptr;
  bytes_ = 0;
}

HostRegistration::HostRegistration(HostRegistration&& o) noexcept
    : ptr_(std::exchange(o.ptr_, nullptr)),
      bytes_(std::exchange(o.bytes_, 0)),
      device_(o.device_) {}

HostRegistration& HostRegistration::operator=(HostRegistration&& o) noexcept {
  if (this != &o) {
    release();
    ptr_ = std::exchange(o.ptr_, nullptr);
    bytes_ = std::exchange(o.bytes_, 0);
    device_ = o.device_;
  }
  return *this;
}

std::vector<HostRegistration> register_ranges(const std::vector<std::pair<void*, size_t>>& ranges,
                                              int device, size_t ceiling, size_t max_threads,
                                              bool read_only, RegistrationTiming& timing) {
  const size_t count = ranges.size();
  timing = RegistrationTiming{};
  std::vector<HostRegistration> regs(count);
  std::vector<std::exception_ptr> errors(count);
  timing.slab_seconds.assign(count, 0.0);
  timing.parallel = max_threads > 1 && count > 1;
  const auto t0 = std::chrono::steady_clock::now();
  auto register_one = [&](size_t i) {
    try {
      const auto ts = std::chrono::steady_clock::now();
      regs[i] = HostRegistration(ranges[i].first, ranges[i].second, device, ceiling, read_only);
      timing.slab_seconds[i] = seconds_since(ts);
    } catch (...) {
      errors[i] = std::current_exception();
    }
  };
  if (timing.parallel) {
    const size_t nthreads = std::min(count, max_threads);
    std::atomic<size_t> next{0};
    std::vector<std::thread> threads;
    threads.reserve(nthreads);
    try {
      for (size_t t = 0; t < nthreads; ++t)
        threads.emplace_back([&] {
          for (size_t i; (i = next.fetch_add(1)) < count;) register_one(i);
        });
    } catch (...) {
      // Could not start every thread: the ones running drain the queue; finish it here.
      for (size_t i; (i = next.fetch_add(1)) < count;) register_one(i);
    }
    for (auto& th : threads) th.join();
    timing.threads = std::max<size_t>(1, threads.size());
  } else {
    for (size_t i = 0; i < count; ++i) register_one(i);
    timing.threads = 1;
  }
  timing.seconds = seconds_since(t0);
  for (auto& e : errors)
    if (e) std::rethrow_exception(e);  // `regs` unregisters the ranges that succeeded
  timing.registered = count > 0;
  return regs;
}

// ---- the pool -----------------------------------------------------------------------------------

namespace {

bool gpu_present(int device) {
  if (!driver::available()) return false;
  try {
    return device >= 0 && device < driver::device_count();
  } catch (const std::exception&) {
    return false;
  }
}

std::atomic<uint64_t> g_file_counter{0};

// One slab file on hugetlbfs: created exclusively, unlinked at once (the mapping keeps it).
uint8_t* map_hugetlbfs(const std::string& mount, size_t bytes) {
  const std::string path = mount + "/vitrify-hostpool-" + std::to_string(::getpid()) + "-" +
                           std::to_string(g_file_counter.fetch_add(1));
  // One owner for the descriptor (file_io::Fd): closed on every path once the mapping holds the file.
  file_io::Fd fd(file_io::open_file(path, O_CREAT | O_EXCL | O_RDWR, file_io::DirectIo::kOff, 0600).fd);
  ::unlink(path.c_str());
  void* p = MAP_FAILED;
  int err = 0;
  const char* what = "ftruncate";
  if (::ftruncate(fd.get(), static_cast<off_t>(bytes)) == 0) {
    what = "mmap";
    p = ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd.get(), 0);
    if (p == MAP_FAILED) err = errno;
  } else {
    err = errno;
  }
  fd.reset();
  if (p == MAP_FAILED)
    detail::throw_errno(err, std::string(what) + " of " + n(bytes) + " bytes (too few free huge pages?)",
                        path);
  return static_cast<uint8_t*>(p);
}

}  // namespace

HostPool::HostPool(size_t total_bytes, size_t page_bytes, HostPoolOptions options)
    : total_bytes_(total_bytes), page_bytes_(page_bytes), options_(std::move(options)) {
  const bool huge = !options_.hugetlbfs_mount.empty();
  FsCapacity cap;
  if (huge) {
    cap = options_.statfs ? options_.statfs(options_.hugetlbfs_mount)
                          : statfs_capacity(options_.hugetlbfs_mount);
    // The type first (needing 0 bytes cannot fail on capacity), so the block size below is the
    // huge page size.
    check_hugetlbfs_capacity(options_.hugetlbfs_mount, 0, cap);
    VITRIFY_EXPECT((cap.block_size & (cap.block_size - 1)) == 0,
                "hugetlbfs mount \"" + options_.hugetlbfs_mount + "\" reports a page size of " +
                    n(cap.block_size) + " bytes, not a power of two");
    map_align_ = static_cast<size_t>(cap.block_size);
  } else {
    map_align_ = static_cast<size_t>(::sysconf(_SC_PAGESIZE));
  }
  plan_ = plan_slabs(total_bytes, page_bytes, options_.max_slab_bytes, map_align_);
  if (huge) {
    size_t needed = 0;
    for (const SlabPlan& s : plan_) needed += s.map_bytes;
    check_hugetlbfs_capacity(options_.hugetlbfs_mount, needed, cap);
  }

  bool do_register = false;
  switch (options_.registration) {
    case Registration::Off: do_register = false; break;
    case Registration::On: do_register = true; break;
    case Registration::Auto: do_register = gpu_present(options_.device); break;
  }
  if (options_.registration == Registration::On && !driver::available())
    throw DriverUnavailable("HostPool registration requested but the CUDA driver is unavailable: " +
                            driver::unavailable_reason());

  try {
    maps_.reserve(plan_.size());
    for (const SlabPlan& s : plan_) {
      uint8_t* p = nullptr;
      if (huge) {
        p = map_hugetlbfs(options_.hugetlbfs_mount, s.map_bytes);
      } else {
        void* m = ::mmap(nullptr, s.map_bytes, PROT_READ | PROT_WRITE,
                         MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
        if (m == MAP_FAILED)
          detail::throw_errno(errno, "mmap of slab " + n(s.index) + " (" + n(s.map_bytes) + " bytes)",
                              "");
        p = static_cast<uint8_t*>(m);
      }
      maps_.push_back({p, s.map_bytes});
    }

    if (do_register && options_.prefault) {
      // cuMemHostRegister faults in and pins pages under the process's memory-map lock, so
      // registering slabs in parallel barely helps (measured 1.05x on the H200 host). Page
      // faults themselves run in parallel (per-VMA locks), so fault everything in first.
      const auto tp = std::chrono::steady_clock::now();
      prefault_parallel(std::max<size_t>(1, options_.registration_threads));
      timing_.prefault_seconds = seconds_since(tp);
    }
    if (do_register) {
      std::vector<std::pair<void*, size_t>> ranges;
      for (const Mapping& m : maps_) ranges.emplace_back(m.ptr, m.bytes);
      const double prefault = timing_.prefault_seconds;
      regs_ = register_ranges(ranges, options_.device, options_.max_slab_bytes,
                              options_.parallel_registration ? options_.registration_threads : 1,
                              false, timing_);
      timing_.prefault_seconds = prefault;
      log::write(log::kInfo, "host pool: registered " + n(ranges.size()) + " slab(s), " +
                                 human(total_bytes_) + " in " +
                                 std::to_string(timing_.seconds) + " s (" +
                                 (timing_.parallel ? "parallel" : "serial") + ")");
    }
  } catch (...) {
    regs_.clear();
    unmap_all();
    throw;
  }
}

HostPool::~HostPool() {
  regs_.clear();  // unregister before unmapping
  unmap_all();
}

#ifndef MADV_POPULATE_READ  // Linux 5.14
#define MADV_POPULATE_READ 22
#define MADV_POPULATE_WRITE 23
#endif

int populate_ranges(const std::vector<std::pair<uint8_t*, size_t>>& ranges, bool write,
                    bool zero_fill, size_t page, size_t threads) noexcept {
  constexpr size_t kPiece = size_t(64) << 20;
  struct Piece {
    uint8_t* p;
    size_t n;
  };
  std::vector<Piece> pieces;
  try {
    for (const auto& [ptr, bytes] : ranges)
      for (size_t off = 0; off < bytes; off += kPiece)
        pieces.push_back({ptr + off, std::min(kPiece, bytes - off)});
  } catch (...) {  // no memory for the list: the pages fault in on first use
    return ENOMEM;
  }
  std::atomic<size_t> next{0};
  std::atomic<int> failed{0};
  auto work = [&] {
    for (size_t i; (i = next.fetch_add(1)) < pieces.size();) {
      if (::madvise(pieces[i].p, pieces[i].n, write ? MADV_POPULATE_WRITE : MADV_POPULATE_READ) ==
          0)
        continue;
      if (errno != EINVAL) failed.store(errno);  // EINVAL: a kernel without it
      // A touch per page: fresh memory (zero already) takes a write, anything else a read.
      if (zero_fill) {
        volatile uint8_t* v = pieces[i].p;
        for (size_t off = 0; off < pieces[i].n; off += page) v[off] = 0;
      } else {
        const volatile uint8_t* v = pieces[i].p;
        for (size_t off = 0; off < pieces[i].n; off += page) (void)v[off];
      }
    }
  };
  std::vector<std::thread> pool;
  const size_t n = std::min(threads, pieces.size());
  try {
    pool.reserve(n);
    for (size_t t = 1; t < n; ++t) pool.emplace_back(work);
  } catch (...) {
    // Fewer threads than asked: the ones running and this one drain the queue.
  }
  work();
  for (auto& th : pool) th.join();
  return failed.load();
}

void HostPool::prefault_parallel(size_t threads) {
  std::vector<std::pair<uint8_t*, size_t>> ranges;
  for (const auto& m : maps_) ranges.emplace_back(m.ptr, m.bytes);
  (void)populate_ranges(ranges, true, true, map_align_, threads);  // any failure touched instead
}

void HostPool::unmap_all() noexcept {
  for (Mapping& m : maps_)
    if (m.ptr != nullptr) ::munmap(m.ptr, m.bytes);
  maps_.clear();
}

uint8_t* HostPool::slab_base(size_t slab) const {
  VITRIFY_EXPECT(slab < plan_.size(),
              "slab " + n(slab) + " out of range: the pool has " + n(plan_.size()) + " slab(s)");
  return maps_[slab].ptr;
}

size_t HostPool::slab_of(size_t page) const {
  VITRIFY_EXPECT(page < num_pages(),
              "page " + n(page) + " out of range: the pool has " + n(num_pages()) + " pages");
  return page / plan_.front().pages;  // every slab but the last holds the same page count
}

uint8_t* HostPool::page_address(size_t page) const {
  const size_t s = slab_of(page);
  return maps_[s].ptr + (page - plan_[s].first_page) * page_bytes_;
}

std::vector<Segment> HostPool::segments(size_t first_page, size_t count) const {
  const size_t total = num_pages();
  VITRIFY_EXPECT(first_page <= total && count <= total - first_page,
              "pages [" + n(first_page) + ", " + n(first_page) + "+" + n(count) +
                  ") out of range: the pool has " + n(total) + " pages");
  std::vector<Segment> out;
  size_t page = first_page;
  const size_t end = first_page + count;
  while (page < end) {
    const size_t s = page / plan_.front().pages;
    const SlabPlan& sp = plan_[s];
    const size_t stop = std::min(end, sp.first_page + sp.pages);
    Segment seg;
    seg.slab = s;
    seg.first_page = page;
    seg.pages = stop - page;
    seg.ptr = maps_[s].ptr + (page - sp.first_page) * page_bytes_;
    seg.bytes = seg.pages * page_bytes_;
    out.push_back(seg);
    page = stop;
  }
  return out;
}

}  // namespace vitrify::host
