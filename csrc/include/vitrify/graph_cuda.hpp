// CUDA graph persistence, the GPU half: recording kernel binaries as the driver loads them
// (CUPTI resource callbacks, libcupti dlopen()ed), turning a captured CUgraph into a
// vitrify::graph::Graph (FREEZE), and rebuilding executable graphs from Graphs (THAW): one
// executable per topology template, per-graph parameters applied on switch, built on background
// threads. Driver calls go through vitrify::driver::cu(). See csrc/src/graph/DESIGN.md.
#pragma once

#include <cuda.h>

#include <atomic>
#include <condition_variable>
#include <exception>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <unordered_map>
#include <vector>

#include "vitrify/graph.hpp"

namespace vitrify::graph {

// A graph cannot be frozen: an unsupported node kind, a kernel whose binary was not recorded,
// an ambiguous kernel, host memory in a copy. The message names the node and the kernel/kind.
// (Python: RuntimeError.)
class FreezeError : public Error {
 public:
  using Error::Error;
};

// ----------------------------------------------------------------------------- recording
// Which recorded binary a driver handle's code came from (DESIGN.md, "Kernel identity"). Two
// binaries may define a kernel of one name (Triton and Inductor compile one name per
// specialisation), so FREEZE resolves a kernel node by the function it holds, not by its name.
// The recorder reports each driver call that can load code (enter/exit) and each module load
// (loaded); a call during which exactly one binary was loaded binds the handles the call names
// to that binary's hash:
//   module loads (cuModuleLoad*)           the new CUmodule                       exact
//   library loads (cuLibraryLoad*)         the new CUlibrary                      exact
//   cuLibraryGetModule                     the CUmodule and the CUlibrary         exact
//   cuModuleGetFunction                    the CUmodule (exact), the CUfunction
//   cuLibraryGetKernel                     the CUlibrary (exact), the CUkernel
//   cuKernelGetFunction                    the CUkernel and the CUfunction
//   uses (launches, attribute calls)       the CUfunction / CUkernel (lazy loading loads there)
// Unloads: a traced cuModuleUnload / cuLibraryUnload drops its module / library (and the
// library's modules) and every function/kernel binding (a handle value may be reused); an
// unload or context teardown the recorder cannot attribute, stop(), start() and clear() drop
// everything. Dropping is always safe: an unbound kernel falls back to its name, and an
// ambiguous name is a FREEZE error. A call that loaded several different binaries binds
// nothing. Thread-safe; the frame stack is per thread (a module load is reported on the thread
// whose call loads it). Pause suspends binding on this thread (FREEZE's own probe loads).
class CodeBindings {
 public:
  enum class Call : uint8_t {
    kModuleLoad, kLibraryLoad, kLibraryGetModule, kModuleGetFunction, kLibraryGetKernel,
    kKernelGetFunction, kUse, kModuleUnload, kLibraryUnload,
  };
  struct Stats {
    size_t loads_in_calls = 0;      // module loads inside a reported call
    size_t loads_outside = 0;       // module loads outside any reported call (not bound)
    size_t ambiguous_calls = 0;     // calls that loaded several binaries (nothing bound)
    size_t dropped = 0;             // times every binding was dropped (untraced unload, ...)
    size_t exact = 0, handles = 0;  // bindings held now
  };
  class Pause {  // RAII: this thread's calls and loads are not reported while it lives
   public:
    Pause();
    ~Pause();
    Pause(const Pause&) = delete;
    Pause& operator=(const Pause&) = delete;
  };
  void enter(Call c);
  void loaded(const Hash& h);
  // `out`: the handle the call returned (null when it returns none or failed); `in`: the handle
  // it was given (library, module, kernel, function, or the module/library being unloaded).
  void exit(Call c, bool ok, const void* out, const void* in);
  // A module unload or context teardown reported by the driver: dropped unless it happens inside
  // a traced unload call (which handles it precisely at its exit).
  void unloading();
  // The binary of an exact handle (CUmodule, CUlibrary) / of a function or kernel handle.
  std::optional<Hash> exact(const void* handle) const;
  std::optional<Hash> handle(const void* handle) const;
  Stats stats() const;
  void clear();  // drops every binding and every open frame (all threads)

 private:
  void drop_all_locked();
  mutable std::mutex mu_;
  std::unordered_map<const void*, Hash> exact_, handles_;
  std::unordered_map<const void*, std::vector<const void*>> library_modules_;
  std::atomic<uint64_t> generation_{1};  // frames of older generations are ignored
  Stats stats_;
};

// Records every module the driver loads into registry(), through a CUPTI subscriber on
// CUPTI_CBID_RESOURCE_MODULE_LOADED. Start it before CUDA is initialised (before torch touches
// the GPU): modules loaded earlier are never reported. One per process (CUPTI allows one
// subscriber, so it cannot coexist with torch's profiler).
class ModuleRecorder {
 public:
  static ModuleRecorder& instance();
  // dlopen()s the first loadable candidate path (the set_cupti_path() one alone when set, else
  // libcupti.so.13, libcupti.so, then CUDA's lib64 directories, then the given extra paths),
  // subscribes and enables the callback. Idempotent. Errors name every path tried and the CUPTI
  // result.
  void start(const std::vector<std::string>& extra_paths = {});
  // The one libcupti a later start() tries ("" restores the search); the Python layer passes
  // VITRIFY_CUPTI_PATH through it at import. No effect once a libcupti is loaded.
  void set_cupti_path(const std::string& path);
  void stop();  // unsubscribes; the registry keeps what was recorded
  bool active() const;
  std::string library_path() const;  // the libcupti that was loaded ("" before start)
  ModuleRegistry& registry() { return registry_; }
  CodeBindings& bindings() { return bindings_; }
  size_t modules_seen() const;  // callbacks received (including duplicates)

  // Internal: called from the CUPTI callbacks.
  void on_module_loaded(const void* data, size_t n) noexcept;
  void on_unloading() noexcept;
  void on_driver_call(uint32_t cbid, bool enter, const void* params, const void* result) noexcept;

 private:
  ModuleRecorder() = default;
  void start_locked(const std::vector<std::string>& extra_paths);
  mutable std::mutex mu_;
  ModuleRegistry registry_;
  CodeBindings bindings_;
  void* lib_ = nullptr;
  void* subscriber_ = nullptr;
  std::string lib_path_;
  std::string cupti_path_;  // set_cupti_path()
  size_t seen_ = 0;
  bool active_ = false;
};

// ------------------------------------------------------------------------------- FREEZE
struct CaptureOptions {
  int device = 0;
  uint64_t region_base = 0, region_size = 0;  // relocation range (size 0: no relocation)
  // Live allocations of the region at capture, as (offset, size): kernel words are relocated
  // only when they point into one (see find_relocations).
  std::vector<std::pair<uint64_t, uint64_t>> live;
  FieldEvidence* evidence = nullptr;  // integer evidence across captures (may be null)
  // Which binary each loaded module / library / function came from (the recorder's); null:
  // kernels are resolved by name alone.
  const CodeBindings* bindings = nullptr;
};

// Walks a captured graph (a CUgraph / cudaGraph_t) into a Graph: kernels resolved to recorded
// modules by the handles they hold (opt.bindings), else by name (disambiguated by the names of
// the module's other functions, identical machine code, then loaded function attributes), parameters from cuFuncGetParamInfo, attributes, memcpy/memset nodes,
// event nodes (events numbered in order of appearance), edges, relocations. Throws FreezeError.
Graph capture_graph(CUgraph graph, const ModuleRegistry& modules, const CaptureOptions& opt);

// --------------------------------------------------------------------------------- THAW
struct RebuildStats {
  size_t graphs = 0, templates = 0, built_templates = 0, ready_graphs = 0;
  size_t modules_loaded = 0, parameter_switches = 0, nodes_updated = 0;
  double build_seconds = 0;  // summed over build threads: module loads + graph builds
  // build_seconds' parts, summed over threads: modules loaded, graphs' nodes created (function
  // lookups, attributes, edges), executables instantiated.
  double module_seconds = 0, nodes_seconds = 0, instantiate_seconds = 0;
  size_t attributes_set = 0;  // cuFuncSetAttribute calls (once per function and value)
};

// Rebuilds graphs in this process. Usage: add_module() for each binary, add() each graph, then
// start(); wait()/wait_all() block until built; launch() replays one graph on a stream.
// Graphs sharing a topology share one CUgraphExec; launching another graph of the template
// first applies its parameters with cuGraphExec*SetParams (no device synchronisation).
//
// Thread safety (rebuild.cpp): every method except the destructor may be called from any thread,
// concurrently with the others. mu_ guards the module/graph/template tables, the build queue,
// each template's done/error and the stats; add() refuses once start() ran, so after start()
// the graphs and templates no longer change and the build threads read them without the lock.
//  - add_module(), add(), start(): serialised by mu_ (start() at most once; add() before it).
//  - wait(), wait_all(), size(), template_of(), stats(), synchronize(): any time, from any
//    number of threads (wait() blocks on cv_ until the graph's template is built or failed).
//  - launch(): concurrent launches of graphs of different templates run in parallel; launches
//    of graphs sharing a template are serialised by that template's launch_mu (apply the
//    parameters, then cuGraphLaunch), so the executable never holds a mix of two graphs'
//    parameters. A parameter switch affects only later launches (the driver's SetParams
//    semantics), never one already enqueued on another stream.
//  - Modules: start() makes one slot per referenced module; the build threads first load them
//    all, each module by one thread under its slot's lock, different modules concurrently.
//  - Lock order: a module slot's lock -> mu_, and launch_mu -> mu_; never the reverse.
//  - The destructor must not race with any other call: it stops queued builds, joins the
//    build threads (a build in progress finishes), synchronises the device when anything was
//    built, then releases executables before the modules their kernels live in.
class GraphSet {
 public:
  // share_templates=false builds one executable per graph (the baseline templates beat).
  explicit GraphSet(int device = 0, bool share_templates = true);
  ~GraphSet();  // joins the build threads, then releases executables, graphs, events, modules
  GraphSet(const GraphSet&) = delete;
  GraphSet& operator=(const GraphSet&) = delete;

  // Registers a binary (its content hash must equal `expected` when given). No driver call.
  // check=false takes `expected` as the hash without hashing the bytes: for binaries whose
  // content a checksum already verified (an archive's CRC32C); without `expected` it hashes.
  Hash add_module(const void* data, size_t n, const Hash* expected = nullptr, bool check = true);
  // Adds a graph (before start()); every module it references must already be added, else a
  // ValueError naming the kernel and the hash. Returns the graph's id (0, 1, ...).
  size_t add(Graph g);
  // Starts `threads` background builders (>= 1). Callable once.
  void start(unsigned threads = 2);
  void wait(size_t id);  // rethrows the build error of the graph's template
  void wait_all();
  // Enqueues graph `id` on `stream` (CUstream as an integer; 0 = the legacy default stream).
  void launch(size_t id, uint64_t stream);
  // cuCtxSynchronize on the set's device (tests and benchmarks; replay itself never syncs).
  void synchronize();
  size_t size() const;
  size_t template_of(size_t id) const;
  RebuildStats stats() const;

 private:
  struct Template;
  struct Loaded;
  void build(size_t t);
  void worker();
  Loaded& ensure_loaded(const Hash& module);
  void set_attributes(const KernelNode& k, CUfunction f);
  CUfunction function(const Hash& module, const std::string& name);
  void apply(Template& t, size_t id);

  const int device_;
  const bool share_templates_;
  mutable std::mutex mu_;
  std::condition_variable cv_;
  std::map<Hash, std::shared_ptr<const Module>> modules_;
  std::vector<Graph> graphs_;
  std::vector<size_t> template_of_;
  std::vector<std::unique_ptr<Template>> templates_;
  std::map<Hash, size_t> template_index_;
  size_t next_job_ = 0;
  bool started_ = false;
  std::vector<std::thread> threads_;
  // One slot per referenced module, made by start() and unchanged after it (each slot has its
  // own lock); preload_ lists them for the build threads' first pass.
  std::map<Hash, std::unique_ptr<Loaded>> loaded_;
  std::vector<Hash> preload_;
  size_t next_module_ = 0;
  RebuildStats stats_;
};

}  // namespace vitrify::graph

