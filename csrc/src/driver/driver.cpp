#include "vitrify/driver.hpp"

#include <dlfcn.h>

#include <mutex>
#include <stdexcept>
#include <vector>

#include "driver/loader.hpp"

namespace vitrify::driver {

LoadResult load_table(const std::string& path) {
  LoadResult out;
  Table& t = out.table;
  t.library_path = path;
  void* h = ::dlopen(path.c_str(), RTLD_NOW | RTLD_LOCAL);
  if (h == nullptr) {
    const char* e = ::dlerror();
    out.reason = "dlopen(\"" + path + "\") failed: " + (e ? e : "unknown error") +
                 (path == "libcuda.so.1"
                      ? " (no NVIDIA driver here? if it is installed outside the loader's path,"
                        " set VITRIFY_LIBCUDA_PATH to its full path, e.g."
                        " /usr/lib/x86_64-linux-gnu/libcuda.so.1)"
                      : " (VITRIFY_LIBCUDA_PATH names this library: point it at an existing"
                        " libcuda.so.1)");
    return out;
  }
  out.handle = h;
  auto gpa = reinterpret_cast<PFN_cuGetProcAddress_v12000>(::dlsym(h, "cuGetProcAddress_v2"));
  if (gpa == nullptr) {
    out.reason = path + " has no cuGetProcAddress_v2: the driver is older than CUDA 12.0";
    return out;
  }
  auto resolve = [&](const char* name, int version, void** slot) -> bool {
    *slot = nullptr;
    if (t.driver_version != 0 && version > t.driver_version) return false;
    CUdriverProcAddressQueryResult status{};
    const CUresult r = gpa(name, slot, version, CU_GET_PROC_ADDRESS_DEFAULT, &status);
    if (r != CUDA_SUCCESS || status != CU_GET_PROC_ADDRESS_SUCCESS) *slot = nullptr;
    return *slot != nullptr;
  };
  if (!resolve("cuDriverGetVersion", 2020, reinterpret_cast<void**>(&t.cuDriverGetVersion)) ||
      t.cuDriverGetVersion(&t.driver_version) != CUDA_SUCCESS) {
    out.reason = "cuDriverGetVersion unavailable or failing in " + path;
    return out;
  }
  std::string missing;
#define VITRIFY_CU_REQUIRED(name, version)                                                     \
  if (!resolve(#name, version, reinterpret_cast<void**>(&t.name)))                          \
    missing += std::string(missing.empty() ? "" : ", ") + #name + " (ABI " #version ")";
#define VITRIFY_CU_OPTIONAL(name, version) \
  resolve(#name, version, reinterpret_cast<void**>(&t.name));
#define VITRIFY_CU_OPTIONAL_AS(field, name, version) \
  resolve(#name, version, reinterpret_cast<void**>(&t.field));
#include "vitrify/driver_entries.inc"
#undef VITRIFY_CU_REQUIRED
#undef VITRIFY_CU_OPTIONAL
#undef VITRIFY_CU_OPTIONAL_AS
  if (!missing.empty()) {
    out.reason = "the CUDA driver (version " + std::to_string(t.driver_version) +
                 ") lacks required entry points: " + missing;
    return out;
  }
  const CUresult r = t.cuInit(0);
  if (r != CUDA_SUCCESS) {
    const char* name = nullptr;
    if (t.cuGetErrorName(r, &name) != CUDA_SUCCESS || name == nullptr) name = "unknown";
    out.reason = std::string("cuInit(0) failed: ") + name + " (" + std::to_string(r) +
                 ") (driver " + std::to_string(t.driver_version) + ", no usable GPU?)";
    return out;
  }
  out.ok = true;
  return out;
}

namespace {

constexpr const char* kDefaultLibrary = "libcuda.so.1";

struct Global {
  std::once_flag once;
  LoadResult result;
  std::mutex mu;  // guards path and loading
  std::string path = kDefaultLibrary;
  bool loading = false;  // the first load has begun: the path is fixed
};

Global& global() {
  // Intentionally leaked: the driver stays loaded until process exit, and no destructor runs
  // driver code while the process is tearing down.
  static Global* g = new Global();
  return *g;
}

const LoadResult& loaded() noexcept {
  Global& g = global();
  std::call_once(g.once, [&g] {
    std::string path;
    {
      std::lock_guard<std::mutex> lock(g.mu);
      g.loading = true;
      path = g.path;
    }
    try {
      g.result = load_table(path);
    } catch (const std::exception& e) {
      g.result.ok = false;
      g.result.reason = std::string("loading the CUDA driver failed: ") + e.what();
    }
  });
  return g.result;
}

}  // namespace

std::string library_path() {
  Global& g = global();
  std::lock_guard<std::mutex> lock(g.mu);
  return g.path;
}

void set_library_path(const std::string& path) {
  const std::string want = path.empty() ? kDefaultLibrary : path;
  Global& g = global();
  std::lock_guard<std::mutex> lock(g.mu);
  if (g.loading && want != g.path)
    throw std::invalid_argument("libcuda_path=" + want + ": the CUDA driver is already loaded from " +
                                g.path + " (choose the library before anything uses the driver)");
  g.path = want;
}

bool available() noexcept { return loaded().ok; }

std::string unavailable_reason() {
  const LoadResult& r = loaded();
  return r.ok ? std::string() : r.reason;
}

const Table& table() {
  const LoadResult& r = loaded();
  if (!r.ok) throw DriverUnavailable("CUDA driver unavailable: " + r.reason);
  return r.table;
}

std::string result_name(int result) {
  const LoadResult& r = loaded();
  const char* s = nullptr;
  if (r.table.cuGetErrorName != nullptr &&
      r.table.cuGetErrorName(static_cast<CUresult>(result), &s) == CUDA_SUCCESS && s != nullptr)
    return s;
  return "CUresult " + std::to_string(result);
}

std::string result_string(int result) {
  const LoadResult& r = loaded();
  const char* s = nullptr;
  if (r.table.cuGetErrorString != nullptr &&
      r.table.cuGetErrorString(static_cast<CUresult>(result), &s) == CUDA_SUCCESS && s != nullptr)
    return s;
  return {};
}

CUcontext primary_context(int device) {
  // One retain per device for the life of the process (as the CUDA runtime does): releasing the
  // last reference would destroy the context and every allocation made in it.
  static std::mutex mu;
  static std::vector<CUcontext>* contexts = new std::vector<CUcontext>();  // leaked on purpose
  const Table& d = table();
  std::lock_guard<std::mutex> lock(mu);
  if (device >= 0 && static_cast<size_t>(device) < contexts->size() && (*contexts)[device])
    return (*contexts)[device];
  const int n = device_count();
  VITRIFY_EXPECT(device >= 0 && device < n, "device ordinal " + std::to_string(device) +
                                             " out of range: this machine has " +
                                             std::to_string(n) + " CUDA device(s)");
  CUdevice dev = 0;
  VITRIFY_CU(d.cuDeviceGet(&dev, device));
  CUcontext ctx = nullptr;
  VITRIFY_CU(d.cuDevicePrimaryCtxRetain(&ctx, dev));
  if (contexts->size() <= static_cast<size_t>(device)) contexts->resize(device + 1, nullptr);
  (*contexts)[device] = ctx;
  return ctx;
}

ContextGuard::ContextGuard(int device) {
  const Table& d = table();
  ctx_ = primary_context(device);
  VITRIFY_CU(d.cuCtxGetCurrent(&prev_));
  if (prev_ != ctx_) VITRIFY_CU(d.cuCtxSetCurrent(ctx_));
}

ContextGuard::~ContextGuard() {
  // Destructors never throw: the result is ignored on purpose (nothing sensible to do with it).
  if (prev_ != ctx_) (void)loaded().table.cuCtxSetCurrent(prev_);
}

uint64_t reserve_alignment(uint64_t addr) noexcept {
  if (addr == 0) return 0;
  const uint64_t low = addr & (~addr + 1);  // lowest set bit
  constexpr uint64_t kGiB = uint64_t(1) << 30;
  return low < kGiB ? low : kGiB;
}

int device_count() {
  int n = 0;
  VITRIFY_CU(table().cuDeviceGetCount(&n));
  return n;
}

DeviceInfo device_info(int ordinal) {
  const Table& d = table();
  const int n = device_count();
  VITRIFY_EXPECT(ordinal >= 0 && ordinal < n, "device ordinal " + std::to_string(ordinal) +
                                               " out of range: this machine has " +
                                               std::to_string(n) + " CUDA device(s)");
  DeviceInfo info;
  info.ordinal = ordinal;
  CUdevice dev = 0;
  VITRIFY_CU(d.cuDeviceGet(&dev, ordinal));
  char name[256] = {};
  VITRIFY_CU(d.cuDeviceGetName(name, sizeof(name) - 1, dev));
  info.name = name;
  CUuuid uuid{};
  VITRIFY_CU(d.cuDeviceGetUuid(&uuid, dev));
  static const char* hex = "0123456789abcdef";
  std::string u = "GPU-";
  for (int i = 0; i < 16; ++i) {
    const auto b = static_cast<unsigned char>(uuid.bytes[i]);
    u += hex[b >> 4];
    u += hex[b & 15];
    if (i == 3 || i == 5 || i == 7 || i == 9) u += '-';
  }
  info.uuid = u;
  auto attr = [&](CUdevice_attribute a) {
    int v = 0;
    VITRIFY_CU(d.cuDeviceGetAttribute(&v, a, dev));
    return v;
  };
  info.sm_major = attr(CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR);
  info.sm_minor = attr(CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR);
  info.multiprocessors = attr(CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT);
  info.vmm_supported = attr(CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED) != 0;
  info.pci_bus = attr(CU_DEVICE_ATTRIBUTE_PCI_BUS_ID);
  info.pci_device = attr(CU_DEVICE_ATTRIBUTE_PCI_DEVICE_ID);
  info.pci_domain = attr(CU_DEVICE_ATTRIBUTE_PCI_DOMAIN_ID);
  VITRIFY_CU(d.cuDeviceTotalMem(&info.total_bytes, dev));
  if (info.vmm_supported) {
    CUmemAllocationProp prop{};
    prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
    prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    prop.location.id = dev;
    VITRIFY_CU(d.cuMemGetAllocationGranularity(&info.granularity_min, &prop,
                                            CU_MEM_ALLOC_GRANULARITY_MINIMUM));
    VITRIFY_CU(d.cuMemGetAllocationGranularity(&info.granularity_recommended, &prop,
                                            CU_MEM_ALLOC_GRANULARITY_RECOMMENDED));
  }
  return info;
}

}  // namespace vitrify::driver
