#include "vitrify/build_info.hpp"

#include <cuda.h>

#include "vitrify/crc32c.hpp"

namespace vitrify {
BuildInfo build_info() {
  return BuildInfo{VITRIFY_VERSION, VITRIFY_GIT_SHA, VITRIFY_BUILD_TYPE, VITRIFY_COMPILER, CUDA_VERSION,
                   crc32c_hardware()};
}
}  // namespace vitrify
