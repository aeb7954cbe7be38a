// vitrify error types and checking macros.
//
// Every CUDA driver call and syscall result is checked. Messages are built only on failure and
// speak the user's words: the called function's name (never the stringified source expression),
// the result (CUresult name / errno text) and, for syscalls, the path; CudaError also carries the
// place (file:line) as its `where` attribute, for bug reports, outside the message.
//   vitrify::CudaError        -> Python vitrify.CudaError (a RuntimeError)
//   vitrify::CudaOutOfMemory  -> Python vitrify.CudaOutOfMemoryError (CudaError and MemoryError)
//   vitrify::OutOfSpace       -> Python MemoryError (a vitrify pool or region is full)
//   vitrify::DriverUnavailable-> Python vitrify.CudaUnavailableError (a RuntimeError)
//   std::system_error      -> Python OSError with errno
//   std::invalid_argument  -> Python ValueError
#pragma once

#include <cerrno>
#include <stdexcept>
#include <string>
#include <system_error>

namespace vitrify {

// Base of vitrify's own runtime errors.
class Error : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// A CUDA driver call returned something other than CUDA_SUCCESS.
class CudaError : public Error {
 public:
  CudaError(int code, std::string name, std::string call, std::string where, std::string detail);
  int code() const noexcept { return code_; }
  const std::string& name() const noexcept { return name_; }
  const std::string& call() const noexcept { return call_; }
  const std::string& where() const noexcept { return where_; }

 private:
  int code_;
  std::string name_, call_, where_;
};

// CUDA_ERROR_OUT_OF_MEMORY from the driver.
class CudaOutOfMemory : public CudaError {
 public:
  using CudaError::CudaError;
};

// The CUDA driver cannot be loaded or initialised on this machine.
class DriverUnavailable : public Error {
 public:
  using Error::Error;
};

// A vitrify-managed space (region, pool, slab) has no room left. Never a silent fallback.
class OutOfSpace : public Error {
 public:
  using Error::Error;
};

namespace detail {
// The called function of a stringified call expression: "d.cuMemMap(p, n, 0, h, 0)" ->
// "cuMemMap", "CU_NEED(cuGraphLaunch)(e, s)" -> "cuGraphLaunch", "::statfs(p, &st)" -> "statfs";
// the expression itself when it calls nothing.
std::string call_name(const char* expr);
// `call` is used as given (a description such as "cuModuleLoadData(module ab12...)");
// throw_cuda_expr reduces a stringified expression to its call_name first.
[[noreturn]] void throw_cuda(int result, const char* call, const char* file, int line);
[[noreturn]] void throw_cuda_expr(int result, const char* expr, const char* file, int line);
// std::system_error "call(\"path\"): <strerror>" (just "call: <strerror>" without a path); a
// non-empty `detail` follows the path: "pread(\"/x.slab\", 4096 bytes at 8192): <strerror>".
[[noreturn]] void throw_errno(int err, const std::string& call, const std::string& path,
                              const std::string& detail = {});
[[noreturn]] void throw_syscall(int err, const char* expr, const std::string& path,
                                const std::string& detail = {});
[[noreturn]] void throw_invalid(const std::string& msg);
std::string where(const char* file, int line);
}  // namespace detail

}  // namespace vitrify

// Check a CUresult-returning expression: VITRIFY_CU(d.cuMemCreate(&h, n, &prop, 0));
#define VITRIFY_CU(expr)                                                              \
  do {                                                                             \
    const int vitrify_cu_result_ = static_cast<int>(expr);                            \
    if (vitrify_cu_result_ != 0)                                                      \
      ::vitrify::detail::throw_cuda_expr(vitrify_cu_result_, #expr, __FILE__, __LINE__);      \
  } while (0)

// Check a syscall returning -1 and setting errno, naming the file it worked on:
// VITRIFY_SYSCALL(::fdatasync(fd), path) -> OSError "fdatasync("/x/y.slab"): Input/output error".
#define VITRIFY_SYSCALL(expr, path)                                                       \
  do {                                                                                    \
    if ((expr) == -1) ::vitrify::detail::throw_syscall(errno, #expr, (path));              \
  } while (0)

// VITRIFY_SYSCALL for a call that EINTR may interrupt (pread, pwrite, open): repeats `expr` while
// it fails with EINTR and stores its last result in `out`; any other failure throws as
// VITRIFY_SYSCALL does, with `what` (evaluated only then) after the path:
// VITRIFY_SYSCALL_RETRY(r, ::pread(fd, p, n, off), path, std::to_string(n) + " bytes at " + ...)
// -> OSError "pread("/x/y.slab", 4096 bytes at 8192): Input/output error".
#define VITRIFY_SYSCALL_RETRY(out, expr, path, what)                                      \
  do {                                                                                    \
    do (out) = (expr);                                                                    \
    while ((out) == -1 && errno == EINTR);                                                \
    if ((out) == -1) ::vitrify::detail::throw_syscall(errno, #expr, (path), (what));       \
  } while (0)

// Check a call returning an errno value directly (posix_fallocate, pthread_*), naming the path
// ("" when there is none).
#define VITRIFY_ERRNO_RESULT(expr, path)                                                  \
  do {                                                                                    \
    const int vitrify_err_ = (expr);                                                      \
    if (vitrify_err_ != 0) ::vitrify::detail::throw_syscall(vitrify_err_, #expr, (path)); \
  } while (0)

// Argument validation, a message in the user's words (argument names, values, valid range):
// VITRIFY_EXPECT(size > 0, "size must be positive, got " + std::to_string(size));
#define VITRIFY_EXPECT(cond, msg)                                                         \
  do {                                                                                    \
    if (!(cond)) ::vitrify::detail::throw_invalid((msg));                                 \
  } while (0)
