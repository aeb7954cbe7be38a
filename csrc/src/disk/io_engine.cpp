// The disk store's slot-transfer engines: io_uring and Linux native AIO by raw system call, and
// the synchronous pread/pwrite loop (DESIGN.md "I/O engines", D25).
#include "disk/detail/io_engine.hpp"

#include <linux/aio_abi.h>
#include <linux/io_uring.h>
#include <sys/mman.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstdlib>
#include <cstdint>
#include <cstring>
#include <functional>
#include <mutex>
#include <system_error>
#include <vector>

#include "vitrify/error.hpp"
#include "vitrify/file_io.hpp"
#include "vitrify/log.hpp"

namespace vitrify::disk {

IoEngine parse_io_engine(const std::string& text) {
  std::string t = text;
  for (char& c : t) c = static_cast<char>(c >= 'A' && c <= 'Z' ? c - 'A' + 'a' : c);
  if (t == "auto") return IoEngine::kAuto;
  if (t == "io_uring") return IoEngine::kIoUring;
  if (t == "aio") return IoEngine::kAio;
  if (t == "psync") return IoEngine::kPsync;
  VITRIFY_EXPECT(false, "engine must be \"auto\", \"io_uring\", \"aio\" or \"psync\", got \"" +
                            text + "\"");
  return IoEngine::kAuto;
}

const char* io_engine_name(IoEngine engine) noexcept {
  switch (engine) {
    case IoEngine::kAuto: return "auto";
    case IoEngine::kIoUring: return "io_uring";
    case IoEngine::kAio: return "aio";
    case IoEngine::kPsync: return "psync";
  }
  return "?";
}

namespace detail {

std::string errno_name(int err) {
  switch (err) {
    case EPERM: return "EPERM";
    case ENOSYS: return "ENOSYS";
    case ENOMEM: return "ENOMEM";
    case EAGAIN: return "EAGAIN";
    case EINVAL: return "EINVAL";
    case EFAULT: return "EFAULT";
    case EMFILE: return "EMFILE";
    case ENFILE: return "ENFILE";
    case EACCES: return "EACCES";
    case EINTR: return "EINTR";
    case EIO: return "EIO";
    case ENOSPC: return "ENOSPC";
    case EBADF: return "EBADF";
    case EBUSY: return "EBUSY";
    case EOPNOTSUPP: return "EOPNOTSUPP";
    default: return "errno " + std::to_string(err);
  }
}

namespace {

// A transfer the kernel answered EINTR or EAGAIN this many times in a row is done with
// pread/pwrite on the engine's thread instead (still checked, still whole).
constexpr unsigned kMaxRetries = 64;

[[noreturn]] void refuse(IoEngine kind, const std::string& call, int err) {
  throw std::system_error(err, std::generic_category(),
                          std::string("disk engine \"") + io_engine_name(kind) +
                              "\" is not available: " + call + " returned -1, errno " +
                              errno_name(err));
}

// The test hook of D25 (set_denied_engines: a comma-separated list of engine names).
std::mutex g_denied_mu;
std::string g_denied;  // guarded by g_denied_mu

bool denied(IoEngine kind) {
  std::string list;
  {
    std::lock_guard<std::mutex> lk(g_denied_mu);
    list = g_denied;
  }
  if (list.empty()) return false;
  const std::string name = io_engine_name(kind);
  size_t start = 0;
  while (start <= list.size()) {
    size_t end = list.find(',', start);
    if (end == std::string::npos) end = list.size();
    std::string item = list.substr(start, end - start);
    item.erase(0, item.find_first_not_of(" \t"));
    item.erase(item.find_last_not_of(" \t") + 1);
    if (item == name) return true;
    start = end + 1;
  }
  return false;
}

// What is left of `op` after `moved` more bytes; true when it is finished (whole, or a read
// that reached the end of the file, or a write that moved nothing: EIO as pwrite_full says).
bool advance(IoOp& op, size_t moved) {
  if (moved == 0) {
    if (op.write) {
      op.error = EIO;
      op.failed_call = op.failed_call ? op.failed_call : "write";
    }
    return true;  // a read: the file ends here
  }
  op.done += moved;
  return op.done >= op.len;
}

// The rest of `op` with pread/pwrite (the psync engine, and a transfer the kernel kept
// answering EINTR/EAGAIN). Never throws.
void transfer_sync(IoOp& op, const char* call) noexcept {
  while (op.done < op.len) {
    const ssize_t r = op.write
                          ? ::pwrite(op.fd, op.buf + op.done, op.len - op.done,
                                     static_cast<off_t>(op.off + op.done))
                          : ::pread(op.fd, op.buf + op.done, op.len - op.done,
                                    static_cast<off_t>(op.off + op.done));
    if (r < 0) {
      if (errno == EINTR) continue;
      op.error = errno;
      op.failed_call = call;
      return;
    }
    if (advance(op, static_cast<size_t>(r))) {
      if (op.error) op.failed_call = call;
      return;
    }
  }
}

// ------------------------------------------------------------------------------ psync
constexpr size_t kNoOp = SIZE_MAX;

// The next op an asynchronous engine puts in flight: one to submit again (its rest, or after
// EINTR/EAGAIN), else the next new one (a zero-length op is finished at once, never sent),
// asking `refill` for more once both are used up; kNoOp when none is left.
size_t take_next(IoOps& ops, size_t& next, std::vector<size_t>& again,
                 const std::function<void(size_t)>& finished,
                 const std::function<void()>& refill) {
  for (;;) {
    if (again.empty() && next == ops.size() && refill) refill();
    if (!again.empty()) {
      const size_t i = again.back();
      again.pop_back();
      return i;
    }
    if (next == ops.size()) return kNoOp;
    const size_t i = next++;
    if (ops[i].len != 0) return i;
    finished(i);
  }
}

class PsyncEngine final : public IoEngineImpl {
 public:
  explicit PsyncEngine(unsigned depth) : IoEngineImpl(depth) {}
  IoEngine kind() const noexcept override { return IoEngine::kPsync; }
  void run(IoOps& ops, const std::function<void(size_t)>& finished,
           const std::function<void()>& refill) noexcept override {
    for (size_t i = 0;; ++i) {
      if (i == ops.size() && refill) refill();
      if (i >= ops.size()) return;
      transfer_sync(ops[i], ops[i].write ? "pwrite" : "pread");
      finished(i);
    }
  }
};

// ------------------------------------------------------------------------------ io_uring
// One mmap of the ring fd; unmapped exactly once.
class RingMapping {
 public:
  RingMapping() = default;
  RingMapping(void* p, size_t n) noexcept : p_(p), n_(n) {}
  ~RingMapping() {
    if (p_ != nullptr) ::munmap(p_, n_);
  }
  RingMapping(RingMapping&& o) noexcept : p_(o.p_), n_(o.n_) { o.p_ = nullptr; }
  RingMapping& operator=(RingMapping&& o) noexcept {
    if (this != &o) {
      if (p_ != nullptr) ::munmap(p_, n_);
      p_ = o.p_;
      n_ = o.n_;
      o.p_ = nullptr;
    }
    return *this;
  }
  RingMapping(const RingMapping&) = delete;
  RingMapping& operator=(const RingMapping&) = delete;
  uint8_t* get() const noexcept { return static_cast<uint8_t*>(p_); }

 private:
  void* p_ = nullptr;
  size_t n_ = 0;
};

int sys_io_uring_setup(unsigned entries, io_uring_params* p) {
  return static_cast<int>(::syscall(__NR_io_uring_setup, entries, p));
}
int sys_io_uring_enter(int fd, unsigned to_submit, unsigned min_complete, unsigned flags) {
  return static_cast<int>(
      ::syscall(__NR_io_uring_enter, fd, to_submit, min_complete, flags, nullptr, size_t{0}));
}

class UringEngine final : public IoEngineImpl {
 public:
  explicit UringEngine(unsigned depth) : IoEngineImpl(depth) {
    io_uring_params p{};
    const int fd = sys_io_uring_setup(depth, &p);
    const std::string call = "io_uring_setup(" + std::to_string(depth) + " entries)";
    if (fd < 0) refuse(IoEngine::kIoUring, call, errno);
    fd_.reset(fd);
    const size_t sq_bytes = p.sq_off.array + p.sq_entries * sizeof(uint32_t);
    const size_t cq_bytes = p.cq_off.cqes + p.cq_entries * sizeof(io_uring_cqe);
    const bool single = (p.features & IORING_FEAT_SINGLE_MMAP) != 0;
    const auto map = [&](size_t bytes, off_t what, const char* name) {
      void* m = ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE, fd_.get(),
                       what);
      if (m == MAP_FAILED)
        refuse(IoEngine::kIoUring, std::string("mmap(io_uring ") + name + ", " +
                                       std::to_string(bytes) + " bytes)",
               errno);
      return RingMapping(m, bytes);
    };
    sq_map_ = map(single ? std::max(sq_bytes, cq_bytes) : sq_bytes, IORING_OFF_SQ_RING, "sq ring");
    if (!single) cq_map_ = map(cq_bytes, IORING_OFF_CQ_RING, "cq ring");
    sqe_map_ = map(p.sq_entries * sizeof(io_uring_sqe), IORING_OFF_SQES, "sqes");
    uint8_t* sq = sq_map_.get();
    uint8_t* cq = single ? sq : cq_map_.get();
    sq_head_ = reinterpret_cast<unsigned*>(sq + p.sq_off.head);
    sq_tail_ = reinterpret_cast<unsigned*>(sq + p.sq_off.tail);
    sq_mask_ = *reinterpret_cast<unsigned*>(sq + p.sq_off.ring_mask);
    sq_array_ = reinterpret_cast<unsigned*>(sq + p.sq_off.array);
    cq_head_ = reinterpret_cast<unsigned*>(cq + p.cq_off.head);
    cq_tail_ = reinterpret_cast<unsigned*>(cq + p.cq_off.tail);
    cq_mask_ = *reinterpret_cast<unsigned*>(cq + p.cq_off.ring_mask);
    cqes_ = reinterpret_cast<io_uring_cqe*>(cq + p.cq_off.cqes);
    sqes_ = reinterpret_cast<io_uring_sqe*>(sqe_map_.get());
    sq_entries_ = p.sq_entries;
    depth_ = std::min(depth, p.sq_entries);  // the CQ (2x) never overflows
  }
  // Members' destructors unmap the rings, then close the fd; run() left nothing in flight.
  IoEngine kind() const noexcept override { return IoEngine::kIoUring; }

  void run(IoOps& ops, const std::function<void(size_t)>& finished,
           const std::function<void()>& refill) noexcept override {
    size_t next = 0;          // next op never submitted
    std::vector<size_t> again;  // ops to submit again (their rest, or after EINTR/EAGAIN)
    unsigned in_flight = 0;   // submitted (queued in the SQ or in the kernel), not yet reaped
    for (;;) {
      // queue what fits (asking for more transfers while the window has room)
      while (in_flight < depth_) {
        const size_t i = take_next(ops, next, again, finished, refill);
        if (i == kNoOp) break;
        queue(ops[i], i);
        ++in_flight;
      }
      // nothing in flight: every op finished and refill added none
      if (in_flight == 0) return;
      // submit what the kernel has not consumed yet, and wait for at least one completion
      const unsigned unsubmitted =
          tail_ - __atomic_load_n(sq_head_, __ATOMIC_ACQUIRE);
      const int r = sys_io_uring_enter(fd_.get(), unsubmitted, 1, IORING_ENTER_GETEVENTS);
      if (r < 0 && errno != EINTR && errno != EAGAIN && errno != EBUSY) {
        // The ring cannot be entered: finish the ops still in the SQ synchronously is not
        // possible (the kernel may consume them later), so wait for what is in the kernel by
        // watching the completion ring, and tell every op the error.
        const int err = errno;
        log::error("vitrify.disk: io_uring_enter(" + std::to_string(unsubmitted) +
                   " to submit) returned -1, errno " + errno_name(err) + ": " +
                   std::strerror(err) + "; waiting for the transfers in flight");
        drain_broken(ops, in_flight, err, finished);
        for (size_t i : again) fail(ops[i], err, i, finished);
        again.clear();
        for (; next < ops.size(); ++next) fail(ops[next], err, next, finished);
        return;
      }
      reap(ops, in_flight, again, finished);
    }
  }

 private:
  void queue(IoOp& op, size_t index) noexcept {
    op.iov.iov_base = op.buf + op.done;
    op.iov.iov_len = op.len - op.done;
    const unsigned idx = tail_ & sq_mask_;
    io_uring_sqe* sqe = &sqes_[idx];
    std::memset(sqe, 0, sizeof *sqe);
    sqe->opcode = op.write ? IORING_OP_WRITEV : IORING_OP_READV;
    sqe->fd = op.fd;
    sqe->addr = reinterpret_cast<uint64_t>(&op.iov);
    sqe->len = 1;
    sqe->off = op.off + op.done;
    sqe->user_data = index;
    sq_array_[idx] = idx;
    ++tail_;
    __atomic_store_n(sq_tail_, tail_, __ATOMIC_RELEASE);
  }

  // Every completion in the CQ ring now: finished ops go to `finished`, the rest to `again`.
  void reap(IoOps& ops, unsigned& in_flight, std::vector<size_t>& again,
            const std::function<void(size_t)>& finished) noexcept {
    unsigned head = *cq_head_;
    const unsigned tail = __atomic_load_n(cq_tail_, __ATOMIC_ACQUIRE);
    for (; head != tail; ++head) {
      const io_uring_cqe& c = cqes_[head & cq_mask_];
      const size_t i = static_cast<size_t>(c.user_data);
      const int res = c.res;
      __atomic_store_n(cq_head_, head + 1, __ATOMIC_RELEASE);
      --in_flight;
      IoOp& op = ops[i];
      if (res == -EINTR || res == -EAGAIN) {
        if (++op.retries > kMaxRetries) {
          transfer_sync(op, op.write ? "pwrite" : "pread");
          finished(i);
        } else {
          again.push_back(i);
        }
      } else if (res < 0) {
        op.error = -res;
        op.failed_call = op.write ? "io_uring write" : "io_uring read";
        finished(i);
      } else if (advance(op, static_cast<size_t>(res))) {
        if (op.error) op.failed_call = "io_uring write";
        finished(i);
      } else {
        again.push_back(i);  // a short transfer: its rest
      }
    }
  }

  void fail(IoOp& op, int err, size_t i, const std::function<void(size_t)>& finished) noexcept {
    op.error = err;
    op.failed_call = "io_uring_enter";
    finished(i);
  }

  // After io_uring_enter failed for good: the transfers in flight still complete into the CQ
  // ring (the kernel posts them without being entered); wait for each, then fail them all.
  void drain_broken(IoOps& ops, unsigned& in_flight, int err,
                    const std::function<void(size_t)>& finished) noexcept {
    const unsigned queued = tail_ - __atomic_load_n(sq_head_, __ATOMIC_ACQUIRE);
    // SQEs the kernel never consumed will not complete: withdraw them.
    std::vector<size_t> withdrawn;
    for (unsigned k = 0; k < queued; ++k) {
      const unsigned idx = (tail_ - 1 - k) & sq_mask_;
      withdrawn.push_back(static_cast<size_t>(sqes_[idx].user_data));
    }
    tail_ -= queued;
    __atomic_store_n(sq_tail_, tail_, __ATOMIC_RELEASE);
    in_flight -= queued;
    for (size_t i : withdrawn) fail(ops[i], err, i, finished);
    while (in_flight > 0) {
      unsigned head = *cq_head_;
      const unsigned tail = __atomic_load_n(cq_tail_, __ATOMIC_ACQUIRE);
      if (head == tail) {
        const timespec pause{0, 1000000};  // 1 ms
        ::nanosleep(&pause, nullptr);
        continue;
      }
      for (; head != tail; ++head) {
        const size_t i = static_cast<size_t>(cqes_[head & cq_mask_].user_data);
        __atomic_store_n(cq_head_, head + 1, __ATOMIC_RELEASE);
        --in_flight;
        fail(ops[i], err, i, finished);
      }
    }
  }

  file_io::Fd fd_;  // declared first: closed after the mappings are unmapped
  RingMapping sq_map_, cq_map_, sqe_map_;
  unsigned* sq_head_ = nullptr;
  unsigned* sq_tail_ = nullptr;
  unsigned* sq_array_ = nullptr;
  unsigned* cq_head_ = nullptr;
  unsigned* cq_tail_ = nullptr;
  unsigned sq_mask_ = 0, cq_mask_ = 0, sq_entries_ = 0;
  unsigned tail_ = 0;  // our SQ tail (we are its only producer)
  io_uring_cqe* cqes_ = nullptr;
  io_uring_sqe* sqes_ = nullptr;
};

// ------------------------------------------------------------------------------ Linux AIO
long sys_io_setup(unsigned nr, aio_context_t* ctx) { return ::syscall(__NR_io_setup, nr, ctx); }
long sys_io_destroy(aio_context_t ctx) { return ::syscall(__NR_io_destroy, ctx); }
long sys_io_submit(aio_context_t ctx, long n, iocb** iocbs) {
  return ::syscall(__NR_io_submit, ctx, n, iocbs);
}
long sys_io_getevents(aio_context_t ctx, long min_nr, long nr, io_event* events) {
  return ::syscall(__NR_io_getevents, ctx, min_nr, nr, events, nullptr);
}

// The owner of one AIO context: io_destroy exactly once (it waits for transfers still in
// flight), never throws.
class AioContext {
 public:
  AioContext() = default;
  ~AioContext() { reset(); }
  AioContext(const AioContext&) = delete;
  AioContext& operator=(const AioContext&) = delete;
  void create(unsigned nr) {
    aio_context_t c = 0;
    if (sys_io_setup(nr, &c) < 0)
      refuse(IoEngine::kAio, "io_setup(" + std::to_string(nr) + " events)", errno);
    ctx_ = c;
  }
  void reset() noexcept {
    if (ctx_ != 0) {
      if (sys_io_destroy(ctx_) < 0)
        log::error(std::string("vitrify.disk: io_destroy returned -1, errno ") +
                   errno_name(errno));
      ctx_ = 0;
    }
  }
  aio_context_t get() const noexcept { return ctx_; }

 private:
  aio_context_t ctx_ = 0;
};

class AioEngine final : public IoEngineImpl {
 public:
  explicit AioEngine(unsigned depth) : IoEngineImpl(depth) {
    ctx_.create(depth);
    iocbs_.resize(depth);
    ptrs_.resize(depth);
    events_.resize(depth);
    slot_op_.assign(depth, SIZE_MAX);
  }
  IoEngine kind() const noexcept override { return IoEngine::kAio; }

  void run(IoOps& ops, const std::function<void(size_t)>& finished,
           const std::function<void()>& refill) noexcept override {
    size_t next = 0;
    std::vector<size_t> again;
    std::vector<unsigned> free_slots;
    for (unsigned s = depth_; s-- > 0;) free_slots.push_back(s);
    unsigned in_flight = 0;
    for (;;) {
      // prepare what fits, then submit it (io_submit may take fewer: the rest waits), asking
      // for more transfers while the window has room
      std::vector<unsigned> batch;
      while (!free_slots.empty()) {
        const size_t i = take_next(ops, next, again, finished, refill);
        if (i == kNoOp) break;
        const unsigned s = free_slots.back();
        free_slots.pop_back();
        prepare(ops[i], i, s);
        batch.push_back(s);
      }
      // nothing to send and nothing in flight: every op finished and refill added none
      if (batch.empty() && in_flight == 0) return;
      size_t sent = 0;
      while (sent < batch.size()) {
        for (size_t k = sent; k < batch.size(); ++k) ptrs_[k - sent] = &iocbs_[batch[k]];
        const long r = sys_io_submit(ctx_.get(), static_cast<long>(batch.size() - sent),
                                     ptrs_.data());
        if (r > 0) {
          sent += static_cast<size_t>(r);
          in_flight += static_cast<unsigned>(r);
          continue;
        }
        const int err = r < 0 ? errno : EAGAIN;
        if ((err == EAGAIN || err == EINTR) && in_flight > 0) break;  // reap first, then more
        // Nothing in flight and the kernel takes nothing more: do the rest with pread/pwrite
        // (EAGAIN, EINTR) or fail it (anything else: EBADF, EINVAL naming a transfer).
        for (size_t k = sent; k < batch.size(); ++k) {
          const size_t i = slot_op_[batch[k]];
          if (err == EAGAIN || err == EINTR) {
            transfer_sync(ops[i], ops[i].write ? "pwrite" : "pread");
          } else {
            ops[i].error = err;
            ops[i].failed_call = "io_submit";
          }
          slot_op_[batch[k]] = SIZE_MAX;
          free_slots.push_back(batch[k]);
          finished(i);
        }
        sent = batch.size();
      }
      // what was prepared but not sent goes back into the queue
      for (size_t k = sent; k < batch.size(); ++k) {
        again.push_back(slot_op_[batch[k]]);
        slot_op_[batch[k]] = SIZE_MAX;
        free_slots.push_back(batch[k]);
      }
      if (in_flight == 0) continue;
      const long got = sys_io_getevents(ctx_.get(), 1, static_cast<long>(events_.size()),
                                        events_.data());
      if (got < 0) {
        if (errno == EINTR) continue;
        // The context cannot be waited on: io_destroy waits for every transfer in flight, so
        // their buffers are free afterwards; they are failed (a write not known to be whole is
        // an error, a read a miss), and a new context serves the next batch.
        const int err = errno;
        log::error("vitrify.disk: io_getevents returned -1, errno " + errno_name(err) + ": " +
                   std::strerror(err) + "; destroying the AIO context");
        ctx_.reset();
        for (unsigned s = 0; s < depth_; ++s)
          if (slot_op_[s] != SIZE_MAX) {
            const size_t i = slot_op_[s];
            slot_op_[s] = SIZE_MAX;
            ops[i].error = err;
            ops[i].failed_call = "io_getevents";
            finished(i);
          }
        for (size_t i : again) {
          ops[i].error = err;
          ops[i].failed_call = "io_getevents";
          finished(i);
        }
        for (; next < ops.size(); ++next) {
          ops[next].error = err;
          ops[next].failed_call = "io_getevents";
          finished(next);
        }
        try {
          ctx_.create(depth_);
        } catch (const std::exception& e) {
          log::error(std::string("vitrify.disk: ") + e.what());
        }
        return;
      }
      for (long e = 0; e < got; ++e) {
        const unsigned s = static_cast<unsigned>(events_[e].data);
        const size_t i = slot_op_[s];
        slot_op_[s] = SIZE_MAX;
        free_slots.push_back(s);
        --in_flight;
        IoOp& op = ops[i];
        const int64_t res = events_[e].res;
        if (res == -EINTR || res == -EAGAIN) {
          if (++op.retries > kMaxRetries) {
            transfer_sync(op, op.write ? "pwrite" : "pread");
            finished(i);
          } else {
            again.push_back(i);
          }
        } else if (res < 0) {
          op.error = static_cast<int>(-res);
          op.failed_call = op.write ? "aio pwrite" : "aio pread";
          finished(i);
        } else if (advance(op, static_cast<size_t>(res))) {
          if (op.error) op.failed_call = "aio pwrite";
          finished(i);
        } else {
          again.push_back(i);  // a short transfer: its rest
        }
      }
    }
  }

 private:
  void prepare(IoOp& op, size_t index, unsigned slot) noexcept {
    iocb& cb = iocbs_[slot];
    std::memset(&cb, 0, sizeof cb);
    cb.aio_data = slot;
    cb.aio_lio_opcode = op.write ? IOCB_CMD_PWRITE : IOCB_CMD_PREAD;
    cb.aio_fildes = static_cast<uint32_t>(op.fd);
    cb.aio_buf = reinterpret_cast<uint64_t>(op.buf + op.done);
    cb.aio_nbytes = op.len - op.done;
    cb.aio_offset = static_cast<int64_t>(op.off + op.done);
    slot_op_[slot] = index;
  }

  AioContext ctx_;
  std::vector<iocb> iocbs_;
  std::vector<iocb*> ptrs_;
  std::vector<io_event> events_;
  std::vector<size_t> slot_op_;  // per iocb slot: the op it carries (SIZE_MAX: free)
};

}  // namespace

std::unique_ptr<IoEngineImpl> make_engine(IoEngine kind, unsigned depth) {
  VITRIFY_EXPECT(depth >= 1 && depth <= 4096,
                 "queue_depth must be in [1, 4096], got " + std::to_string(depth));
  VITRIFY_EXPECT(kind != IoEngine::kAuto, "make_engine needs a resolved engine, not \"auto\"");
  if (kind != IoEngine::kPsync && denied(kind))
    throw std::system_error(EPERM, std::generic_category(),
                            std::string("disk engine \"") + io_engine_name(kind) +
                                "\" is not available: refused by VITRIFY_DISK_ENGINE_DENY "
                                "(test hook), errno EPERM");
  switch (kind) {
    case IoEngine::kIoUring: return std::make_unique<UringEngine>(depth);
    case IoEngine::kAio: return std::make_unique<AioEngine>(depth);
    default: return std::make_unique<PsyncEngine>(depth);
  }
}

}  // namespace detail

void set_denied_engines(const std::string& list) {
  std::lock_guard<std::mutex> lk(detail::g_denied_mu);
  detail::g_denied = list;
}

}  // namespace vitrify::disk
