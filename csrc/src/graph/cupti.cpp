// Recording kernel binaries through CUPTI resource callbacks, and which handle each came from
// through driver-API callbacks on the calls that load code (CodeBindings). libcupti is dlopen()ed (never
// linked), and only the handful of CUPTI declarations used here are written out below; when
// the CUPTI headers are present at build time they are checked against them.
#include <dlfcn.h>

#include <cstdlib>

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

// The driver calls that can load code, by CUPTI callback id (cupti_driver_cbid.h), with the
// layout of their parameters (generated_cuda_meta.h): which handle each returns and takes.
using Call = CodeBindings::Call;
struct Traced {
  uint32_t cbid;
  Call call;
  const char* name;
};
constexpr Traced kTraced[] = {
    {18, Call::kModuleLoad, "cuModuleLoad"},
    {19, Call::kModuleLoad, "cuModuleLoadData"},
    {20, Call::kModuleLoad, "cuModuleLoadDataEx"},
    {21, Call::kModuleLoad, "cuModuleLoadFatBinary"},
    {22, Call::kModuleUnload, "cuModuleUnload"},
    {307, Call::kLaunch, "cuLaunchKernel"},
    {442, Call::kLaunch, "cuLaunchKernel_ptsz"},
    {652, Call::kLaunch, "cuLaunchKernelEx"},
    {653, Call::kLaunch, "cuLaunchKernelEx_ptsz"},
    {678, Call::kLibraryLoad, "cuLibraryLoadData"},
    {679, Call::kLibraryLoad, "cuLibraryLoadFromFile"},
    {680, Call::kLibraryUnload, "cuLibraryUnload"},
    {681, Call::kLibraryGetKernel, "cuLibraryGetKernel"},
    {682, Call::kLibraryGetModule, "cuLibraryGetModule"},
    {683, Call::kKernelGetFunction, "cuKernelGetFunction"},
};

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
#ifdef VITRIFY_HAVE_CUPTI_DRIVER_CBID
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
  if (domain != kDomainResource || cbid != kCbidModuleLoaded) return;
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
    // The handles each call returns (`out`, through its first parameter, a pointer) and takes
    // (`in`), read from the parameter struct the driver passes (generated_cuda_meta.h).
    auto field = [&](size_t i) { return static_cast<const void* const*>(params)[i]; };
    auto deref = [&](size_t i) -> const void* {
      const void* p = field(i);
      return ok && p != nullptr ? *static_cast<const void* const*>(p) : nullptr;
    };
    const void* out = nullptr;
    const void* in = nullptr;
    switch (t->call) {
      case Call::kModuleLoad:         // (CUmodule* module, ...)
      case Call::kLibraryLoad:        // (CUlibrary* library, ...)
        out = deref(0);
        break;
      case Call::kLibraryGetModule:   // (CUmodule* pMod, CUlibrary library)
      case Call::kLibraryGetKernel:   // (CUkernel* pKernel, CUlibrary library, const char* name)
      case Call::kKernelGetFunction:  // (CUfunction* pFunc, CUkernel kernel)
        out = deref(0);
        in = field(1);
        break;
      case Call::kLaunch:             // cuLaunchKernel(CUfunction f, ...) /
        in = cbid == 652 || cbid == 653 ? field(1) : field(0);  // Ex(const CUlaunchConfig*, f, ...)
        break;
      case Call::kModuleUnload:       // (CUmodule hmod)
      case Call::kLibraryUnload:      // (CUlibrary library)
        in = field(0);
        break;
    }
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
  if (CuptiResult r = enable(1, sub, kDomainResource, kCbidModuleLoaded); r != 0) {
    unsubscribe(sub);
    fail("cuptiEnableCallback(RESOURCE, MODULE_LOADED)", r);
  }
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
