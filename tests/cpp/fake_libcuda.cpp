// A stand-in for libcuda.so.1 used by CPU tests of the driver seam. It exports only
// cuGetProcAddress_v2, like the real driver's loader path needs. Knobs (read at each call):
//   FAKE_CUDA_VERSION  driver version reported (default 13000)
//   FAKE_CUDA_INIT     CUresult cuInit returns (default 0)
//   FAKE_CUDA_MISSING  comma-separated entry points reported as not found
// Every entry point not implemented below returns CUDA_ERROR_NOT_SUPPORTED.
#include <cuda.h>

#include <cstdlib>
#include <cstring>
#include <string>

namespace {

int env_int(const char* name, int fallback) {
  const char* v = std::getenv(name);
  return (v && *v) ? std::atoi(v) : fallback;
}

bool missing(const char* symbol) {
  const char* v = std::getenv("FAKE_CUDA_MISSING");
  if (!v) return false;
  std::string list = std::string(",") + v + ",";
  return list.find(std::string(",") + symbol + ",") != std::string::npos;
}

CUresult fake_not_supported() { return CUDA_ERROR_NOT_SUPPORTED; }
CUresult fake_driver_get_version(int* v) {
  *v = env_int("FAKE_CUDA_VERSION", 13000);
  return CUDA_SUCCESS;
}
CUresult fake_init(unsigned int) { return static_cast<CUresult>(env_int("FAKE_CUDA_INIT", 0)); }
CUresult fake_device_get_count(int* n) {
  *n = 0;
  return CUDA_SUCCESS;
}
const char* name_of(CUresult r) {
  switch (r) {
    case CUDA_SUCCESS: return "CUDA_SUCCESS";
    case CUDA_ERROR_INVALID_VALUE: return "CUDA_ERROR_INVALID_VALUE";
    case CUDA_ERROR_OUT_OF_MEMORY: return "CUDA_ERROR_OUT_OF_MEMORY";
    case CUDA_ERROR_NO_DEVICE: return "CUDA_ERROR_NO_DEVICE";
    case CUDA_ERROR_NOT_SUPPORTED: return "CUDA_ERROR_NOT_SUPPORTED";
    default: return nullptr;
  }
}
CUresult fake_get_error_name(CUresult r, const char** s) {
  *s = name_of(r);
  return *s ? CUDA_SUCCESS : CUDA_ERROR_INVALID_VALUE;
}
CUresult fake_get_error_string(CUresult r, const char** s) {
  *s = name_of(r) ? "fake driver error text" : nullptr;
  return *s ? CUDA_SUCCESS : CUDA_ERROR_INVALID_VALUE;
}

}  // namespace

extern "C" __attribute__((visibility("default"))) CUresult cuGetProcAddress_v2(
    const char* symbol, void** pfn, int version, cuuint64_t, CUdriverProcAddressQueryResult* st) {
  (void)version;
  *pfn = nullptr;
  if (missing(symbol)) {
    if (st) *st = CU_GET_PROC_ADDRESS_SYMBOL_NOT_FOUND;
    return CUDA_ERROR_NOT_FOUND;
  }
  if (!std::strcmp(symbol, "cuDriverGetVersion")) *pfn = (void*)&fake_driver_get_version;
  else if (!std::strcmp(symbol, "cuInit")) *pfn = (void*)&fake_init;
  else if (!std::strcmp(symbol, "cuGetErrorName")) *pfn = (void*)&fake_get_error_name;
  else if (!std::strcmp(symbol, "cuGetErrorString")) *pfn = (void*)&fake_get_error_string;
  else if (!std::strcmp(symbol, "cuDeviceGetCount")) *pfn = (void*)&fake_device_get_count;
  else *pfn = (void*)&fake_not_supported;
  if (st) *st = CU_GET_PROC_ADDRESS_SUCCESS;
  return CUDA_SUCCESS;
}
