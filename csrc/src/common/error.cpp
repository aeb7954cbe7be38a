#include "vitrify/error.hpp"

#include <cstring>

#include "vitrify/driver.hpp"

namespace vitrify {

CudaError::CudaError(int code, std::string name, std::string call, std::string where,
                     std::string detail)
    : Error(call + " failed: " + name + " (" + std::to_string(code) + ")" +
            (detail.empty() ? std::string() : ": " + detail) + " at " + where),
      code_(code),
      name_(std::move(name)),
      call_(std::move(call)),
      where_(std::move(where)) {}

namespace detail {

std::string where(const char* file, int line) {
  // Keep the path from csrc/ on, so messages do not leak build-machine directories.
  const char* p = std::strstr(file, "csrc/");
  return std::string(p ? p : file) + ":" + std::to_string(line);
}

void throw_cuda(int result, const char* call, const char* file, int line) {
  const std::string name = driver::result_name(result);
  const std::string text = driver::result_string(result);
  if (result == CUDA_ERROR_OUT_OF_MEMORY)
    throw CudaOutOfMemory(result, name, call, where(file, line), text);
  throw CudaError(result, name, call, where(file, line), text);
}

void throw_errno(int err, const char* call, const char* file, int line) {
  throw std::system_error(err, std::generic_category(),
                          std::string(call) + " failed at " + where(file, line));
}

void throw_invalid(const std::string& msg, const char* file, int line) {
  throw std::invalid_argument(msg + " (at " + where(file, line) + ")");
}

}  // namespace detail
}  // namespace vitrify
