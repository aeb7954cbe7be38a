#pragma once
#include <string>
namespace vitrify {
struct BuildInfo {
  std::string version, git_sha, build_type, compiler;
  int cuda_headers = 0;  // CUDA_VERSION of the headers vitrify was built against
  bool crc32c_hardware = false;
};
BuildInfo build_info();
}  // namespace vitrify
