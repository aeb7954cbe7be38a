// THAW: rebuild executable graphs from Graphs, one executable per topology template, on
// background threads (see DESIGN.md, "Rebuilding").
#include <chrono>
#include <cstring>
#include <exception>
#include <new>

#include "graph/cuda_util.hpp"
#include "vitrify/graph_cuda.hpp"
#include "vitrify/log.hpp"

namespace vitrify::graph {

// One referenced module: loaded once, by whichever build thread needs it first (or by the
// preload pass), while other threads load other modules; mu guards the load and the functions.
struct GraphSet::Loaded {
  std::mutex mu;
  bool tried = false;
  CUresult result = CUDA_SUCCESS;
  std::exception_ptr error;  // the load threw (an entry point missing, no memory): rethrown
  CUmodule module = nullptr;
  std::map<std::string, CUfunction> functions;
  // Function attributes applied (function name, attribute id) -> value: set once per value,
  // not once per node (a ladder of 36 graphs holds each kernel ~36 times).
  std::map<std::pair<std::string, int>, int> attributes;
  ~Loaded() {
    if (module != nullptr && driver::available() && driver::cu().cuModuleUnload != nullptr)
      driver::cu().cuModuleUnload(module);  // errors ignored: destructors never throw
  }
};

struct GraphSet::Template {
  std::vector<size_t> members;  // graph ids; members[0] is the one the graph is built from
  CUgraph graph = nullptr;
  CUgraphExec exec = nullptr;
  std::vector<CUgraphNode> nodes;    // node i of the description -> node of `graph`
  std::vector<CUfunction> functions;  // per node (kernel nodes only)
  std::vector<CUevent> events;
  CUcontext context = nullptr;
  bool done = false;  // built or failed (guarded by GraphSet::mu_)
  std::exception_ptr error;
  std::mutex launch_mu;  // apply + launch
  size_t current = SIZE_MAX;  // graph whose parameters `exec` holds (SIZE_MAX: unknown)
  double nodes_seconds = 0, instantiate_seconds = 0;  // of build(), for the stats

  ~Template() {
    if (!driver::available()) return;
    const auto& d = driver::cu();
    if (exec != nullptr && d.cuGraphExecDestroy) d.cuGraphExecDestroy(exec);
    if (graph != nullptr && d.cuGraphDestroy) d.cuGraphDestroy(graph);
    for (CUevent e : events) d.cuEventDestroy(e);
  }
};

GraphSet::GraphSet(int device, bool share_templates)
    : device_(device), share_templates_(share_templates) {}

GraphSet::~GraphSet() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    next_job_ = templates_.size();  // no new builds
  }
  for (std::thread& t : threads_) t.join();
  // Launched graphs may still run kernels from modules unloaded below: wait for them. The
  // context stays current for the releases (module unloads need it, on whatever thread this is).
  bool built = false;
  for (const auto& t : templates_) built = built || t->exec != nullptr;
  std::unique_ptr<driver::ContextGuard> ctx;
  if (driver::available() && (!templates_.empty() || !loaded_.empty())) {
    try {
      ctx = std::make_unique<driver::ContextGuard>(device_);
      if (built) driver::cu().cuCtxSynchronize();
    } catch (...) {
    }
  }
  templates_.clear();  // executables and graphs before the modules their kernels live in
  loaded_.clear();
}

Hash GraphSet::add_module(const void* data, size_t n, const Hash* expected, bool check) {
  auto m = std::make_shared<Module>();
  m->hash = (!check && expected != nullptr) ? *expected : sha256(data, n);
  if (expected != nullptr)
    VITRIFY_EXPECT(m->hash == *expected, "module content hash " + to_hex(m->hash) +
                                          " does not match its name " + to_hex(*expected) +
                                          " (corrupt module file)");
  m->kind = detect_binary_kind(data, n);
  m->bytes.assign(static_cast<const uint8_t*>(data), static_cast<const uint8_t*>(data) + n);
  const Hash h = m->hash;
  std::lock_guard<std::mutex> lock(mu_);
  modules_.emplace(h, std::move(m));
  return h;
}

size_t GraphSet::add(Graph g) {
  validate(g);
  std::lock_guard<std::mutex> lock(mu_);
  VITRIFY_EXPECT(!started_, "GraphSet::add after start(): add every graph first");
  const size_t id = graphs_.size();
  for (size_t i = 0; i < g.nodes.size(); ++i) {
    const Node& n = g.nodes[i];
    if (n.kind == NodeKind::kernel)
      VITRIFY_EXPECT(modules_.count(n.kernel.module),
                  "graph " + std::to_string(id) + " node " + std::to_string(i) + ": kernel '" +
                      n.kernel.name + "' needs module " + to_hex(n.kernel.module) +
                      ", which was not added");
  }
  Hash topo = topology_hash(g);
  if (!share_templates_) {  // a distinct key per graph
    const std::string salt = to_hex(topo) + "#" + std::to_string(id);
    topo = sha256(salt.data(), salt.size());
  }
  auto [it, fresh] = template_index_.emplace(topo, templates_.size());
  if (fresh) templates_.push_back(std::make_unique<Template>());
  templates_[it->second]->members.push_back(id);
  template_of_.push_back(it->second);
  graphs_.push_back(std::move(g));
  return id;
}

void GraphSet::start(unsigned threads) {
  VITRIFY_EXPECT(threads >= 1, "GraphSet::start needs at least one build thread, got 0");
  std::lock_guard<std::mutex> lock(mu_);
  VITRIFY_EXPECT(!started_, "GraphSet::start called twice");
  started_ = true;
  stats_.graphs = graphs_.size();
  stats_.templates = templates_.size();
  // Every referenced module gets its slot now; the map does not change after this, so build
  // threads read it without a lock. They load all modules first, concurrently, then build.
  for (const Graph& g : graphs_)
    for (const Node& n : g.nodes)
      if (n.kind == NodeKind::kernel && !loaded_.count(n.kernel.module)) {
        loaded_.emplace(n.kernel.module, std::make_unique<Loaded>());
        preload_.push_back(n.kernel.module);
      }
  const size_t jobs = std::max(templates_.size(), preload_.size());
  const size_t n = std::min<size_t>(threads, std::max<size_t>(jobs, 1));
  for (size_t i = 0; i < n; ++i) threads_.emplace_back([this] { worker(); });
}

GraphSet::Loaded& GraphSet::ensure_loaded(const Hash& module) {
  Loaded& l = *loaded_.at(module);  // start() made a slot for every referenced module
  std::lock_guard<std::mutex> lock(l.mu);
  if (!l.tried) {
    l.tried = true;
    std::shared_ptr<const Module> m;
    {
      std::lock_guard<std::mutex> l2(mu_);
      m = modules_.at(module);
    }
    // A load that throws (DriverUnavailable: no cuModuleLoadData; bad_alloc copying PTX) is
    // this module's error for every user, never success with a null module.
    l.error = nullptr;
    try {
      l.result = detail::load_module(&l.module, *m);
    } catch (const std::bad_alloc&) {
      l.error = std::current_exception();
      l.tried = false;  // host memory may come back: the next user retries
    } catch (...) {
      l.error = std::current_exception();
    }
    if (!l.error && l.result == CUDA_SUCCESS && l.module == nullptr)
      l.result = CUDA_ERROR_INVALID_HANDLE;  // a driver that said yes and gave nothing
    // Out of memory may pass (span restores run beside the loads): the next user retries.
    if (l.result == CUDA_ERROR_OUT_OF_MEMORY) l.tried = false;
    if (!l.error && l.result == CUDA_SUCCESS) {
      std::lock_guard<std::mutex> l2(mu_);
      ++stats_.modules_loaded;
    }
  }
  return l;
}

void GraphSet::worker() {
  // Pass 1: load the modules, each by one thread (a failure is reported by the graphs using it).
  try {
    driver::ContextGuard ctx(device_);
    for (;;) {
      size_t i;
      {
        std::lock_guard<std::mutex> lock(mu_);
        if (next_module_ >= preload_.size() || next_job_ >= templates_.size()) break;
        i = next_module_++;
      }
      const auto t0 = std::chrono::steady_clock::now();
      ensure_loaded(preload_[i]);
      const double s =
          std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      std::lock_guard<std::mutex> lock(mu_);
      stats_.build_seconds += s;
      stats_.module_seconds += s;
    }
  } catch (...) {
    // No context here: the builds below fail with the driver's error, naming their graph.
  }
  // Pass 2: build the templates.
  for (;;) {
    size_t t;
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (next_job_ >= templates_.size()) return;
      t = next_job_++;
    }
    const auto t0 = std::chrono::steady_clock::now();
    std::exception_ptr error;
    try {
      build(t);
    } catch (...) {
      error = std::current_exception();
    }
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    {
      std::lock_guard<std::mutex> lock(mu_);
      Template& T = *templates_[t];
      T.error = error;
      T.done = true;
      stats_.build_seconds += s;
      stats_.nodes_seconds += T.nodes_seconds;
      stats_.instantiate_seconds += T.instantiate_seconds;
      if (!error) {
        ++stats_.built_templates;
        stats_.ready_graphs += T.members.size();
      }
    }
    cv_.notify_all();
  }
}

CUfunction GraphSet::function(const Hash& module, const std::string& name) {
  Loaded& l = ensure_loaded(module);
  std::lock_guard<std::mutex> lock(l.mu);
  if (l.error) std::rethrow_exception(l.error);
  if (l.result != CUDA_SUCCESS) {
    std::shared_ptr<const Module> m;
    {
      std::lock_guard<std::mutex> l2(mu_);
      m = modules_.at(module);
    }
    ::vitrify::detail::throw_cuda(l.result, ("cuModuleLoadData(module " + to_hex(module) + ", " +
                                             binary_kind_name(m->kind) + ", " +
                                             std::to_string(m->bytes.size()) + " bytes)").c_str(),
                                  __FILE__, __LINE__);
  }
  auto f = l.functions.find(name);
  if (f != l.functions.end()) return f->second;
  CUfunction fn = nullptr;
  const CUresult r = CU_NEED(cuModuleGetFunction)(&fn, l.module, name.c_str());
  if (r != CUDA_SUCCESS)
    ::vitrify::detail::throw_cuda(r, ("cuModuleGetFunction(module " + to_hex(module).substr(0, 16) + ", '" +
                           name + "')").c_str(), __FILE__, __LINE__);
  l.functions.emplace(name, fn);
  return fn;
}

namespace {

CUDA_MEMCPY3D memcpy_params(const MemcpyNode& m) {
  CUDA_MEMCPY3D c;
  std::memset(&c, 0, sizeof c);
  c.srcMemoryType = CUmemorytype(m.src_type);
  c.srcDevice = m.src;
  c.srcXInBytes = m.src_x; c.srcY = m.src_y; c.srcZ = m.src_z;
  c.srcPitch = m.src_pitch; c.srcHeight = m.src_height;
  c.dstMemoryType = CUmemorytype(m.dst_type);
  c.dstDevice = m.dst;
  c.dstXInBytes = m.dst_x; c.dstY = m.dst_y; c.dstZ = m.dst_z;
  c.dstPitch = m.dst_pitch; c.dstHeight = m.dst_height;
  c.WidthInBytes = m.width; c.Height = m.height; c.Depth = m.depth;
  return c;
}

CUDA_MEMSET_NODE_PARAMS memset_params(const MemsetNode& m) {
  CUDA_MEMSET_NODE_PARAMS s;
  std::memset(&s, 0, sizeof s);
  s.dst = m.dst;
  s.pitch = m.pitch;
  s.value = m.value;
  s.elementSize = m.element_size;
  s.width = m.width;
  s.height = m.height;
  return s;
}

// Kernel node parameters pointing into k's parameter buffer (args holds the pointers).
CUDA_KERNEL_NODE_PARAMS kernel_params(const KernelNode& k, CUfunction f, std::vector<void*>& args) {
  args.resize(k.slots.size());
  for (size_t i = 0; i < k.slots.size(); ++i)
    args[i] = const_cast<uint8_t*>(k.params.data()) + k.slots[i].offset;
  CUDA_KERNEL_NODE_PARAMS p;
  std::memset(&p, 0, sizeof p);
  p.func = f;
  p.gridDimX = k.grid.x; p.gridDimY = k.grid.y; p.gridDimZ = k.grid.z;
  p.blockDimX = k.block.x; p.blockDimY = k.block.y; p.blockDimZ = k.block.z;
  p.sharedMemBytes = k.shared_mem;
  p.kernelParams = args.empty() ? nullptr : args.data();
  return p;
}

std::string label(size_t graph, size_t node, const Node& n) {
  std::string s = "graph " + std::to_string(graph) + " node " + std::to_string(node) + " (" +
                  kind_name(n.kind);
  if (n.kind == NodeKind::kernel) s += " '" + n.kernel.name + "'";
  return s + ")";
}

}  // namespace

void GraphSet::build(size_t t) {
  Template& T = *templates_[t];
  const size_t gid = T.members[0];
  const Graph& g = graphs_[gid];  // graphs_ is immutable after start()
  driver::ContextGuard ctx(device_);
  T.context = ctx.context();
  const auto t0 = std::chrono::steady_clock::now();
  VITRIFY_CU(CU_NEED(cuGraphCreate)(&T.graph, 0));
  for (uint32_t e = 0; e < g.event_count; ++e) {
    CUevent ev = nullptr;
    VITRIFY_CU(driver::cu().cuEventCreate(&ev, CU_EVENT_DISABLE_TIMING));
    T.events.push_back(ev);
  }
  T.nodes.assign(g.nodes.size(), nullptr);
  T.functions.assign(g.nodes.size(), nullptr);
  std::vector<void*> args;
  for (size_t i = 0; i < g.nodes.size(); ++i) {
    const Node& n = g.nodes[i];
    CUgraphNode& node = T.nodes[i];
    try {
      switch (n.kind) {
        case NodeKind::kernel: {
          const KernelNode& k = n.kernel;
          CUfunction f = function(k.module, k.name);
          T.functions[i] = f;
          if (!k.func_attributes.empty()) set_attributes(k, f);
          const CUDA_KERNEL_NODE_PARAMS p = kernel_params(k, f, args);
          VITRIFY_CU(CU_NEED(cuGraphAddKernelNode)(&node, T.graph, nullptr, 0, &p));
          for (const LaunchAttribute& a : k.attributes) {
            CUkernelNodeAttrValue v;
            std::memset(&v, 0, sizeof v);
            std::memcpy(&v, a.value.data(), std::min(a.value.size(), sizeof v));
            VITRIFY_CU(CU_NEED(cuGraphKernelNodeSetAttribute)(node, CUkernelNodeAttrID(a.id), &v));
          }
          break;
        }
        case NodeKind::memcpy: {
          const CUDA_MEMCPY3D c = memcpy_params(n.memcpy);
          VITRIFY_CU(CU_NEED(cuGraphAddMemcpyNode)(&node, T.graph, nullptr, 0, &c, T.context));
          break;
        }
        case NodeKind::memset: {
          const CUDA_MEMSET_NODE_PARAMS s = memset_params(n.memset);
          VITRIFY_CU(CU_NEED(cuGraphAddMemsetNode)(&node, T.graph, nullptr, 0, &s, T.context));
          break;
        }
        case NodeKind::event_record:
          VITRIFY_CU(CU_NEED(cuGraphAddEventRecordNode)(&node, T.graph, nullptr, 0, T.events[n.event]));
          break;
        case NodeKind::event_wait:
          VITRIFY_CU(CU_NEED(cuGraphAddEventWaitNode)(&node, T.graph, nullptr, 0, T.events[n.event]));
          break;
        case NodeKind::empty:
          VITRIFY_CU(CU_NEED(cuGraphAddEmptyNode)(&node, T.graph, nullptr, 0));
          break;
      }
    } catch (const CudaError& e) {
      // Same error, with the node it happened at in front of the call.
      const std::string call = "rebuilding " + label(gid, i, n) + ": " + e.call();
      const std::string text = driver::result_string(e.code());
      if (e.code() == CUDA_ERROR_OUT_OF_MEMORY)
        throw CudaOutOfMemory(e.code(), e.name(), call, e.where(), text);
      throw CudaError(e.code(), e.name(), call, e.where(), text);
    }
  }
  if (!g.edges.empty()) {
    std::vector<CUgraphNode> from, to;
    std::vector<CUgraphEdgeData> data;
    bool plain = true;
    for (const Edge& e : g.edges) {
      from.push_back(T.nodes[e.from]);
      to.push_back(T.nodes[e.to]);
      CUgraphEdgeData d;
      std::memset(&d, 0, sizeof d);
      d.from_port = e.from_port;
      d.to_port = e.to_port;
      d.type = e.type;
      plain = plain && e.from_port == 0 && e.to_port == 0 && e.type == 0;
      data.push_back(d);
    }
    const auto& d = driver::cu();
    if (d.cuGraphAddDependencies != nullptr)
      VITRIFY_CU(d.cuGraphAddDependencies(T.graph, from.data(), to.data(), data.data(), from.size()));
    else if (plain)
      VITRIFY_CU(CU_NEED(cuGraphAddDependencies_v10000)(T.graph, from.data(), to.data(), from.size()));
    else
      throw DriverUnavailable("graph " + std::to_string(gid) + " has typed edges (programmatic "
                              "dependencies) and this driver lacks cuGraphAddDependencies_v2");
  }
  const auto t1 = std::chrono::steady_clock::now();
  VITRIFY_CU(CU_NEED(cuGraphInstantiateWithFlags)(&T.exec, T.graph, 0));
  T.current = gid;
  T.nodes_seconds = std::chrono::duration<double>(t1 - t0).count();
  T.instantiate_seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - t1).count();
}

void GraphSet::set_attributes(const KernelNode& k, CUfunction f) {
  Loaded& l = ensure_loaded(k.module);
  std::lock_guard<std::mutex> lock(l.mu);
  for (const FuncAttribute& a : k.func_attributes) {
    const auto key = std::make_pair(k.name, static_cast<int>(a.id));
    const auto it = l.attributes.find(key);
    if (it != l.attributes.end() && it->second == a.value) continue;  // this value is set
    VITRIFY_CU(CU_NEED(cuFuncSetAttribute)(f, CUfunction_attribute(a.id), a.value));
    l.attributes[key] = a.value;  // recorded only once the driver took it
    std::lock_guard<std::mutex> l2(mu_);
    ++stats_.attributes_set;
  }
}

void GraphSet::apply(Template& T, size_t id) {
  const Graph& g = graphs_[id];
  const Graph* cur = T.current == SIZE_MAX ? nullptr : &graphs_[T.current];
  T.current = SIZE_MAX;  // until every node holds g's parameters
  size_t updated = 0;
  std::vector<void*> args;
  for (size_t i = 0; i < g.nodes.size(); ++i) {
    const Node& n = g.nodes[i];
    const Node* c = cur ? &cur->nodes[i] : nullptr;
    switch (n.kind) {
      case NodeKind::kernel:
        if (c && c->kernel.params == n.kernel.params && c->kernel.grid == n.kernel.grid) break;
        {
          const CUDA_KERNEL_NODE_PARAMS p = kernel_params(n.kernel, T.functions[i], args);
          VITRIFY_CU(CU_NEED(cuGraphExecKernelNodeSetParams)(T.exec, T.nodes[i], &p));
        }
        ++updated;
        break;
      case NodeKind::memcpy:
        if (c && c->memcpy == n.memcpy) break;
        {
          const CUDA_MEMCPY3D m = memcpy_params(n.memcpy);
          VITRIFY_CU(CU_NEED(cuGraphExecMemcpyNodeSetParams)(T.exec, T.nodes[i], &m, T.context));
        }
        ++updated;
        break;
      case NodeKind::memset:
        if (c && c->memset == n.memset) break;
        {
          const CUDA_MEMSET_NODE_PARAMS s = memset_params(n.memset);
          VITRIFY_CU(CU_NEED(cuGraphExecMemsetNodeSetParams)(T.exec, T.nodes[i], &s, T.context));
        }
        ++updated;
        break;
      default:
        break;
    }
  }
  T.current = id;
  std::lock_guard<std::mutex> lock(mu_);
  ++stats_.parameter_switches;
  stats_.nodes_updated += updated;
}

void GraphSet::wait(size_t id) {
  std::unique_lock<std::mutex> lock(mu_);
  VITRIFY_EXPECT(id < graphs_.size(), "graph id " + std::to_string(id) + " out of range: " +
                                       std::to_string(graphs_.size()) + " graphs");
  VITRIFY_EXPECT(started_, "GraphSet::wait before start()");
  Template& T = *templates_[template_of_[id]];
  cv_.wait(lock, [&] { return T.done; });
  if (T.error) std::rethrow_exception(T.error);
}

void GraphSet::wait_all() {
  size_t n;
  {
    std::lock_guard<std::mutex> lock(mu_);
    n = graphs_.size();
  }
  for (size_t i = 0; i < n; ++i) wait(i);
}

void GraphSet::launch(size_t id, uint64_t stream) {
  wait(id);
  Template& T = *templates_[template_of_[id]];
  std::lock_guard<std::mutex> lock(T.launch_mu);
  driver::ContextGuard ctx(device_);
  if (T.current != id) apply(T, id);
  VITRIFY_CU(CU_NEED(cuGraphLaunch)(T.exec, reinterpret_cast<CUstream>(stream)));
}

void GraphSet::synchronize() {
  driver::ContextGuard ctx(device_);
  VITRIFY_CU(driver::cu().cuCtxSynchronize());
}

size_t GraphSet::size() const {
  std::lock_guard<std::mutex> lock(mu_);
  return graphs_.size();
}

size_t GraphSet::template_of(size_t id) const {
  std::lock_guard<std::mutex> lock(mu_);
  VITRIFY_EXPECT(id < graphs_.size(), "graph id " + std::to_string(id) + " out of range: " +
                                       std::to_string(graphs_.size()) + " graphs");
  return template_of_[id];
}

RebuildStats GraphSet::stats() const {
  std::lock_guard<std::mutex> lock(mu_);
  RebuildStats s = stats_;
  s.graphs = graphs_.size();
  s.templates = templates_.size();
  return s;
}

}  // namespace vitrify::graph
