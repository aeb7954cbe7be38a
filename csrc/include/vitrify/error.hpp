// vitrify error types and checking macros.
//
// Every CUDA driver call and syscall result is checked. Messages name the call, the result
// (CUresult name / errno text) and the place (file:line), and are built only on failure.
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
[[noreturn]] void throw_cuda(int result, const char* call, const char* file, int line);
[[noreturn]] void throw_errno(int err, const char* call, const char* file, int line);
[[noreturn]] void throw_invalid(const std::string& msg, const char* file, int line);
std::string where(const char* file, int line);
}  // namespace detail

}  // namespace vitrify

// Check a CUresult-returning expression: VITRIFY_CU(d.cuMemCreate(&h, n, &prop, 0));
#define VITRIFY_CU(expr)                                                              \
  do {                                                                             \
    const int vitrify_cu_result_ = static_cast<int>(expr);                            \
    if (vitrify_cu_result_ != 0)                                                      \
      ::vitrify::detail::throw_cuda(vitrify_cu_result_, #expr, __FILE__, __LINE__);      \
  } while (0)

// Check a syscall returning -1 and setting errno: VITRIFY_SYSCALL(::fdatasync(fd));
#define VITRIFY_SYSCALL(expr)                                                         \
  do {                                                                             \
    if ((expr) == -1) ::vitrify::detail::throw_errno(errno, #expr, __FILE__, __LINE__); \
  } while (0)

// Check a call returning an errno value directly (posix_fallocate, pthread_*).
#define VITRIFY_ERRNO_RESULT(expr)                                                    \
  do {                                                                             \
    const int vitrify_err_ = (expr);                                                  \
    if (vitrify_err_ != 0) ::vitrify::detail::throw_errno(vitrify_err_, #expr, __FILE__, __LINE__); \
  } while (0)

// Argument validation: VITRIFY_EXPECT(size > 0, "size must be positive, got " + std::to_string(size));
#define VITRIFY_EXPECT(cond, msg)                                                     \
  do {                                                                             \
    if (!(cond)) ::vitrify::detail::throw_invalid((msg), __FILE__, __LINE__);         \
  } while (0)
