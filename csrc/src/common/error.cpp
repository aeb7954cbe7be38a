#include "vitrify/error.hpp"

#include <cstring>

#include "vitrify/driver.hpp"

namespace vitrify {

CudaError::CudaError(int code, std::string name, std::string call, std::string where,
                     std::string detail)
    : Error(call + " failed: " + name + " (" + std::to_string(code) + ")" +
            (detail.empty() ? std::string() : ": " + detail)),
      code_(code),
      name_(std::move(name)),
      call_(std::move(call)),
      where_(std::move(where)) {}

namespace detail {

namespace {
bool ident_char(char c) {
  return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '_';
}
}  // namespace

std::string call_name(const char* expr) {
  // The identifiers of `expr` that are called (followed by '(' or, inside CU_NEED(name), ')').
  const std::string e(expr == nullptr ? "" : expr);
  std::string first_called;
  for (size_t i = 0; i < e.size();) {
    if (!ident_char(e[i]) || (e[i] >= '0' && e[i] <= '9')) {
      ++i;
      continue;
    }
    size_t j = i;
    while (j < e.size() && ident_char(e[j])) ++j;
    const std::string id = e.substr(i, j - i);
    const char next = j < e.size() ? e[j] : '\0';
    if ((next == '(' || next == ')') && id.size() > 2 && id.compare(0, 2, "cu") == 0) return id;
    if (next == '(' && first_called.empty() && id != "CU_NEED") first_called = id;
    i = j;
  }
  return first_called.empty() ? e : first_called;
}

std::string where(const char* file, int line) {
  // Keep the path from csrc/ on, so messages do not leak build-machine directories.
  const char* p = std::strstr(file, "csrc/");
  return std::string(p ? p : file) + ":" + std::to_string(line);
}

void throw_cuda_expr(int result, const char* expr, const char* file, int line) {
  throw_cuda(result, call_name(expr).c_str(), file, line);
}

void throw_cuda(int result, const char* call, const char* file, int line) {
  const std::string name = driver::result_name(result);
  const std::string text = driver::result_string(result);
  if (result == CUDA_ERROR_OUT_OF_MEMORY)
    throw CudaOutOfMemory(result, name, call, where(file, line), text);
  throw CudaError(result, name, call, where(file, line), text);
}

void throw_errno(int err, const std::string& call, const std::string& path,
                 const std::string& detail) {
  std::string args = path.empty() ? std::string() : "\"" + path + "\"";
  if (!detail.empty()) args += (args.empty() ? "" : ", ") + detail;
  throw std::system_error(err, std::generic_category(),
                          args.empty() ? call : call + "(" + args + ")");
}

void throw_syscall(int err, const char* expr, const std::string& path, const std::string& detail) {
  throw_errno(err, call_name(expr), path, detail);
}

void throw_invalid(const std::string& msg) { throw std::invalid_argument(msg); }

}  // namespace detail
}  // namespace vitrify
