// CodeBindings (which recorded binary a driver handle's code came from) and the recorder's
// driver-call decoding, on CPU: the CUPTI callbacks are replayed by hand with parameter structs
// laid out as the driver passes them (generated_cuda_meta.h).
#include <gtest/gtest.h>

#include <cuda.h>

#include <cstddef>
#include <thread>

#include "vitrify/graph_cuda.hpp"

using namespace vitrify;
using namespace vitrify::graph;
using Call = CodeBindings::Call;

namespace {

Hash hash_of(uint8_t b) {
  Hash h{};
  h[0] = b;
  return h;
}
const void* handle(uintptr_t v) { return reinterpret_cast<const void*>(v); }

TEST(CodeBindings, OneLoadInACallBindsTheHandleTheCallReturns) {
  CodeBindings b;
  b.enter(Call::kModuleLoad);
  b.loaded(hash_of(1));
  b.exit(Call::kModuleLoad, true, handle(0x100), nullptr);
  ASSERT_TRUE(b.exact(handle(0x100)).has_value());
  EXPECT_EQ(*b.exact(handle(0x100)), hash_of(1));
  EXPECT_FALSE(b.handle(handle(0x100)).has_value());  // a module is an exact binding
  EXPECT_EQ(b.stats().loads_in_calls, 1u);
  EXPECT_EQ(b.stats().exact, 1u);
}

TEST(CodeBindings, LoadsOutsideCallsFailedCallsAndCallsWithoutLoadsBindNothing) {
  CodeBindings b;
  b.loaded(hash_of(1));  // e.g. a lazy load inside a call that is not traced
  b.enter(Call::kModuleLoad);
  b.loaded(hash_of(2));
  b.exit(Call::kModuleLoad, false, handle(0x100), nullptr);
  b.enter(Call::kUse);
  b.exit(Call::kUse, true, nullptr, handle(0x200));
  EXPECT_FALSE(b.exact(handle(0x100)).has_value());
  EXPECT_FALSE(b.handle(handle(0x200)).has_value());
  EXPECT_EQ(b.stats().loads_outside, 1u);
  EXPECT_EQ(b.stats().exact + b.stats().handles, 0u);
}

TEST(CodeBindings, ACallThatLoadedTwoModulesIsAmbiguousAndBindsNothing) {
  CodeBindings b;
  b.enter(Call::kUse);
  b.loaded(hash_of(1));
  b.loaded(hash_of(2));
  b.exit(Call::kUse, true, nullptr, handle(0x300));
  EXPECT_FALSE(b.handle(handle(0x300)).has_value());
  EXPECT_EQ(b.stats().ambiguous_calls, 1u);
}

TEST(CodeBindings, EachCallBindsItsOwnHandles) {
  CodeBindings b;
  // cuLibraryLoadData (eager): the library.
  b.enter(Call::kLibraryLoad);
  b.loaded(hash_of(1));
  b.exit(Call::kLibraryLoad, true, handle(0x10), nullptr);
  EXPECT_EQ(b.exact(handle(0x10)), hash_of(1));
  // cuLibraryGetModule loading lazily: the module and the library, both exact.
  b.enter(Call::kLibraryGetModule);
  b.loaded(hash_of(2));
  b.exit(Call::kLibraryGetModule, true, handle(0x21), handle(0x20));
  EXPECT_EQ(b.exact(handle(0x21)), hash_of(2));
  EXPECT_EQ(b.exact(handle(0x20)), hash_of(2));
  // cuKernelGetFunction: the function and the kernel, as handles.
  b.enter(Call::kKernelGetFunction);
  b.loaded(hash_of(3));
  b.exit(Call::kKernelGetFunction, true, handle(0x31), handle(0x30));
  EXPECT_EQ(b.handle(handle(0x31)), hash_of(3));
  EXPECT_EQ(b.handle(handle(0x30)), hash_of(3));
  EXPECT_FALSE(b.exact(handle(0x31)).has_value());
  // cuLibraryGetKernel: the library exact, the kernel as a handle.
  b.enter(Call::kLibraryGetKernel);
  b.loaded(hash_of(4));
  b.exit(Call::kLibraryGetKernel, true, handle(0x41), handle(0x40));
  EXPECT_EQ(b.exact(handle(0x40)), hash_of(4));
  EXPECT_EQ(b.handle(handle(0x41)), hash_of(4));
  // A launch that loads lazily: the launched function/kernel.
  b.enter(Call::kUse);
  b.loaded(hash_of(5));
  b.exit(Call::kUse, true, nullptr, handle(0x50));
  EXPECT_EQ(b.handle(handle(0x50)), hash_of(5));
}

TEST(CodeBindings, AModuleLoadedInsideANestedCallBelongsToTheInnermostCall) {
  CodeBindings b;
  b.enter(Call::kUse);
  b.enter(Call::kLibraryGetModule);
  b.loaded(hash_of(7));
  b.exit(Call::kLibraryGetModule, true, handle(0x71), handle(0x70));
  b.exit(Call::kUse, true, nullptr, handle(0x72));
  EXPECT_EQ(b.exact(handle(0x71)), hash_of(7));
  EXPECT_FALSE(b.handle(handle(0x72)).has_value());  // the outer call loaded nothing itself
}

TEST(CodeBindings, UnloadsDropExactBindingsAndEveryHandleBinding) {
  CodeBindings b;
  b.enter(Call::kModuleLoad);
  b.loaded(hash_of(1));
  b.exit(Call::kModuleLoad, true, handle(0x100), nullptr);
  b.enter(Call::kLibraryGetModule);
  b.loaded(hash_of(2));
  b.exit(Call::kLibraryGetModule, true, handle(0x201), handle(0x200));
  b.enter(Call::kUse);
  b.loaded(hash_of(3));
  b.exit(Call::kUse, true, nullptr, handle(0x300));
  // A failed unload changes nothing.
  b.enter(Call::kModuleUnload);
  b.exit(Call::kModuleUnload, false, nullptr, handle(0x100));
  EXPECT_TRUE(b.exact(handle(0x100)).has_value());
  EXPECT_TRUE(b.handle(handle(0x300)).has_value());
  // Unloading the module drops it and every function/kernel handle (values may be reused).
  b.enter(Call::kModuleUnload);
  b.exit(Call::kModuleUnload, true, nullptr, handle(0x100));
  EXPECT_FALSE(b.exact(handle(0x100)).has_value());
  EXPECT_FALSE(b.handle(handle(0x300)).has_value());
  EXPECT_TRUE(b.exact(handle(0x201)).has_value());
  // Unloading the library drops it and the modules it handed out.
  b.enter(Call::kLibraryUnload);
  b.exit(Call::kLibraryUnload, true, nullptr, handle(0x200));
  EXPECT_FALSE(b.exact(handle(0x200)).has_value());
  EXPECT_FALSE(b.exact(handle(0x201)).has_value());
  EXPECT_EQ(b.stats().exact, 0u);
}

TEST(CodeBindings, FramesBelongToTheirThreadAndTheirOwner) {
  CodeBindings a, b;
  a.enter(Call::kModuleLoad);
  b.loaded(hash_of(9));                                  // b has no call open: outside
  std::thread([&] { a.loaded(hash_of(8)); }).join();     // another thread: outside
  a.loaded(hash_of(1));
  a.exit(Call::kModuleLoad, true, handle(0x100), nullptr);
  EXPECT_EQ(a.exact(handle(0x100)), hash_of(1));
  EXPECT_EQ(a.stats().loads_outside, 1u);
  EXPECT_EQ(b.stats().loads_outside, 1u);
  EXPECT_FALSE(b.exact(handle(0x100)).has_value());
}

TEST(CodeBindings, AnExitWithoutItsEnterBindsNothingAndLeavesTheStack) {
  CodeBindings b;
  b.enter(Call::kUse);
  b.enter(Call::kModuleLoad);  // its exit is never reported
  b.loaded(hash_of(1));
  b.exit(Call::kUse, true, nullptr, handle(0x500));  // the innermost open call is another one
  EXPECT_FALSE(b.handle(handle(0x500)).has_value());
  b.enter(Call::kModuleLoad);
  b.loaded(hash_of(2));
  b.exit(Call::kModuleLoad, true, handle(0x600), nullptr);
  EXPECT_EQ(b.exact(handle(0x600)), hash_of(2));
}

TEST(CodeBindings, ClearForgetsCallsLeftOpenOnEveryThread) {
  CodeBindings b;
  b.enter(Call::kModuleLoad);  // open when recording restarts
  b.clear();
  b.loaded(hash_of(1));        // no current call: outside
  b.exit(Call::kModuleLoad, true, handle(0x700), nullptr);
  EXPECT_FALSE(b.exact(handle(0x700)).has_value());
  EXPECT_EQ(b.stats().loads_outside, 1u);
}

TEST(CodeBindings, OneBinaryLoadedTwiceInOneCallIsNotAmbiguous) {
  CodeBindings b;
  b.enter(Call::kLibraryLoad);  // eager: loaded into two contexts
  b.loaded(hash_of(3));
  b.loaded(hash_of(3));
  b.exit(Call::kLibraryLoad, true, handle(0x800), nullptr);
  EXPECT_EQ(b.exact(handle(0x800)), hash_of(3));
  EXPECT_EQ(b.stats().ambiguous_calls, 0u);
}

TEST(CodeBindings, UnloadsTheRecorderCannotAttributeDropEverything) {
  CodeBindings b;
  b.enter(Call::kModuleLoad);
  b.loaded(hash_of(1));
  b.exit(Call::kModuleLoad, true, handle(0x100), nullptr);
  b.enter(Call::kModuleGetFunction);
  b.loaded(hash_of(1));
  b.exit(Call::kModuleGetFunction, true, handle(0x101), handle(0x100));
  EXPECT_EQ(b.handle(handle(0x101)), hash_of(1));
  // Inside a traced unload the drop waits for its exit (precise) ...
  b.enter(Call::kModuleUnload);
  b.unloading();
  EXPECT_TRUE(b.exact(handle(0x100)).has_value());
  b.exit(Call::kModuleUnload, true, nullptr, handle(0x100));
  EXPECT_FALSE(b.exact(handle(0x100)).has_value());
  // ... elsewhere (a context torn down, a module unloaded inside the driver) all bindings go.
  b.enter(Call::kLibraryLoad);
  b.loaded(hash_of(2));
  b.exit(Call::kLibraryLoad, true, handle(0x200), nullptr);
  b.unloading();
  EXPECT_FALSE(b.exact(handle(0x200)).has_value());
  EXPECT_EQ(b.stats().dropped, 1u);
}

TEST(CodeBindings, PausedThreadsReportNothing) {
  CodeBindings b;
  {
    const CodeBindings::Pause pause;  // e.g. FREEZE loading a candidate binary to compare it
    b.enter(Call::kModuleLoad);
    b.loaded(hash_of(1));
    b.exit(Call::kModuleLoad, true, handle(0x900), nullptr);
    b.enter(Call::kModuleUnload);
    b.exit(Call::kModuleUnload, true, nullptr, handle(0x900));
  }
  EXPECT_FALSE(b.exact(handle(0x900)).has_value());
  EXPECT_EQ(b.stats().loads_in_calls + b.stats().loads_outside, 0u);
}

// The recorder decodes the driver's parameter structs: which field holds the returned handle and
// which the handle the call was given, for each traced call.
TEST(ModuleRecorderDriverCalls, DecodesTheParameterStructsOfEachTracedCall) {
  ModuleRecorder& r = ModuleRecorder::instance();
  CodeBindings& b = r.bindings();
  b.clear();
  const CUresult ok = CUDA_SUCCESS, failed = CUDA_ERROR_INVALID_VALUE;
  const uint8_t binary_a[] = {'a', 'b', 'c'}, binary_b[] = {'d', 'e', 'f', 'g'};
  const Hash ha = r.registry().add(binary_a, sizeof binary_a);
  const Hash hb = r.registry().add(binary_b, sizeof binary_b);

  // cuModuleLoadData(CUmodule* module, const void* image): cbid 19.
  CUmodule mod = reinterpret_cast<CUmodule>(0xA000);
  struct { CUmodule* module; const void* image; } load{&mod, binary_a};
  r.on_driver_call(19, true, &load, nullptr);
  r.on_module_loaded(binary_a, sizeof binary_a);
  r.on_driver_call(19, false, &load, &ok);
  EXPECT_EQ(b.exact(mod), ha);

  // cuLaunchKernelEx(const CUlaunchConfig* config, CUfunction f, ...): cbid 652, f second.
  CUfunction fn = reinterpret_cast<CUfunction>(0xB000);
  struct { const void* config; CUfunction f; void** params; void** extra; } ex{nullptr, fn, nullptr, nullptr};
  r.on_driver_call(652, true, &ex, nullptr);
  r.on_module_loaded(binary_b, sizeof binary_b);
  r.on_driver_call(652, false, &ex, &ok);
  EXPECT_EQ(b.handle(fn), hb);

  // cuLaunchKernel(CUfunction f, ...): cbid 307, f first.
  CUfunction fn2 = reinterpret_cast<CUfunction>(0xB100);
  struct { CUfunction f; unsigned g[6]; } launch{fn2, {}};
  r.on_driver_call(307, true, &launch, nullptr);
  r.on_module_loaded(binary_a, sizeof binary_a);
  r.on_driver_call(307, false, &launch, &ok);
  EXPECT_EQ(b.handle(fn2), ha);

  // cuLibraryGetModule(CUmodule* pMod, CUlibrary library): cbid 682.
  CUmodule lmod = reinterpret_cast<CUmodule>(0xC001);
  CUlibrary lib = reinterpret_cast<CUlibrary>(0xC000);
  struct { CUmodule* pMod; CUlibrary library; } getmod{&lmod, lib};
  r.on_driver_call(682, true, &getmod, nullptr);
  r.on_module_loaded(binary_b, sizeof binary_b);
  r.on_driver_call(682, false, &getmod, &ok);
  EXPECT_EQ(b.exact(lmod), hb);
  EXPECT_EQ(b.exact(lib), hb);

  // cuModuleGetFunction(CUfunction* hfunc, CUmodule hmod, const char* name): cbid 23.
  CUmodule gm = reinterpret_cast<CUmodule>(0xE000);
  CUfunction gf = reinterpret_cast<CUfunction>(0xE001);
  struct { CUfunction* hfunc; CUmodule hmod; const char* name; } getfn{&gf, gm, "k"};
  r.on_driver_call(23, true, &getfn, nullptr);
  r.on_module_loaded(binary_a, sizeof binary_a);
  r.on_driver_call(23, false, &getfn, &ok);
  EXPECT_EQ(b.exact(gm), ha);
  EXPECT_EQ(b.handle(gf), ha);

  // cuKernelSetAttribute(attrib, int val, CUkernel kernel, CUdevice dev): the kernel at byte 8.
  CUkernel kk = reinterpret_cast<CUkernel>(0xF000);
  struct { int attrib; int val; CUkernel kernel; int dev; } setattr{0, 1, kk, 0};
  static_assert(offsetof(decltype(setattr), kernel) == 8);
  r.on_driver_call(687, true, &setattr, nullptr);
  r.on_module_loaded(binary_b, sizeof binary_b);
  r.on_driver_call(687, false, &setattr, &ok);
  EXPECT_EQ(b.handle(kk), hb);

  // cuFuncGetAttribute(int* pi, attrib, CUfunction hfunc): the function at byte 16.
  CUfunction af = reinterpret_cast<CUfunction>(0xF100);
  int value = 0;
  struct { int* pi; int attrib; CUfunction hfunc; } getattr{&value, 0, af};
  static_assert(offsetof(decltype(getattr), hfunc) == 16);
  r.on_driver_call(85, true, &getattr, nullptr);
  r.on_module_loaded(binary_a, sizeof binary_a);
  r.on_driver_call(85, false, &getattr, &ok);
  EXPECT_EQ(b.handle(af), ha);

  // A failed cuModuleLoadData leaves its output unread and binds nothing.
  CUmodule junk = reinterpret_cast<CUmodule>(0xD000);
  struct { CUmodule* module; const void* image; } bad{&junk, binary_a};
  r.on_driver_call(19, true, &bad, nullptr);
  r.on_module_loaded(binary_a, sizeof binary_a);
  r.on_driver_call(19, false, &bad, &failed);
  EXPECT_FALSE(b.exact(junk).has_value());

  // cuModuleUnload(CUmodule hmod): cbid 22.
  struct { CUmodule hmod; } unload{mod};
  r.on_driver_call(22, true, &unload, nullptr);
  r.on_driver_call(22, false, &unload, &ok);
  EXPECT_FALSE(b.exact(mod).has_value());
  EXPECT_FALSE(b.handle(fn).has_value());

  // Untraced callback ids and null parameters are ignored.
  r.on_driver_call(9999, true, &load, nullptr);
  r.on_driver_call(19, true, nullptr, nullptr);
  b.clear();
}

}  // namespace
