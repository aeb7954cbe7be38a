// Filesystem facts vitrify's disk paths depend on.
#pragma once

#include <cstdint>
#include <string>

namespace vitrify::fs {

struct DirectIoProbe {
  bool supported = false;  // a 4 KiB-aligned O_DIRECT write + read-back worked in the directory
  std::string reason;      // why not (or "" when supported)
  uint64_t fs_magic = 0;   // statfs f_type
  std::string fs_type;     // "ext4", "xfs", "tmpfs", ... or "0x<magic>"
  uint64_t block_size = 0; // statfs f_bsize
};

// Creates, writes, reads and removes a temporary file in `directory`. Throws std::system_error
// only when the directory itself cannot be examined (missing, not a directory, no permission).
DirectIoProbe probe_direct_io(const std::string& directory);

// statfs magic -> name ("ext4" for 0xEF53 — ext2/3/4 share it).
std::string fs_type_name(uint64_t magic);

}  // namespace vitrify::fs
