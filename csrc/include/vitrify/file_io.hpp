// vitrify's file-I/O layer, shared by the disk tier and span files: the direct-I/O mode
// (auto / on / off) and its parser, the file-descriptor owner, the open routine with the
// O_DIRECT probe and the buffered fallback, and full pread / pwrite loops.
//
// Every system-call failure is a std::system_error (Python OSError) whose message names the
// call, the path and the errno text, e.g. `pread("/x/a.slab", 4096 bytes at 8192): Input/output
// error` (see VITRIFY_SYSCALL in error.hpp).
#pragma once

#include <sys/stat.h>
#include <sys/types.h>

#include <cstddef>
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "vitrify/fs.hpp"

namespace vitrify::file_io {

// VITRIFY_DIRECT_IO and every `direct_io` argument. kAuto: O_DIRECT where the filesystem accepts
// it, buffered I/O elsewhere; kOn: O_DIRECT or an error; kOff: buffered I/O.
enum class DirectIo { kAuto, kOn, kOff };

// "auto" | "on" | "off" in any letter case; anything else is std::invalid_argument (ValueError)
// `direct_io must be auto, on or off, got "<text>"`.
DirectIo parse_direct_io(const std::string& text);
// The lower-case name parse_direct_io accepts for `mode`: "auto", "on" or "off".
const char* direct_io_name(DirectIo mode) noexcept;

// Owns one file descriptor: closes it exactly once (on destruction, reset or move-assignment),
// never throws. Move-only; a moved-from Fd owns nothing.
class Fd {
 public:
  Fd() noexcept = default;
  explicit Fd(int fd) noexcept : fd_(fd) {}
  ~Fd() { reset(); }
  Fd(Fd&& other) noexcept : fd_(other.release()) {}
  Fd& operator=(Fd&& other) noexcept {
    if (this != &other) reset(other.release());
    return *this;
  }
  Fd(const Fd&) = delete;
  Fd& operator=(const Fd&) = delete;

  int get() const noexcept { return fd_; }
  explicit operator bool() const noexcept { return fd_ >= 0; }
  // Gives the descriptor up without closing it; the Fd owns nothing afterwards.
  int release() noexcept {
    const int fd = fd_;
    fd_ = -1;
    return fd;
  }
  // Closes the owned descriptor (a close error is ignored: on Linux the descriptor is released
  // either way, and callers that need durability fdatasync first), then owns `fd`.
  void reset(int fd = -1) noexcept;

 private:
  int fd_ = -1;
};

struct OpenedFile {
  Fd fd;
  bool direct = false;          // opened with O_DIRECT
  std::string buffered_reason;  // why not O_DIRECT ("" when direct)
  bool created = false;         // open_regular_file: this open created the file (O_EXCL)
};

// Opens `path` with `flags | O_CLOEXEC` (`perm` applies when O_CREAT creates it).
//   kOff : buffered.
//   kAuto: O_DIRECT when fs::probe_direct_io succeeds in the file's directory; buffered (with the
//          reason) when the probe fails or open refuses O_DIRECT with EINVAL.
//   kOn  : O_DIRECT; open refusing it is an OSError, never a fallback.
// Any other open failure is an OSError naming open and the path.
OpenedFile open_file(const std::string& path, int flags, DirectIo mode, mode_t perm = 0644);

// open_file for a file vitrify writes in place (the KV stores' slab files) or reads: never
// follows a symbolic link (O_NOFOLLOW) and opens only a regular file or nothing (O_NONBLOCK for
// the open, so a FIFO never blocks it; cleared afterwards), so a link or a device planted at
// `path` is never written or read through. With O_CREAT the file is created O_EXCL when absent,
// and `created` says so (an existing one is opened as it is). A link at `path` is
// std::system_error ELOOP, a directory EISDIR, anything else that is not a regular file EINVAL,
// one line each naming `what` and the path, whatever the open itself said:
//   written: "slab file \"/d/x.kind0.slab\" is a symbolic link; vitrify writes only ..."
//   read (O_RDONLY, neither O_CREAT nor O_TRUNC): "open(\"/a/w.span\", read-only): span file
//         is a FIFO; vitrify reads only regular files and never follows a link there"
// (then the errno text). Other failures as open_file. A read of "/proc/self/fd/<n>" (the
// caller's own open descriptor, which names a file, not a path) reopens it through that link;
// it must still be a regular file.
OpenedFile open_regular_file(const std::string& path, int flags, DirectIo mode, mode_t perm,
                             const std::string& what);
// How every reader of a file vitrify did not just write opens it (an archive's span, graph,
// module and JIT files, whatever a caller checked before: the path may name something else by
// now): open_regular_file(path, O_RDONLY, mode, 0, what), i.e. O_RDONLY | O_NOFOLLOW |
// O_NONBLOCK | O_CLOEXEC (O_DIRECT as `mode` asks), fstat, a regular file only, O_NONBLOCK
// cleared. `what` names the file in the refusal ("span file", "file").
OpenedFile open_for_reading(const std::string& path, DirectIo mode, const std::string& what);
// The refusal open_regular_file gives a file it writes when `st` (an lstat or fstat of `path`)
// is not a regular file: std::system_error ELOOP for a link, EISDIR for a directory, EINVAL for
// anything else.
[[noreturn]] void refuse_not_regular(const struct ::stat& st, const std::string& path,
                                     const std::string& what);

// Reads [off, off + n) of the file into `buf`, repeating on EINTR and short reads. Returns the
// bytes read: n, or fewer only where the file ends first (the caller says what a short file
// means). An error is an OSError `pread("<path>", <n> bytes at <off>): <errno text>`.
size_t pread_full(int fd, void* buf, size_t n, uint64_t off, const std::string& path);

// Writes `n` bytes of `buf` at `off`, repeating on EINTR and short writes. An error, or a write
// that moves nothing, is an OSError `pwrite("<path>", <n> bytes at <off>): <errno text>`.
void pwrite_full(int fd, const void* buf, size_t n, uint64_t off, const std::string& path);

// A file read whole (buffered), with the CRC32C of its bytes.
struct WholeFile {
  uint64_t size = 0;          // st_size when opened
  std::vector<uint8_t> data;  // empty when size != the expected size (nothing read)
  uint32_t crc32c = 0;
};

// Reads `paths[i]` whole when its size is `expect[i]`, `threads` files at a time, checksumming
// each on the way: many small files (kernel modules, graphs) in one call, so a caller that holds
// a lock per call (Python's GIL) takes it once. A file of another size is returned unread (the
// caller names both sizes). Each file is opened by open_for_reading ("file": no link followed,
// a FIFO or directory refused without blocking). The first open/read error (OSError naming the
// call and path) is thrown after every reader stopped.
std::vector<WholeFile> read_whole_files(const std::vector<std::string>& paths,
                                        const std::vector<uint64_t>& expect, unsigned threads);

// Runs `work` on `threads` threads, this one included, and joins them. `work` must pull its
// items itself (a shared counter): a thread that cannot be started is simply missing, and the
// ones that run (at least this one) do everything. `work` must not throw.
void on_threads(unsigned threads, const std::function<void()>& work);

// The directory part of `path`: "a/b" -> "a", "/b" -> "/", "b" -> ".".
std::string directory_of(const std::string& path);

namespace detail {
// The calls the layer makes, replaceable in tests to inject EINTR, short transfers and a
// filesystem that refuses O_DIRECT. Each behaves like the system call of its name.
struct Syscalls {
  int (*open)(const char* path, int flags, mode_t perm);
  ssize_t (*pread)(int fd, void* buf, size_t n, off_t off);
  ssize_t (*pwrite)(int fd, const void* buf, size_t n, off_t off);
  fs::DirectIoProbe (*probe_direct_io)(const std::string& directory);
};
// The real ones (what the functions above use).
const Syscalls& system_calls() noexcept;

OpenedFile open_file(const Syscalls& os, const std::string& path, int flags, DirectIo mode,
                     mode_t perm);
size_t pread_full(const Syscalls& os, int fd, void* buf, size_t n, uint64_t off,
                  const std::string& path);
void pwrite_full(const Syscalls& os, int fd, const void* buf, size_t n, uint64_t off,
                 const std::string& path);
}  // namespace detail

}  // namespace vitrify::file_io
