#include "thaw/build_info.hpp"

#include <cuda.h>

#include "thaw/crc32c.hpp"

namespace thaw {
BuildInfo build_info() {
  return BuildInfo{THAW_VERSION, THAW_GIT_SHA, THAW_BUILD_TYPE, THAW_COMPILER, CUDA_VERSION,
                   crc32c_hardware()};
}
}  // namespace thaw
