// The file-I/O layer (see vitrify/file_io.hpp).
#include "vitrify/file_io.hpp"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <exception>
#include <mutex>
#include <stdexcept>
#include <thread>

#include "vitrify/crc32c.hpp"

#include "vitrify/error.hpp"

namespace vitrify::file_io {
namespace {

constexpr const char* kModeNames[] = {"auto", "on", "off"};  // in DirectIo order

std::string ascii_lower(std::string s) {
  for (char& c : s)
    if (c >= 'A' && c <= 'Z') c = static_cast<char>(c - 'A' + 'a');
  return s;
}

// "<n> bytes at <off>", the detail of a transfer error.
std::string transfer_detail(size_t n, uint64_t off) {
  return std::to_string(n) + " bytes at " + std::to_string(off);
}

int sys_open(const char* path, int flags, mode_t perm) { return ::open(path, flags, perm); }
ssize_t sys_pread(int fd, void* buf, size_t n, off_t off) { return ::pread(fd, buf, n, off); }
ssize_t sys_pwrite(int fd, const void* buf, size_t n, off_t off) {
  return ::pwrite(fd, buf, n, off);
}

constexpr detail::Syscalls kSystemCalls{sys_open, sys_pread, sys_pwrite, fs::probe_direct_io};

}  // namespace

DirectIo parse_direct_io(const std::string& text) {
  const std::string t = ascii_lower(text);
  for (DirectIo mode : {DirectIo::kAuto, DirectIo::kOn, DirectIo::kOff})
    if (t == direct_io_name(mode)) return mode;
  VITRIFY_EXPECT(false, "direct_io must be auto, on or off, got \"" + text + "\"");
  return DirectIo::kAuto;
}

const char* direct_io_name(DirectIo mode) noexcept {
  return kModeNames[static_cast<int>(mode)];
}

void Fd::reset(int fd) noexcept {
  if (fd_ >= 0 && fd_ != fd) (void)::close(fd_);  // released even when close reports an error
  fd_ = fd;
}

std::string directory_of(const std::string& path) {
  const auto slash = path.find_last_of('/');
  if (slash == std::string::npos) return ".";
  if (slash == 0) return "/";
  return path.substr(0, slash);
}

OpenedFile open_file(const std::string& path, int flags, DirectIo mode, mode_t perm) {
  return detail::open_file(kSystemCalls, path, flags, mode, perm);
}

namespace {

// What `st` is, in words: "a symbolic link", "a FIFO", ...
const char* kind_of(const struct ::stat& st) {
  return S_ISLNK(st.st_mode)    ? "a symbolic link"
         : S_ISDIR(st.st_mode)  ? "a directory"
         : S_ISFIFO(st.st_mode) ? "a FIFO"
         : S_ISSOCK(st.st_mode) ? "a socket"
         : S_ISCHR(st.st_mode)  ? "a character device"
         : S_ISBLK(st.st_mode)  ? "a block device"
                                : "not a regular file";
}

// The errno of a refusal: ELOOP for a link, EISDIR for a directory, EINVAL for anything else.
int refusal_errno(const struct ::stat& st) {
  return S_ISLNK(st.st_mode) ? ELOOP : S_ISDIR(st.st_mode) ? EISDIR : EINVAL;
}

// open_regular_file's refusal of a file opened for reading: names the call, the path and what
// is there (the errno text follows, from std::system_error).
[[noreturn]] void refuse_read(const struct ::stat& st, const std::string& path,
                              const std::string& what) {
  throw std::system_error(refusal_errno(st), std::generic_category(),
                          "open(\"" + path + "\", read-only): " + what + " is " + kind_of(st) +
                              "; vitrify reads only regular files and never follows a link "
                              "there");
}

// "/proc/self/fd/<n>": the caller's own open descriptor, reopened (a magic link that names the
// descriptor, not a path, so nothing can swap what it opens between a check and this open).
bool own_descriptor_path(const std::string& path) {
  constexpr const char kPrefix[] = "/proc/self/fd/";
  constexpr size_t kLen = sizeof kPrefix - 1;
  if (path.size() <= kLen || path.size() > kLen + 10 || path.compare(0, kLen, kPrefix) != 0)
    return false;
  return std::all_of(path.begin() + kLen, path.end(), [](char c) { return c >= '0' && c <= '9'; });
}

}  // namespace

void refuse_not_regular(const struct ::stat& st, const std::string& path, const std::string& what) {
  throw std::system_error(refusal_errno(st), std::generic_category(),
                          what + " \"" + path + "\" is " + kind_of(st) +
                              "; vitrify writes only regular files it creates or owns and never "
                              "follows a link there (remove it, or choose another directory or "
                              "name)");
}

OpenedFile open_regular_file(const std::string& path, int flags, DirectIo mode, mode_t perm,
                             const std::string& what) {
  const bool reading = (flags & O_ACCMODE) == O_RDONLY && (flags & (O_CREAT | O_TRUNC)) == 0;
  const auto refuse = [&](const struct ::stat& st) {
    if (reading) refuse_read(st, path, what);
    refuse_not_regular(st, path, what);
  };
  flags |= O_NONBLOCK;
  if (!(reading && own_descriptor_path(path))) flags |= O_NOFOLLOW;
  const bool create = (flags & O_CREAT) != 0;
  OpenedFile f;
  for (int attempt = 0;; ++attempt) {
    try {
      if (create) {
        try {
          f = detail::open_file(kSystemCalls, path, flags | O_EXCL, mode, perm);
          f.created = true;
        } catch (const std::system_error& e) {
          if (e.code().value() != EEXIST || (flags & O_EXCL) != 0) throw;
          f = detail::open_file(kSystemCalls, path, flags & ~O_CREAT, mode, perm);
        }
      } else {
        f = detail::open_file(kSystemCalls, path, flags, mode, perm);
      }
      break;
    } catch (const std::system_error& e) {
      // Removed between the exclusive create and the plain open: create it again.
      if (e.code().value() == ENOENT && create && attempt < 8) continue;
      // Whatever the open said (ELOOP for a link, EINVAL for O_DIRECT on a FIFO, ...), a link
      // or a non-regular file there is refused as such.
      struct stat st{};
      if (::lstat(path.c_str(), &st) == 0 && !S_ISREG(st.st_mode) &&
          !(reading && own_descriptor_path(path)))
        refuse(st);
      throw;
    }
  }
  struct stat st{};
  VITRIFY_SYSCALL(::fstat(f.fd.get(), &st), path);
  if (!S_ISREG(st.st_mode)) refuse(st);
  const int fl = ::fcntl(f.fd.get(), F_GETFL);
  if (fl == -1 || ::fcntl(f.fd.get(), F_SETFL, fl & ~O_NONBLOCK) == -1)
    vitrify::detail::throw_errno(errno, "fcntl", path, "F_SETFL, clearing O_NONBLOCK");
  return f;
}

OpenedFile open_for_reading(const std::string& path, DirectIo mode, const std::string& what) {
  return open_regular_file(path, O_RDONLY, mode, 0, what);
}

size_t pread_full(int fd, void* buf, size_t n, uint64_t off, const std::string& path) {
  return detail::pread_full(kSystemCalls, fd, buf, n, off, path);
}

void pwrite_full(int fd, const void* buf, size_t n, uint64_t off, const std::string& path) {
  detail::pwrite_full(kSystemCalls, fd, buf, n, off, path);
}

std::vector<WholeFile> read_whole_files(const std::vector<std::string>& paths,
                                        const std::vector<uint64_t>& expect, unsigned threads) {
  if (paths.size() != expect.size())
    throw std::invalid_argument("read_whole_files: " + std::to_string(paths.size()) +
                                " paths but " + std::to_string(expect.size()) + " sizes");
  std::vector<WholeFile> out(paths.size());
  std::atomic<size_t> next{0};
  std::atomic<bool> stop{false};
  std::exception_ptr first;
  std::mutex mu;
  auto work = [&] {
    while (!stop.load()) {
      const size_t i = next.fetch_add(1);
      if (i >= paths.size()) return;
      try {
        const OpenedFile f = open_for_reading(paths[i], DirectIo::kOff, "file");
        struct stat st {};
        VITRIFY_SYSCALL(::fstat(f.fd.get(), &st), paths[i]);
        WholeFile& w = out[i];
        w.size = static_cast<uint64_t>(st.st_size);
        if (w.size != expect[i]) continue;
        w.data.resize(w.size);
        const size_t got = pread_full(f.fd.get(), w.data.data(), w.size, 0, paths[i]);
        if (got != w.size) {  // shrank since fstat: report what is there
          w.size = got;
          w.data.clear();
          continue;
        }
        w.crc32c = crc32c(w.data.data(), w.data.size());
      } catch (...) {
        std::lock_guard<std::mutex> lock(mu);
        if (!first) first = std::current_exception();
        stop = true;
      }
    }
  };
  on_threads(static_cast<unsigned>(std::min<size_t>(std::max(1u, threads), paths.size())), work);
  if (first) std::rethrow_exception(first);
  return out;
}

void on_threads(unsigned threads, const std::function<void()>& work) {
  std::vector<std::thread> pool;
  try {
    pool.reserve(threads > 1 ? threads - 1 : 0);
    for (unsigned t = 1; t < threads; ++t) pool.emplace_back(work);
  } catch (...) {  // no thread: the ones started and this one do the work
  }
  work();
  for (std::thread& t : pool) t.join();
}

namespace detail {

const Syscalls& system_calls() noexcept { return kSystemCalls; }

OpenedFile open_file(const Syscalls& os, const std::string& path, int flags, DirectIo mode,
                     mode_t perm) {
  OpenedFile out;
  flags |= O_CLOEXEC;
  bool want_direct = mode == DirectIo::kOn;
  if (mode == DirectIo::kOff) {
    out.buffered_reason = "VITRIFY_DIRECT_IO=off";
  } else if (mode == DirectIo::kAuto) {
    const std::string dir = directory_of(path);
    const fs::DirectIoProbe p = os.probe_direct_io(dir);
    want_direct = p.supported;
    if (!p.supported)
      out.buffered_reason = "O_DIRECT refused in " + dir + " (" + p.fs_type + "): " + p.reason;
  }
  int fd = -1;
  if (want_direct) {
    do fd = os.open(path.c_str(), flags | O_DIRECT, perm);
    while (fd == -1 && errno == EINTR);
    if (fd >= 0) {
      out.fd.reset(fd);
      out.direct = true;
      return out;
    }
    const int err = errno;
    if (err == EINVAL && mode == DirectIo::kOn)
      vitrify::detail::throw_errno(err, "open", path, "O_DIRECT with direct_io=on");
    if (err != EINVAL) vitrify::detail::throw_errno(err, "open", path, "O_DIRECT");
    out.buffered_reason = "open(O_DIRECT) refused for " + path;  // kAuto: fall back
  }
  VITRIFY_SYSCALL_RETRY(fd, os.open(path.c_str(), flags, perm), path, std::string());
  out.fd.reset(fd);
  return out;
}

size_t pread_full(const Syscalls& os, int fd, void* buf, size_t n, uint64_t off,
                  const std::string& path) {
  auto* p = static_cast<uint8_t*>(buf);
  size_t done = 0;
  while (done < n) {
    ssize_t r = -1;
    VITRIFY_SYSCALL_RETRY(r, os.pread(fd, p + done, n - done, static_cast<off_t>(off + done)),
                          path, transfer_detail(n, off));
    if (r == 0) break;  // end of file
    done += static_cast<size_t>(r);
  }
  return done;
}

void pwrite_full(const Syscalls& os, int fd, const void* buf, size_t n, uint64_t off,
                 const std::string& path) {
  const auto* p = static_cast<const uint8_t*>(buf);
  size_t done = 0;
  while (done < n) {
    ssize_t w = -1;
    VITRIFY_SYSCALL_RETRY(w, os.pwrite(fd, p + done, n - done, static_cast<off_t>(off + done)),
                          path, transfer_detail(n, off));
    if (w == 0)
      vitrify::detail::throw_errno(EIO, "pwrite", path,
                                   transfer_detail(n, off) + ", nothing written at byte " +
                                       std::to_string(off + done));
    done += static_cast<size_t>(w);
  }
}

}  // namespace detail
}  // namespace vitrify::file_io
