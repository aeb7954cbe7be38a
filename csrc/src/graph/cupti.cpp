// Recording kernel binaries through CUPTI resource callbacks, and which handle each came from
// through driver-API callbacks on the calls that load code (CodeBindings). libcupti is dlopen()ed (never
// linked), and only the handful of CUPTI declarations used here are written out below; when
// the CUPTI headers are present at build time they are checked against them.
#include <dlfcn.h>

#include <cstdlib>
#include <cstring>

#include "vitrify/graph_cuda.hpp"
#include "vitrify/log.hpp"

#if __has_include(<cupti_callbacks.h>)
#include <cupti_callbacks.h>
#define VITRIFY_HAVE_CUPTI_HEADERS 1
#if __has_include(<cupti_driver_cbid.h>)
#include <cupti_driver_cbid.h>
#define VITRIFY_HAVE_CUPTI_DRIVER_CBID 1
#endif

#endif

namespace vitrify::graph {
namespace {

// CUPTI ABI subset (cupti_callbacks.h, cupti_result.h).
using CuptiResult = int;
using CuptiCallback = void (*)(void* userdata, int domain, uint32_t cbid, const void* cbdata);
using PfnSubscribe = CuptiResult (*)(void** subscriber, CuptiCallback cb, void* userdata);
using PfnUnsubscribe = CuptiResult (*)(void* subscriber);
using PfnEnableCallback = CuptiResult (*)(uint32_t enable, void* subscriber, int domain, uint32_t cbid);
using PfnResultString = CuptiResult (*)(CuptiResult r, const char** text);
constexpr int kDomainDriver = 1;            // CUPTI_CB_DOMAIN_DRIVER_API
constexpr int kDomainResource = 3;          // CUPTI_CB_DOMAIN_RESOURCE
constexpr uint32_t kCbidModuleLoaded = 6;   // CUPTI_CBID_RESOURCE_MODULE_LOADED
constexpr int kApiEnter = 0;                // CUPTI_API_ENTER
constexpr CuptiResult kMultipleSubscribers = 39;  // CUPTI_ERROR_MULTIPLE_SUBSCRIBERS_NOT_SUPPORTED
struct ResourceData {                       // CUpti_ResourceData
  void* context;
  void* resource_handle;
  void* resource_descriptor;
};
struct ModuleResourceData {                 // CUpti_ModuleResourceData
  uint32_t module_id;
  size_t cubin_size;
  const char* cubin;
};
struct CallbackData {                       // CUpti_CallbackData (driver API domain)
  int site;                                 // CUpti_ApiCallbackSite
  const char* function_name;
  const void* function_params;
  void* function_return_value;              // CUresult*
  const char* symbol_name;
  void* context;
  uint32_t context_uid;
  uint64_t* correlation_data;
  uint32_t correlation_id;
};

// The driver calls that can load code, by CUPTI callback id (cupti_driver_cbid.h), with where
// their parameter struct (generated_cuda_meta.h, which needs the driver's internal v1 types and is
// not included: tests/cpp/test_graph_bindings.cpp lays the structs out and checks the decoding)
// holds the pointer to the handle the call returns (`out`) and the handle it is given (`in`), as
// byte offsets (-1: none).
using Call = CodeBindings::Call;
struct Traced {
  uint32_t cbid;
  Call call;
  const char* name;
  int out, in;
};
constexpr Traced kTraced[] = {
    {18, Call::kModuleLoad, "cuModuleLoad", 0, -1},
    {19, Call::kModuleLoad, "cuModuleLoadData", 0, -1},
    {20, Call::kModuleLoad, "cuModuleLoadDataEx", 0, -1},
    {21, Call::kModuleLoad, "cuModuleLoadFatBinary", 0, -1},
    {22, Call::kModuleUnload, "cuModuleUnload", -1, 0},
    {23, Call::kModuleGetFunction, "cuModuleGetFunction", 0, 8},
    {85, Call::kUse, "cuFuncGetAttribute", -1, 16},
    {307, Call::kUse, "cuLaunchKernel", -1, 0},
    {442, Call::kUse, "cuLaunchKernel_ptsz", -1, 0},
    {477, Call::kUse, "cuLaunchCooperativeKernel", -1, 0},
    {478, Call::kUse, "cuLaunchCooperativeKernel_ptsz", -1, 0},
    {481, Call::kUse, "cuFuncSetAttribute", -1, 0},
    {652, Call::kUse, "cuLaunchKernelEx", -1, 8},
    {653, Call::kUse, "cuLaunchKernelEx_ptsz", -1, 8},
    {678, Call::kLibraryLoad, "cuLibraryLoadData", 0, -1},
    {679, Call::kLibraryLoad, "cuLibraryLoadFromFile", 0, -1},
    {680, Call::kLibraryUnload, "cuLibraryUnload", -1, 0},
    {681, Call::kLibraryGetKernel, "cuLibraryGetKernel", 0, 8},
    {682, Call::kLibraryGetModule, "cuLibraryGetModule", 0, 8},
    {683, Call::kKernelGetFunction, "cuKernelGetFunction", 0, 8},
    {686, Call::kUse, "cuKernelGetAttribute", -1, 16},
    {687, Call::kUse, "cuKernelSetAttribute", -1, 8},
};
constexpr uint32_t kCbidContextDestroyStarting = 2;  // CUPTI_CBID_RESOURCE_CONTEXT_DESTROY_STARTING
constexpr uint32_t kCbidModuleUnloadStarting = 7;    // CUPTI_CBID_RESOURCE_MODULE_UNLOAD_STARTING

#ifdef VITRIFY_HAVE_CUPTI_HEADERS
static_assert(CUPTI_CB_DOMAIN_RESOURCE == kDomainResource);
static_assert(CUPTI_CBID_RESOURCE_MODULE_LOADED == kCbidModuleLoaded);
static_assert(sizeof(CUpti_ResourceData) == sizeof(ResourceData));
static_assert(offsetof(CUpti_ResourceData, resourceDescriptor) ==
              offsetof(ResourceData, resource_descriptor));
static_assert(sizeof(CUpti_ModuleResourceData) == sizeof(ModuleResourceData));
static_assert(offsetof(CUpti_ModuleResourceData, cubinSize) == offsetof(ModuleResourceData, cubin_size));
static_assert(offsetof(CUpti_ModuleResourceData, pCubin) == offsetof(ModuleResourceData, cubin));
static_assert(CUPTI_CB_DOMAIN_DRIVER_API == kDomainDriver && CUPTI_API_ENTER == kApiEnter);
static_assert(sizeof(CUpti_CallbackData) == sizeof(CallbackData));
static_assert(offsetof(CUpti_CallbackData, functionParams) == offsetof(CallbackData, function_params));
static_assert(offsetof(CUpti_CallbackData, functionReturnValue) ==
              offsetof(CallbackData, function_return_value));
static_assert(CUPTI_CBID_RESOURCE_CONTEXT_DESTROY_STARTING == kCbidContextDestroyStarting &&
              CUPTI_CBID_RESOURCE_MODULE_UNLOAD_STARTING == kCbidModuleUnloadStarting);
#ifdef VITRIFY_HAVE_CUPTI_DRIVER_CBID
static_assert(CUPTI_DRIVER_TRACE_CBID_cuModuleGetFunction == 23 &&
              CUPTI_DRIVER_TRACE_CBID_cuFuncGetAttribute == 85 &&
              CUPTI_DRIVER_TRACE_CBID_cuLaunchCooperativeKernel == 477 &&
              CUPTI_DRIVER_TRACE_CBID_cuLaunchCooperativeKernel_ptsz == 478 &&
              CUPTI_DRIVER_TRACE_CBID_cuFuncSetAttribute == 481 &&
              CUPTI_DRIVER_TRACE_CBID_cuKernelGetAttribute == 686 &&
              CUPTI_DRIVER_TRACE_CBID_cuKernelSetAttribute == 687);
static_assert(CUPTI_DRIVER_TRACE_CBID_cuModuleLoad == 18 && CUPTI_DRIVER_TRACE_CBID_cuModuleLoadData == 19 &&
              CUPTI_DRIVER_TRACE_CBID_cuModuleLoadDataEx == 20 &&
              CUPTI_DRIVER_TRACE_CBID_cuModuleLoadFatBinary == 21 &&
              CUPTI_DRIVER_TRACE_CBID_cuModuleUnload == 22 && CUPTI_DRIVER_TRACE_CBID_cuLaunchKernel == 307 &&
              CUPTI_DRIVER_TRACE_CBID_cuLaunchKernel_ptsz == 442 &&
              CUPTI_DRIVER_TRACE_CBID_cuLaunchKernelEx == 652 &&
              CUPTI_DRIVER_TRACE_CBID_cuLaunchKernelEx_ptsz == 653 &&
              CUPTI_DRIVER_TRACE_CBID_cuLibraryLoadData == 678 &&
              CUPTI_DRIVER_TRACE_CBID_cuLibraryLoadFromFile == 679 &&
              CUPTI_DRIVER_TRACE_CBID_cuLibraryUnload == 680 &&
              CUPTI_DRIVER_TRACE_CBID_cuLibraryGetKernel == 681 &&
              CUPTI_DRIVER_TRACE_CBID_cuLibraryGetModule == 682 &&
              CUPTI_DRIVER_TRACE_CBID_cuKernelGetFunction == 683);
#endif
#endif

void callback(void* userdata, int domain, uint32_t cbid, const void* cbdata) {
  if (cbdata == nullptr) return;
  if (domain == kDomainDriver) {
    const auto* cd = static_cast<const CallbackData*>(cbdata);
    static_cast<ModuleRecorder*>(userdata)->on_driver_call(cbid, cd->site == kApiEnter,
                                                           cd->function_params,
                                                           cd->function_return_value);
    return;
  }
  if (domain != kDomainResource) return;
  if (cbid == kCbidModuleUnloadStarting || cbid == kCbidContextDestroyStarting) {
    static_cast<ModuleRecorder*>(userdata)->on_unloading();
    return;
  }
  if (cbid != kCbidModuleLoaded) return;
  const auto* rd = static_cast<const ResourceData*>(cbdata);
  const auto* md = static_cast<const ModuleResourceData*>(rd->resource_descriptor);
  if (md == nullptr || md->cubin == nullptr || md->cubin_size == 0) return;
  static_cast<ModuleRecorder*>(userdata)->on_module_loaded(md->cubin, md->cubin_size);
}

std::vector<std::string> candidates(const std::string& explicit_path,
                                    const std::vector<std::string>& extra) {
  std::vector<std::string> out;
  if (!explicit_path.empty()) {
    out.push_back(explicit_path);
    return out;  // an explicit path is the only one tried
  }
  out.push_back("libcupti.so.13");
  out.push_back("libcupti.so");
  std::vector<std::string> roots;
  for (const char* env : {"CUDA_HOME", "CUDA_PATH"})
    if (const char* v = std::getenv(env); v != nullptr && *v != '\0') roots.emplace_back(v);
  roots.push_back("/usr/local/cuda");
  roots.push_back("/usr/local/cuda-13");
  for (const std::string& r : roots)
    for (const char* sub : {"/lib64/libcupti.so.13", "/extras/CUPTI/lib64/libcupti.so.13",
                            "/lib/libcupti.so.13", "/lib64/libcupti.so"})
      out.push_back(r + sub);
  out.insert(out.end(), extra.begin(), extra.end());
  return out;
}

}  // namespace

ModuleRecorder& ModuleRecorder::instance() {
  static ModuleRecorder* r = new ModuleRecorder();  // leaked: CUPTI may call back until exit
  return *r;
}

void ModuleRecorder::on_module_loaded(const void* data, size_t n) noexcept {
  try {
    bindings_.loaded(registry_.add(data, n));
    std::lock_guard<std::mutex> lock(mu_);
    ++seen_;
  } catch (...) {
    // Out of memory while copying a binary: the kernel will be reported missing at FREEZE.
  }
}

void ModuleRecorder::on_unloading() noexcept {
  try {
    bindings_.unloading();
  } catch (...) {
  }
}

void ModuleRecorder::on_driver_call(uint32_t cbid, bool enter, const void* params,
                                    const void* result) noexcept {
  const Traced* t = nullptr;
  for (const Traced& x : kTraced)
    if (x.cbid == cbid) t = &x;
  if (t == nullptr || params == nullptr) return;
  try {
    if (enter) {
      bindings_.enter(t->call);
      return;
    }
    const bool ok = result != nullptr && *static_cast<const CUresult*>(result) == CUDA_SUCCESS;
    // The handles the call returns (through a pointer) and takes, read from the parameter
    // struct the driver passes, at the table's byte offsets.
    const auto* base = static_cast<const uint8_t*>(params);
    auto field = [&](int off) -> const void* {
      const void* v = nullptr;
      if (off >= 0) std::memcpy(&v, base + off, sizeof v);
      return v;
    };
    const void* out_ptr = field(t->out);
    const void* out = nullptr;
    if (ok && out_ptr != nullptr) std::memcpy(&out, out_ptr, sizeof out);
    const void* in = field(t->in);
    bindings_.exit(t->call, ok, out, in);
  } catch (...) {
    // Out of memory recording a binding: the kernel falls back to resolution by name.
  }
}

void ModuleRecorder::start(const std::vector<std::string>& extra_paths) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (active_) return;
    start_locked(extra_paths);
  }
  // Logged outside the lock: the Python log sink takes the GIL.
  if (log::enabled(log::kInfo)) log::info("recording kernel binaries through " + library_path());
}

void ModuleRecorder::start_locked(const std::vector<std::string>& extra_paths) {
  if (lib_ == nullptr) {
    std::string tried;
    for (const std::string& p : candidates(cupti_path_, extra_paths)) {
      void* h = ::dlopen(p.c_str(), RTLD_NOW | RTLD_LOCAL);
      if (h != nullptr) {
        lib_ = h;
        lib_path_ = p;
        break;
      }
      const char* e = ::dlerror();
      tried += "\n  " + p + ": " + (e ? e : "not loadable");
    }
    if (lib_ == nullptr)
      throw Error("cannot load libcupti (needed to record kernel binaries); set VITRIFY_CUPTI_PATH "
                  "to libcupti.so.13. Tried:" + tried);
  }
  auto sym = [&](const char* name) {
    void* s = ::dlsym(lib_, name);
    if (s == nullptr) throw Error(lib_path_ + " has no " + name + ": not a usable libcupti");
    return s;
  };
  auto subscribe = reinterpret_cast<PfnSubscribe>(sym("cuptiSubscribe"));
  auto enable = reinterpret_cast<PfnEnableCallback>(sym("cuptiEnableCallback"));
  auto unsubscribe = reinterpret_cast<PfnUnsubscribe>(sym("cuptiUnsubscribe"));
  auto result_string = reinterpret_cast<PfnResultString>(::dlsym(lib_, "cuptiGetResultString"));
  auto fail = [&](const char* call, CuptiResult r) {
    const char* text = nullptr;
    if (result_string == nullptr || result_string(r, &text) != 0 || text == nullptr) text = "";
    std::string msg = std::string(call) + " failed: CUPTI result " + std::to_string(r) + " " +
                      text + " (" + lib_path_ + ")";
    if (r == kMultipleSubscribers)
      msg += "; another CUPTI subscriber is active (torch profiler, Nsight, cuda-gdb?)";
    throw Error(msg);
  };
  void* sub = nullptr;
  if (CuptiResult r = subscribe(&sub, &callback, this); r != 0) fail("cuptiSubscribe", r);
  for (uint32_t cbid : {kCbidModuleLoaded, kCbidModuleUnloadStarting, kCbidContextDestroyStarting})
    if (CuptiResult r = enable(1, sub, kDomainResource, cbid); r != 0) {
      unsubscribe(sub);
      fail(("cuptiEnableCallback(RESOURCE, " + std::to_string(cbid) + ")").c_str(), r);
    }
  // Bindings from an earlier recording may be stale: unloads were not seen in between.
  bindings_.clear();
  for (const Traced& t : kTraced) {
    if (CuptiResult r = enable(1, sub, kDomainDriver, t.cbid); r != 0) {
      unsubscribe(sub);
      fail((std::string("cuptiEnableCallback(DRIVER_API, ") + t.name + ")").c_str(), r);
    }
  }
  subscriber_ = sub;
  active_ = true;
}

void ModuleRecorder::set_cupti_path(const std::string& path) {
  std::lock_guard<std::mutex> lock(mu_);
  cupti_path_ = path;
}

void ModuleRecorder::stop() {
  std::lock_guard<std::mutex> lock(mu_);
  if (!active_) return;
  auto unsubscribe = reinterpret_cast<PfnUnsubscribe>(::dlsym(lib_, "cuptiUnsubscribe"));
  if (unsubscribe != nullptr) unsubscribe(subscriber_);
  subscriber_ = nullptr;
  active_ = false;
  bindings_.clear();  // unloads are no longer seen: no handle stays trusted
}

bool ModuleRecorder::active() const {
  std::lock_guard<std::mutex> lock(mu_);
  return active_;
}

std::string ModuleRecorder::library_path() const {
  std::lock_guard<std::mutex> lock(mu_);
  return lib_path_;
}

size_t ModuleRecorder::modules_seen() const {
  std::lock_guard<std::mutex> lock(mu_);
  return seen_;
}

}  // namespace vitrify::graph
