// Region = Layout (pure bookkeeping) + the VMM owners. Invariant numbers refer to DESIGN.md.
#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <optional>
#include <string>

#include "region/vmm.hpp"
#include "vitrify/aligned.hpp"
#include "vitrify/device_memory.hpp"
#include "vitrify/host.hpp"
#include "vitrify/log.hpp"
#include "vitrify/region.hpp"

namespace vitrify {

using region::format_range;
using region::hex;
using region::Span;
using region::detail::Mapping;
using region::detail::PhysicalMemory;
using region::detail::Reservation;

struct Region::Fallback {
  DeviceBuffer buffer;
};

// R17: a released chunk; `copy` holds its bytes when release_memory kept them, registered
// (pinned) for the copy back where the driver allowed it.
struct Region::Released {
  uint64_t size = 0;
  std::optional<AlignedBuffer> copy;
  host::HostRegistration pin;
};

namespace {

// The shareable handle type of the region's physical chunks (R15).
CUmemAllocationHandleType handle_types(bool exportable) {
  return exportable ? CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR : CU_MEM_HANDLE_TYPE_NONE;
}

std::string gib(uint64_t n) {
  char b[32];
  std::snprintf(b, sizeof b, "%.3g GiB", double(n) / double(region::kGiB));
  return b;
}

// R2: one reserve that covers exactly [base, base + size); anything else is freed and reported.
// The reservation starts at the 1 GiB boundary at or below `base` (the driver honours hints
// reliably only with a 1 GiB alignment: scripts/experiments/va_hints.py), so any
// granularity-aligned base can be had (a relocation by 2 MiB), and spans at least
// kMinReservation: the H200 driver places small reservations in its own heap whatever the hint,
// depending on what the process did before (a 64 MiB reserve at a 1 GiB-aligned hint came back
// exact in a fresh process and elsewhere in a pytest process that had used torch); 512 MiB and
// more were always honoured. The region still hands out only `size` from `base`.
std::unique_ptr<Reservation> reserve_exact(uint64_t base, uint64_t size, std::string* why) {
  const uint64_t start = base & ~(region::kGiB - 1);
  const uint64_t span = (base - start) + std::max(size, region::kMinReservation);
  std::unique_ptr<Reservation> r;
  try {
    r = std::make_unique<Reservation>(start, span);
  } catch (const CudaError& e) {
    *why = "cuMemAddressReserve failed: " + e.name();
    return nullptr;
  }
  if (r->ptr() == start) return r;
  *why = "the driver returned " + format_range(r->ptr(), r->ptr() + span) + " for " +
         format_range(start, start + span) + " instead";
  r.reset();  // free the stray reservation before reporting
  return nullptr;
}

}  // namespace

Region::Region(std::optional<uint64_t> base, uint64_t size, int device, bool exportable)
    : device_(device), exportable_(exportable) {
  VITRIFY_EXPECT(size > 0, "region size must be positive, got 0");
  const int n = driver::device_count();
  VITRIFY_EXPECT(device >= 0 && device < n, "device ordinal " + std::to_string(device) +
                                             " out of range: this machine has " +
                                             std::to_string(n) + " CUDA device(s)");
  if (exportable && driver::cu().cuMemExportToShareableHandle == nullptr)
    throw DriverUnavailable("the CUDA driver (version " +
                            std::to_string(driver::table().driver_version) +
                            ") lacks cuMemExportToShareableHandle, which an exportable region "
                            "needs");
  driver::ContextGuard ctx(device);
  if (exportable) region::detail::check_fd_support(device, "an exportable region");
  granularity_ = region::detail::granularity(device, handle_types(exportable_));
  size_ = region::round_up(size, granularity_);
  if (base) {
    VITRIFY_EXPECT(*base % granularity_ == 0, "region base " + hex(*base) +
                                               " is not a multiple of the allocation granularity " +
                                               std::to_string(granularity_) + " of device " +
                                               std::to_string(device));
    VITRIFY_EXPECT(*base != 0 && *base <= UINT64_MAX - size_,
                "region base " + hex(*base) + " with size " + std::to_string(size_) +
                    " is not a usable range");
    std::string why;
    reservation_ = reserve_exact(*base, size_, &why);
    if (!reservation_)
      throw AddressUnavailable("could not reserve the region " +
                               format_range(*base, *base + size_) + " (" + gib(size_) +
                               ") on device " + std::to_string(device) + ": " + why +
                               "; the range (or part of it) is in use in this process — pick "
                               "another base, or base=None for the deterministic search");
  } else {
    const std::vector<uint64_t> cands = region::candidate_bases(size_);
    std::string tried;
    for (uint64_t c : cands) {
      std::string why;
      reservation_ = reserve_exact(c, size_, &why);
      if (reservation_) break;
      tried += "\n  " + format_range(c, c + size_) + ": " + why;
    }
    if (!reservation_)
      throw AddressUnavailable("no candidate base could be reserved for a region of " +
                               std::to_string(size_) + " bytes (" + gib(size_) + ") on device " +
                               std::to_string(device) +
                               (cands.empty() ? std::string(": the size exceeds the search window ") +
                                                    format_range(region::kSearchFirst,
                                                                 region::kSearchLimit)
                                              : ", tried:" + tried));
  }
  base_ = base ? *base : reservation_->ptr();
  layout_ = std::make_unique<region::Layout>(size_, granularity_);
  region::register_region(this);
  log::debug("region " + describe() + " reserved");
}

Region::~Region() { close(); }

void Region::close() noexcept {
  region::unregister_region(this);  // first: the C ABI can no longer reach this region
  std::string problems;
  {
    std::lock_guard<std::mutex> lk(mu_);
    if (closed_) return;
    closed_ = true;
    std::optional<driver::ContextGuard> ctx;
    try {
      ctx.emplace(device_);
    } catch (...) {
      // Without a context the driver objects are gone with it; the owners below still try.
    }
    fallback_.clear();
    released_.clear();  // host copies (and their registrations) go; nothing is mapped there
    for (auto& [off, m] : mappings_) {
      const int r = m->release();
      if (r != 0) {
        problems += " unmap ";
        problems += hex(base_ + off);
        problems += ": " + driver::result_name(r) + ";";
      }
    }
    mappings_.clear();
    if (reservation_) {
      const int r = reservation_->release();
      if (r != 0) problems += " cuMemAddressFree: " + driver::result_name(r) + ";";
      reservation_.reset();
    }
  }
  if (!problems.empty()) log::warning("region " + describe() + " close:" + problems);
}

bool Region::closed() const {
  std::lock_guard<std::mutex> lk(mu_);
  return closed_;
}

void Region::check_open() const {
  if (closed_) throw Error("region " + describe() + " is closed");
}

std::string Region::describe() const {
  return format_range(base_, base_ + size_) + " on device " + std::to_string(device_);
}

std::unique_ptr<Mapping> Region::map_chunk(const Span& s) const {
  PhysicalMemory mem(s.size, device_, handle_types(exportable_));
  return std::make_unique<Mapping>(base_ + s.offset, std::move(mem), device_);
}

std::string Region::release_chunks(const std::vector<Span>& release) {
  std::string problems;
  if (release.empty()) return problems;
  std::optional<driver::ContextGuard> ctx;
  try {
    ctx.emplace(device_);
  } catch (...) {
  }
  for (const Span& s : release) {
    released_.erase(s.offset);  // a released chunk the layout gives up: nothing to unmap (R17)
    auto it = mappings_.find(s.offset);
    if (it == mappings_.end()) continue;
    const int r = it->second->release();
    if (r != 0) {
      problems += ' ';
      problems += format_range(base_ + s.offset, base_ + s.end());
      problems += ": " + driver::result_name(r) + ";";
    }
    mappings_.erase(it);
  }
  return problems;
}

uint64_t Region::allocate(uint64_t bytes, bool at_cursor) {
  VITRIFY_EXPECT(bytes > 0, "allocation size must be positive, got 0");
  std::string problems;
  uint64_t ptr = 0;
  {
    std::lock_guard<std::mutex> lk(mu_);
    check_open();
    if (stopped_) {  // R8: ordinary memory, the cursor does not move
      auto f = std::make_unique<Fallback>(Fallback{DeviceBuffer(bytes, device_)});
      const uint64_t p = f->buffer.ptr();
      fallback_.emplace(p, std::move(f));
      return p;
    }
    const region::Layout::AllocPlan plan = layout_->plan_allocate(bytes, at_cursor);  // may throw OutOfSpace
    for (const auto& [off, r] : released_)  // R17: no physical memory there
      if (off < plan.alloc.end() && plan.alloc.offset < off + r->size)
        throw Error("allocation of " + std::to_string(bytes) + " bytes at " +
                    hex(base_ + plan.alloc.offset) + " lands in the released chunk " +
                    format_range(base_ + off, base_ + off + r->size) + " of the region " +
                    describe() + ": restore_memory first");
    std::unique_ptr<Mapping> m;
    if (plan.new_chunk) {
      driver::ContextGuard ctx(device_);
      m = map_chunk(*plan.new_chunk);  // a failure unwinds here; nothing was committed (R9)
    }
    const std::vector<Span> release = layout_->commit_allocate(plan);
    if (m) mappings_.emplace(plan.new_chunk->offset, std::move(m));
    problems = release_chunks(release);
    ptr = base_ + plan.alloc.offset;
  }
  if (!problems.empty()) log::warning("region " + describe() + ": releasing chunks failed:" + problems);
  return ptr;
}

void Region::free(uint64_t ptr) {
  std::string problems;
  {
    std::lock_guard<std::mutex> lk(mu_);
    check_open();
    if (auto f = fallback_.find(ptr); f != fallback_.end()) {
      fallback_.erase(f);
      return;
    }
    VITRIFY_EXPECT(contains(ptr), "pointer " + hex(ptr) + " is neither in the region " + describe() +
                                   " nor an allocation made while it was stopped");
    problems = release_chunks(layout_->free(ptr - base_));
  }
  if (!problems.empty()) log::warning("region " + describe() + ": releasing chunks failed:" + problems);
}

bool Region::owns(uint64_t ptr) const {
  std::lock_guard<std::mutex> lk(mu_);
  if (closed_) return false;
  if (fallback_.count(ptr)) return true;
  if (!contains(ptr)) return false;
  const auto a = layout_->allocation_containing(ptr - base_);
  return a && a->offset == ptr - base_;
}

bool Region::stop() {
  std::lock_guard<std::mutex> lk(mu_);
  check_open();
  return std::exchange(stopped_, true);
}

bool Region::resume() {
  std::lock_guard<std::mutex> lk(mu_);
  check_open();
  return std::exchange(stopped_, false);
}

bool Region::stopped() const {
  std::lock_guard<std::mutex> lk(mu_);
  return stopped_;
}

uint64_t Region::offset() const {
  std::lock_guard<std::mutex> lk(mu_);
  return layout_->cursor();
}

void Region::set_offset(uint64_t n) {
  std::string problems;
  {
    std::lock_guard<std::mutex> lk(mu_);
    check_open();
    problems = release_chunks(layout_->set_offset(n));
  }
  if (!problems.empty()) log::warning("region " + describe() + ": releasing chunks failed:" + problems);
}

uint64_t Region::preallocate(uint64_t upto, uint64_t chunk_bytes) {
  std::lock_guard<std::mutex> lk(mu_);
  check_open();
  const std::vector<Span> plan = layout_->plan_preallocate(upto, chunk_bytes);
  if (plan.empty()) return 0;
  driver::ContextGuard ctx(device_);
  std::vector<std::unique_ptr<Mapping>> made;  // all or nothing (R9)
  made.reserve(plan.size());
  uint64_t bytes = 0;
  for (const Span& s : plan) {
    made.push_back(map_chunk(s));
    bytes += s.size;
  }
  layout_->commit_chunks(plan);
  for (size_t i = 0; i < plan.size(); ++i) mappings_.emplace(plan[i].offset, std::move(made[i]));
  return bytes;
}

namespace {
// Closes the fds of a part-made export unless dismissed (export_range's all-or-nothing).
struct CloseOnFailure {
  std::vector<region::ExportedChunk>* out;
  ~CloseOnFailure() {
    if (out == nullptr) return;
    for (const auto& c : *out) ::close(c.fd);
    out->clear();
  }
};
}  // namespace

std::vector<region::ExportedChunk> Region::export_range(uint64_t offset, uint64_t nbytes) const {
  std::lock_guard<std::mutex> lk(mu_);
  check_open();
  if (!exportable_)
    throw Error("export_range: the region " + describe() +
                " was created without exportable=True: its memory cannot be exported");
  VITRIFY_EXPECT(nbytes > 0, "export_range: nbytes must be positive, got 0");
  VITRIFY_EXPECT(offset <= size_ && nbytes <= size_ - offset,
                 "export_range: [" + std::to_string(offset) + ", " + std::to_string(offset) +
                     " + " + std::to_string(nbytes) + ") runs outside the region of " +
                     std::to_string(size_) + " bytes " + describe());
  // First the chunks (all of them mapped, or nothing is exported), then the fds.
  std::vector<const Mapping*> chunks;
  const uint64_t end = offset + nbytes;
  uint64_t at = offset;
  while (at < end) {
    auto it = mappings_.upper_bound(at);
    const Mapping* m = nullptr;
    if (it != mappings_.begin()) {
      --it;
      if (at < it->first + it->second->size()) m = it->second.get();
    }
    VITRIFY_EXPECT(m != nullptr, "export_range: offset " + std::to_string(at) + " (" +
                                     hex(base_ + at) + ") of [" + std::to_string(offset) + ", " +
                                     std::to_string(end) + ") is not mapped in the region " +
                                     describe() + ": allocate or preallocate it first");
    chunks.push_back(m);
    at = it->first + m->size();
  }
  auto exp = driver::cu().cuMemExportToShareableHandle;  // checked non-null by the constructor
  driver::ContextGuard ctx(device_);
  std::vector<region::ExportedChunk> out;
  out.reserve(chunks.size());
  CloseOnFailure guard{&out};
  for (const Mapping* m : chunks) {
    int fd = -1;
    const int r = exp(&fd, m->handle(), CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0);
    if (r != 0)
      vitrify::detail::throw_cuda(r, "cuMemExportToShareableHandle", __FILE__, __LINE__);
    out.push_back(region::ExportedChunk{m->ptr() - base_, m->size(), fd});
    // The caller owns the fd; it must not leak into programs this process executes.
    const int flags = ::fcntl(fd, F_GETFD);
    if (flags == -1 || ::fcntl(fd, F_SETFD, flags | FD_CLOEXEC) == -1)
      vitrify::detail::throw_errno(errno, "fcntl", "",
                                   "FD_CLOEXEC on the exported fd " + std::to_string(fd));
  }
  guard.out = nullptr;
  return out;
}

void Region::check_inside(const char* what, uint64_t offset, uint64_t nbytes) const {
  VITRIFY_EXPECT(nbytes > 0, std::string(what) + ": nbytes must be positive, got 0");
  VITRIFY_EXPECT(offset <= size_ && nbytes <= size_ - offset,
                 std::string(what) + ": [" + std::to_string(offset) + ", " +
                     std::to_string(offset) + " + " + std::to_string(nbytes) +
                     ") runs outside the region of " + std::to_string(size_) + " bytes " +
                     describe());
}

std::vector<uint64_t> Region::chunks_of(uint64_t offset, uint64_t end, const char* what,
                                        std::vector<uint64_t>* released) const {
  std::vector<uint64_t> mapped;
  uint64_t at = offset;
  while (at < end) {
    uint64_t start = 0, size = 0;
    bool is_released = false;
    auto m = mappings_.upper_bound(at);
    if (m != mappings_.begin() && at < std::prev(m)->first + std::prev(m)->second->size()) {
      start = std::prev(m)->first;
      size = std::prev(m)->second->size();
    } else {
      auto r = released_.upper_bound(at);
      VITRIFY_EXPECT(r != released_.begin() && at < std::prev(r)->first + std::prev(r)->second->size,
                     std::string(what) + ": offset " + std::to_string(at) + " (" + hex(base_ + at) +
                         ") of [" + std::to_string(offset) + ", " + std::to_string(end) +
                         ") is in no chunk of the region " + describe());
      start = std::prev(r)->first;
      size = std::prev(r)->second->size;
      is_released = true;
    }
    VITRIFY_EXPECT(start >= offset && start + size <= end,
                   std::string(what) + ": [" + std::to_string(offset) + ", " + std::to_string(end) +
                       ") cuts the chunk " + format_range(base_ + start, base_ + start + size) +
                       " (offsets " + std::to_string(start) + ".." + std::to_string(start + size) +
                       "): the range must cover whole chunks");
    if (is_released) {
      if (released != nullptr) released->push_back(start);
    } else {
      mapped.push_back(start);
    }
    at = start + size;
  }
  return mapped;
}

uint64_t Region::release_memory(uint64_t offset, uint64_t nbytes, bool keep) {
  std::string problems;
  uint64_t bytes = 0;
  {
    std::lock_guard<std::mutex> lk(mu_);
    check_open();
    check_inside("release_memory", offset, nbytes);
    const std::vector<uint64_t> chunks = chunks_of(offset, offset + nbytes, "release_memory",
                                                   nullptr);
    driver::ContextGuard ctx(device_);
    // first every copy (a failure leaves everything mapped), then the unmaps
    std::vector<std::unique_ptr<Released>> made;
    made.reserve(chunks.size());
    bool pinning = true;
    for (uint64_t off : chunks) {
      auto r = std::make_unique<Released>();
      const Mapping& m = *mappings_.at(off);
      r->size = m.size();
      if (keep) {
        r->copy.emplace(static_cast<size_t>(m.size()));
        if (pinning) {
          try {
            r->pin = host::HostRegistration(r->copy->data(), r->copy->size(), device_, r->copy->size());
          } catch (const std::exception& e) {  // slower copies, the same bytes
            pinning = false;
            log::warning("region " + describe() + ": release_memory keeps its copies unpinned (" +
                         e.what() + ")");
          }
        }
        VITRIFY_CU(driver::cu().cuMemcpyDtoH(r->copy->data(), m.ptr(), m.size()));
      }
      made.push_back(std::move(r));
    }
    for (size_t i = 0; i < chunks.size(); ++i) {
      auto it = mappings_.find(chunks[i]);
      const int rc = it->second->release();
      if (rc != 0) {  // gone from the driver's view either way: recorded as released
        problems += ' ';
        problems += format_range(base_ + chunks[i], base_ + chunks[i] + made[i]->size);
        problems += ": " + driver::result_name(rc) + ";";
      }
      mappings_.erase(it);
      bytes += made[i]->size;
      released_.emplace(chunks[i], std::move(made[i]));
    }
  }
  if (!problems.empty()) log::warning("region " + describe() + ": release_memory:" + problems);
  log::debug("region " + describe() + ": released " + std::to_string(bytes) + " bytes" +
             (keep ? " (kept on the host)" : ""));
  return bytes;
}

uint64_t Region::restore_memory(uint64_t offset, uint64_t nbytes) {
  std::lock_guard<std::mutex> lk(mu_);
  check_open();
  check_inside("restore_memory", offset, nbytes);
  std::vector<uint64_t> chunks;
  (void)chunks_of(offset, offset + nbytes, "restore_memory", &chunks);
  if (chunks.empty()) return 0;
  driver::ContextGuard ctx(device_);
  std::vector<std::unique_ptr<Mapping>> made;  // all or nothing (R9): unmapped again on failure
  made.reserve(chunks.size());
  uint64_t bytes = 0;
  for (uint64_t off : chunks) {
    const Released& r = *released_.at(off);
    made.push_back(map_chunk(Span{off, r.size}));
    if (r.copy)
      VITRIFY_CU(driver::cu().cuMemcpyHtoD(base_ + off, r.copy->data(), r.size));
    else
      VITRIFY_CU(driver::cu().cuMemsetD8(base_ + off, 0, r.size));
    bytes += r.size;
  }
  for (size_t i = 0; i < chunks.size(); ++i) {
    mappings_.emplace(chunks[i], std::move(made[i]));
    released_.erase(chunks[i]);
  }
  log::debug("region " + describe() + ": restored " + std::to_string(bytes) + " bytes");
  return bytes;
}

std::vector<region::ReleasedChunk> Region::released() const {
  std::lock_guard<std::mutex> lk(mu_);
  std::vector<region::ReleasedChunk> out;
  for (const auto& [off, r] : released_) out.push_back({off, r->size, r->copy.has_value()});
  return out;
}

uint64_t Region::checkpoint(const std::string& name) {
  std::lock_guard<std::mutex> lk(mu_);
  check_open();
  return layout_->checkpoint(name);
}

std::vector<std::pair<std::string, uint64_t>> Region::checkpoints() const {
  std::lock_guard<std::mutex> lk(mu_);
  return layout_->checkpoints();
}

std::vector<region::Span> Region::live_allocations() const {
  std::lock_guard<std::mutex> lk(mu_);
  if (closed_) return {};
  return layout_->live_allocations();
}

RegionStats Region::stats() const {
  std::lock_guard<std::mutex> lk(mu_);
  RegionStats s;
  s.base = base_;
  s.device = device_;
  s.stopped = stopped_;
  s.layout = layout_->stats();
  if (closed_) {  // nothing is mapped any more
    s.layout.mapped_bytes = 0;
    s.layout.chunks = 0;
  }
  s.fallback_live = fallback_.size();
  for (const auto& [p, f] : fallback_) s.fallback_bytes += f->buffer.size();
  for (const auto& [off, r] : released_) {  // R17: in the layout's chunks, not mapped
    ++s.released_chunks;
    s.released_bytes += r->size;
    if (r->copy) s.kept_bytes += r->size;
  }
  if (!closed_) {
    s.layout.mapped_bytes -= s.released_bytes;
    s.layout.chunks -= s.released_chunks;
  }
  return s;
}

void Region::check_live_range(uint64_t ptr, size_t n, const char* what) const {
  VITRIFY_EXPECT(n > 0, std::string(what) + " of 0 bytes");
  auto f = fallback_.upper_bound(ptr);
  if (f != fallback_.begin()) {
    --f;
    const uint64_t b = f->first, e = b + f->second->buffer.size();
    if (ptr >= b && ptr < e) {
      VITRIFY_EXPECT(n <= e - ptr, std::string(what) + " of " + std::to_string(n) + " bytes at " +
                                    hex(ptr) + " runs past the end of its allocation " +
                                    format_range(b, e));
      return;
    }
  }
  VITRIFY_EXPECT(contains(ptr), std::string(what) + " at " + hex(ptr) + ": not in the region " +
                                 describe() + " nor a fallback allocation");
  const auto a = layout_->allocation_containing(ptr - base_);
  VITRIFY_EXPECT(a.has_value(), std::string(what) + " at " + hex(ptr) +
                                 ": no live allocation of the region holds this address");
  const uint64_t e = base_ + a->end();
  VITRIFY_EXPECT(n <= e - ptr, std::string(what) + " of " + std::to_string(n) + " bytes at " +
                                hex(ptr) + " runs past the end of its allocation " +
                                format_range(base_ + a->offset, e));
  const uint64_t lo = ptr - base_, hi = lo + n;  // R17: no physical memory behind a released chunk
  for (const auto& [off, r] : released_)
    VITRIFY_EXPECT(!(off < hi && lo < off + r->size),
                   std::string(what) + " at " + hex(ptr) + ": the chunk " +
                       format_range(base_ + off, base_ + off + r->size) +
                       " is released (release_memory): restore_memory first");
}

void Region::write(uint64_t dst, const void* src, size_t n) {
  std::lock_guard<std::mutex> lk(mu_);
  check_open();
  check_live_range(dst, n, "write");
  driver::ContextGuard ctx(device_);
  VITRIFY_CU(driver::cu().cuMemcpyHtoD(dst, src, n));
}

void Region::read(uint64_t src, void* dst, size_t n) const {
  std::lock_guard<std::mutex> lk(mu_);
  check_open();
  check_live_range(src, n, "read");
  driver::ContextGuard ctx(device_);
  VITRIFY_CU(driver::cu().cuMemcpyDtoH(dst, src, n));
}

}  // namespace vitrify
