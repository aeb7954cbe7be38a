// A VMM buffer on one device that another process on the same node can map: the staging buffer
// through which a trainer streams weights to an inference engine. Legacy CUDA IPC
// (cuIpcGetMemHandle) cannot export VMM memory, so the physical allocation is created with a
// POSIX file descriptor shareable handle and exported once, as an fd the caller sends to the
// peer (SCM_RIGHTS over a Unix socket, or inheritance); the peer imports it with import_fd.
// Ownership and lifetime: invariant R14 in csrc/src/region/DESIGN.md.
//
//   SharedBuffer b(size, device);        cuMemCreate(POSIX fd) + reserve + map + read-write
//   int fd = b.export_fd();              a new close-on-exec fd; the caller closes it
//   auto peer = SharedBuffer::import_fd(fd, size, device);   in the peer: import + map
//   peer.release();                      unmap, release the handle, free the range (or ~)
//   auto span = SharedBuffer::import_fds({{fd0, n0}, {fd1, n1}}, device);   several exported
//                                        allocations (Region::export_range) as one range
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <utility>
#include <vector>

namespace vitrify::region {

class SharedBuffer {
 public:
  // Creates `size` bytes (rounded up to the device's allocation granularity) of device memory
  // exportable as a POSIX fd, reserves an address range anywhere, maps the memory there and
  // makes it read-write for `device`. Errors: DriverUnavailable when the driver lacks
  // cuMemExportToShareableHandle / cuMemImportFromShareableHandle (named); vitrify::Error when
  // the device cannot export POSIX fds; std::invalid_argument for size 0 or a bad device;
  // CudaError for a failing driver call. A failure leaves nothing behind.
  SharedBuffer(uint64_t size, int device);

  // Maps the buffer another SharedBuffer exported as `fd`. The fd is not consumed: the caller
  // still owns `fd` and closes it, as soon as this returns if it likes — the imported handle
  // holds its own reference to the allocation (NVIDIA's memMapIPCDrv sample closes its fds right
  // after importing; the fake driver's import keeps a dup). Not yet checked on a GPU here:
  // scripts/experiments/shared_fd_probe.py does. `size` is rounded up to
  // the granularity and must be the exporter's size(): a different size is std::invalid_argument
  // naming both (when the fd says its size) or fails the mapping (when it does not).
  // std::system_error (EBADF) when fd is not open.
  static SharedBuffer import_fd(int fd, uint64_t size, int device);

  // Maps several exported allocations consecutively in ONE reserved range: piece i, (fd, size),
  // at ptr() + the sum of the previous sizes, read-write for `device` (the peer's view of an
  // exportable Region's span: Region::export_range; R15 in DESIGN.md). size() is the total.
  // Each size must be a positive multiple of the device's granularity (std::invalid_argument
  // otherwise, naming the piece) and, where the fd says its size (the fake driver's memfds), equal
  // to it. The fds are not consumed (as import_fd). A failure part-way unmaps and releases the
  // pieces mapped so far and frees the range: nothing is left mapped or reserved. read/write work
  // over the whole range; export_fd() on a buffer of more than one piece throws (export each
  // piece from its owner instead); release() unmaps and releases every piece, then frees the range.
  static SharedBuffer import_fds(const std::vector<std::pair<int, uint64_t>>& pieces, int device);

  ~SharedBuffer();  // release(), its result ignored; never throws
  SharedBuffer(SharedBuffer&&) noexcept;
  SharedBuffer& operator=(SharedBuffer&&) = delete;
  SharedBuffer(const SharedBuffer&) = delete;
  SharedBuffer& operator=(const SharedBuffer&) = delete;

  // cuMemExportToShareableHandle: a new file descriptor (FD_CLOEXEC set) that the caller owns
  // and closes. Each call makes another fd; "export once" is the caller's protocol (one fd sent
  // to one peer). Throws once released, and for a buffer of several pieces (import_fds).
  int export_fd() const;

  // Unmaps, releases this process's handle and frees the address range, in that order; returns
  // the first failing CUresult (0 when all succeeded or when already released). Every step is
  // attempted even after a failure. Afterwards ptr() is 0 and read/write/export_fd throw. The
  // memory itself lives until the last process holding it (a handle, a mapping or an exported
  // fd) lets go.
  int release() noexcept;
  bool released() const noexcept;

  uint64_t ptr() const noexcept;  // 0 once released
  uint64_t size() const noexcept { return size_; }
  int device() const noexcept { return device_; }
  bool imported() const noexcept { return imported_; }

  // Synchronous copies between host memory and [ptr()+offset, +n) (cuMemcpyHtoD / DtoH);
  // std::invalid_argument when the range does not fit in size().
  void write(uint64_t offset, const void* src, size_t n);
  void read(uint64_t offset, void* dst, size_t n) const;

  struct Owners;  // opaque: the owners of the driver objects (src/region/shared.cpp)

 private:
  SharedBuffer(std::unique_ptr<Owners> owners, uint64_t size, int device, bool imported);
  std::unique_ptr<Owners> owners_;
  uint64_t size_ = 0;
  int device_ = 0;
  bool imported_ = false;
};

}  // namespace vitrify::region
