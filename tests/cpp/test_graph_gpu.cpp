// GPU tests of graph persistence (ctest label `gpu`): walk a CUgraph built from the fixture
// cubin (tests/cpp/fixtures/graph_kernels.cu), serialize, rebuild with GraphSet, replay, and
// compare the output bytes with the original graph's; relocation to another buffer; templates;
// FREEZE errors; CUPTI module recording. Each test skips without a driver or without nvcc.
#include <gtest/gtest.h>

#include <cstring>
#include <fstream>
#include <vector>

#include "graph/cuda_util.hpp"
#include "vitrify/device_memory.hpp"
#include "vitrify/driver.hpp"
#include "vitrify/graph.hpp"
#include "vitrify/graph_cuda.hpp"

using namespace vitrify;
using namespace vitrify::graph;

#define REQUIRE_GPU()                                                                     \
  do {                                                                                    \
    if (!driver::available()) GTEST_SKIP() << "no CUDA driver: " << driver::unavailable_reason(); \
    if (std::string(VITRIFY_GRAPH_FIXTURES).empty())                                         \
      GTEST_SKIP() << "nvcc was not found at configure time: no fixture cubin";           \
  } while (0)

namespace {

constexpr int kN = 4096;          // floats per array
constexpr size_t kRegion = 2 << 20;  // one 2 MiB buffer plays the region
// Layout inside the region: x at 0, y at 64 KiB, z at 128 KiB.
constexpr size_t kX = 0, kY = 64 << 10, kZ = 128 << 10;

std::vector<uint8_t> cubin() {
  std::ifstream f(std::string(VITRIFY_GRAPH_FIXTURES) + "/graph_kernels.cubin", std::ios::binary);
  return std::vector<uint8_t>((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
}

struct ModuleOwner {
  CUmodule m = nullptr;
  explicit ModuleOwner(const std::vector<uint8_t>& image) {
    VITRIFY_CU(CU_NEED(cuModuleLoadData)(&m, image.data()));
  }
  ~ModuleOwner() { CU_NEED(cuModuleUnload)(m); }
  CUfunction fn(const char* name) const {
    CUfunction f = nullptr;
    VITRIFY_CU(CU_NEED(cuModuleGetFunction)(&f, m, name));
    return f;
  }
};

struct GraphOwner {
  CUgraph g = nullptr;
  CUgraphExec exec = nullptr;
  std::vector<CUevent> events;
  GraphOwner() { VITRIFY_CU(CU_NEED(cuGraphCreate)(&g, 0)); }
  ~GraphOwner() {
    if (exec) CU_NEED(cuGraphExecDestroy)(exec);
    CU_NEED(cuGraphDestroy)(g);
    for (CUevent e : events) driver::cu().cuEventDestroy(e);
  }
  void run() {
    if (!exec) VITRIFY_CU(CU_NEED(cuGraphInstantiateWithFlags)(&exec, g, 0));
    VITRIFY_CU(CU_NEED(cuGraphLaunch)(exec, nullptr));
    VITRIFY_CU(driver::cu().cuCtxSynchronize());
  }
};

CUgraphNode add_kernel(CUgraph g, CUfunction f, std::vector<void*> args, unsigned grid,
                       std::vector<CUgraphNode> deps) {
  CUDA_KERNEL_NODE_PARAMS p;
  std::memset(&p, 0, sizeof p);
  p.func = f;
  p.gridDimX = grid; p.gridDimY = 1; p.gridDimZ = 1;
  p.blockDimX = 256; p.blockDimY = 1; p.blockDimZ = 1;
  p.kernelParams = args.data();
  CUgraphNode n = nullptr;
  VITRIFY_CU(CU_NEED(cuGraphAddKernelNode)(&n, g, deps.data(), deps.size(), &p));
  return n;
}

struct Span {
  float* data;
  int n;
};

// memset(y[0:kN] = 1.0) -> record(e) -> wait(e) -> axpy(2, x, y, n) -> add_span({y, n}, 0.5)
//   -> helper_apply(y, n) -> memcpy(z[0:kN] <- y) -> empty.
// So z[i] = 3 * (2 x[i] + 1 + 0.5) + 1 for i < n, and 1.0 for n <= i < kN.
void build_pipeline(GraphOwner& G, const ModuleOwner& mod, CUdeviceptr base, int n) {
  CUcontext ctx = nullptr;
  VITRIFY_CU(driver::cu().cuCtxGetCurrent(&ctx));
  CUDA_MEMSET_NODE_PARAMS ms;
  std::memset(&ms, 0, sizeof ms);
  ms.dst = base + kY;
  ms.value = 0x3f800000u;  // 1.0f
  ms.elementSize = 4;
  ms.width = kN;  // copies and memsets keep their size across a template; kernels vary
  ms.height = 1;
  CUgraphNode set = nullptr, rec = nullptr, wait = nullptr, cp = nullptr, end = nullptr;
  VITRIFY_CU(CU_NEED(cuGraphAddMemsetNode)(&set, G.g, nullptr, 0, &ms, ctx));
  CUevent e = nullptr;
  VITRIFY_CU(driver::cu().cuEventCreate(&e, CU_EVENT_DISABLE_TIMING));
  G.events.push_back(e);
  VITRIFY_CU(CU_NEED(cuGraphAddEventRecordNode)(&rec, G.g, &set, 1, e));
  VITRIFY_CU(CU_NEED(cuGraphAddEventWaitNode)(&wait, G.g, &rec, 1, e));
  float a = 2.0f, v = 0.5f;
  CUdeviceptr x = base + kX, y = base + kY;
  int count = n;
  Span span{reinterpret_cast<float*>(y), n};
  const unsigned grid = (n + 255) / 256;
  CUgraphNode k1 = add_kernel(G.g, mod.fn("vitrify_axpy"), {&a, &x, &y, &count}, grid, {wait});
  CUgraphNode k2 = add_kernel(G.g, mod.fn("vitrify_add_span"), {&span, &v}, grid, {k1});
  CUgraphNode k3 = add_kernel(G.g, mod.fn("vitrify_helper_apply"), {&y, &count}, grid, {k2});
  CUDA_MEMCPY3D c;
  std::memset(&c, 0, sizeof c);
  c.srcMemoryType = CU_MEMORYTYPE_DEVICE;
  c.srcDevice = y;
  c.dstMemoryType = CU_MEMORYTYPE_DEVICE;
  c.dstDevice = base + kZ;
  c.WidthInBytes = size_t(kN) * 4;
  c.Height = 1;
  c.Depth = 1;
  VITRIFY_CU(CU_NEED(cuGraphAddMemcpyNode)(&cp, G.g, &k3, 1, &c, ctx));
  VITRIFY_CU(CU_NEED(cuGraphAddEmptyNode)(&end, G.g, &cp, 1));
}

std::vector<float> inputs() {
  std::vector<float> x(kN);
  for (int i = 0; i < kN; ++i) x[i] = float(i % 97) * 0.25f - 3.0f;
  return x;
}

float expected(float x) { return 3.0f * (2.0f * x + 1.0f + 0.5f) + 1.0f; }

// Fills a region buffer: x = inputs, y and z = a sentinel.
void prepare(DeviceBuffer& buf) {
  std::vector<float> sentinel(kN, -777.0f);
  const auto x = inputs();
  buf.copy_from_host(x.data(), kN * 4, kX);
  buf.copy_from_host(sentinel.data(), kN * 4, kY);
  buf.copy_from_host(sentinel.data(), kN * 4, kZ);
}

std::vector<float> read_z(const DeviceBuffer& buf, int n = kN) {
  std::vector<float> z(n);
  buf.copy_to_host(z.data(), size_t(n) * 4, kZ);
  return z;
}

void expect_pipeline_output(const DeviceBuffer& buf, int n, const char* what) {
  const auto x = inputs();
  const auto z = read_z(buf);
  for (int i = 0; i < kN; ++i) {
    const float want = i < n ? expected(x[i]) : 1.0f;
    ASSERT_EQ(z[i], want) << what << ": z[" << i << "] (n = " << n << ")";
  }
}

Graph freeze(CUgraph g, const ModuleRegistry& reg, CUdeviceptr base) {
  CaptureOptions opt;
  opt.device = 0;
  opt.region_base = base;
  opt.region_size = kRegion;
  opt.live = {{0, kRegion}};
  Graph d = capture_graph(g, reg, opt);
  const auto bytes = serialize(d);
  return deserialize(bytes.data(), bytes.size());  // what THAW reads back from disk
}

}  // namespace

TEST(GraphGpu, WalkSerializeRebuildReplayMatchesTheOriginal) {
  REQUIRE_GPU();
  driver::ContextGuard ctx(0);
  const auto image = cubin();
  ModuleOwner mod(image);
  DeviceBuffer buf(kRegion, 0);
  prepare(buf);
  GraphOwner G;
  build_pipeline(G, mod, buf.ptr(), kN);
  G.run();
  expect_pipeline_output(buf, kN, "original graph");
  const auto original = read_z(buf);

  ModuleRegistry reg;
  reg.add(image.data(), image.size());
  Graph d = freeze(G.g, reg, buf.ptr());
  ASSERT_EQ(d.nodes.size(), 8u);
  size_t kernels = 0, memsets = 0, memcpys = 0, records = 0, waits = 0, empties = 0;
  for (const Node& n : d.nodes) {
    kernels += n.kind == NodeKind::kernel;
    memsets += n.kind == NodeKind::memset;
    memcpys += n.kind == NodeKind::memcpy;
    records += n.kind == NodeKind::event_record;
    waits += n.kind == NodeKind::event_wait;
    empties += n.kind == NodeKind::empty;
    if (n.kind == NodeKind::kernel) EXPECT_EQ(n.kernel.module, sha256(image.data(), image.size()));
  }
  EXPECT_EQ(kernels, 3u);
  EXPECT_EQ(memsets + memcpys + records + waits + empties, 5u);
  EXPECT_EQ(d.event_count, 1u);
  EXPECT_EQ(d.edges.size(), 7u);
  // axpy: x, y; add_span: span.data; helper_apply: p; memset: dst; memcpy: src, dst.
  EXPECT_EQ(d.relocations.size(), 7u);

  prepare(buf);
  GraphSet set(0);
  set.add_module(image.data(), image.size());
  const size_t id = set.add(d);
  set.start(1);
  set.wait(id);
  set.launch(id, 0);
  VITRIFY_CU(driver::cu().cuCtxSynchronize());
  EXPECT_EQ(read_z(buf), original) << "rebuilt graph output differs from the original's";
  EXPECT_EQ(set.stats().modules_loaded, 1u);
}

TEST(GraphGpu, RelocatedGraphWritesOnlyTheNewRegion) {
  REQUIRE_GPU();
  driver::ContextGuard ctx(0);
  const auto image = cubin();
  ModuleOwner mod(image);
  DeviceBuffer a(kRegion, 0), b(kRegion, 0);
  prepare(a);
  GraphOwner G;
  build_pipeline(G, mod, a.ptr(), kN);
  ModuleRegistry reg;
  reg.add(image.data(), image.size());
  Graph d = freeze(G.g, reg, a.ptr());
  relocate(d, b.ptr());
  prepare(a);
  prepare(b);
  GraphSet set(0);
  set.add_module(image.data(), image.size());
  set.add(d);
  set.start(1);
  set.launch(0, 0);
  VITRIFY_CU(driver::cu().cuCtxSynchronize());
  expect_pipeline_output(b, kN, "relocated graph, new region");
  const auto untouched = read_z(a);
  for (int i = 0; i < kN; ++i) ASSERT_EQ(untouched[i], -777.0f) << "old region written at " << i;
}

TEST(GraphGpu, BatchSizesShareOneTemplateAndSwitchWithoutSync) {
  REQUIRE_GPU();
  driver::ContextGuard ctx(0);
  const auto image = cubin();
  ModuleOwner mod(image);
  const int sizes[] = {256, 1000, 4096};
  std::vector<std::unique_ptr<DeviceBuffer>> bufs;
  ModuleRegistry reg;
  reg.add(image.data(), image.size());
  GraphSet set(0);
  set.add_module(image.data(), image.size());
  for (int n : sizes) {
    bufs.push_back(std::make_unique<DeviceBuffer>(kRegion, 0));
    GraphOwner G;
    build_pipeline(G, mod, bufs.back()->ptr(), n);
    set.add(freeze(G.g, reg, bufs.back()->ptr()));
  }
  set.start(2);
  set.wait_all();
  EXPECT_EQ(set.stats().templates, 1u) << "the three graphs differ only in grid and parameters";
  for (auto& b : bufs) prepare(*b);
  // Launch all three back to back on one stream, twice, with no synchronisation in between.
  for (int round = 0; round < 2; ++round)
    for (size_t i = 0; i < 3; ++i) set.launch(i, 0);
  VITRIFY_CU(driver::cu().cuCtxSynchronize());
  for (size_t i = 0; i < 3; ++i) expect_pipeline_output(*bufs[i], sizes[i], "template member");
  EXPECT_GE(set.stats().parameter_switches, 5u);
}

TEST(GraphGpu, FreezeNamesAMissingBinaryAndAnUnsupportedNode) {
  REQUIRE_GPU();
  driver::ContextGuard ctx(0);
  const auto image = cubin();
  ModuleOwner mod(image);
  DeviceBuffer buf(kRegion, 0);
  GraphOwner G;
  build_pipeline(G, mod, buf.ptr(), kN);
  ModuleRegistry empty;
  try {
    capture_graph(G.g, empty, CaptureOptions{});
    FAIL() << "no FreezeError for a kernel whose binary was not recorded";
  } catch (const FreezeError& e) {
    EXPECT_NE(std::string(e.what()).find("vitrify_axpy"), std::string::npos) << e.what();
  }
  GraphOwner child, parent;
  CUgraphNode n = nullptr;
  VITRIFY_CU(CU_NEED(cuGraphAddEmptyNode)(&n, child.g, nullptr, 0));
  VITRIFY_CU(CU_NEED(cuGraphAddChildGraphNode)(&n, parent.g, nullptr, 0, child.g));
  try {
    capture_graph(parent.g, empty, CaptureOptions{});
    FAIL() << "no FreezeError for a child-graph node";
  } catch (const FreezeError& e) {
    EXPECT_NE(std::string(e.what()).find("child graph"), std::string::npos) << e.what();
  }
}

TEST(GraphGpu, CorruptModuleIsRejectedBeforeLoading) {
  REQUIRE_GPU();
  const auto image = cubin();
  GraphSet set(0);
  const Hash wrong = sha256("x", 1);
  EXPECT_THROW(set.add_module(image.data(), image.size(), &wrong), std::invalid_argument);
}

TEST(GraphGpu, CuptiRecordsModulesLoadedAfterStart) {
  REQUIRE_GPU();
  ModuleRecorder& r = ModuleRecorder::instance();
  try {
    r.start();
  } catch (const Error& e) {
    GTEST_SKIP() << "CUPTI unavailable here: " << e.what();
  }
  driver::ContextGuard ctx(0);
  const auto image = cubin();
  const size_t before = r.modules_seen();
  {
    ModuleOwner mod(image);
    mod.fn("vitrify_axpy");  // lazy loading: make sure the module is really loaded
  }
  EXPECT_GT(r.modules_seen(), before) << "no CUPTI module-loaded callback via " << r.library_path();
  bool found = false;
  for (const Hash& h : r.registry().hashes()) {
    auto m = r.registry().get(h);
    for (const auto& k : m->kernels) found = found || k == "vitrify_axpy";
  }
  EXPECT_TRUE(found) << r.registry().size() << " modules recorded, none defines vitrify_axpy";
}

// ----------------------------------------------- relocation safety on the real driver
namespace {

std::vector<uint8_t> reloc_cubin() {
  std::ifstream f(std::string(VITRIFY_GRAPH_FIXTURES) + "/reloc_kernels.cubin", std::ios::binary);
  return std::vector<uint8_t>((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
}

struct PairAndPointer {
  int lo;
  int hi;
  int* p;
};

std::vector<int32_t> read_ints(const DeviceBuffer& buf, size_t offset, size_t n) {
  std::vector<int32_t> v(n);
  buf.copy_to_host(v.data(), n * 4, offset);
  return v;
}

}  // namespace

TEST(GraphGpu, IntegersThatReadLikeRegionAddressesSurviveRelocation) {
  // The relocation bug: two adjacent 32-bit integers (x, upper half of the region base) form an
  // 8-byte word inside the region. Here every byte of the region counts as live (the weakest
  // provenance), so only the parameter layout and the cross-launch evidence keep them integers.
  REQUIRE_GPU();
  driver::ContextGuard ctx(0);
  const auto image = reloc_cubin();
  ASSERT_FALSE(image.empty()) << "reloc_kernels.cubin was not built";
  ModuleOwner mod(image);
  DeviceBuffer a(kRegion, 0), b(kRegion, 0);
  const uint32_t hi = uint32_t(a.ptr() >> 32);
  const uint32_t lo = uint32_t(a.ptr()) + 256;  // (lo, hi) = a.ptr() + 256: inside the region
  const std::vector<int32_t> zeros(8, 0);
  a.copy_from_host(zeros.data(), 32, kZ);
  GraphOwner G;
  int n = int(lo), m = int(hi);
  CUdeviceptr out = a.ptr() + kZ;
  CUgraphNode k1 = add_kernel(G.g, mod.fn("vitrify_pair_store"), {&n, &m, &out}, 1, {});
  PairAndPointer s1{int(lo), int(hi), reinterpret_cast<int*>(a.ptr() + kZ)};
  int slot1 = 1;
  CUgraphNode k2 = add_kernel(G.g, mod.fn("vitrify_struct_store"), {&s1, &slot1}, 1, {k1});
  // The same struct field in another launch holds 0x9000 as its upper half: no user address.
  PairAndPointer s2{int(lo), 0x9000, reinterpret_cast<int*>(a.ptr() + kZ)};
  int slot2 = 2;
  add_kernel(G.g, mod.fn("vitrify_struct_store"), {&s2, &slot2}, 1, {k2});
  G.run();
  const auto original = read_ints(a, kZ, 6);
  ASSERT_EQ(original, (std::vector<int32_t>{int(lo), int(hi), int(lo), int(hi), int(lo), 0x9000}));

  ModuleRegistry reg;
  reg.add(image.data(), image.size());
  FieldEvidence ev;
  CaptureOptions opt;
  opt.region_base = a.ptr();
  opt.region_size = kRegion;
  opt.live = {{0, kRegion}};
  opt.evidence = &ev;
  Graph d = capture_graph(G.g, reg, opt);
  ASSERT_EQ(d.nodes.size(), 3u);
  // The driver's layout: (n, m, out) are three parameters, the struct one 16-byte parameter.
  EXPECT_EQ(d.nodes[0].kernel.slots, (std::vector<ParamSlot>{{0, 4}, {4, 4}, {8, 8}}));
  EXPECT_EQ(d.nodes[1].kernel.slots, (std::vector<ParamSlot>{{0, 16}, {16, 4}}));
  // Before the evidence: out, s1.p, s2.p and s1's (lo, hi) word (indistinguishable alone).
  EXPECT_EQ(d.relocations.size(), 4u);
  EXPECT_EQ(apply_evidence(d, ev), 1u);
  ASSERT_EQ(d.relocations.size(), 3u);
  for (const Relocation& r : d.relocations) EXPECT_EQ(r.offset, 8u);  // out, s1.p, s2.p
  EXPECT_TRUE(relocatable(d));
  const auto bytes = serialize(d);
  Graph back = deserialize(bytes.data(), bytes.size());
  relocate(back, b.ptr());
  a.copy_from_host(zeros.data(), 32, kZ);
  b.copy_from_host(zeros.data(), 32, kZ);
  GraphSet set(0);
  set.add_module(image.data(), image.size());
  set.add(back);
  set.start(1);
  set.launch(0, 0);
  VITRIFY_CU(driver::cu().cuCtxSynchronize());
  EXPECT_EQ(read_ints(b, kZ, 6), original) << "the relocated graph changed an integer";
  EXPECT_EQ(read_ints(a, kZ, 6), std::vector<int32_t>(6, 0)) << "the old region was written";
}

TEST(GraphGpu, TensorMapHoldsItsGlobalAddressAsAPlainWord) {
  // Relocating a CUtensorMap parameter rewrites its address word (kind tensor_map). That is
  // only right if the driver's encoding holds the address as a plain 8-byte word: checked
  // here by encoding the same tensor at two addresses.
  if (!driver::available()) GTEST_SKIP() << "no CUDA driver: " << driver::unavailable_reason();
  if (!driver::cu().cuTensorMapEncodeTiled) GTEST_SKIP() << "driver has no cuTensorMapEncodeTiled";
  driver::ContextGuard ctx(0);
  DeviceBuffer a(kRegion, 0);
  auto encode = [&](CUdeviceptr addr) {
    CUtensorMap m;
    std::memset(&m, 0, sizeof m);
    const cuuint64_t dims[2] = {128, 256}, strides[1] = {128 * 2};
    const cuuint32_t box[2] = {64, 64}, elem[2] = {1, 1};
    VITRIFY_CU(driver::cu().cuTensorMapEncodeTiled(
        &m, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 2, reinterpret_cast<void*>(addr), dims, strides, box,
        elem, CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
        CU_TENSOR_MAP_L2_PROMOTION_NONE, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE));
    std::vector<uint8_t> v(sizeof m);
    std::memcpy(v.data(), &m, sizeof m);
    return v;
  };
  ASSERT_EQ(sizeof(CUtensorMap), 128u);
  const CUdeviceptr p = a.ptr() + 4096, q = a.ptr() + (1 << 20);
  auto first = encode(p);
  const auto second = encode(q);
  size_t words = 0;
  for (size_t o = 0; o + 8 <= first.size(); o += 8) {
    uint64_t w;
    std::memcpy(&w, first.data() + o, 8);
    if (w == p) {
      ++words;
      const uint64_t moved = q;
      std::memcpy(first.data() + o, &moved, 8);
    }
  }
  EXPECT_EQ(words, 1u) << "the tensor map does not hold its address as one plain 8-byte word";
  EXPECT_EQ(first, second) << "rewriting the address word does not give the tensor map of the "
                              "new address: TMA descriptors must not be relocated as plain words";
}
