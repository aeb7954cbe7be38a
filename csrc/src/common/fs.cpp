#include "vitrify/fs.hpp"

#include <fcntl.h>
#include <sys/stat.h>
#include <sys/vfs.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstring>

#include "vitrify/aligned.hpp"
#include "vitrify/error.hpp"
#include "vitrify/file_io.hpp"

namespace vitrify::fs {

std::string fs_type_name(uint64_t magic) {
  switch (magic) {
    case 0xEF53: return "ext4";
    case 0x58465342: return "xfs";
    case 0x9123683E: return "btrfs";
    case 0x01021994: return "tmpfs";
    case 0x794C7630: return "overlayfs";
    case 0x6969: return "nfs";
    case 0x2FC12FC1: return "zfs";
    case 0x958458F6: return "hugetlbfs";
    case 0x65735546: return "fuse";
    case 0xF2F52010: return "f2fs";
    case 0x01021997: return "9p";
    case 0x62656572: return "sysfs";
    case 0x9FA0: return "proc";
    default: {
      char buf[32];
      std::snprintf(buf, sizeof buf, "0x%llx", static_cast<unsigned long long>(magic));
      return buf;
    }
  }
}

DirectIoProbe probe_direct_io(const std::string& directory) {
  DirectIoProbe out;
  struct stat st{};
  VITRIFY_SYSCALL(::stat(directory.c_str(), &st), directory);
  if (!S_ISDIR(st.st_mode)) vitrify::detail::throw_errno(ENOTDIR, "stat", directory);
  struct statfs sfs{};
  VITRIFY_SYSCALL(::statfs(directory.c_str(), &sfs), directory);
  out.fs_magic = static_cast<uint64_t>(sfs.f_type);
  out.fs_type = fs_type_name(out.fs_magic);
  out.block_size = static_cast<uint64_t>(sfs.f_bsize);

  // From here on a failure is the answer (`reason`), not an error; the file is always removed.
  std::string tmpl = directory + "/.vitrify-odirect-probe-XXXXXX";
  file_io::Fd created(::mkstemp(tmpl.data()));
  if (!created) {
    out.reason = std::string("cannot create a file there: ") + std::strerror(errno);
    return out;
  }
  created.reset();
  file_io::Fd fd(::open(tmpl.c_str(), O_RDWR | O_DIRECT | O_CLOEXEC));
  if (!fd) {
    out.reason = std::string("open(O_DIRECT) refused: ") + std::strerror(errno);
  } else {
    AlignedBuffer buf(8192, 4096);
    for (size_t i = 0; i < 4096; ++i) buf.data()[i] = static_cast<uint8_t>(i * 31 + 7);
    const ssize_t w = ::pwrite(fd.get(), buf.data(), 4096, 0);
    if (w != 4096) {
      out.reason = std::string("aligned O_DIRECT write failed: ") +
                   (w < 0 ? std::strerror(errno) : "short write");
    } else {
      uint8_t* back = buf.data() + 4096;
      const ssize_t r = ::pread(fd.get(), back, 4096, 0);
      if (r != 4096)
        out.reason = std::string("aligned O_DIRECT read failed: ") +
                     (r < 0 ? std::strerror(errno) : "short read");
      else if (std::memcmp(buf.data(), back, 4096) != 0)
        out.reason = "O_DIRECT read-back differs from what was written";
      else
        out.supported = true;
    }
    fd.reset();
  }
  (void)::unlink(tmpl.c_str());  // best effort: a probe file left behind is harmless
  return out;
}

}  // namespace vitrify::fs
