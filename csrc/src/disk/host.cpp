// The host tier's pieces beside SlabFile (DESIGN.md, Host tier): the mapping owner of a host
// slab, the filesystem check of a host directory and its free-space check.
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/statfs.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <system_error>
#include <vector>

#include "vitrify/disk.hpp"
#include "vitrify/error.hpp"
#include "vitrify/fs.hpp"
#include "vitrify/host.hpp"
#include "vitrify/log.hpp"

namespace vitrify::disk {
namespace {
constexpr uint64_t kTmpfsMagic = 0x01021994;
constexpr uint64_t kHugetlbfsMagic = 0x958458F6;

// The topmost ancestor of `dir` on the same device: the mount point that holds it.
std::string mount_of(const std::string& dir) {
  char real[PATH_MAX];
  if (::realpath(dir.c_str(), real) == nullptr) return dir;
  std::string at = real;
  struct stat st{};
  if (::stat(at.c_str(), &st) != 0) return at;
  const dev_t dev = st.st_dev;
  while (at != "/") {
    const std::string parent = file_io::directory_of(at);
    struct stat ps{};
    if (::stat(parent.c_str(), &ps) != 0 || ps.st_dev != dev) break;
    at = parent;
  }
  return at;
}
constexpr size_t kPopulateThreads = 8;

// Puts every page of a fresh mapping into this process's page tables before the first copy
// needs it: without it a restarted server's (or a reader's) first reads of the host tier take
// a page fault per 4 KiB page, in parallel copy threads that then contend in the kernel.
// host::populate_ranges on up to 8 threads, never writing the slab's bytes. Never fails.
void populate(uint8_t* p, size_t n, bool writable, const std::string& path) noexcept {
  const auto t0 = std::chrono::steady_clock::now();
  const int failed = host::populate_ranges({{p, n}}, writable, false, kBlock, kPopulateThreads);
  const double ms =
      std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
  try {
    if (failed != 0)
      log::warning("vitrify.disk: host slab " + path + ": populating its page tables failed (" +
                   std::strerror(failed) + "); its pages were touched one by one instead");
    else
      log::debug("vitrify.disk: host slab " + path + ": " + std::to_string(n >> 20) +
                 " MiB of page tables populated in " + std::to_string(ms) + " ms");
  } catch (...) {  // no memory for the message: nothing else to do
  }
}
}  // namespace

SlabMapping::SlabMapping(int fd, size_t bytes, bool writable, const std::string& path) {
  void* p = ::mmap(nullptr, bytes, writable ? PROT_READ | PROT_WRITE : PROT_READ, MAP_SHARED, fd,
                   0);
  if (p == MAP_FAILED)
    vitrify::detail::throw_errno(errno, "mmap", path,
                                 std::to_string(bytes) + (writable ? " bytes, read-write"
                                                                   : " bytes, read-only"));
  p_ = static_cast<uint8_t*>(p);
  n_ = bytes;
  populate(p_, n_, writable, path);
}

SlabMapping& SlabMapping::operator=(SlabMapping&& o) noexcept {
  if (this != &o) {
    reset();
    p_ = o.p_;
    n_ = o.n_;
    o.p_ = nullptr;
    o.n_ = 0;
  }
  return *this;
}

void SlabMapping::reset() noexcept {
  if (p_ == nullptr) return;
  if (::munmap(p_, n_) != 0)
    log::warning(std::string("vitrify.disk: munmap of a host slab: ") + std::strerror(errno));
  p_ = nullptr;
  n_ = 0;
}

HostFs host_fs(const std::string& dir) {
  struct statfs st{};
  VITRIFY_SYSCALL(::statfs(dir.c_str(), &st), dir);
  const uint64_t magic = static_cast<uint64_t>(st.f_type);
  HostFs f;
  f.mount = mount_of(dir);
  f.type = fs::fs_type_name(magic);
  VITRIFY_EXPECT(magic == kTmpfsMagic || magic == kHugetlbfsMagic,
                 "host tier directory \"" + dir + "\" is on " + f.type + " (mount \"" + f.mount +
                     "\"), not in memory: use a directory on tmpfs (such as /dev/shm) or on a "
                     "hugetlbfs mount");
  // The huge page size on hugetlbfs (and its free pool when the mount has no size= limit), the
  // page size on tmpfs: host::statfs_capacity is the host pool's capacity check.
  const host::FsCapacity cap = host::statfs_capacity(dir);
  f.block_size = cap.block_size > 0 ? cap.block_size : kBlock;
  f.free_bytes = cap.free_blocks * f.block_size;
  return f;
}

void check_host_space(const HostFs& fs, const std::string& what, uint64_t needed) {
  if (needed <= fs.free_bytes) return;
  throw HostSpaceShort(
      fs.mount, needed, fs.free_bytes,
      "host tier: " + what + " needs " + std::to_string(needed) + " more bytes on " + fs.type +
          " mount \"" + fs.mount + "\", which has " + std::to_string(fs.free_bytes) +
          " bytes free (free memory there, lower the host budget or choose another directory)");
}

}  // namespace vitrify::disk
