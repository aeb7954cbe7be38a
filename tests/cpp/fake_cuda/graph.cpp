// Graphs, modules and functions of the fake driver: enough of the API to run vitrify's graph
// capture (csrc/src/graph/capture.cpp) and rebuild (rebuild.cpp) logic without a GPU. Graphs,
// nodes, executables and modules are plain host objects; a launch appends the executable's
// effective node parameters, as text, to a log the tests read (fake_graph_* hooks below).
// cuPointerGetAttribute calls every address device memory (what the capture's checks need).
//
// Module images are PTX-like text: ".entry NAME ( // params OFF:SIZE OFF:SIZE ..." per kernel.
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <sstream>
#include <string>
#include <vector>

#include "fake_cuda.hpp"

namespace fake {
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

// Live object counts (leak checks), counters, the launch log.
int live_graphs = 0, live_execs = 0, live_modules = 0;
int exec_updates = 0;
CUgraph last_graph = nullptr;
std::vector<std::string> launch_log;

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

CUresult pointer_get_attribute(void* out, CUpointer_attribute a, CUdeviceptr) {
  if (a != CU_POINTER_ATTRIBUTE_MEMORY_TYPE) return CUDA_ERROR_NOT_SUPPORTED;
  *static_cast<unsigned*>(out) = CU_MEMORYTYPE_DEVICE;
  return CUDA_SUCCESS;
}

// ------------------------------------------------------------------------ modules, functions
// Like the driver, the fake never trusts an image: anything it cannot parse is
// CUDA_ERROR_INVALID_IMAGE (never an exception or a read past the image), and a null module or
// name is an error code, never a dereference. ELF (cubin) and fatbin images are not
// NUL-terminated text, so the fake refuses them by their magic without scanning them.
bool parse_size(const std::string& text, size_t& out) {
  if (text.empty() || text.size() > 12 || text.find_first_not_of("0123456789") != std::string::npos)
    return false;
  out = static_cast<size_t>(std::stoull(text));
  return true;
}

CUresult parse_image(const char* image, Module& m) {
  const unsigned char* u = reinterpret_cast<const unsigned char*>(image);
  if (u[0] == 0x7F && u[1] == 'E' && u[2] == 'L' && u[3] == 'F') return CUDA_ERROR_INVALID_IMAGE;
  if (u[0] == 0x50 && u[1] == 0xED && u[2] == 0x55 && u[3] == 0xBA) return CUDA_ERROR_INVALID_IMAGE;
  std::istringstream in(image);
  std::string line;
  while (std::getline(in, line)) {
    const size_t e = line.find(".entry ");
    if (e == std::string::npos) continue;
    auto f = std::make_unique<Func>();
    std::istringstream ls(line.substr(e + 7));
    ls >> f->name;
    if (f->name.empty() || f->name == "(" || f->name == "//") return CUDA_ERROR_INVALID_IMAGE;
    const size_t p = line.find("// params");
    if (p != std::string::npos) {
      std::istringstream ps(line.substr(p + 9));
      std::string tok;
      while (ps >> tok) {
        const size_t c = tok.find(':');
        size_t off = 0, size = 0;
        if (c == std::string::npos || !parse_size(tok.substr(0, c), off) ||
            !parse_size(tok.substr(c + 1), size) || size == 0 || off > (size_t{1} << 20) ||
            size > (size_t{1} << 20))
          return CUDA_ERROR_INVALID_IMAGE;
        f->params.push_back({off, size});
      }
    }
    f->module = &m;
    m.funcs.push_back(std::move(f));
  }
  return m.funcs.empty() ? CUDA_ERROR_INVALID_IMAGE : CUDA_SUCCESS;
}

CUresult module_load_data(CUmodule* out, const void* image) {
  if (out == nullptr || image == nullptr) return CUDA_ERROR_INVALID_VALUE;
  if (need_context() != CUDA_SUCCESS) return CUDA_ERROR_INVALID_CONTEXT;
  auto m = std::make_unique<Module>();
  CUresult r;
  try {
    r = parse_image(static_cast<const char*>(image), *m);
  } catch (...) {  // out of memory while parsing: what the driver would say
    r = CUDA_ERROR_OUT_OF_MEMORY;
  }
  if (r != CUDA_SUCCESS) return r;
  std::lock_guard<std::mutex> l(mu);
  ++live_modules;
  *out = reinterpret_cast<CUmodule>(m.release());
  return CUDA_SUCCESS;
}
CUresult module_unload(CUmodule m) {
  if (m == nullptr) return CUDA_ERROR_INVALID_HANDLE;
  std::lock_guard<std::mutex> l(mu);
  delete reinterpret_cast<Module*>(m);
  --live_modules;
  return CUDA_SUCCESS;
}
CUresult module_get_function(CUfunction* f, CUmodule m, const char* name) {
  if (f == nullptr || name == nullptr) return CUDA_ERROR_INVALID_VALUE;
  if (m == nullptr) return CUDA_ERROR_INVALID_HANDLE;
  for (auto& fn : reinterpret_cast<Module*>(m)->funcs)
    if (fn->name == name) {
      *f = reinterpret_cast<CUfunction>(fn.get());
      return CUDA_SUCCESS;
    }
  return CUDA_ERROR_NOT_FOUND;
}
CUresult module_get_function_count(unsigned* n, CUmodule m) {
  if (n == nullptr) return CUDA_ERROR_INVALID_VALUE;
  if (m == nullptr) return CUDA_ERROR_INVALID_HANDLE;
  *n = unsigned(reinterpret_cast<Module*>(m)->funcs.size());
  return CUDA_SUCCESS;
}
CUresult module_enumerate_functions(CUfunction* fs, unsigned n, CUmodule m) {
  if (fs == nullptr && n != 0) return CUDA_ERROR_INVALID_VALUE;
  if (m == nullptr) return CUDA_ERROR_INVALID_HANDLE;
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
  if (need_context() != CUDA_SUCCESS) return CUDA_ERROR_INVALID_CONTEXT;
  Exec* e = reinterpret_cast<Exec*>(he);
  std::string s;
  for (const Node& n : e->state) s += describe(n) + ";";
  std::lock_guard<std::mutex> l(mu);
  launch_log.push_back(s);
  return CUDA_SUCCESS;
}

FAKE_CUDA_ENTRIES({
    {"cuPointerGetAttribute", FAKE_FN(pointer_get_attribute)},
    {"cuModuleLoadData", FAKE_FN(module_load_data)},
    {"cuModuleUnload", FAKE_FN(module_unload)},
    {"cuModuleGetFunction", FAKE_FN(module_get_function)},
    {"cuModuleGetFunctionCount", FAKE_FN(module_get_function_count)},
    {"cuModuleEnumerateFunctions", FAKE_FN(module_enumerate_functions)},
    {"cuFuncGetModule", FAKE_FN(func_get_module)},
    {"cuFuncGetName", FAKE_FN(func_get_name)},
    {"cuFuncGetParamInfo", FAKE_FN(func_get_param_info)},
    {"cuFuncGetAttribute", FAKE_FN(func_get_attribute)},
    {"cuFuncSetAttribute", FAKE_FN(func_set_attribute)},
    {"cuGraphCreate", FAKE_FN(graph_create)},
    {"cuGraphDestroy", FAKE_FN(graph_destroy)},
    {"cuGraphAddKernelNode", FAKE_FN(add_kernel)},
    {"cuGraphAddMemcpyNode", FAKE_FN(add_memcpy)},
    {"cuGraphAddMemsetNode", FAKE_FN(add_memset)},
    {"cuGraphAddEventRecordNode", FAKE_FN(add_record)},
    {"cuGraphAddEventWaitNode", FAKE_FN(add_wait)},
    {"cuGraphAddEmptyNode", FAKE_FN(add_empty)},
    {"cuGraphAddChildGraphNode", FAKE_FN(add_child)},
    {"cuGraphAddDependencies", FAKE_FN(add_dependencies)},
    {"cuGraphKernelNodeSetAttribute", FAKE_FN(kernel_set_attribute)},
    {"cuGraphKernelNodeGetAttribute", FAKE_FN(kernel_get_attribute)},
    {"cuGraphGetNodes", FAKE_FN(get_nodes)},
    {"cuGraphGetEdges", FAKE_FN(get_edges)},
    {"cuGraphNodeGetType", FAKE_FN(node_get_type)},
    {"cuGraphKernelNodeGetParams", FAKE_FN(kernel_get_params)},
    {"cuGraphMemcpyNodeGetParams", FAKE_FN(memcpy_get_params)},
    {"cuGraphMemsetNodeGetParams", FAKE_FN(memset_get_params)},
    {"cuGraphEventRecordNodeGetEvent", FAKE_FN(record_get_event)},
    {"cuGraphEventWaitNodeGetEvent", FAKE_FN(record_get_event)},
    {"cuGraphInstantiateWithFlags", FAKE_FN(instantiate)},
    {"cuGraphExecDestroy", FAKE_FN(exec_destroy)},
    {"cuGraphExecKernelNodeSetParams", FAKE_FN(exec_kernel_set)},
    {"cuGraphExecMemcpyNodeSetParams", FAKE_FN(exec_memcpy_set)},
    {"cuGraphExecMemsetNodeSetParams", FAKE_FN(exec_memset_set)},
    {"cuGraphLaunch", FAKE_FN(launch)},
});

}  // namespace
}  // namespace fake

// ---- test hooks -------------------------------------------------------------------------------
// Live objects and counters by name: graphs, execs, modules, events, exec_updates (-1: unknown).
FAKE_EXPORT int fake_graph_live(const char* what) {
  const std::string w = what;
  if (w == "events") return fake::live_events();
  std::lock_guard<std::mutex> l(fake::mu);
  return w == "graphs" ? fake::live_graphs : w == "execs" ? fake::live_execs
       : w == "modules" ? fake::live_modules : w == "exec_updates" ? fake::exec_updates : -1;
}
// The graph created last (nullptr once destroyed).
FAKE_EXPORT CUgraph fake_graph_last() {
  std::lock_guard<std::mutex> l(fake::mu);
  return fake::last_graph;
}
// The launch log: how many launches, and launch i's node parameters as text.
FAKE_EXPORT size_t fake_graph_launches() {
  std::lock_guard<std::mutex> l(fake::mu);
  return fake::launch_log.size();
}
FAKE_EXPORT const char* fake_graph_launch(size_t i) {
  std::lock_guard<std::mutex> l(fake::mu);
  return i < fake::launch_log.size() ? fake::launch_log[i].c_str() : nullptr;
}
