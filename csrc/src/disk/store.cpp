// Store: slab files per (kind, drive), one SlotIndex per kind (index.cpp: the index, slot pool
// and GC decisions) and the background I/O threads that write, sync, read and load the slabs.
// Invariants (numbered as in DESIGN.md) are cited where they are kept.
#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstring>
#include <functional>

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include "disk/detail/io_engine.hpp"
#include "vitrify/disk.hpp"
#include "vitrify/error.hpp"
#include "vitrify/log.hpp"

namespace vitrify::disk {

// ------------------------------------------------------------------------------ Completion
std::vector<int64_t> Completion::wait() {
  std::unique_lock lk(mu_);
  cv_.wait(lk, [&] { return remaining_ == 0; });
  return results_;
}

bool Completion::done() const {
  std::lock_guard lk(mu_);
  return remaining_ == 0;
}

void Completion::finish(size_t index, int64_t result) {
  std::lock_guard lk(mu_);
  results_[index] = result;
  if (--remaining_ == 0) cv_.notify_all();
}

// ------------------------------------------------------------------------------ Store
namespace {
constexpr size_t kSpareBuffersPerKind = 16;
// A batched read thread (D25) stages reads into plain destinations through scratch slot
// buffers of at most this many bytes together (at least one buffer).
constexpr uint64_t kReadScratchBytes = 32ull << 20;
}

Store::Store(StoreConfig config) : cfg_(std::move(config)) {
  VITRIFY_EXPECT(!cfg_.dirs.empty(), "a disk store needs at least one directory");
  VITRIFY_EXPECT(!cfg_.kinds.empty(), "a disk store needs at least one payload kind");
  VITRIFY_EXPECT(cfg_.kinds.size() <= 0xFFFF, "at most 65535 payload kinds");
  VITRIFY_EXPECT(!cfg_.name.empty() && cfg_.name.find('/') == std::string::npos,
              "store name must be non-empty and contain no '/', got \"" + cfg_.name + "\"");
  VITRIFY_EXPECT(cfg_.write_threads >= 1 && cfg_.read_threads >= 1,
              "write_threads and read_threads must be >= 1");
  VITRIFY_EXPECT(cfg_.queue_capacity >= 1, "queue_capacity must be >= 1");
  VITRIFY_EXPECT(cfg_.max_batch >= 1, "max_batch must be >= 1");
  VITRIFY_EXPECT(cfg_.queue_depth >= 1 && cfg_.queue_depth <= 4096,
                 "queue_depth must be in [1, 4096], got " + std::to_string(cfg_.queue_depth));
  VITRIFY_EXPECT(cfg_.load_threads <= 256,
              "load_threads must be in [0, 256], got " + std::to_string(cfg_.load_threads));
  VITRIFY_EXPECT(cfg_.gc_low > 0 && cfg_.gc_low < cfg_.gc_high && cfg_.gc_high <= 1.0,
              "need 0 < gc_low < gc_high <= 1, got gc_low=" + std::to_string(cfg_.gc_low) +
                  " gc_high=" + std::to_string(cfg_.gc_high));
  double share_sum = 0;
  for (size_t i = 0; i < cfg_.kinds.size(); ++i) {
    const KindConfig& kc = cfg_.kinds[i];
    VITRIFY_EXPECT(kc.page_bytes > 0 && kc.page_bytes <= (uint64_t{1} << 32) - kBlock,
                "kind " + std::to_string(i) + ": page_bytes must be in (0, 4 GiB - 4 KiB], got " +
                    std::to_string(kc.page_bytes));
    VITRIFY_EXPECT(std::isfinite(kc.share) && kc.share > 0,
                "kind " + std::to_string(i) + ": share must be a finite number > 0, got " +
                    std::to_string(kc.share));
    share_sum += kc.share;
  }
  if (cfg_.host) {
    VITRIFY_EXPECT(cfg_.direct_io != file_io::DirectIo::kOn,
                   "direct_io=on does not apply to a host-tier store (its slabs are mapped)");
    cfg_.direct_io = file_io::DirectIo::kOff;
    VITRIFY_EXPECT(cfg_.engine == IoEngine::kAuto || cfg_.engine == IoEngine::kPsync,
                   std::string("engine=\"") + io_engine_name(cfg_.engine) +
                       "\" does not apply to a host-tier store (its slots are copied in its "
                       "mapping); use \"auto\" or \"psync\"");
  }
  const size_t nd = cfg_.dirs.size();
  const uint64_t tag = store_tag(cfg_.name);
  const auto slab_path = [&](size_t kind, size_t drive) {
    return cfg_.dirs[drive] + "/" + cfg_.name + ".kind" + std::to_string(kind) + ".slab";
  };
  kinds_.resize(cfg_.kinds.size());
  std::vector<std::vector<uint64_t>> counts(kinds_.size());
  // The valid budgets (Python: vitrify.disk.budget_range): every kind at least one slot plus
  // its file header per drive, and at most kMaxSlotsPerSlab slots (a slot index is 32-bit).
  const auto budget_text = [&] {
    double lo = 1, hi = 9223372036854775807.0;
    for (const KindConfig& kc : cfg_.kinds) {
      const double slot = static_cast<double>(slot_bytes_for(kc.page_bytes));
      const double scale = static_cast<double>(nd) * share_sum / kc.share;
      lo = std::max(lo, std::ceil((static_cast<double>(kFileHeaderBytes) + slot) * scale));
      hi = std::min(hi, std::ceil((static_cast<double>(kFileHeaderBytes) +
                                   (static_cast<double>(kMaxSlotsPerSlab) + 1) * slot) * scale) - 1);
    }
    return "budget_bytes must be in [" + std::to_string(static_cast<uint64_t>(lo)) + ", " +
           std::to_string(static_cast<uint64_t>(hi)) + "] for these kinds and " +
           std::to_string(nd) + (nd == 1 ? " drive" : " drives");
  };
  if (cfg_.read_only) cfg_.cold_start = ColdStart::kLoad;  // a reader only ever loads (D14)
  for (size_t i = 0; i < kinds_.size(); ++i) {
    KindState& k = kinds_[i];
    k.cfg = cfg_.kinds[i];
    k.slot_bytes = slot_bytes_for(k.cfg.page_bytes);
    const double kind_budget = static_cast<double>(cfg_.budget_bytes) * k.cfg.share / share_sum;
    const uint64_t per_drive = static_cast<uint64_t>(kind_budget / static_cast<double>(nd));
    const uint64_t count = per_drive > kFileHeaderBytes ? (per_drive - kFileHeaderBytes) / k.slot_bytes : 0;
    VITRIFY_EXPECT(count >= 1, "budget_bytes=" + std::to_string(cfg_.budget_bytes) +
                                   " leaves kind " + std::to_string(i) + " " +
                                   std::to_string(per_drive) + " bytes per drive, less than one " +
                                   std::to_string(k.slot_bytes) +
                                   "-byte slot plus a 4096-byte header: " + budget_text());
    VITRIFY_EXPECT(count <= kMaxSlotsPerSlab,
                   "budget_bytes=" + std::to_string(cfg_.budget_bytes) + " gives kind " +
                       std::to_string(i) + " " + std::to_string(count) + " slots of " +
                       std::to_string(k.slot_bytes) + " bytes per drive, more than the " +
                       std::to_string(kMaxSlotsPerSlab) + " one slab file holds: " +
                       budget_text());
    counts[i].assign(nd, count);
  }
  // Lock every slab file before reading or writing any of them (D13): a slab held by another
  // open store refuses the whole store (SlabBusy), and the locks already taken are released
  // when `locked` goes out of scope, before any file was formatted or scanned.
  // A read-only store takes no lock and opens the existing slabs O_RDONLY (D14).
  // A failed open undoes what it did to the files (D22): the slab files it created are removed
  // and an existing disk slab it grew is cut back to its size, while the locks are still held.
  std::vector<LockedSlab> locked;
  std::vector<OpenedSlab> opened;
  try {
    std::vector<HostFs> host_fss;
    if (cfg_.host)  // H1: in memory, or refused before any file is created
      for (size_t d = 0; d < nd; ++d) host_fss.push_back(host_fs(cfg_.dirs[d]));
    if (!cfg_.read_only) {
      locked.reserve(kinds_.size() * nd);
      opened.reserve(kinds_.size() * nd);
      for (size_t i = 0; i < kinds_.size(); ++i)
        for (size_t d = 0; d < nd; ++d) {
          LockedSlab ls = lock_slab(slab_path(i, d), cfg_.direct_io, cfg_.slab_locking, cfg_.host);
          opened.push_back(OpenedSlab{ls.path, ls.dev, ls.ino, ls.created, ls.size});
          locked.push_back(std::move(ls));
        }
    }
    if (cfg_.host && !cfg_.read_only) {
      // H5: the space the slabs still have to take, per directory, against what its filesystem
      // has free, before any slab grows (a write into a mapping tmpfs cannot back is a SIGBUS).
      for (size_t d = 0; d < nd; ++d) {
        uint64_t needed = 0;
        for (size_t i = 0; i < kinds_.size(); ++i) {
          const uint64_t bytes = round_up(
              kFileHeaderBytes + counts[i][d] * kinds_[i].slot_bytes, host_fss[d].block_size);
          struct stat st{};
          VITRIFY_SYSCALL(::fstat(locked[i * nd + d].file.fd.get(), &st), slab_path(i, d));
          const uint64_t have = static_cast<uint64_t>(st.st_blocks) * 512;
          needed += bytes > have ? bytes - have : 0;
        }
        check_host_space(host_fss[d],
                         "the slabs \"" + cfg_.dirs[d] + "/" + cfg_.name + ".kind*.slab\"", needed);
      }
    }
    for (size_t i = 0; i < kinds_.size(); ++i) {
      KindState& k = kinds_[i];
      for (size_t d = 0; d < nd; ++d) {
        const SlabGeometry geo{static_cast<uint16_t>(i), k.slot_bytes, counts[i][d], tag,
                               k.cfg.page_bytes};
        if (cfg_.read_only)
          k.slabs.push_back(
              SlabFile::open_read_only(slab_path(i, d), geo, cfg_.direct_io, cfg_.host));
        else
          k.slabs.push_back(std::make_unique<SlabFile>(std::move(locked[i * nd + d]), geo,
                                                       cfg_.cold_start, cfg_.host));
        if (cfg_.host && !cfg_.read_only) k.slabs.back()->mark_used();
      }
      k.index.emplace(counts[i], cfg_.gc_high, cfg_.gc_low);
      k.index->hold_freed_slots();  // a freed slot is zeroed before it is reused (D5, D14)
    }
    counters_.direct_io = true;
    for (auto& k : kinds_)
      for (auto& s : k.slabs) counters_.direct_io = counters_.direct_io && s->direct();
    load_index();
    if (cfg_.host && cfg_.register_device >= 0) register_mappings();
    const unsigned writers = cfg_.read_only ? 0u : cfg_.write_threads;
    open_engines(nd * (writers + cfg_.read_threads));
    for (size_t d = 0; d < nd; ++d) drives_.push_back(std::make_unique<Drive>());
    size_t e = 0;  // the next thread's engine (engines_ is empty for psync)
    const auto engine_for = [&]() -> detail::IoEngineImpl* {
      return engines_.empty() ? nullptr : engines_[e++].get();
    };
    for (size_t d = 0; d < nd; ++d) {
      for (unsigned t = 0; t < writers; ++t)
        drives_[d]->threads.emplace_back(
            [this, d, en = engine_for()] { write_loop(static_cast<unsigned>(d), en); });
      for (unsigned t = 0; t < cfg_.read_threads; ++t)
        drives_[d]->threads.emplace_back(
            [this, d, en = engine_for()] { read_loop(static_cast<unsigned>(d), en); });
    }
  } catch (...) {
    // Undo the files first (the locks still held: nobody else uses them meanwhile), then stop
    // the threads that started and settle owner records and locks as close() does.
    undo_failed_open(opened, cfg_.host);
    close();
    throw;
  }
}

// D25: the engine is chosen when the store opens, by creating every I/O thread's ring or
// context: auto takes the first the kernel grants (io_uring, then aio, then psync; each refusal
// logged at DEBUG), a named engine is granted or the open fails with the kernel's errno.
void Store::open_engines(size_t threads) {
  engine_ = IoEngine::kPsync;
  if (cfg_.host || cfg_.engine == IoEngine::kPsync) return;
  std::vector<IoEngine> candidates;
  if (cfg_.engine == IoEngine::kAuto)
    candidates = {IoEngine::kIoUring, IoEngine::kAio};
  else
    candidates = {cfg_.engine};
  for (IoEngine kind : candidates) {
    std::vector<std::unique_ptr<detail::IoEngineImpl>> made;
    try {
      made.reserve(threads);
      for (size_t t = 0; t < threads; ++t) made.push_back(detail::make_engine(kind, cfg_.queue_depth));
    } catch (const std::system_error& e) {
      if (cfg_.engine != IoEngine::kAuto) throw;
      engine_fallback_ += (engine_fallback_.empty() ? "" : "; ") + std::string(e.what());
      log::debug(std::string("vitrify.disk: store '") + cfg_.name + "': " + e.what() +
                 "; trying the next engine");
      continue;
    }
    engines_ = std::move(made);
    engine_ = kind;
    break;
  }
  log::debug(std::string("vitrify.disk: store '") + cfg_.name + "' uses engine " +
             io_engine_name(engine_) + " (queue_depth " + std::to_string(cfg_.queue_depth) +
             ", requested " + io_engine_name(cfg_.engine) + ")");
}

// D22: what a failed open created is removed, what it grew is cut back; a path that names
// another file by now (replaced meanwhile) is left alone. Never throws; failures are logged.
void Store::undo_failed_open(const std::vector<OpenedSlab>& opened, bool host) noexcept {
  for (const OpenedSlab& o : opened) {
    try {
      struct stat st{};
      if (::lstat(o.path.c_str(), &st) != 0 || st.st_dev != o.dev || st.st_ino != o.ino) continue;
      if (o.created) {
        if (::unlink(o.path.c_str()) != 0 && errno != ENOENT)
          log::warning("vitrify.disk: a failed open could not remove the slab file it created, \"" +
                       o.path + "\": " + std::strerror(errno));
        continue;
      }
      // A host slab is never shrunk (H1: a reader may map it); a disk slab this open grew goes
      // back to its size, which frees what posix_fallocate took.
      if (host || static_cast<uint64_t>(st.st_size) <= o.size) continue;
      const int fd = ::open(o.path.c_str(), O_WRONLY | O_NOFOLLOW | O_NONBLOCK | O_CLOEXEC);
      if (fd < 0) continue;
      file_io::Fd owned(fd);
      struct stat fs{};
      if (::fstat(fd, &fs) != 0 || fs.st_dev != o.dev || fs.st_ino != o.ino) continue;
      if (::ftruncate(fd, static_cast<off_t>(o.size)) != 0)
        log::warning("vitrify.disk: a failed open could not cut \"" + o.path + "\" back to " +
                     std::to_string(o.size) + " bytes: " + std::strerror(errno));
    } catch (...) {  // no memory for a message: nothing else to undo for this file
    }
  }
}

Store::~Store() { close(); }

void Store::register_mappings() {
  VITRIFY_EXPECT(cfg_.register_threads >= 1 && cfg_.register_max_bytes >= (uint64_t{2} << 20),
                 "register_threads must be >= 1 and register_max_bytes >= 2 MiB");
  // Pieces of whole 2 MiB units (the last one of a slab takes the rest), each under the
  // single-registration ceiling.
  const uint64_t unit = uint64_t{2} << 20;
  const uint64_t piece = cfg_.register_max_bytes / unit * unit;
  std::vector<std::pair<void*, size_t>> ranges;
  for (const KindState& k : kinds_)
    for (const auto& slab : k.slabs) {
      const SlabMapping& m = slab->mapping();
      for (uint64_t off = 0; off < m.size(); off += piece)
        ranges.emplace_back(m.data() + off, static_cast<size_t>(std::min<uint64_t>(piece, m.size() - off)));
    }
  registrations_ = host::register_ranges(ranges, cfg_.register_device, cfg_.register_max_bytes,
                                         cfg_.register_threads, cfg_.read_only, registration_);
  uint64_t bytes = 0;
  for (const auto& r : ranges) bytes += r.second;
  log::info("vitrify.disk: host store " + cfg_.name + ": " + std::to_string(bytes >> 20) +
            " MiB registered with CUDA device " + std::to_string(cfg_.register_device) + " in " +
            std::to_string(ranges.size()) + " ranges, " + std::to_string(registration_.seconds) +
            " s on " + std::to_string(registration_.threads) + " threads");
}

void Store::close() noexcept {
  std::lock_guard cl(clear_mu_);  // not while a clear() rewrites the slab headers
  {
    std::lock_guard lk(mu_);
    if (closed_) return;
    closed_ = true;
  }
  for (auto& d : drives_) {
    {
      std::lock_guard lk(d->writes.mu);
      d->writes.stop = true;
    }
    d->writes.not_empty.notify_all();
    d->writes.not_full.notify_all();
    {
      std::lock_guard lk(d->reads.mu);
      d->reads.stop = true;
    }
    d->reads.not_empty.notify_all();
    d->reads.not_full.notify_all();
  }
  for (auto& d : drives_)
    for (auto& t : d->threads)
      if (t.joinable()) t.join();
  settled_cv_.notify_all();  // deletes waiting for a put see closed_
  const ClosedGate gate(*this);  // no delete or mapped read still zeroes or copies a slot
  // Zero the headers of freed slots so `load` rebuilds exactly the live set (D5), and sync what
  // was zeroed since the last sync. A reader writes nothing (D14).
  std::lock_guard lk(mu_);
  for (auto& k : kinds_) {
    if (cfg_.read_only) break;
    if (!k.index) continue;  // a failed open: this kind's slabs were never indexed
    settle_freed_locked(k);
    for (uint32_t d = 0; d < k.slabs.size(); ++d) {
      try {
        for (uint64_t slot : k.index->stale(d)) k.slabs[d]->invalidate(slot);
        k.slabs[d]->sync();
        k.index->clear_stale(d);
      } catch (const std::exception& e) {
        log::error(std::string("vitrify.disk: invalidating freed slots on close: ") + e.what());
      }
    }
  }
  // Nothing touches the slabs after this: another store may open them now (D13).
  for (auto& k : kinds_)
    for (auto& s : k.slabs) {
      if (cfg_.host && !cfg_.read_only) s->mark_used();  // `vitrify tier ls`: last use
      s->release_lock();
    }
  registrations_.clear();  // unregisters (never throws); the mappings stay until destruction
  registration_.registered = false;
}

// Scan the slab headers; the kind's SlotIndex rebuilds the index, slot pool and GC order (D7).
void Store::load_index() {
  const unsigned threads = cfg_.load_threads == 0 ? kDefaultLoadThreads : cfg_.load_threads;
  counters_.loaded_entries = 0;
  for (KindState& k : kinds_) {
    std::vector<FoundSlot> found;
    for (size_t d = 0; d < k.slabs.size(); ++d) {
      if (cfg_.cold_start != ColdStart::kLoad || k.slabs[d]->formatted()) continue;
      // scan() returns the slots in slot order whatever the thread count.
      for (ScannedSlot s : k.slabs[d]->scan(threads)) {
        if (s.payload_len > k.cfg.page_bytes) continue;
        if (!cfg_.host) s.dirty = false;  // D24 is the host tier's (a copied host slab)
        found.push_back({static_cast<uint32_t>(d), s});
      }
    }
    counters_.loaded_entries += k.index->load(std::move(found), seq_);
  }
}

uint64_t Store::page_bytes(unsigned kind) const { return kind_state(kind).cfg.page_bytes; }
uint64_t Store::slot_bytes(unsigned kind) const { return kind_state(kind).slot_bytes; }

SlotBufferPtr Store::make_buffer(unsigned kind) const {
  return std::make_shared<AlignedBuffer>(kind_state(kind).slot_bytes, kBlock);
}

Store::KindState& Store::kind_state(unsigned kind) {
  VITRIFY_EXPECT(kind < kinds_.size(), "payload kind " + std::to_string(kind) + " out of range [0, " +
                                        std::to_string(kinds_.size()) + ")");
  return kinds_[kind];
}
const Store::KindState& Store::kind_state(unsigned kind) const {
  return const_cast<Store*>(this)->kind_state(kind);
}

const SlabFile& Store::slab(unsigned kind, unsigned drive) const {
  const KindState& k = kind_state(kind);
  VITRIFY_EXPECT(drive < k.slabs.size(), "drive " + std::to_string(drive) + " out of range");
  return *k.slabs[drive];
}

template <class Job>
bool Store::push(Queue<Job>& q, Job& job) {
  std::unique_lock lk(q.mu);
  q.not_full.wait(lk, [&] { return q.stop || q.jobs.size() < cfg_.queue_capacity; });
  if (q.stop) return false;
  q.jobs.push_back(std::move(job));
  lk.unlock();
  q.not_empty.notify_one();
  return true;
}

void Store::refuse_if_read_only(const char* what) const {
  if (cfg_.read_only)
    vitrify::detail::throw_errno(EROFS, what, cfg_.name, "the disk store is open read-only");
}

Ticket Store::submit_put(unsigned kind, std::vector<PutItem> items) {
  refuse_if_read_only("put");
  KindState& k = kind_state(kind);
  for (size_t i = 0; i < items.size(); ++i) {
    const PutItem& it = items[i];
    VITRIFY_EXPECT(!it.dirty || cfg_.host,
                   "dirty puts (write-back, D24) are for host-tier stores; store '" + cfg_.name +
                       "' is a disk store");
    VITRIFY_EXPECT(it.buffer != nullptr, "put item " + std::to_string(i) + " has no slot buffer");
    VITRIFY_EXPECT(it.payload_len <= k.cfg.page_bytes,
                "payload of " + std::to_string(it.payload_len) + " bytes exceeds page_bytes " +
                    std::to_string(k.cfg.page_bytes) + " of kind " + std::to_string(kind));
    VITRIFY_EXPECT(it.buffer->size() >= round_up(kSlotHeaderBytes + it.payload_len, kBlock) &&
                    is_aligned(reinterpret_cast<uintptr_t>(it.buffer->data()), kBlock),
                "put item " + std::to_string(i) + ": slot buffer of " +
                    std::to_string(it.buffer->size()) + " bytes is too small or not aligned");
  }
  auto t = std::make_shared<Completion>(items.size());
  enqueue_puts(kind, items, t, nullptr);
  return t;
}

// Allocate slots and queue writes; result i of `items` goes to t[where ? where[i] : i].
void Store::enqueue_puts(unsigned kind, std::vector<PutItem>& items, const Ticket& t,
                         const std::vector<size_t>* where) {
  KindState& k = kinds_[kind];
  std::vector<WriteJob> jobs;
  {
    std::unique_lock lk(mu_);
    for (size_t n = 0; n < items.size(); ++n) {
      PutItem& it = items[n];
      const size_t i = where ? (*where)[n] : n;
      if (closed_) {
        t->finish(i, static_cast<int64_t>(PutResult::kCancelled));
        continue;
      }
      SlotIndex::PutPlan plan = k.index->plan_put(it.key);
      if (plan.action == SlotIndex::PutPlan::kFull) {  // full: GC first (D9)
        ++counters_.gc_runs;
        counters_.gc_reclaims += k.index->collect();
        settle_freed_locked(k);  // zeroed here, under mu_: the put needs a slot now (D5)
        plan = k.index->plan_put(it.key);
        // Slots another thread is zeroing right now are free in a moment: wait for them
        // rather than report a full pool (D9).
        while (plan.action == SlotIndex::PutPlan::kFull && k.index->slots_out() > 0 &&
               !closed_) {
          settled_cv_.wait(lk);
          plan = k.index->plan_put(it.key);
        }
        if (closed_) {
          t->finish(i, static_cast<int64_t>(PutResult::kCancelled));
          continue;
        }
      }
      if (plan.action == SlotIndex::PutPlan::kDuplicate) {  // dedup (D6)
        k.index->touch(it.key);
        ++counters_.dedup_hits;
        t->finish(i, static_cast<int64_t>(PutResult::kDuplicate));
        continue;
      }
      if (plan.action == SlotIndex::PutPlan::kJoin) {  // same key, same content (D2)
        ++counters_.dedup_hits;
        k.index->join(it.key, Joiner{t, i});
        continue;
      }
      if (plan.action == SlotIndex::PutPlan::kFull) {
        ++counters_.put_failures;
        t->finish(i, static_cast<int64_t>(PutResult::kFull));
        continue;
      }
      const uint64_t slot = k.index->allocate(it.key, plan);
      const uint32_t d = plan.drive;
      jobs.push_back(WriteJob{kind, it.key, d, slot, std::move(it.buffer),
                              it.payload_len, seq_++, t, i, epoch_, it.dirty});
      ++in_flight_writes_;  // from here until its acknowledgement (finish_write)
    }
    write_queue_depth_ += jobs.size();
  }
  for (size_t j = 0; j < jobs.size(); ++j) {
    if (!push(drives_[jobs[j].drive]->writes, jobs[j])) {  // closed meanwhile: undo
      {
        std::lock_guard lk(mu_);
        --write_queue_depth_;
        finish_write(jobs[j], PutResult::kCancelled);  // its slot is settled by close()
      }
      settled_cv_.notify_all();
    }
  }
}

Ticket Store::submit_put_copy(unsigned kind, const std::vector<Key>& keys,
                              const std::vector<const void*>& srcs,
                              const std::vector<size_t>& lens, bool dirty) {
  refuse_if_read_only("put");
  VITRIFY_EXPECT(!dirty || cfg_.host, "dirty puts (write-back, D24) are for host-tier stores; "
                                      "store '" + cfg_.name + "' is a disk store");
  KindState& k = kind_state(kind);
  VITRIFY_EXPECT(keys.size() == srcs.size() && keys.size() == lens.size(),
              "keys, sources and lengths differ in count");
  for (size_t i = 0; i < lens.size(); ++i)
    VITRIFY_EXPECT(lens[i] <= k.cfg.page_bytes,
                "payload of " + std::to_string(lens[i]) + " bytes exceeds page_bytes " +
                    std::to_string(k.cfg.page_bytes) + " of kind " + std::to_string(kind));
  // Keys already present are acknowledged without copying (dedup is free).
  std::vector<PutItem> items;
  std::vector<size_t> where;
  std::vector<bool> dup(keys.size(), false);
  {
    std::lock_guard lk(mu_);
    for (size_t i = 0; i < keys.size(); ++i) {
      if (k.index->touch(keys[i])) {
        ++counters_.dedup_hits;
        dup[i] = true;
      }
    }
  }
  for (size_t i = 0; i < keys.size(); ++i) {
    if (dup[i]) continue;
    SlotBufferPtr b;
    {
      std::lock_guard lk(mu_);
      if (!k.spare.empty()) {
        b = std::move(k.spare.back());
        k.spare.pop_back();
      }
    }
    if (!b) b = make_buffer(kind);
    if (lens[i] != 0) std::memcpy(b->data() + kSlotHeaderBytes, srcs[i], lens[i]);
    items.push_back(PutItem{keys[i], std::move(b), lens[i], dirty});
    where.push_back(i);
  }
  auto t = std::make_shared<Completion>(keys.size());
  for (size_t i = 0; i < keys.size(); ++i)
    if (dup[i]) t->finish(i, static_cast<int64_t>(PutResult::kDuplicate));
  enqueue_puts(kind, items, t, &where);
  return t;
}

// Called with mu_ held: publish or undo one write, wake its joiners.
void Store::finish_write(WriteJob& job, PutResult r, std::vector<Ack>* acks) {
  --in_flight_writes_;  // with the acknowledgement, under the same lock as stats()
  const auto ack = [&](const Ticket& t, size_t i, PutResult v) {
    if (acks != nullptr)
      acks->push_back(Ack{t, i, static_cast<int64_t>(v)});
    else
      t->finish(i, static_cast<int64_t>(v));
  };
  if (job.epoch != epoch_) {
    // clear() ran since the slot was allocated: the slot went back to the pool and the pending
    // entry (with its joiners) was acknowledged then. Nothing of this job is in the state.
    job.buffer.reset();
    ack(job.ticket, job.index, PutResult::kCancelled);
    return;
  }
  KindState& k = kinds_[job.kind];
  // Durable before visible (D3): r is kStored only after the slab's fdatasync returned.
  SlotIndex::PutOutcome out = k.index->finish_put(job.key, job.drive, job.slot,
                                                  static_cast<uint32_t>(job.len),
                                                  r == PutResult::kStored, job.dirty);
  if (r == PutResult::kStored && out.cancelled) r = PutResult::kCancelled;
  if (out.published) {
    ++counters_.spills;
    counters_.spill_bytes += job.len;
  } else if (r == PutResult::kError) {
    ++counters_.write_errors;
  }
  // Keep buffers nobody else holds (and that fit any page of the kind) for copying puts.
  if (job.buffer && job.buffer.use_count() == 1 && job.buffer->size() >= k.slot_bytes &&
      k.spare.size() < kSpareBuffersPerKind)
    k.spare.push_back(std::move(job.buffer));
  job.buffer.reset();
  ack(job.ticket, job.index, r);
  const PutResult jr = r == PutResult::kStored ? PutResult::kDuplicate : r;
  for (auto& [tk, idx] : out.joiners) ack(tk, idx, jr);
}

void Store::write_loop(unsigned drive, detail::IoEngineImpl* engine) {
  Queue<WriteJob>& q = drives_[drive]->writes;
  std::vector<WriteJob> batch;
  for (;;) {
    batch.clear();
    {
      std::unique_lock lk(q.mu);
      q.not_empty.wait(lk, [&] { return q.stop || !q.jobs.empty(); });
      if (q.jobs.empty()) return;  // stopped and drained
      while (!q.jobs.empty() && batch.size() < cfg_.max_batch) {
        batch.push_back(std::move(q.jobs.front()));
        q.jobs.pop_front();
      }
    }
    q.not_full.notify_all();
    write_queue_depth_ -= batch.size();
    GateGuard gate{this};  // no clear() while this batch does slot I/O
    {
      // Jobs allocated before a clear() own no slot any more: acknowledge them, write nothing.
      std::lock_guard lk(mu_);
      size_t keep = 0;
      for (size_t i = 0; i < batch.size(); ++i) {
        if (batch[i].epoch != epoch_)
          finish_write(batch[i], PutResult::kCancelled);
        else if (keep != i)
          batch[keep++] = std::move(batch[i]);
        else
          ++keep;
      }
      batch.resize(keep);
    }
    std::vector<PutResult> res(batch.size(), PutResult::kStored);
    std::vector<SlabFile*> touched;
    if (engine != nullptr) write_batch(drive, batch, res, touched, *engine);
    for (size_t i = 0; engine == nullptr && i < batch.size(); ++i) {
      WriteJob& j = batch[i];
      SlabFile& s = *kinds_[j.kind].slabs[drive];
      try {
        s.write_aligned(j.slot, j.key, j.buffer->data(), j.len, j.seq,
                        j.dirty ? kSlotDirty : uint8_t{0});
        if (std::find(touched.begin(), touched.end(), &s) == touched.end()) touched.push_back(&s);
      } catch (const std::exception& e) {
        res[i] = PutResult::kError;
        log::error(std::string("vitrify.disk: slot write failed: ") + e.what());
      }
    }
    // Slot write -> fdatasync -> index entry (D3): one sync per slab per batch.
    for (SlabFile* s : touched) {
      try {
        s->sync();
      } catch (const std::exception& e) {
        log::error(std::string("vitrify.disk: ") + e.what());
        for (size_t i = 0; i < batch.size(); ++i)
          if (kinds_[batch[i].kind].slabs[drive].get() == s) res[i] = PutResult::kError;
      }
    }
    // Published under mu_, acknowledged after the GC pass zeroed its victims: when a put
    // returns, nothing its batch evicted is found by a reader's refresh any more (D14), and
    // the slots are back in the pool (D10).
    std::vector<Ack> acks;
    acks.reserve(batch.size());
    {
      std::lock_guard lk(mu_);
      std::vector<unsigned> kinds_touched;
      for (size_t i = 0; i < batch.size(); ++i) {
        finish_write(batch[i], res[i], &acks);
        if (std::find(kinds_touched.begin(), kinds_touched.end(), batch[i].kind) == kinds_touched.end())
          kinds_touched.push_back(batch[i].kind);
      }
      // GC between writes, on the write thread (D8).
      for (unsigned ki : kinds_touched) {
        SlotIndex& index = *kinds_[ki].index;
        if (index.gc_due()) {
          ++counters_.gc_runs;
          counters_.gc_reclaims += index.collect();
        }
      }
    }
    // Evicted and failed slots: zeroed, then free (D5, D14), still inside the gate.
    settle_freed();
    settled_cv_.notify_all();  // puts finished: a delete waiting for one goes on
    for (const Ack& a : acks) a.ticket->finish(a.index, a.result);
  }
}

// D25: the batch's slot images are prepared exactly as write_aligned prepares them, then the
// engine has every write of the batch in flight at once (at most queue_depth); what follows
// (one fdatasync per slab touched, then publish: D3) is the psync path's.
void Store::write_batch(unsigned drive, std::vector<WriteJob>& batch, std::vector<PutResult>& res,
                        std::vector<SlabFile*>& touched, detail::IoEngineImpl& engine) {
  detail::IoOps ops;
  std::vector<size_t> job_of;
  job_of.reserve(batch.size());
  for (size_t i = 0; i < batch.size(); ++i) {
    WriteJob& j = batch[i];
    SlabFile& s = *kinds_[j.kind].slabs[drive];
    try {
      const size_t n = s.prepare_write(j.slot, j.key, j.buffer->data(), j.len, j.seq,
                                       j.dirty ? kSlotDirty : uint8_t{0});
      detail::IoOp op;
      op.fd = s.fd();
      op.write = true;
      op.buf = j.buffer->data();
      op.len = n;
      op.off = s.slot_offset(j.slot);
      ops.push_back(op);
      job_of.push_back(i);
    } catch (const std::exception& e) {
      res[i] = PutResult::kError;
      log::error(std::string("vitrify.disk: slot write failed: ") + e.what());
    }
  }
  engine.run(ops, [&](size_t k) {
    const detail::IoOp& op = ops[k];
    const size_t i = job_of[k];
    SlabFile& s = *kinds_[batch[i].kind].slabs[drive];
    if (op.error != 0 || op.done != op.len) {
      res[i] = PutResult::kError;
      const int err = op.error != 0 ? op.error : EIO;
      log::error(std::string("vitrify.disk: slot write failed: ") +
                 (op.failed_call ? op.failed_call : "write") + "(\"" + s.path() + "\", " +
                 std::to_string(op.len) + " bytes at " + std::to_string(op.off) +
                 "): " + std::strerror(err));
      return;
    }
    if (std::find(touched.begin(), touched.end(), &s) == touched.end()) touched.push_back(&s);
  });
}

Ticket Store::submit_get(unsigned kind, std::vector<GetItem> items) {
  KindState& k = kind_state(kind);
  auto t = std::make_shared<Completion>(items.size());
  std::vector<ReadJob> jobs;
  std::vector<bool> done(items.size(), false);
  {
    std::lock_guard lk(mu_);
    for (size_t i = 0; i < items.size(); ++i) {
      const GetItem& it = items[i];
      const std::optional<SlotLocation> e = closed_ ? std::nullopt : k.index->find(it.key);
      if (!e || it.miss_if_small) continue;
      const size_t need = it.dst_is_slot ? round_up(kSlotHeaderBytes + e->len, kBlock) : e->len;
      VITRIFY_EXPECT(it.dst_bytes >= need && (it.dst != nullptr || need == 0),
                  "get item " + std::to_string(i) + ": destination of " +
                      std::to_string(it.dst_bytes) + " bytes is smaller than the " +
                      std::to_string(need) + " bytes the entry needs");
      VITRIFY_EXPECT(!it.dst_is_slot || is_aligned(reinterpret_cast<uintptr_t>(it.dst), kBlock),
                  "get item " + std::to_string(i) + ": slot buffer is not 4096-byte aligned");
    }
    for (size_t i = 0; i < items.size(); ++i) {
      std::optional<SlotLocation> e = closed_ ? std::nullopt : k.index->find(items[i].key);
      const GetItem& it = items[i];
      if (e && it.miss_if_small &&
          it.dst_bytes < (it.dst_is_slot ? round_up(kSlotHeaderBytes + e->len, kBlock) : e->len))
        e.reset();  // the entry changed size since the caller looked: a miss
      if (!e) {
        ++counters_.misses;
        done[i] = true;
        continue;
      }
      k.index->touch(items[i].key);  // reads touch (D8)
      jobs.push_back(ReadJob{kind, items[i].key, e->drive, e->slot, e->len, items[i], t, i, epoch_});
    }
    read_queue_depth_ += jobs.size();
  }
  for (size_t i = 0; i < items.size(); ++i)
    if (done[i]) t->finish(i, -1);
  for (ReadJob& j : jobs) {
    if (!push(drives_[j.drive]->reads, j)) {
      --read_queue_depth_;
      t->finish(j.index, -1);
    }
  }
  return t;
}

std::vector<int64_t> Store::read_mapped(unsigned kind, const std::vector<Key>& keys,
                                        size_t expected_len, const MappedCopy& copy) {
  VITRIFY_EXPECT(cfg_.host, "read_mapped: store '" + cfg_.name +
                                "' is a disk store; only a host store's slabs are mapped");
  KindState& k = kind_state(kind);
  std::vector<int64_t> out(keys.size(), -1);
  struct Found {
    SlotLocation at;
    std::optional<SlabFile::MappedSlot> mapped;  // nullopt: the header did not verify
  };
  std::vector<Found> found(keys.size());
  std::vector<size_t> located;  // key indices found in the index
  GateGuard gate{this};         // no clear() or refresh() until the copies are checked
  {
    std::lock_guard lk(mu_);
    for (size_t i = 0; i < keys.size(); ++i) {
      const std::optional<SlotLocation> e = closed_ ? std::nullopt : k.index->find(keys[i]);
      if (!e) {
        ++counters_.misses;
        continue;
      }
      k.index->touch(keys[i]);  // reads touch (D8)
      found[i].at = *e;
      located.push_back(i);
    }
  }
  in_flight_reads_ += located.size();
  struct InFlight {  // the count comes back down on every way out, allocation failures too
    std::atomic<uint64_t>& n;
    size_t k;
    ~InFlight() { n -= k; }
  } in_flight{in_flight_reads_, located.size()};
  std::vector<MappedPayload> items;
  items.reserve(located.size());
  for (size_t i : located) {
    Found& f = found[i];
    f.mapped = k.slabs[f.at.drive]->mapped_slot(f.at.slot, keys[i], expected_len);
    if (f.mapped) items.push_back({i, f.mapped->payload, f.mapped->header.payload_len});
  }
  std::vector<std::optional<uint32_t>> crcs;
  std::exception_ptr error;
  try {
    if (!items.empty()) crcs = copy(items);
    VITRIFY_EXPECT(crcs.size() == items.size(),
                   "read_mapped: the copy returned " + std::to_string(crcs.size()) +
                       " results for " + std::to_string(items.size()) + " payloads");
  } catch (...) {
    error = std::current_exception();
    crcs.assign(items.size(), std::nullopt);
  }
  std::atomic_thread_fence(std::memory_order_acquire);  // the copies before the second look
  // Per located key: a hit, a plain miss (declined, an error, or the slot rewritten during the
  // copy: its header changed, so nothing is known about the entry), or corrupt (the first look
  // failed, or the header is unchanged and the CRC differs: D1, the entry is dropped).
  enum class Outcome : uint8_t { kCorrupt, kMiss, kHit };
  std::vector<Outcome> outcome(keys.size(), Outcome::kCorrupt);
  for (size_t j = 0; j < items.size(); ++j) {
    const size_t i = items[j].index;
    if (!crcs[j]) {
      outcome[i] = Outcome::kMiss;
      continue;
    }
    const SlotHeader& h = found[i].mapped->header;
    const auto again = k.slabs[found[i].at.drive]->mapped_slot(found[i].at.slot, keys[i],
                                                                 expected_len);
    if (!again || std::memcmp(&again->header, &h, sizeof h) != 0) {
      outcome[i] = Outcome::kMiss;
    } else if (*crcs[j] == h.payload_crc) {
      outcome[i] = Outcome::kHit;
      out[i] = static_cast<int64_t>(h.payload_len);
    }
  }
  {
    std::lock_guard lk(mu_);
    for (size_t i : located) {
      if (outcome[i] == Outcome::kHit) {
        ++counters_.reloads;
        counters_.reload_bytes += static_cast<uint64_t>(out[i]);
      } else if (outcome[i] == Outcome::kMiss || error) {
        ++counters_.misses;
      } else {
        ++counters_.verify_failures;
        k.index->drop_if_at(keys[i], found[i].at);  // a slot that does not verify (D1, D4)
      }
    }
  }
  settle_freed();  // still inside the gate
  if (error) std::rethrow_exception(error);
  return out;
}

// Statistics, the verify-failure reclaim and the acknowledgement of one read.
void Store::complete_read(ReadJob& j, std::optional<size_t> r) {
  {
    std::lock_guard lk(mu_);
    if (r) {
      ++counters_.reloads;
      counters_.reload_bytes += *r;
    } else if (j.epoch != epoch_) {
      ++counters_.misses;  // looked up before a clear(): the entry is gone
    } else {
      ++counters_.verify_failures;
      // A slot that does not verify is a miss; drop its entry if it still points there (D4).
      kinds_[j.kind].index->drop_if_at(j.key, SlotLocation{j.drive, j.slot, j.len});
    }
  }
  if (!r) settle_freed();  // a dropped slot is zeroed first; callers hold the gate
  --in_flight_reads_;
  j.ticket->finish(j.index, r ? static_cast<int64_t>(*r) : -1);
}

// Takes the next read job; false when the queue is stopped and drained.
bool Store::next_read(unsigned drive, ReadJob& j) {
  Queue<ReadJob>& q = drives_[drive]->reads;
  {
    std::unique_lock lk(q.mu);
    q.not_empty.wait(lk, [&] { return q.stop || !q.jobs.empty(); });
    if (q.jobs.empty()) return false;
    j = std::move(q.jobs.front());
    q.jobs.pop_front();
  }
  q.not_full.notify_one();
  --read_queue_depth_;
  ++in_flight_reads_;
  return true;
}

bool Store::current_epoch(const ReadJob& j) const {
  std::lock_guard lk(mu_);
  return j.epoch == epoch_;
}

void Store::read_loop(unsigned drive, detail::IoEngineImpl* engine) {
  uint64_t max_slot = 0;
  for (auto& k : kinds_) max_slot = std::max(max_slot, k.slot_bytes);
  if (engine != nullptr) return read_loop_batched(drive, max_slot, *engine);
  const bool staged = cfg_.verify_stage > 0 || (cfg_.verify_stage < 0 && cfg_.read_threads == 1);
  if (staged) {
    try {
      read_loop_staged(drive, max_slot);
      return;
    } catch (const std::system_error& e) {  // no second thread: verify on this one
      log::warning(std::string("vitrify.disk: no verify thread (") + e.what() + ")");
    }
  }
  AlignedBuffer scratch;
  ReadJob j;
  while (next_read(drive, j)) {
    GateGuard gate{this};  // no clear() while this read does slot I/O
    if (!current_epoch(j)) {  // looked up before a clear(): the entry is gone, a miss
      complete_read(j, std::nullopt);
      continue;
    }
    const SlabFile& s = *kinds_[j.kind].slabs[drive];
    std::optional<size_t> r;
    if (j.item.dst_is_slot) {
      r = s.read_into(j.slot, j.key, j.item.dst, j.item.dst_bytes, j.len);
    } else {
      if (scratch.size() < max_slot) scratch = AlignedBuffer(max_slot, kBlock);
      r = s.read_into(j.slot, j.key, scratch.data(), scratch.size(), j.len);
      if (r && *r) std::memcpy(j.item.dst, scratch.data() + kSlotHeaderBytes, *r);
    }
    complete_read(j, r);
  }
}

// D25: up to queue_depth queued reads (and, for plain destinations, as many as the scratch
// budget stages) in flight at once; each is verified (D1: verify_read, exactly as the psync
// path) and acknowledged as soon as its transfer lands, while the others are still in flight.
void Store::read_loop_batched(unsigned drive, uint64_t max_slot, detail::IoEngineImpl& engine) {
  Queue<ReadJob>& q = drives_[drive]->reads;
  const size_t cap = engine.depth();
  const size_t scratch_cap = std::max<uint64_t>(1, kReadScratchBytes / std::max<uint64_t>(max_slot, 1));
  // A batch keeps the gate; it takes at most this many jobs, so a clear() waits a bounded time.
  const size_t batch_max = 16 * cap;
  std::vector<AlignedBuffer> scratch;
  std::vector<size_t> free_scratch;  // indices into scratch
  std::deque<ReadJob> jobs;
  detail::IoOps ops;
  std::vector<size_t> job_of, scratch_of;  // per op: its job, its scratch buffer (SIZE_MAX: none)
  size_t taken = 0;
  // Moves up to `room` queued jobs into `jobs` (no more reads into plain destinations than
  // scratch buffers are free); `wait`: block for the first. False when stopped and drained.
  const auto take = [&](size_t room, bool wait) {
    size_t got = 0;
    {
      std::unique_lock lk(q.mu);
      if (wait) {
        q.not_empty.wait(lk, [&] { return q.stop || !q.jobs.empty(); });
        if (q.jobs.empty()) return false;
      }
      size_t staged = 0;
      while (!q.jobs.empty() && got < room) {
        const bool needs_scratch = !q.jobs.front().item.dst_is_slot;
        if (needs_scratch && staged == free_scratch.size() + (scratch_cap - scratch.size())) break;
        staged += needs_scratch ? 1 : 0;
        jobs.push_back(std::move(q.jobs.front()));
        q.jobs.pop_front();
        ++got;
      }
    }
    if (got > 0) q.not_full.notify_all();
    read_queue_depth_ -= got;
    in_flight_reads_ += got;
    taken += got;
    return true;
  };
  // Turns the jobs taken since `from` into ops (or answers them at once: a job of an older
  // epoch, or one read_raw would refuse, is a miss as on psync).
  const auto stage = [&](size_t from) {
    std::vector<char> live(jobs.size() - from);
    {
      std::lock_guard lk(mu_);
      for (size_t i = from; i < jobs.size(); ++i) live[i - from] = jobs[i].epoch == epoch_;
    }
    for (size_t i = from; i < jobs.size(); ++i) {
      ReadJob& j = jobs[i];
      if (!live[i - from]) {  // looked up before a clear(): the entry is gone, a miss
        complete_read(j, std::nullopt);
        continue;
      }
      const SlabFile& s = *kinds_[j.kind].slabs[drive];
      uint8_t* buf;
      size_t bytes, sc = SIZE_MAX;
      if (j.item.dst_is_slot) {
        buf = j.item.dst;
        bytes = j.item.dst_bytes;
      } else {
        if (free_scratch.empty()) {
          scratch.emplace_back(max_slot, kBlock);
          free_scratch.push_back(scratch.size() - 1);
        }
        sc = free_scratch.back();
        free_scratch.pop_back();
        buf = scratch[sc].data();
        bytes = max_slot;
      }
      const std::optional<size_t> n = s.read_length(j.slot, buf, bytes, j.len);
      if (!n) {  // read_raw would refuse it: verify_read of nothing, a miss (D1)
        if (sc != SIZE_MAX) free_scratch.push_back(sc);
        complete_read(j, s.verify_read(j.slot, j.key, buf, -1, j.len));
        continue;
      }
      detail::IoOp op;
      op.fd = s.fd();
      op.buf = buf;
      op.len = *n;
      op.off = s.slot_offset(j.slot);
      ops.push_back(op);
      job_of.push_back(i);
      scratch_of.push_back(sc);
    }
  };
  const auto clear_pending = [&] {
    std::lock_guard lk(gate_mu_);
    return gate_clearing_ > 0;
  };
  for (;;) {
    jobs.clear();
    ops.clear();
    job_of.clear();
    scratch_of.clear();
    taken = 0;
    if (!take(cap, true)) return;  // stopped and drained
    GateGuard gate{this};  // no clear() while this batch does slot I/O
    stage(0);
    // While transfers land, queued reads join the batch (the window stays full), up to
    // batch_max jobs and never while a clear() waits for the gate.
    size_t finished_ops = 0;
    const auto refill = [&] {
      const size_t in_flight_now = ops.size() - finished_ops;
      if (taken >= batch_max || in_flight_now >= cap || clear_pending()) return;
      const size_t from = jobs.size();
      take(std::min(cap - in_flight_now, batch_max - taken), false);
      if (jobs.size() > from) stage(from);
    };
    engine.run(ops, [&](size_t k) {
      ++finished_ops;
      const detail::IoOp& op = ops[k];
      ReadJob& j = jobs[job_of[k]];
      const SlabFile& s = *kinds_[j.kind].slabs[drive];
      // an I/O error reads as a miss, as read_raw's does; a short read ends at the file's end
      const ssize_t got = op.error != 0 ? -1 : static_cast<ssize_t>(op.done);
      std::optional<size_t> r = s.verify_read(j.slot, j.key, op.buf, got, j.len);
      if (r && *r && !j.item.dst_is_slot)
        std::memcpy(j.item.dst, op.buf + kSlotHeaderBytes, *r);
      if (scratch_of[k] != SIZE_MAX) free_scratch.push_back(scratch_of[k]);
      complete_read(j, r);
    }, refill);
  }
}

// One reader and one verifier per drive: the payload CRC (and the copy out of the scratch
// buffer) of read i runs on the verifier while the reader already transfers read i + 1, so at
// queue depth 1 the drive does not idle during verification. D1 is unchanged: bytes
// are acknowledged only after verify_read. Two scratch buffers alternate: the reader fills one
// while the verifier may still read the other, and hands over only when the verifier is idle.
void Store::read_loop_staged(unsigned drive, uint64_t max_slot) {
  struct Staged {
    ReadJob job;
    uint8_t* buf;    // slot image: the caller's slot buffer or a scratch buffer
    ssize_t got;     // read_raw's result
  };
  std::mutex mu;
  std::condition_variable cv;
  std::optional<Staged> next;  // handed to the verifier
  bool busy = false, stop = false;
  std::thread verifier([&] {
    for (;;) {
      Staged st;
      {
        std::unique_lock lk(mu);
        cv.wait(lk, [&] { return stop || next.has_value(); });
        if (!next) return;
        st = std::move(*next);
        next.reset();
        busy = true;
      }
      cv.notify_all();
      {
        GateGuard gate{this};  // verify_read uses the slab id, which clear() changes
        std::optional<size_t> r;
        if (st.got >= 0 && current_epoch(st.job)) {
          const SlabFile& s = *kinds_[st.job.kind].slabs[drive];
          r = s.verify_read(st.job.slot, st.job.key, st.buf, st.got, st.job.len);
          if (r && *r && !st.job.item.dst_is_slot)
            std::memcpy(st.job.item.dst, st.buf + kSlotHeaderBytes, *r);
        }
        complete_read(st.job, r);
      }
      {
        std::lock_guard lk(mu);
        busy = false;
      }
      cv.notify_all();
    }
  });
  AlignedBuffer scratch[2];
  unsigned cur = 0;
  ReadJob j;
  while (next_read(drive, j)) {
    Staged st{std::move(j), nullptr, -1};
    {
      GateGuard gate{this};  // no clear() while this read does slot I/O
      if (current_epoch(st.job)) {
        const SlabFile& s = *kinds_[st.job.kind].slabs[drive];
        if (st.job.item.dst_is_slot) {
          st.buf = st.job.item.dst;
          st.got = s.read_raw(st.job.slot, st.buf, st.job.item.dst_bytes, st.job.len);
        } else {
          if (scratch[cur].size() < max_slot) scratch[cur] = AlignedBuffer(max_slot, kBlock);
          st.buf = scratch[cur].data();
          st.got = s.read_raw(st.job.slot, st.buf, scratch[cur].size(), st.job.len);
          cur ^= 1;
        }
      }
    }
    {
      std::unique_lock lk(mu);
      cv.wait(lk, [&] { return !next.has_value() && !busy; });
      next = std::move(st);
    }
    cv.notify_all();
  }
  {
    std::unique_lock lk(mu);
    cv.wait(lk, [&] { return !next.has_value() && !busy; });
    stop = true;
  }
  cv.notify_all();
  verifier.join();
}

std::optional<size_t> Store::lookup(unsigned kind, const Key& key) const {
  const KindState& k = kind_state(kind);
  std::lock_guard lk(mu_);
  const std::optional<SlotLocation> e = k.index->find(key);
  if (!e) return std::nullopt;
  return e->len;
}

// D14: a delete is invisible to a reader's later refresh: a put of the key still in flight is
// waited for (so the page is published, then removed), and the freed slot is zeroed before
// remove() returns.
bool Store::remove(unsigned kind, const Key& key) {
  refuse_if_read_only("remove");
  KindState& k = kind_state(kind);
  for (;;) {
    {
      std::unique_lock lk(mu_);
      settled_cv_.wait(lk, [&] { return closed_ || !k.index->pending(key); });
      if (closed_) return false;
    }
    GateGuard gate{this};  // gate before mu_, as the I/O threads take them
    {
      std::lock_guard lk(mu_);
      if (closed_) return false;
      if (k.index->pending(key)) continue;  // put again meanwhile: wait for that write too
      if (!k.index->remove(key)) return false;  // index entry first, then the slot (D4)
      ++counters_.deletes;
    }
    settle_freed();
    return true;
  }
}

// D5, D14: the slots freed so far (evicted, deleted, failed, dropped) get their first 4 KiB
// zeroed, then go back to the free stacks; one that cannot be zeroed stays stale (close() tries
// again). Called inside the gate, without mu_. A reader writes nothing: it only releases.
void Store::settle_freed() {
  std::vector<std::pair<unsigned, SlotIndex::Held>> work;
  {
    std::lock_guard lk(mu_);
    for (unsigned i = 0; i < kinds_.size(); ++i)
      if (kinds_[i].index && kinds_[i].index->has_held())
        work.emplace_back(i, kinds_[i].index->take_held());
  }
  if (work.empty()) return;
  std::vector<std::vector<bool>> zeroed(work.size());
  for (size_t w = 0; w < work.size(); ++w) {
    KindState& k = kinds_[work[w].first];
    for (const auto& [drive, slot] : work[w].second.slots)
      zeroed[w].push_back(cfg_.read_only || zero_slot(k, drive, slot));
  }
  {
    std::lock_guard lk(mu_);
    for (size_t w = 0; w < work.size(); ++w) {
      SlotIndex& index = *kinds_[work[w].first].index;
      const auto& held = work[w].second;
      for (size_t j = 0; j < held.slots.size(); ++j)
        index.release_held(held.generation, held.slots[j].first, held.slots[j].second,
                           zeroed[w][j]);
    }
  }
  settled_cv_.notify_all();  // a put waiting for free slots goes on
}

void Store::settle_freed_locked(KindState& k) {
  if (!k.index->has_held()) return;
  const SlotIndex::Held held = k.index->take_held();
  for (const auto& [drive, slot] : held.slots)
    k.index->release_held(held.generation, drive, slot,
                          cfg_.read_only || zero_slot(k, drive, slot));
}

bool Store::zero_slot(KindState& k, uint32_t drive, uint64_t slot) noexcept {
  try {
    k.slabs[drive]->invalidate(slot);
    return true;
  } catch (const std::exception& e) {
    log::error(std::string("vitrify.disk: zeroing a freed slot: ") + e.what());
    return false;
  }
}

std::vector<bool> Store::mark_clean(unsigned kind, const std::vector<Key>& keys) {
  refuse_if_read_only("mark_clean");
  VITRIFY_EXPECT(cfg_.host, "mark_clean: store '" + cfg_.name +
                                "' is a disk store; dirty pages (D24) are the host tier's");
  KindState& k = kind_state(kind);
  std::vector<bool> out(keys.size(), false);
  GateGuard gate{this};  // no clear() reformats meanwhile
  std::lock_guard lk(mu_);
  if (closed_) return out;
  for (size_t i = 0; i < keys.size(); ++i) {
    const std::optional<SlotLocation> at = k.index->mark_clean(keys[i]);
    if (!at) continue;
    out[i] = true;
    try {  // the header too, so a restart does not write the page back again
      k.slabs[at->drive]->set_slot_flags(at->slot, keys[i], 0);
    } catch (const std::exception& e) {
      log::error(std::string("vitrify.disk: mark_clean: ") + e.what());
    }
  }
  return out;
}

std::vector<Key> Store::keys(unsigned kind, bool dirty_only) const {
  const KindState& k = kind_state(kind);
  std::lock_guard lk(mu_);
  return k.index->keys(dirty_only);
}

void Store::gate_enter() {
  std::unique_lock g(gate_mu_);
  gate_cv_.wait(g, [&] { return gate_clearing_ == 0; });
  ++gate_active_;
}

void Store::gate_leave() {
  {
    std::lock_guard g(gate_mu_);
    --gate_active_;
  }
  gate_cv_.notify_all();
}

void Store::clear() {
  refuse_if_read_only("clear");
  std::lock_guard cl(clear_mu_);
  {
    std::lock_guard lk(mu_);
    if (closed_) return;
  }
  const ClosedGate gate(*this);  // no slot write or read in progress until it reopens
  // Take every queued job: they are acknowledged below without I/O.
  std::vector<WriteJob> writes;
  std::vector<ReadJob> reads;
  for (auto& d : drives_) {
    {
      std::lock_guard lk(d->writes.mu);
      for (auto& j : d->writes.jobs) writes.push_back(std::move(j));
      d->writes.jobs.clear();
    }
    d->writes.not_full.notify_all();
    {
      std::lock_guard lk(d->reads.mu);
      for (auto& j : d->reads.jobs) reads.push_back(std::move(j));
      d->reads.jobs.clear();
    }
    d->reads.not_full.notify_all();
  }
  {
    std::lock_guard lk(mu_);
    write_queue_depth_ -= writes.size();
    read_queue_depth_ -= reads.size();
    ++epoch_;  // every job allocated so far is cancelled when it reaches a thread
    ++counters_.clears;
    for (KindState& k : kinds_)  // every slot free, nothing stale: the new slab id (D12)
      for (auto& [tk, idx] : k.index->clear())
        tk->finish(idx, static_cast<int64_t>(PutResult::kCancelled));
    for (WriteJob& j : writes) finish_write(j, PutResult::kCancelled);
  }
  settled_cv_.notify_all();
  for (ReadJob& j : reads) j.ticket->finish(j.index, -1);
  // New slab ids, as cold start `clear` writes them (D7). The gate is still closed,
  // so no slot I/O runs; puts submitted meanwhile wait at the gate and get the new id.
  std::exception_ptr err;
  for (KindState& k : kinds_)
    for (auto& slab : k.slabs) {
      try {
        slab->reformat();
      } catch (const std::exception& e) {
        log::error(std::string("vitrify.disk: clear: ") + e.what());
        if (!err) err = std::current_exception();
      }
    }
  if (err) std::rethrow_exception(err);
}

Store::ClosedGate::ClosedGate(Store& s) : s_(s) {
  std::unique_lock g(s_.gate_mu_);
  ++s_.gate_clearing_;
  s_.gate_cv_.wait(g, [&] { return s_.gate_active_ == 0; });
}

Store::ClosedGate::~ClosedGate() {
  {
    std::lock_guard g(s_.gate_mu_);
    --s_.gate_clearing_;
  }
  s_.gate_cv_.notify_all();
}

// D14: rescan under the closed gate (no slot read in progress, so slab ids may change), then
// swap the index. Queued reads carry their old location and are verified against the new
// slab id: a slot the writer reused or cleared is a miss (D1).
size_t Store::refresh() {
  if (!cfg_.read_only)  // the writer's index is the truth; a rescan would only lose state
    vitrify::detail::throw_errno(EROFS, "refresh", cfg_.name,
                                 "refresh() is for read-only stores; this one is the writer");
  std::lock_guard cl(clear_mu_);
  {
    std::lock_guard lk(mu_);
    if (closed_) return 0;
  }
  const ClosedGate gate(*this);
  const unsigned threads = cfg_.load_threads == 0 ? kDefaultLoadThreads : cfg_.load_threads;
  std::vector<std::vector<FoundSlot>> found(kinds_.size());
  std::exception_ptr err;
  for (size_t i = 0; i < kinds_.size(); ++i) {
    KindState& k = kinds_[i];
    for (size_t d = 0; d < k.slabs.size(); ++d) {
      const std::string why = k.slabs[d]->reload_header();
      if (!why.empty()) {  // being formatted, or replaced: no slot of it is served for now
        log::warning("vitrify.disk: refresh: " + k.slabs[d]->path() + " " + why);
        continue;
      }
      try {
        for (const ScannedSlot& s : k.slabs[d]->scan(threads))
          if (s.payload_len <= k.cfg.page_bytes) found[i].push_back({static_cast<uint32_t>(d), s});
      } catch (...) {
        if (!err) err = std::current_exception();
        found[i].clear();
      }
    }
  }
  std::lock_guard lk(mu_);
  ++counters_.refreshes;
  size_t entries = 0;
  for (size_t i = 0; i < kinds_.size(); ++i)
    entries += kinds_[i].index->load(std::move(found[i]), seq_);
  if (err) std::rethrow_exception(err);
  return entries;
}

StoreStats Store::stats() const {
  std::lock_guard lk(mu_);
  StoreStats s = counters_;
  for (const KindState& k : kinds_)
    s.kinds.push_back(KindStats{k.cfg.page_bytes, k.slot_bytes, k.index->slots_total(),
                                k.index->slots_used(), k.index->entries(),
                                k.index->dirty_count()});
  s.in_flight_writes = in_flight_writes_;
  s.in_flight_reads = in_flight_reads_.load();
  s.write_queue_depth = write_queue_depth_.load();
  s.read_queue_depth = read_queue_depth_.load();
  return s;
}

}  // namespace vitrify::disk
