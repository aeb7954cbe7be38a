#pragma once
#include <string>
namespace thaw {
struct BuildInfo {
  std::string version, git_sha, build_type, compiler;
  int cuda_headers = 0;  // CUDA_VERSION of the headers thaw was built against
  bool crc32c_hardware = false;
};
BuildInfo build_info();
}  // namespace thaw
