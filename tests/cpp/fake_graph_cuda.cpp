// A fake libcuda with enough of the graph, module and context API to run vitrify's graph capture
// (csrc/src/graph/capture.cpp) and rebuild (rebuild.cpp) logic on a machine without a GPU.
// Graphs, nodes, executables, modules and events are plain host objects; a launch appends the
// executable's effective node parameters, as text, to a log the tests read (fake_graph_*).
//
// Module images are PTX-like text: ".entry NAME ( // params OFF:SIZE OFF:SIZE ..." per kernel.
#include <cuda.h>

#include <cstdio>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <sstream>
#include <string>
#include <vector>

namespace {

std::mutex mu;

struct Func {
  std::string name;
  std::vector<std::pair<size_t, size_t>> params;
  std::map<int, int> attrs;
  struct Module* module = nullptr;
};
struct Module {
  std::vector<std::unique_ptr<Func>> funcs;
};
struct Node {
  CUgraphNodeType type = CU_GRAPH_NODE_TYPE_EMPTY;
  Func* func = nullptr;
  unsigned grid[3] = {1, 1, 1}, block[3] = {1, 1, 1}, smem = 0;
  std::vector<uint8_t> params;
  std::vector<void*> param_ptrs;
  std::map<int, CUlaunchAttributeValue> attrs;
  CUDA_MEMCPY3D copy{};
  CUDA_MEMSET_NODE_PARAMS set{};
  CUevent event = nullptr;
};
struct Graph {
  std::vector<std::unique_ptr<Node>> nodes;
  struct E {
    Node* from;
    Node* to;
    CUgraphEdgeData data;
  };
  std::vector<E> edges;
};
struct Exec {
  Graph* graph;
  std::vector<Node> state;  // per node, the parameters this executable launches with
};
struct Event {
  int id;
};

// Live object counts (leak checks), counters, the launch log.
int live_graphs = 0, live_execs = 0, live_modules = 0, live_events = 0;
int exec_updates = 0;
CUgraph last_graph = nullptr;
std::vector<std::string> launch_log;
int fake_ctx_storage = 0;
thread_local CUcontext current = nullptr;

Node* find_node(Graph* g, CUgraphNode n) {
  for (auto& p : g->nodes)
    if (p.get() == reinterpret_cast<Node*>(n)) return p.get();
  return nullptr;
}
size_t index_of(const Graph* g, const Node* n) {
  for (size_t i = 0; i < g->nodes.size(); ++i)
    if (g->nodes[i].get() == n) return i;
  return SIZE_MAX;
}

std::string hex(const std::vector<uint8_t>& b) {
  std::string s;
  char t[3];
  for (uint8_t c : b) {
    std::snprintf(t, sizeof t, "%02x", c);
    s += t;
  }
  return s;
}

std::string describe(const Node& n) {
  std::ostringstream o;
  switch (n.type) {
    case CU_GRAPH_NODE_TYPE_KERNEL:
      o << "K " << n.func->name << " g=" << n.grid[0] << "," << n.grid[1] << "," << n.grid[2]
        << " b=" << n.block[0] << "," << n.block[1] << "," << n.block[2] << " s=" << n.smem
        << " p=" << hex(n.params);
      break;
    case CU_GRAPH_NODE_TYPE_MEMCPY:
      o << "C " << n.copy.srcDevice << "->" << n.copy.dstDevice << " w=" << n.copy.WidthInBytes;
      break;
    case CU_GRAPH_NODE_TYPE_MEMSET:
      o << "S " << n.set.dst << " v=" << n.set.value << " w=" << n.set.width;
      break;
    case CU_GRAPH_NODE_TYPE_EVENT_RECORD: o << "R"; break;
    case CU_GRAPH_NODE_TYPE_WAIT_EVENT: o << "W"; break;
    default: o << "E"; break;
  }
  return o.str();
}

CUresult set_kernel(Node& n, const CUDA_KERNEL_NODE_PARAMS* p) {
  if (p->func == nullptr) return CUDA_ERROR_INVALID_VALUE;
  Func* f = reinterpret_cast<Func*>(p->func);
  n.type = CU_GRAPH_NODE_TYPE_KERNEL;
  n.func = f;
  n.grid[0] = p->gridDimX; n.grid[1] = p->gridDimY; n.grid[2] = p->gridDimZ;
  n.block[0] = p->blockDimX; n.block[1] = p->blockDimY; n.block[2] = p->blockDimZ;
  n.smem = p->sharedMemBytes;
  size_t total = 0;
  for (auto [off, size] : f->params) total = std::max(total, off + size);
  n.params.assign(total, 0);
  if (!f->params.empty() && p->kernelParams == nullptr) return CUDA_ERROR_INVALID_VALUE;
  for (size_t i = 0; i < f->params.size(); ++i)
    std::memcpy(n.params.data() + f->params[i].first, p->kernelParams[i], f->params[i].second);
  n.param_ptrs.clear();
  for (auto [off, size] : f->params) n.param_ptrs.push_back(n.params.data() + off);
  return CUDA_SUCCESS;
}

Node* add(CUgraphNode* out, CUgraph g) {
  auto* graph = reinterpret_cast<Graph*>(g);
  graph->nodes.push_back(std::make_unique<Node>());
  *out = reinterpret_cast<CUgraphNode>(graph->nodes.back().get());
  return graph->nodes.back().get();
}

CUresult deps(CUgraph g, CUgraphNode to, const CUgraphNode* d, size_t n) {
  auto* graph = reinterpret_cast<Graph*>(g);
  for (size_t i = 0; i < n; ++i)
    graph->edges.push_back({reinterpret_cast<Node*>(d[i]), reinterpret_cast<Node*>(to), {}});
  return CUDA_SUCCESS;
}

// ---------------------------------------------------------------- basics, devices, contexts
CUresult not_supported() { return CUDA_ERROR_NOT_SUPPORTED; }
CUresult driver_get_version(int* v) { *v = 13000; return CUDA_SUCCESS; }
CUresult init(unsigned) { return CUDA_SUCCESS; }
CUresult device_get_count(int* n) { *n = 1; return CUDA_SUCCESS; }
CUresult device_get(CUdevice* d, int ordinal) { *d = ordinal; return ordinal == 0 ? CUDA_SUCCESS : CUDA_ERROR_INVALID_DEVICE; }
CUresult primary_retain(CUcontext* c, CUdevice) {
  *c = reinterpret_cast<CUcontext>(&fake_ctx_storage);
  return CUDA_SUCCESS;
}
CUresult ctx_get_current(CUcontext* c) { *c = current; return CUDA_SUCCESS; }
CUresult ctx_set_current(CUcontext c) { current = c; return CUDA_SUCCESS; }
CUresult ctx_synchronize() { return current ? CUDA_SUCCESS : CUDA_ERROR_INVALID_CONTEXT; }
const char* name_of(CUresult r) {
  switch (r) {
    case CUDA_SUCCESS: return "CUDA_SUCCESS";
    case CUDA_ERROR_INVALID_VALUE: return "CUDA_ERROR_INVALID_VALUE";
    case CUDA_ERROR_NOT_FOUND: return "CUDA_ERROR_NOT_FOUND";
    case CUDA_ERROR_INVALID_CONTEXT: return "CUDA_ERROR_INVALID_CONTEXT";
    case CUDA_ERROR_INVALID_IMAGE: return "CUDA_ERROR_INVALID_IMAGE";
    case CUDA_ERROR_NOT_SUPPORTED: return "CUDA_ERROR_NOT_SUPPORTED";
    default: return nullptr;
  }
}
CUresult get_error_name(CUresult r, const char** s) { *s = name_of(r); return *s ? CUDA_SUCCESS : CUDA_ERROR_INVALID_VALUE; }
CUresult get_error_string(CUresult r, const char** s) { *s = name_of(r) ? "fake graph driver" : nullptr; return *s ? CUDA_SUCCESS : CUDA_ERROR_INVALID_VALUE; }
CUresult event_create(CUevent* e, unsigned) {
  std::lock_guard<std::mutex> l(mu);
  static int next = 0;
  *e = reinterpret_cast<CUevent>(new Event{next++});
  ++live_events;
  return CUDA_SUCCESS;
}
CUresult event_destroy(CUevent e) {
  std::lock_guard<std::mutex> l(mu);
  delete reinterpret_cast<Event*>(e);
  --live_events;
  return CUDA_SUCCESS;
}
CUresult pointer_get_attribute(void* out, CUpointer_attribute a, CUdeviceptr) {
  if (a != CU_POINTER_ATTRIBUTE_MEMORY_TYPE) return CUDA_ERROR_NOT_SUPPORTED;
  *static_cast<unsigned*>(out) = CU_MEMORYTYPE_DEVICE;
  return CUDA_SUCCESS;
}

// ------------------------------------------------------------------------ modules, functions
CUresult module_load_data(CUmodule* out, const void* image) {
  if (current == nullptr) return CUDA_ERROR_INVALID_CONTEXT;
  std::istringstream in(static_cast<const char*>(image));
  auto m = std::make_unique<Module>();
  std::string line;
  while (std::getline(in, line)) {
    const size_t e = line.find(".entry ");
    if (e == std::string::npos) continue;
    auto f = std::make_unique<Func>();
    std::istringstream ls(line.substr(e + 7));
    ls >> f->name;
    const size_t p = line.find("// params");
    if (p != std::string::npos) {
      std::istringstream ps(line.substr(p + 9));
      std::string tok;
      while (ps >> tok) {
        const size_t c = tok.find(':');
        f->params.push_back({std::stoul(tok.substr(0, c)), std::stoul(tok.substr(c + 1))});
      }
    }
    f->module = m.get();
    m->funcs.push_back(std::move(f));
  }
  if (m->funcs.empty()) return CUDA_ERROR_INVALID_IMAGE;
  std::lock_guard<std::mutex> l(mu);
  ++live_modules;
  *out = reinterpret_cast<CUmodule>(m.release());
  return CUDA_SUCCESS;
}
CUresult module_unload(CUmodule m) {
  std::lock_guard<std::mutex> l(mu);
  delete reinterpret_cast<Module*>(m);
  --live_modules;
  return CUDA_SUCCESS;
}
CUresult module_get_function(CUfunction* f, CUmodule m, const char* name) {
  for (auto& fn : reinterpret_cast<Module*>(m)->funcs)
    if (fn->name == name) {
      *f = reinterpret_cast<CUfunction>(fn.get());
      return CUDA_SUCCESS;
    }
  return CUDA_ERROR_NOT_FOUND;
}
CUresult module_get_function_count(unsigned* n, CUmodule m) {
  *n = unsigned(reinterpret_cast<Module*>(m)->funcs.size());
  return CUDA_SUCCESS;
}
CUresult module_enumerate_functions(CUfunction* fs, unsigned n, CUmodule m) {
  auto& v = reinterpret_cast<Module*>(m)->funcs;
  for (unsigned i = 0; i < n && i < v.size(); ++i) fs[i] = reinterpret_cast<CUfunction>(v[i].get());
  return CUDA_SUCCESS;
}
CUresult func_get_module(CUmodule* m, CUfunction f) {
  *m = reinterpret_cast<CUmodule>(reinterpret_cast<Func*>(f)->module);
  return CUDA_SUCCESS;
}
CUresult func_get_name(const char** s, CUfunction f) {
  *s = reinterpret_cast<Func*>(f)->name.c_str();
  return CUDA_SUCCESS;
}
CUresult func_get_param_info(CUfunction f, size_t i, size_t* off, size_t* size) {
  auto& p = reinterpret_cast<Func*>(f)->params;
  if (i >= p.size()) return CUDA_ERROR_INVALID_VALUE;
  *off = p[i].first;
  if (size) *size = p[i].second;
  return CUDA_SUCCESS;
}
CUresult func_get_attribute(int* v, CUfunction_attribute a, CUfunction f) {
  std::lock_guard<std::mutex> l(mu);  // the real driver is thread-safe; so is the fake
  auto& attrs = reinterpret_cast<Func*>(f)->attrs;
  auto it = attrs.find(a);
  *v = it != attrs.end() ? it->second : (a == CU_FUNC_ATTRIBUTE_PREFERRED_SHARED_MEMORY_CARVEOUT ? -1 : 0);
  return CUDA_SUCCESS;
}
CUresult func_set_attribute(CUfunction f, CUfunction_attribute a, int v) {
  std::lock_guard<std::mutex> l(mu);
  reinterpret_cast<Func*>(f)->attrs[a] = v;
  return CUDA_SUCCESS;
}

// -------------------------------------------------------------------------------- graphs
CUresult graph_create(CUgraph* g, unsigned) {
  std::lock_guard<std::mutex> l(mu);
  *g = reinterpret_cast<CUgraph>(new Graph());
  last_graph = *g;
  ++live_graphs;
  return CUDA_SUCCESS;
}
CUresult graph_destroy(CUgraph g) {
  std::lock_guard<std::mutex> l(mu);
  delete reinterpret_cast<Graph*>(g);
  --live_graphs;
  if (last_graph == g) last_graph = nullptr;
  return CUDA_SUCCESS;
}
CUresult add_kernel(CUgraphNode* out, CUgraph g, const CUgraphNode* d, size_t nd, const CUDA_KERNEL_NODE_PARAMS* p) {
  Node* n = add(out, g);
  if (CUresult r = set_kernel(*n, p); r != CUDA_SUCCESS) return r;
  return deps(g, *out, d, nd);
}
CUresult add_memcpy(CUgraphNode* out, CUgraph g, const CUgraphNode* d, size_t nd, const CUDA_MEMCPY3D* c, CUcontext ctx) {
  if (ctx == nullptr) return CUDA_ERROR_INVALID_CONTEXT;
  Node* n = add(out, g);
  n->type = CU_GRAPH_NODE_TYPE_MEMCPY;
  n->copy = *c;
  return deps(g, *out, d, nd);
}
CUresult add_memset(CUgraphNode* out, CUgraph g, const CUgraphNode* d, size_t nd, const CUDA_MEMSET_NODE_PARAMS* s, CUcontext ctx) {
  if (ctx == nullptr) return CUDA_ERROR_INVALID_CONTEXT;
  Node* n = add(out, g);
  n->type = CU_GRAPH_NODE_TYPE_MEMSET;
  n->set = *s;
  return deps(g, *out, d, nd);
}
CUresult add_record(CUgraphNode* out, CUgraph g, const CUgraphNode* d, size_t nd, CUevent e) {
  Node* n = add(out, g);
  n->type = CU_GRAPH_NODE_TYPE_EVENT_RECORD;
  n->event = e;
  return deps(g, *out, d, nd);
}
CUresult add_wait(CUgraphNode* out, CUgraph g, const CUgraphNode* d, size_t nd, CUevent e) {
  Node* n = add(out, g);
  n->type = CU_GRAPH_NODE_TYPE_WAIT_EVENT;
  n->event = e;
  return deps(g, *out, d, nd);
}
CUresult add_empty(CUgraphNode* out, CUgraph g, const CUgraphNode* d, size_t nd) {
  add(out, g);
  return deps(g, *out, d, nd);
}
CUresult add_child(CUgraphNode* out, CUgraph g, const CUgraphNode* d, size_t nd, CUgraph) {
  Node* n = add(out, g);
  n->type = CU_GRAPH_NODE_TYPE_GRAPH;
  return deps(g, *out, d, nd);
}
CUresult add_dependencies(CUgraph g, const CUgraphNode* from, const CUgraphNode* to, const CUgraphEdgeData* data, size_t n) {
  auto* graph = reinterpret_cast<Graph*>(g);
  for (size_t i = 0; i < n; ++i) {
    Node* a = find_node(graph, from[i]);
    Node* b = find_node(graph, to[i]);
    if (!a || !b || a == b) return CUDA_ERROR_INVALID_VALUE;
    graph->edges.push_back({a, b, data ? data[i] : CUgraphEdgeData{}});
  }
  return CUDA_SUCCESS;
}
CUresult kernel_set_attribute(CUgraphNode n, CUkernelNodeAttrID id, const CUkernelNodeAttrValue* v) {
  reinterpret_cast<Node*>(n)->attrs[id] = *v;
  return CUDA_SUCCESS;
}
CUresult kernel_get_attribute(CUgraphNode n, CUkernelNodeAttrID id, CUkernelNodeAttrValue* v) {
  auto& a = reinterpret_cast<Node*>(n)->attrs;
  auto it = a.find(id);
  if (it != a.end()) *v = it->second;
  else std::memset(v, 0, sizeof *v);
  return CUDA_SUCCESS;
}
CUresult get_nodes(CUgraph g, CUgraphNode* out, size_t* n) {
  auto* graph = reinterpret_cast<Graph*>(g);
  if (out != nullptr)
    for (size_t i = 0; i < *n && i < graph->nodes.size(); ++i)
      out[i] = reinterpret_cast<CUgraphNode>(graph->nodes[i].get());
  *n = graph->nodes.size();
  return CUDA_SUCCESS;
}
CUresult get_edges(CUgraph g, CUgraphNode* from, CUgraphNode* to, CUgraphEdgeData* data, size_t* n) {
  auto* graph = reinterpret_cast<Graph*>(g);
  if (from != nullptr)
    for (size_t i = 0; i < *n && i < graph->edges.size(); ++i) {
      from[i] = reinterpret_cast<CUgraphNode>(graph->edges[i].from);
      to[i] = reinterpret_cast<CUgraphNode>(graph->edges[i].to);
      if (data) data[i] = graph->edges[i].data;
    }
  *n = graph->edges.size();
  return CUDA_SUCCESS;
}
CUresult node_get_type(CUgraphNode n, CUgraphNodeType* t) {
  *t = reinterpret_cast<Node*>(n)->type;
  return CUDA_SUCCESS;
}
CUresult kernel_get_params(CUgraphNode hn, CUDA_KERNEL_NODE_PARAMS* p) {
  Node* n = reinterpret_cast<Node*>(hn);
  std::memset(p, 0, sizeof *p);
  p->func = reinterpret_cast<CUfunction>(n->func);
  p->gridDimX = n->grid[0]; p->gridDimY = n->grid[1]; p->gridDimZ = n->grid[2];
  p->blockDimX = n->block[0]; p->blockDimY = n->block[1]; p->blockDimZ = n->block[2];
  p->sharedMemBytes = n->smem;
  p->kernelParams = n->param_ptrs.empty() ? nullptr : n->param_ptrs.data();
  return CUDA_SUCCESS;
}
CUresult memcpy_get_params(CUgraphNode n, CUDA_MEMCPY3D* c) { *c = reinterpret_cast<Node*>(n)->copy; return CUDA_SUCCESS; }
CUresult memset_get_params(CUgraphNode n, CUDA_MEMSET_NODE_PARAMS* s) { *s = reinterpret_cast<Node*>(n)->set; return CUDA_SUCCESS; }
CUresult record_get_event(CUgraphNode n, CUevent* e) { *e = reinterpret_cast<Node*>(n)->event; return CUDA_SUCCESS; }

CUresult instantiate(CUgraphExec* out, CUgraph g, unsigned long long) {
  auto* graph = reinterpret_cast<Graph*>(g);
  auto* e = new Exec{graph, {}};
  for (auto& n : graph->nodes) e->state.push_back(*n);
  std::lock_guard<std::mutex> l(mu);
  ++live_execs;
  *out = reinterpret_cast<CUgraphExec>(e);
  return CUDA_SUCCESS;
}
CUresult exec_destroy(CUgraphExec e) {
  std::lock_guard<std::mutex> l(mu);
  delete reinterpret_cast<Exec*>(e);
  --live_execs;
  return CUDA_SUCCESS;
}
CUresult exec_kernel_set(CUgraphExec he, CUgraphNode hn, const CUDA_KERNEL_NODE_PARAMS* p) {
  Exec* e = reinterpret_cast<Exec*>(he);
  const size_t i = index_of(e->graph, reinterpret_cast<Node*>(hn));
  if (i == SIZE_MAX || e->state[i].type != CU_GRAPH_NODE_TYPE_KERNEL) return CUDA_ERROR_INVALID_VALUE;
  std::lock_guard<std::mutex> l(mu);
  ++exec_updates;
  return set_kernel(e->state[i], p);
}
CUresult exec_memcpy_set(CUgraphExec he, CUgraphNode hn, const CUDA_MEMCPY3D* c, CUcontext) {
  Exec* e = reinterpret_cast<Exec*>(he);
  const size_t i = index_of(e->graph, reinterpret_cast<Node*>(hn));
  if (i == SIZE_MAX || e->state[i].type != CU_GRAPH_NODE_TYPE_MEMCPY) return CUDA_ERROR_INVALID_VALUE;
  std::lock_guard<std::mutex> l(mu);
  ++exec_updates;
  e->state[i].copy = *c;
  return CUDA_SUCCESS;
}
CUresult exec_memset_set(CUgraphExec he, CUgraphNode hn, const CUDA_MEMSET_NODE_PARAMS* s, CUcontext) {
  Exec* e = reinterpret_cast<Exec*>(he);
  const size_t i = index_of(e->graph, reinterpret_cast<Node*>(hn));
  if (i == SIZE_MAX || e->state[i].type != CU_GRAPH_NODE_TYPE_MEMSET) return CUDA_ERROR_INVALID_VALUE;
  std::lock_guard<std::mutex> l(mu);
  ++exec_updates;
  e->state[i].set = *s;
  return CUDA_SUCCESS;
}
CUresult launch(CUgraphExec he, CUstream) {
  if (current == nullptr) return CUDA_ERROR_INVALID_CONTEXT;
  Exec* e = reinterpret_cast<Exec*>(he);
  std::string s;
  for (const Node& n : e->state) s += describe(n) + ";";
  std::lock_guard<std::mutex> l(mu);
  launch_log.push_back(s);
  return CUDA_SUCCESS;
}

}  // namespace

#define EXPORT extern "C" __attribute__((visibility("default")))

EXPORT CUresult cuGetProcAddress_v2(const char* symbol, void** pfn, int, cuuint64_t,
                                    CUdriverProcAddressQueryResult* st) {
  static const std::map<std::string, void*> table = {
      {"cuDriverGetVersion", (void*)&driver_get_version},
      {"cuInit", (void*)&init},
      {"cuGetErrorName", (void*)&get_error_name},
      {"cuGetErrorString", (void*)&get_error_string},
      {"cuDeviceGetCount", (void*)&device_get_count},
      {"cuDeviceGet", (void*)&device_get},
      {"cuDevicePrimaryCtxRetain", (void*)&primary_retain},
      {"cuCtxGetCurrent", (void*)&ctx_get_current},
      {"cuCtxSetCurrent", (void*)&ctx_set_current},
      {"cuCtxSynchronize", (void*)&ctx_synchronize},
      {"cuEventCreate", (void*)&event_create},
      {"cuEventDestroy", (void*)&event_destroy},
      {"cuPointerGetAttribute", (void*)&pointer_get_attribute},
      {"cuModuleLoadData", (void*)&module_load_data},
      {"cuModuleUnload", (void*)&module_unload},
      {"cuModuleGetFunction", (void*)&module_get_function},
      {"cuModuleGetFunctionCount", (void*)&module_get_function_count},
      {"cuModuleEnumerateFunctions", (void*)&module_enumerate_functions},
      {"cuFuncGetModule", (void*)&func_get_module},
      {"cuFuncGetName", (void*)&func_get_name},
      {"cuFuncGetParamInfo", (void*)&func_get_param_info},
      {"cuFuncGetAttribute", (void*)&func_get_attribute},
      {"cuFuncSetAttribute", (void*)&func_set_attribute},
      {"cuGraphCreate", (void*)&graph_create},
      {"cuGraphDestroy", (void*)&graph_destroy},
      {"cuGraphAddKernelNode", (void*)&add_kernel},
      {"cuGraphAddMemcpyNode", (void*)&add_memcpy},
      {"cuGraphAddMemsetNode", (void*)&add_memset},
      {"cuGraphAddEventRecordNode", (void*)&add_record},
      {"cuGraphAddEventWaitNode", (void*)&add_wait},
      {"cuGraphAddEmptyNode", (void*)&add_empty},
      {"cuGraphAddChildGraphNode", (void*)&add_child},
      {"cuGraphAddDependencies", (void*)&add_dependencies},
      {"cuGraphKernelNodeSetAttribute", (void*)&kernel_set_attribute},
      {"cuGraphKernelNodeGetAttribute", (void*)&kernel_get_attribute},
      {"cuGraphGetNodes", (void*)&get_nodes},
      {"cuGraphGetEdges", (void*)&get_edges},
      {"cuGraphNodeGetType", (void*)&node_get_type},
      {"cuGraphKernelNodeGetParams", (void*)&kernel_get_params},
      {"cuGraphMemcpyNodeGetParams", (void*)&memcpy_get_params},
      {"cuGraphMemsetNodeGetParams", (void*)&memset_get_params},
      {"cuGraphEventRecordNodeGetEvent", (void*)&record_get_event},
      {"cuGraphEventWaitNodeGetEvent", (void*)&record_get_event},
      {"cuGraphInstantiateWithFlags", (void*)&instantiate},
      {"cuGraphExecDestroy", (void*)&exec_destroy},
      {"cuGraphExecKernelNodeSetParams", (void*)&exec_kernel_set},
      {"cuGraphExecMemcpyNodeSetParams", (void*)&exec_memcpy_set},
      {"cuGraphExecMemsetNodeSetParams", (void*)&exec_memset_set},
      {"cuGraphLaunch", (void*)&launch},
  };
  auto it = table.find(symbol);
  *pfn = it != table.end() ? it->second : (void*)&not_supported;
  if (st) *st = CU_GET_PROC_ADDRESS_SUCCESS;
  return CUDA_SUCCESS;
}

// Test hooks.
EXPORT int fake_graph_live(const char* what) {
  std::lock_guard<std::mutex> l(mu);
  const std::string w = what;
  return w == "graphs" ? live_graphs : w == "execs" ? live_execs : w == "modules" ? live_modules
       : w == "events" ? live_events : w == "exec_updates" ? exec_updates : -1;
}
EXPORT CUgraph fake_graph_last() {
  std::lock_guard<std::mutex> l(mu);
  return last_graph;
}
EXPORT size_t fake_graph_launches() {
  std::lock_guard<std::mutex> l(mu);
  return launch_log.size();
}
EXPORT const char* fake_graph_launch(size_t i) {
  std::lock_guard<std::mutex> l(mu);
  return i < launch_log.size() ? launch_log[i].c_str() : nullptr;
}
