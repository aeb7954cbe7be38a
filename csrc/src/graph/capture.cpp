// FREEZE: a captured CUgraph -> vitrify::graph::Graph (see DESIGN.md, "Walking a captured graph").
#include <algorithm>
#include <cstring>
#include <optional>
#include <set>
#include <unordered_map>

#include "graph/cuda_util.hpp"
#include "vitrify/graph_cuda.hpp"
#include "vitrify/log.hpp"

namespace vitrify::graph {
namespace {

const char* node_type_name(CUgraphNodeType t) {
  switch (t) {
    case CU_GRAPH_NODE_TYPE_KERNEL: return "kernel";
    case CU_GRAPH_NODE_TYPE_MEMCPY: return "memcpy";
    case CU_GRAPH_NODE_TYPE_MEMSET: return "memset";
    case CU_GRAPH_NODE_TYPE_HOST: return "host (CPU callback)";
    case CU_GRAPH_NODE_TYPE_GRAPH: return "child graph";
    case CU_GRAPH_NODE_TYPE_EMPTY: return "empty";
    case CU_GRAPH_NODE_TYPE_WAIT_EVENT: return "event wait";
    case CU_GRAPH_NODE_TYPE_EVENT_RECORD: return "event record";
    case CU_GRAPH_NODE_TYPE_EXT_SEMAS_SIGNAL: return "external semaphore signal";
    case CU_GRAPH_NODE_TYPE_EXT_SEMAS_WAIT: return "external semaphore wait";
    case CU_GRAPH_NODE_TYPE_MEM_ALLOC: return "memory allocation";
    case CU_GRAPH_NODE_TYPE_MEM_FREE: return "memory free";
    case CU_GRAPH_NODE_TYPE_BATCH_MEM_OP: return "batch memory operation";
    case CU_GRAPH_NODE_TYPE_CONDITIONAL: return "conditional";
    default: return "unknown";
  }
}

// Launch attributes carried over to the rebuilt node; values that are all zero are defaults.
constexpr CUlaunchAttributeID kNodeAttributes[] = {
    CU_LAUNCH_ATTRIBUTE_COOPERATIVE,
    CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION,
    CU_LAUNCH_ATTRIBUTE_CLUSTER_SCHEDULING_POLICY_PREFERENCE,
    CU_LAUNCH_ATTRIBUTE_PRIORITY,
    CU_LAUNCH_ATTRIBUTE_MEM_SYNC_DOMAIN_MAP,
    CU_LAUNCH_ATTRIBUTE_MEM_SYNC_DOMAIN,
};

// Function attributes the reloaded function needs (set with cuFuncSetAttribute at THAW), with
// the value that means "not set".
struct FuncAttr {
  CUfunction_attribute id;
  int unset;
};
constexpr FuncAttr kFuncAttributes[] = {
    {CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, 0},
    {CU_FUNC_ATTRIBUTE_PREFERRED_SHARED_MEMORY_CARVEOUT, -1},
    {CU_FUNC_ATTRIBUTE_NON_PORTABLE_CLUSTER_SIZE_ALLOWED, 0},
    {CU_FUNC_ATTRIBUTE_CLUSTER_SCHEDULING_POLICY_PREFERENCE, 0},
};

// Attributes compared to tell apart same-named kernels in different binaries.
constexpr CUfunction_attribute kIdentityAttributes[] = {
    CU_FUNC_ATTRIBUTE_NUM_REGS,         CU_FUNC_ATTRIBUTE_SHARED_SIZE_BYTES,
    CU_FUNC_ATTRIBUTE_CONST_SIZE_BYTES, CU_FUNC_ATTRIBUTE_LOCAL_SIZE_BYTES,
    CU_FUNC_ATTRIBUTE_MAX_THREADS_PER_BLOCK, CU_FUNC_ATTRIBUTE_BINARY_VERSION,
    CU_FUNC_ATTRIBUTE_PTX_VERSION,
};

std::vector<int> identity(CUfunction f) {
  std::vector<int> out;
  for (CUfunction_attribute a : kIdentityAttributes) {
    int v = 0;
    VITRIFY_CU(CU_NEED(cuFuncGetAttribute)(&v, a, f));
    out.push_back(v);
  }
  return out;
}

std::string short_hex(const Hash& h) { return to_hex(h).substr(0, 16); }

// Maps the functions of kernel nodes to recorded binaries, once per function.
class Resolver {
 public:
  Resolver(const ModuleRegistry& m, const CodeBindings* b) : modules_(m), bindings_(b) {}

  // `kern`: the CUkernel the node holds (null for a CUfunction launched from a module).
  Hash resolve(CUfunction f, CUkernel kern, const std::string& name, const std::string& where) {
    auto it = cache_.find(f);
    if (it != cache_.end()) return it->second;
    std::optional<Hash> h = by_handle(f, kern, name, where);
    if (!h) h = by_name(f, name, where);
    cache_.emplace(f, *h);
    return *h;
  }

  size_t by_handle_count() const { return by_handle_; }

 private:
  // The binary the driver loaded this function's code from, through the handles the recorder
  // bound (CodeBindings): the function's module, the kernel's library (exact), then the launched
  // function / kernel handles. A bound binary must be recorded and define `name`, else the
  // binding is stale and ignored; two valid bindings that disagree are a FREEZE error.
  std::optional<Hash> by_handle(CUfunction f, CUkernel kern, const std::string& name,
                                const std::string& where) {
    if (bindings_ == nullptr) return std::nullopt;
    const auto& d = driver::cu();
    std::vector<std::pair<Hash, const char*>> found;
    auto consider = [&](std::optional<Hash> h, const char* via) {
      if (!h) return;
      const auto m = modules_.get(*h);
      if (m == nullptr || !std::binary_search(m->kernels.begin(), m->kernels.end(), name)) return;
      found.emplace_back(*h, via);
    };
    CUmodule mod = nullptr;
    if (d.cuFuncGetModule && d.cuFuncGetModule(&mod, f) == CUDA_SUCCESS && mod != nullptr)
      consider(bindings_->exact(mod), "its module");
    CUlibrary lib = nullptr;
    if (kern != nullptr && d.cuKernelGetLibrary &&
        d.cuKernelGetLibrary(&lib, kern) == CUDA_SUCCESS && lib != nullptr)
      consider(bindings_->exact(lib), "its library");
    consider(bindings_->handle(f), "the launched function");
    if (kern != nullptr) consider(bindings_->handle(kern), "the launched kernel");
    if (found.empty()) return std::nullopt;
    for (const auto& [h, via] : found)
      if (h != found[0].first)
        throw FreezeError(where + ": kernel '" + name + "' is bound to two recorded binaries (" +
                          short_hex(found[0].first) + " through " + found[0].second + ", " +
                          short_hex(h) + " through " + via + "); vitrify cannot tell which one "
                          "this process launched");
    ++by_handle_;
    return found[0].first;
  }

  Hash by_name(CUfunction f, const std::string& name, const std::string& where) {
    std::vector<Hash> c = modules_.modules_with_kernel(name);
    if (c.empty())
      throw FreezeError(where + ": the binary of kernel '" + name + "' was not recorded (" +
                        std::to_string(modules_.size()) + " modules recorded). Start "
                        "vitrify.graph.record_modules() before CUDA is initialised (before the "
                        "first torch.cuda call), and make sure no other CUPTI subscriber (a "
                        "profiler) is active");
    if (c.size() == 1) return c[0];
    // Same-named kernels in several binaries: keep those whose entry names equal the names of
    // the functions in this function's module.
    if (auto siblings = module_function_names(f); !siblings.empty()) {
      std::vector<Hash> keep;
      for (const Hash& h : c)
        if (modules_.get(h)->kernels == siblings) keep.push_back(h);
      if (!keep.empty()) c = keep;
      if (c.size() == 1) return c[0];
    }
    // Identical machine code for this kernel in every remaining binary (a template instantiated
    // in several translation units): any of them runs the same code; take the first.
    {
      auto code_of = [&](const Hash& h) {
        const auto m = modules_.get(h);
        try {
          return kernel_code_hash(m->bytes.data(), m->bytes.size(), name);
        } catch (const std::invalid_argument&) {
          return Hash{};  // a malformed ELF has no fingerprint
        }
      };
      const Hash code = code_of(c[0]);
      bool same = code != Hash{};
      for (size_t i = 1; same && i < c.size(); ++i) same = code_of(c[i]) == code;
      if (same) return c[0];
    }
    // Then load each candidate and compare the function's attributes with this one's.
    const std::vector<int> want = identity(f);
    std::vector<Hash> keep;
    const CodeBindings::Pause pause;  // these probe loads/unloads are ours, not the engine's
    for (const Hash& h : c) {
      auto m = modules_.get(h);
      CUmodule mod = nullptr;
      if (detail::load_module(&mod, *m) != CUDA_SUCCESS) continue;
      CUfunction g = nullptr;
      bool same = false;
      if (CU_NEED(cuModuleGetFunction)(&g, mod, name.c_str()) == CUDA_SUCCESS) {
        try {
          same = identity(g) == want;
        } catch (const CudaError&) {
          same = false;
        }
      }
      CU_NEED(cuModuleUnload)(mod);
      if (same) keep.push_back(h);
    }
    if (keep.size() == 1) return keep[0];
    std::string list;
    for (const Hash& h : (keep.empty() ? c : keep)) list += (list.empty() ? "" : ", ") + short_hex(h);
    throw FreezeError(where + ": kernel '" + name + "' is defined by " +
                      std::to_string(keep.empty() ? c.size() : keep.size()) +
                      " different recorded binaries (" + list +
                      ") and vitrify cannot tell which one this process launched");
  }

  // Sorted names of the functions in f's module; {} when the driver cannot say.
  static std::vector<std::string> module_function_names(CUfunction f) {
    const auto& d = driver::cu();
    if (!d.cuFuncGetModule || !d.cuModuleGetFunctionCount || !d.cuModuleEnumerateFunctions ||
        !d.cuFuncGetName)
      return {};
    CUmodule m = nullptr;
    unsigned count = 0;
    if (d.cuFuncGetModule(&m, f) != CUDA_SUCCESS || m == nullptr ||
        d.cuModuleGetFunctionCount(&count, m) != CUDA_SUCCESS || count == 0)
      return {};
    std::vector<CUfunction> fs(count);
    if (d.cuModuleEnumerateFunctions(fs.data(), count, m) != CUDA_SUCCESS) return {};
    std::vector<std::string> names;
    for (CUfunction g : fs) {
      const char* s = nullptr;
      if (d.cuFuncGetName(&s, g) != CUDA_SUCCESS || s == nullptr) return {};
      names.emplace_back(s);
    }
    std::sort(names.begin(), names.end());
    names.erase(std::unique(names.begin(), names.end()), names.end());
    return names;
  }

  const ModuleRegistry& modules_;
  const CodeBindings* bindings_;
  std::unordered_map<CUfunction, Hash> cache_;
  size_t by_handle_ = 0;
};

uint64_t copy_address(CUmemorytype t, CUdeviceptr dev, const char* which, const std::string& where) {
  if (t == CU_MEMORYTYPE_UNIFIED) {
    // A unified address may be pinned host memory (the runtime captures cudaMemcpyDefault and
    // host copies this way): ask the driver what it is.
    unsigned int actual = 0;
    const CUresult r = driver::cu().cuPointerGetAttribute(&actual, CU_POINTER_ATTRIBUTE_MEMORY_TYPE, dev);
    if (r != CUDA_SUCCESS || actual != CU_MEMORYTYPE_DEVICE)
      throw FreezeError(where + ": memcpy " + which + " " + std::to_string(dev) + " is " +
                        (r != CUDA_SUCCESS ? std::string("not memory the driver knows (pageable "
                                                         "host memory?)")
                                           : "host memory") +
                        "; only copies between device addresses can be frozen (host addresses "
                        "do not survive the process)");
    return dev;
  }
  if (t == CU_MEMORYTYPE_DEVICE) return dev;
  const char* what = t == CU_MEMORYTYPE_HOST    ? "host memory"
                     : t == CU_MEMORYTYPE_ARRAY ? "a CUDA array"
                                                : "an unknown memory type";
  throw FreezeError(where + ": memcpy " + which + " is " + what + " (memory type " +
                    std::to_string(int(t)) + "); only copies between device addresses can be "
                    "frozen (host addresses do not survive the process)");
}

void capture_kernel(CUgraphNode node, Node& out, Resolver& resolver, const std::string& where) {
  CUDA_KERNEL_NODE_PARAMS p{};
  VITRIFY_CU(CU_NEED(cuGraphKernelNodeGetParams)(node, &p));
  CUfunction f = p.func;
  if (f == nullptr && p.kern != nullptr) VITRIFY_CU(CU_NEED(cuKernelGetFunction)(&f, p.kern));
  if (f == nullptr) throw FreezeError(where + ": kernel node has neither a function nor a kernel");
  const char* cname = nullptr;
  VITRIFY_CU(CU_NEED(cuFuncGetName)(&cname, f));
  KernelNode& k = out.kernel;
  k.name = cname != nullptr ? cname : "";
  if (k.name.empty()) throw FreezeError(where + ": the driver returned no name for its kernel");
  const std::string at = where + " (kernel '" + k.name + "')";
  k.module = resolver.resolve(f, p.kern, k.name, where);
  k.grid = {p.gridDimX, p.gridDimY, p.gridDimZ};
  k.block = {p.blockDimX, p.blockDimY, p.blockDimZ};
  k.shared_mem = p.sharedMemBytes;

  // Parameter layout: cuFuncGetParamInfo answers CUDA_ERROR_INVALID_VALUE past the last one.
  size_t total = 0;
  for (size_t i = 0;; ++i) {
    size_t off = 0, size = 0;
    const CUresult r = CU_NEED(cuFuncGetParamInfo)(f, i, &off, &size);
    if (r == CUDA_ERROR_INVALID_VALUE) break;
    VITRIFY_CU(r);
    if (i >= 4096) throw FreezeError(at + ": more than 4096 parameters");
    k.slots.push_back({uint32_t(off), uint32_t(size)});
    total = std::max(total, off + size);
  }
  k.params.assign(total, 0);
  if (!k.slots.empty()) {
    if (p.kernelParams != nullptr) {
      for (size_t i = 0; i < k.slots.size(); ++i) {
        if (p.kernelParams[i] == nullptr)
          throw FreezeError(at + ": parameter " + std::to_string(i) + " has no value");
        std::memcpy(k.params.data() + k.slots[i].offset, p.kernelParams[i], k.slots[i].size);
      }
    } else if (p.extra != nullptr) {
      const void* buf = nullptr;
      size_t buf_size = 0;
      for (size_t i = 0; p.extra[i] != CU_LAUNCH_PARAM_END; i += 2) {
        if (p.extra[i] == CU_LAUNCH_PARAM_BUFFER_POINTER) buf = p.extra[i + 1];
        else if (p.extra[i] == CU_LAUNCH_PARAM_BUFFER_SIZE)
          buf_size = *static_cast<const size_t*>(p.extra[i + 1]);
      }
      if (buf == nullptr || buf_size < total)
        throw FreezeError(at + ": its `extra` parameter buffer holds " +
                          std::to_string(buf_size) + " bytes, the kernel takes " +
                          std::to_string(total));
      std::memcpy(k.params.data(), buf, total);
    } else {
      throw FreezeError(at + ": the node carries no parameter values");
    }
  }

  for (CUlaunchAttributeID id : kNodeAttributes) {
    CUkernelNodeAttrValue v;
    std::memset(&v, 0, sizeof v);
    if (CU_NEED(cuGraphKernelNodeGetAttribute)(node, id, &v) != CUDA_SUCCESS) continue;
    const uint8_t* b = reinterpret_cast<const uint8_t*>(&v);
    size_t len = sizeof v;
    while (len > 0 && b[len - 1] == 0) --len;  // trailing zeros are restored at THAW
    if (len == 0) continue;
    k.attributes.push_back({uint32_t(id), std::vector<uint8_t>(b, b + len)});
  }
  {
    CUkernelNodeAttrValue v;
    std::memset(&v, 0, sizeof v);
    if (CU_NEED(cuGraphKernelNodeGetAttribute)(node, CU_LAUNCH_ATTRIBUTE_ACCESS_POLICY_WINDOW,
                                               &v) == CUDA_SUCCESS &&
        v.accessPolicyWindow.num_bytes != 0)
      throw FreezeError(at + ": has an access policy window (an L2 persistence hint holding a "
                        "device address), which vitrify does not freeze");
  }
  for (const FuncAttr& a : kFuncAttributes) {
    int v = a.unset;
    if (CU_NEED(cuFuncGetAttribute)(&v, a.id, f) != CUDA_SUCCESS) continue;
    if (v != a.unset) k.func_attributes.push_back({uint32_t(a.id), int32_t(v)});
  }
}

}  // namespace

Graph capture_graph(CUgraph graph, const ModuleRegistry& modules, const CaptureOptions& opt) {
  VITRIFY_EXPECT(graph != nullptr, "capture_graph: the graph handle is null");
  const auto& d = driver::cu();
  driver::ContextGuard ctx(opt.device);
  size_t n = 0;
  VITRIFY_CU(CU_NEED(cuGraphGetNodes)(graph, nullptr, &n));
  std::vector<CUgraphNode> handles(n);
  if (n > 0) VITRIFY_CU(CU_NEED(cuGraphGetNodes)(graph, handles.data(), &n));
  handles.resize(n);
  std::unordered_map<CUgraphNode, uint32_t> index;
  for (size_t i = 0; i < n; ++i) index.emplace(handles[i], uint32_t(i));
  std::unordered_map<CUevent, uint32_t> events;
  auto event_index = [&](CUevent e) {
    return events.emplace(e, uint32_t(events.size())).first->second;
  };
  Resolver resolver(modules, opt.bindings);
  Graph g;
  g.nodes.resize(n);
  for (size_t i = 0; i < n; ++i) {
    const std::string where = "graph node " + std::to_string(i) + " of " + std::to_string(n);
    CUgraphNodeType type;
    VITRIFY_CU(CU_NEED(cuGraphNodeGetType)(handles[i], &type));
    Node& out = g.nodes[i];
    switch (type) {
      case CU_GRAPH_NODE_TYPE_KERNEL:
        out.kind = NodeKind::kernel;
        capture_kernel(handles[i], out, resolver, where);
        break;
      case CU_GRAPH_NODE_TYPE_MEMCPY: {
        out.kind = NodeKind::memcpy;
        CUDA_MEMCPY3D c;
        std::memset(&c, 0, sizeof c);
        VITRIFY_CU(CU_NEED(cuGraphMemcpyNodeGetParams)(handles[i], &c));
        MemcpyNode& m = out.memcpy;
        m.src_type = uint8_t(c.srcMemoryType);
        m.dst_type = uint8_t(c.dstMemoryType);
        m.src = copy_address(c.srcMemoryType, c.srcDevice, "source", where);
        m.dst = copy_address(c.dstMemoryType, c.dstDevice, "destination", where);
        m.src_x = c.srcXInBytes; m.src_y = c.srcY; m.src_z = c.srcZ;
        m.src_pitch = c.srcPitch; m.src_height = c.srcHeight;
        m.dst_x = c.dstXInBytes; m.dst_y = c.dstY; m.dst_z = c.dstZ;
        m.dst_pitch = c.dstPitch; m.dst_height = c.dstHeight;
        m.width = c.WidthInBytes; m.height = c.Height; m.depth = c.Depth;
        break;
      }
      case CU_GRAPH_NODE_TYPE_MEMSET: {
        out.kind = NodeKind::memset;
        CUDA_MEMSET_NODE_PARAMS s;
        std::memset(&s, 0, sizeof s);
        VITRIFY_CU(CU_NEED(cuGraphMemsetNodeGetParams)(handles[i], &s));
        out.memset = {s.dst, s.pitch, s.value, s.elementSize, s.width, s.height};
        break;
      }
      case CU_GRAPH_NODE_TYPE_EVENT_RECORD: {
        out.kind = NodeKind::event_record;
        CUevent e = nullptr;
        VITRIFY_CU(CU_NEED(cuGraphEventRecordNodeGetEvent)(handles[i], &e));
        out.event = event_index(e);
        break;
      }
      case CU_GRAPH_NODE_TYPE_WAIT_EVENT: {
        out.kind = NodeKind::event_wait;
        CUevent e = nullptr;
        VITRIFY_CU(CU_NEED(cuGraphEventWaitNodeGetEvent)(handles[i], &e));
        out.event = event_index(e);
        break;
      }
      case CU_GRAPH_NODE_TYPE_EMPTY:
        out.kind = NodeKind::empty;
        break;
      default:
        throw FreezeError(where + ": unsupported node kind '" + node_type_name(type) +
                          "' (CUgraphNodeType " + std::to_string(int(type)) +
                          "); vitrify freezes kernel, memcpy, memset, event record/wait and empty "
                          "nodes");
    }
  }
  g.event_count = uint32_t(events.size());

  // Edges, with their port/type data where the driver has cuGraphGetEdges_v2.
  size_t ne = 0;
  std::vector<CUgraphNode> from, to;
  std::vector<CUgraphEdgeData> data;
  if (d.cuGraphGetEdges != nullptr) {
    VITRIFY_CU(d.cuGraphGetEdges(graph, nullptr, nullptr, nullptr, &ne));
    from.resize(ne);
    to.resize(ne);
    data.resize(ne);
    if (ne > 0) VITRIFY_CU(d.cuGraphGetEdges(graph, from.data(), to.data(), data.data(), &ne));
  } else {
    VITRIFY_CU(CU_NEED(cuGraphGetEdges_v10000)(graph, nullptr, nullptr, &ne));
    from.resize(ne);
    to.resize(ne);
    data.assign(ne, CUgraphEdgeData{});
    if (ne > 0) VITRIFY_CU(d.cuGraphGetEdges_v10000(graph, from.data(), to.data(), &ne));
  }
  for (size_t e = 0; e < ne; ++e) {
    auto a = index.find(from[e]), b = index.find(to[e]);
    if (a == index.end() || b == index.end())
      throw FreezeError("graph edge " + std::to_string(e) + " names a node cuGraphGetNodes did "
                        "not return");
    g.edges.push_back({a->second, b->second, data[e].from_port, data[e].to_port, data[e].type});
  }
  if (opt.region_size > 0) {
    ScanOptions scan;
    scan.base = opt.region_base;
    scan.size = opt.region_size;
    scan.live = opt.live;
    // An address the driver knows (device or registered host memory) may be a pointer; any
    // other value outside the region is evidence that its field holds an integer.
    scan.is_device_pointer = [&d](uint64_t v) {
      unsigned int type = 0;
      return d.cuPointerGetAttribute(&type, CU_POINTER_ATTRIBUTE_MEMORY_TYPE, CUdeviceptr(v)) ==
             CUDA_SUCCESS;
    };
    find_relocations(g, scan, opt.evidence);
  }
  validate(g);
  if (log::enabled(log::kDebug))
    log::debug("graph captured: " + std::to_string(n) + " nodes, " + std::to_string(ne) +
               " edges, " + std::to_string(g.relocations.size()) + " relocations, " +
               std::to_string(g.notes.size()) + " region-like words left as they are; " +
               std::to_string(resolver.by_handle_count()) + " kernel functions resolved by "
               "handle");
  return g;
}

}  // namespace vitrify::graph
