// The owner lock of a slab file (DESIGN.md D13): an OFD lock on the slab's descriptor (flock
// where the kernel refuses OFD locks), plus the owner record `<slab>.owner` that names the
// holder in the refusal a second opener gets.
#include <fcntl.h>
#include <signal.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <sys/statfs.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <ctime>
#include <thread>

#include "vitrify/disk.hpp"
#include "vitrify/error.hpp"
#include "vitrify/file_io.hpp"
#include "vitrify/log.hpp"

namespace vitrify::disk {
namespace {

constexpr size_t kOwnerRecordMax = 512;
// A refused opener re-reads a missing or stale record this often (the holder writes its record
// right after it takes the lock, so a record can lag the lock by a moment).
constexpr int kOwnerReadTries = 20;
constexpr auto kOwnerReadPause = std::chrono::milliseconds(5);
// How long a lock whose owner record names a dead process of this host is tried again (D13,
// D25: a SIGKILLed holder's in-flight io_uring transfers hold its file description a while).
constexpr auto kDeadHolderWait = std::chrono::seconds(2);

std::string host_name() {
  char buf[256] = {};
  if (::gethostname(buf, sizeof buf - 1) != 0) return "unknown";
  return buf;
}

std::string utc_now() {
  const std::time_t t = std::time(nullptr);
  std::tm tm{};
  char buf[32] = {};
  if (::gmtime_r(&t, &tm) == nullptr ||
      std::strftime(buf, sizeof buf, "%Y-%m-%dT%H:%M:%SZ", &tm) == 0)
    return "unknown";
  return buf;
}

struct flock whole_file(short type) {
  struct flock fl{};
  fl.l_type = type;
  fl.l_whence = SEEK_SET;
  fl.l_start = 0;
  fl.l_len = 0;  // to the end of the file, however it grows
  fl.l_pid = 0;  // required for OFD locks
  return fl;
}

// Takes the lock without waiting: the method that holds it, or kNone when another open file
// description holds it. Throws std::system_error for any other failure.
LockMethod try_lock(int fd, const std::string& path, SlabLocking locking) {
  if (locking == SlabLocking::kAuto) {
    struct flock fl = whole_file(F_WRLCK);
    int r;
    do r = ::fcntl(fd, F_OFD_SETLK, &fl);
    while (r == -1 && errno == EINTR);
    if (r == 0) return LockMethod::kOfd;
    const int err = errno;
    if (err == EAGAIN || err == EACCES) return LockMethod::kNone;
    if (err != EINVAL) vitrify::detail::throw_errno(err, "fcntl", path, "F_OFD_SETLK, F_WRLCK");
    log::info("vitrify.disk: OFD locks unsupported here (fcntl F_OFD_SETLK: EINVAL); locking " +
              path + " with flock");
  }
  int r;
  do r = ::flock(fd, LOCK_EX | LOCK_NB);
  while (r == -1 && errno == EINTR);
  if (r == 0) return LockMethod::kFlock;
  const int err = errno;
  if (err == EWOULDBLOCK) return LockMethod::kNone;
  vitrify::detail::throw_errno(err, "flock", path, "LOCK_EX | LOCK_NB");
}

// Writes the owner record of `path` atomically (a temporary file renamed over it), so a reader
// sees the previous record or this one, never a part.
void write_owner_record(const std::string& path) {
  const std::string record = slab_owner_path(path);
  const std::string tmp = record + "." + std::to_string(::getpid()) + ".tmp";
  const std::string text = "pid=" + std::to_string(::getpid()) + " host=" + host_name() +
                           " since=" + utc_now() + "\n";
  try {
    // Created exclusively and never through a link (issue 32): a file or link left at the
    // temporary name (a dead process of this pid, or planted) is removed, never written through.
    int fd = -1;
    for (int attempt = 0;; ++attempt) {
      do fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0644);
      while (fd == -1 && errno == EINTR);
      if (fd >= 0) break;
      const int err = errno;
      if (err == EEXIST && attempt < 3 && (::unlink(tmp.c_str()) == 0 || errno == ENOENT))
        continue;
      vitrify::detail::throw_errno(err, "open", tmp, "owner record, created exclusively");
    }
    file_io::Fd owned(fd);
    file_io::pwrite_full(owned.get(), text.data(), text.size(), 0, tmp);
    owned.reset();
    VITRIFY_SYSCALL(::rename(tmp.c_str(), record.c_str()), tmp + "\" -> \"" + record);
  } catch (...) {
    (void)::unlink(tmp.c_str());
    throw;
  }
}

bool is_dead_local(const SlabOwner& o, const std::string& me) {
  return o.pid > 0 && o.host == me && ::kill(o.pid, 0) == -1 && errno == ESRCH;
}

[[noreturn]] void throw_busy(const std::string& path) {
  const std::string me = host_name();
  SlabOwner o = read_slab_owner(path);
  for (int i = 1; i < kOwnerReadTries && (o.pid < 0 || is_dead_local(o, me)); ++i) {
    std::this_thread::sleep_for(kOwnerReadPause);
    o = read_slab_owner(path);
  }
  std::string who;
  if (o.pid < 0) {
    who = "is locked by an unknown holder (no owner record \"" + slab_owner_path(path) + "\")";
  } else if (is_dead_local(o, me)) {
    // Still a dead process after the re-reads: the lock's holder is alive (the kernel dropped
    // the dead one's lock) and has not written its own record yet. Never name the dead pid as
    // the holder (issue 33).
    who = "is held by an unknown process (the record names " + std::to_string(o.pid) +
          ", which has exited)";
    o = SlabOwner{};
  } else {
    who = "is locked by process " + std::to_string(o.pid) + " on host " + o.host;
    if (o.pid == ::getpid() && o.host == me) who += " (this process)";
    who += " since " + o.since;
  }
  throw SlabBusy(path, o.pid, o.pid < 0 ? std::string() : o.host,
                 "slab file \"" + path + "\" " + who +
                     ": another open store uses it (close that store first, or give this one "
                     "another name or directory)");
}

}  // namespace

SlabLocking parse_slab_locking(const std::string& text) {
  if (text == "auto") return SlabLocking::kAuto;
  if (text == "flock") return SlabLocking::kFlock;
  VITRIFY_EXPECT(false, "slab_lock must be \"auto\" or \"flock\", got \"" + text + "\"");
  return SlabLocking::kAuto;
}

SlabBusy::SlabBusy(std::string path, int holder_pid, std::string holder_host, std::string message)
    : std::system_error(EBUSY, std::generic_category(), message),
      path_(std::move(path)),
      holder_pid_(holder_pid),
      holder_host_(std::move(holder_host)),
      message_(std::move(message)) {}

SlabOwner read_slab_owner(const std::string& slab_path) noexcept {
  SlabOwner o;
  try {
    const std::string record = slab_owner_path(slab_path);
    // Never through a link, never blocking on a FIFO planted there: a record that is not a
    // regular file is no record.
    const int fd = ::open(record.c_str(), O_RDONLY | O_NOFOLLOW | O_NONBLOCK | O_CLOEXEC);
    if (fd < 0) return o;
    file_io::Fd owned(fd);
    struct stat st{};
    if (::fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) return o;
    char buf[kOwnerRecordMax + 1] = {};
    const size_t n = file_io::pread_full(owned.get(), buf, kOwnerRecordMax, 0, record);
    const std::string line(buf, ::strnlen(buf, n));
    // pid=<n> host=<name> since=<time>
    const auto field = [&](const char* name) -> std::string {
      const std::string key = std::string(name) + "=";
      const size_t at = line.find(key);
      if (at == std::string::npos) return {};
      const size_t start = at + key.size();
      const size_t end = line.find_first_of(" \n", start);
      return line.substr(start, end == std::string::npos ? std::string::npos : end - start);
    };
    const std::string pid = field("pid");
    if (pid.empty() || pid.find_first_not_of("0123456789") != std::string::npos || pid.size() > 9)
      return o;
    o.pid = std::stoi(pid);
    o.host = field("host");
    o.since = field("since");
    if (o.pid <= 0 || o.host.empty()) o = SlabOwner{};
  } catch (...) {
    o = SlabOwner{};
  }
  return o;
}

SlabLock::SlabLock(int fd, const std::string& path, SlabLocking locking) : path_(path) {
  LockMethod m = try_lock(fd, path, locking);
  // A holder killed with io_uring transfers in flight (D25) keeps its open file description,
  // and so its lock, until the kernel's asynchronous ring teardown has finished them: while the
  // owner record names a dead process of this host, the lock is tried again for a while.
  if (m == LockMethod::kNone) {
    const std::string me = host_name();
    const auto until = std::chrono::steady_clock::now() + kDeadHolderWait;
    while (m == LockMethod::kNone && std::chrono::steady_clock::now() < until &&
           is_dead_local(read_slab_owner(path), me)) {
      std::this_thread::sleep_for(kOwnerReadPause);
      m = try_lock(fd, path, locking);
    }
  }
  if (m == LockMethod::kNone) throw_busy(path);
  fd_ = fd;
  method_ = m;
  try {
    write_owner_record(path);
  } catch (const std::system_error& e) {
    // hugetlbfs (a host-tier directory, H1) refuses write(2): no owner record there; a
    // refused opener then names "an unknown holder". Anything else fails the lock.
    struct statfs sfs{};
    if (e.code().value() == EINVAL &&
        ::statfs(file_io::directory_of(path).c_str(), &sfs) == 0 &&
        static_cast<uint64_t>(sfs.f_type) == 0x958458F6) {
      log::info("vitrify.disk: no owner record for " + path + " (hugetlbfs refuses write)");
      return;
    }
    release();  // nothing stays locked when the constructor fails
    throw;
  } catch (...) {
    release();
    throw;
  }
}

SlabLock::SlabLock(SlabLock&& other) noexcept
    : fd_(other.fd_), method_(other.method_), path_(std::move(other.path_)) {
  other.fd_ = -1;
  other.method_ = LockMethod::kNone;
}

SlabLock& SlabLock::operator=(SlabLock&& other) noexcept {
  if (this != &other) {
    release();
    fd_ = other.fd_;
    method_ = other.method_;
    path_ = std::move(other.path_);
    other.fd_ = -1;
    other.method_ = LockMethod::kNone;
  }
  return *this;
}

void SlabLock::release() noexcept {
  if (method_ == LockMethod::kNone) return;
  // The record first: once unlocked, the next holder writes its own.
  const std::string record = slab_owner_path(path_);
  if (::unlink(record.c_str()) != 0 && errno != ENOENT)
    log::warning("vitrify.disk: unlink(\"" + record + "\"): " + std::strerror(errno));
  if (method_ == LockMethod::kOfd) {
    struct flock fl = whole_file(F_UNLCK);
    if (::fcntl(fd_, F_OFD_SETLK, &fl) != 0)
      log::warning("vitrify.disk: fcntl(\"" + path_ + "\", F_OFD_SETLK, F_UNLCK): " +
                   std::strerror(errno) + " (the lock goes when the file closes)");
  } else {
    if (::flock(fd_, LOCK_UN) != 0)
      log::warning("vitrify.disk: flock(\"" + path_ + "\", LOCK_UN): " + std::strerror(errno) +
                   " (the lock goes when the file closes)");
  }
  method_ = LockMethod::kNone;
  fd_ = -1;
}

LockedSlab lock_slab(const std::string& path, file_io::DirectIo dio, SlabLocking locking,
                     bool host) {
  LockedSlab s;
  s.path = path;
  // Never through a link, only a regular file or a new one (D13, issue 32): a link planted at
  // the slab path (in a shared directory, or by mistake) is refused naming it, its target
  // untouched. A host slab (H2): created 0600, buffered (it is mapped), never another user's.
  s.file = file_io::open_regular_file(path, O_RDWR | O_CREAT,
                                      host ? file_io::DirectIo::kOff : dio, host ? 0600 : 0644,
                                      host ? "host slab file" : "slab file");
  struct stat st{};
  VITRIFY_SYSCALL(::fstat(s.file.fd.get(), &st), path);
  s.created = s.file.created;
  s.dev = st.st_dev;
  s.ino = st.st_ino;
  s.size = static_cast<uint64_t>(st.st_size);
  if (host) check_host_owner(s.file.fd.get(), path, true);
  s.lock = SlabLock(s.file.fd.get(), path, locking);
  return s;
}

bool slab_lock_held(const std::string& path) noexcept {
  const int fd = ::open(path.c_str(), O_RDONLY | O_NOFOLLOW | O_NONBLOCK | O_CLOEXEC);
  if (fd < 0) return false;
  file_io::Fd owned(fd);
  struct stat st{};
  if (::fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) return false;
  struct flock fl = whole_file(F_WRLCK);
  if (::fcntl(fd, F_OFD_GETLK, &fl) != 0) return false;
  return fl.l_type != F_UNLCK;
}

void check_host_owner(int fd, const std::string& path, bool fix_mode) {
  struct stat st{};
  VITRIFY_SYSCALL(::fstat(fd, &st), path);
  if (st.st_uid != ::geteuid())
    vitrify::detail::throw_errno(
        EACCES, "host slab", path,
        "owned by uid " + std::to_string(st.st_uid) + ", not this user (uid " +
            std::to_string(::geteuid()) + "): host slabs of another user are never used");
  if (fix_mode && (st.st_mode & 077) != 0) VITRIFY_SYSCALL(::fchmod(fd, 0600), path);
}

}  // namespace vitrify::disk
