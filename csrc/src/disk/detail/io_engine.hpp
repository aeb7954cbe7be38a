// The disk store's slot-transfer engines (DESIGN.md "I/O engines", D25): io_uring and Linux
// native AIO through their raw system calls (<linux/io_uring.h>, <linux/aio_abi.h>; no
// liburing, no libaio), probed when a store opens, never assumed. Internal to the disk area:
// the public header knows only disk::IoEngine and its name.
//
// One engine object belongs to one I/O thread: it owns one ring (io_uring: the ring fd and its
// three mappings) or one AIO context, released exactly once by its destructor, which never
// throws. run() puts a whole batch of transfers in flight (at most depth() at a time), repeats
// a transfer's rest after a short one, resubmits one the kernel answered EINTR or EAGAIN, and
// returns only when every transfer of the batch is finished: no transfer is ever left in flight
// with its buffer, so a caller may free or reuse every buffer afterwards.
#pragma once

#include <sys/types.h>
#include <sys/uio.h>

#include <cstddef>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <string>

#include "vitrify/disk.hpp"

namespace vitrify::disk::detail {

// One transfer of a batch: [off, off + len) of `fd` from / into `buf` (4 KiB-aligned for
// O_DIRECT). run() fills the results.
struct IoOp {
  int fd = -1;
  bool write = false;
  uint8_t* buf = nullptr;
  size_t len = 0;
  uint64_t off = 0;
  // results: bytes moved (a read may stop short only where the file ends), and the errno of a
  // failed transfer (0: none) with the call that failed ("io_uring write", "aio pread", ...)
  size_t done = 0;
  int error = 0;
  const char* failed_call = nullptr;
  // the engine's own state while the transfer is in flight
  struct iovec iov{};
  unsigned retries = 0;
};

using IoOps = std::deque<IoOp>;

class IoEngineImpl {
 public:
  virtual ~IoEngineImpl() = default;
  virtual IoEngine kind() const noexcept = 0;
  unsigned depth() const noexcept { return depth_; }
  // Runs every op of `ops` to completion, at most depth() in flight; `finished(i)` is called
  // once per op on this thread as soon as op i is finished (successfully or not), while later
  // ops may still be in flight. Whenever every op is in flight or finished and the window has
  // room, `refill` (when given) may append more ops to `ops` (a deque: the ops in flight do not
  // move); run() returns when no op is left in flight and refill appended nothing. Never
  // throws; `finished` and `refill` must not throw either.
  virtual void run(IoOps& ops, const std::function<void(size_t)>& finished,
                   const std::function<void()>& refill = {}) noexcept = 0;

 protected:
  explicit IoEngineImpl(unsigned depth) : depth_(depth) {}
  unsigned depth_;
};

// An engine of `kind` (kIoUring, kAio or kPsync; not kAuto) with room for `depth` transfers in
// flight. A kernel that refuses it (io_uring_setup / io_setup failing: ENOSYS, EPERM from a
// seccomp filter or io_uring_disabled, ENOMEM, EAGAIN from aio-max-nr) is std::system_error
// with that errno, one line naming the engine, the call, its result and the errno:
//   disk engine "io_uring" is not available: io_uring_setup(64 entries) returned -1, errno
//   EPERM: Operation not permitted
// The engines disk::set_denied_engines names (the D25 test hook; vitrify.disk hands it
// VITRIFY_DISK_ENGINE_DENY from vitrify.config)
// makes the named engines refuse as a seccomp filter would (EPERM), before any system call.
std::unique_ptr<IoEngineImpl> make_engine(IoEngine kind, unsigned depth);

// "EPERM", "ENOSYS", ... for the errno values an engine may see ("errno <n>" for others).
std::string errno_name(int err);

}  // namespace vitrify::disk::detail
