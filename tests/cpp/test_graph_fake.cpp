// The graph capture (FREEZE) and rebuild (THAW) logic against a fake driver
// (fake_cuda/graph.cpp), on CPU: description -> GraphSet rebuild -> launch (the fake logs the
// parameters each launch runs with) -> capture_graph of the rebuilt graph -> the same
// description; template switching; ownership (nothing leaks); FREEZE errors. A case that needs
// the driver table loaded with an entry point hidden (it is loaded once per process) runs this
// binary again with VITRIFY_GRAPH_CHILD set: the gtest Environment below does the child's part
// and exits before any test runs.
#include <dlfcn.h>
#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "run_self.hpp"
#include "fake_cuda/use_fake.hpp"
#include "vitrify/driver.hpp"
#include "vitrify/graph.hpp"
#include "vitrify/graph_cuda.hpp"

using namespace vitrify::graph;

namespace {

template <typename F>
F hook(const char* name) {
  auto f = reinterpret_cast<F>(vitrify::test::fake_symbol(name));
  if (f == nullptr) throw std::runtime_error(std::string("fake hook missing: ") + name);
  return f;
}
int live(const char* what) { return hook<int (*)(const char*)>("fake_graph_live")(what); }
size_t launches() { return hook<size_t (*)()>("fake_graph_launches")(); }
std::string launch_state(size_t i) { return hook<const char* (*)(size_t)>("fake_graph_launch")(i); }
CUgraph last_graph() { return hook<CUgraph (*)()>("fake_graph_last")(); }

const std::string kImageA =
    ".version 8.0\n.target sm_90\n"
    ".visible .entry vitrify_axpy ( // params 0:4 8:8 16:8 24:4\n"
    ".visible .entry vitrify_add_span ( // params 0:16 16:4\n";
const std::string kImageB =  // also defines vitrify_axpy, next to another kernel
    ".version 8.0\n.entry vitrify_axpy ( // params 0:4 8:8 16:8 24:4\n.entry other ( // params 0:8\n";
const std::string kImageA2 = kImageA + "// same kernels, other bytes\n";

Hash hash_of(const std::string& s) { return sha256(s.data(), s.size()); }

constexpr uint64_t kBase = 0x7e0000000000ull, kSize = 1ull << 30;

void put64(std::vector<uint8_t>& b, size_t off, uint64_t v) { std::memcpy(b.data() + off, &v, 8); }

Graph pipeline(uint64_t base, uint32_t n, uint32_t memset_value = 7) {
  Graph g;
  g.event_count = 1;
  Node set;
  set.kind = NodeKind::memset;
  set.memset = {base + 0x10000, 0, memset_value, 4, 4096, 1};
  Node rec, wait;
  rec.kind = NodeKind::event_record;
  wait.kind = NodeKind::event_wait;
  Node axpy;
  axpy.kind = NodeKind::kernel;
  KernelNode& k = axpy.kernel;
  k.module = hash_of(kImageA);
  k.name = "vitrify_axpy";
  k.grid = {(n + 255) / 256, 1, 1};
  k.block = {256, 1, 1};
  k.params.assign(28, 0);
  const float a = 2.0f;
  std::memcpy(k.params.data(), &a, 4);
  put64(k.params, 8, base);
  put64(k.params, 16, base + 0x10000);
  std::memcpy(k.params.data() + 24, &n, 4);
  k.slots = {{0, 4}, {8, 8}, {16, 8}, {24, 4}};
  Node span;
  span.kind = NodeKind::kernel;
  KernelNode& s = span.kernel;
  s.module = hash_of(kImageA);
  s.name = "vitrify_add_span";
  s.grid = {(n + 127) / 128, 1, 1};
  s.block = {128, 1, 1};
  s.shared_mem = 2048;
  s.params.assign(20, 0);
  put64(s.params, 0, base + 0x10000);
  std::memcpy(s.params.data() + 8, &n, 4);
  s.slots = {{0, 16}, {16, 4}};
  s.attributes.push_back({CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION, {2, 0, 0, 0, 1, 0, 0, 0, 1}});
  s.func_attributes.push_back({CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, 65536});
  Node cp;
  cp.kind = NodeKind::memcpy;
  cp.memcpy.src_type = cp.memcpy.dst_type = CU_MEMORYTYPE_DEVICE;
  cp.memcpy.src = base + 0x10000;
  cp.memcpy.dst = base + 0x20000;
  cp.memcpy.width = 16384;
  cp.memcpy.height = cp.memcpy.depth = 1;
  g.nodes = {set, rec, wait, axpy, span, cp, Node{}};
  g.edges = {{0, 1}, {1, 2}, {2, 3}, {3, 4, 0, 0, 1}, {4, 5}, {5, 6}};
  find_relocations(g, kBase, kSize);
  return g;
}

// What the fake logs for a launch of a graph holding g's parameters.
std::string expected_state(const Graph& g) {
  std::string out;
  char buf[8];
  for (const Node& n : g.nodes) {
    switch (n.kind) {
      case NodeKind::kernel: {
        const KernelNode& k = n.kernel;
        out += "K " + k.name + " g=" + std::to_string(k.grid.x) + "," + std::to_string(k.grid.y) +
               "," + std::to_string(k.grid.z) + " b=" + std::to_string(k.block.x) + "," +
               std::to_string(k.block.y) + "," + std::to_string(k.block.z) +
               " s=" + std::to_string(k.shared_mem) + " p=";
        for (uint8_t c : k.params) {
          std::snprintf(buf, sizeof buf, "%02x", c);
          out += buf;
        }
        break;
      }
      case NodeKind::memcpy:
        out += "C " + std::to_string(n.memcpy.src) + "->" + std::to_string(n.memcpy.dst) +
               " w=" + std::to_string(n.memcpy.width);
        break;
      case NodeKind::memset:
        out += "S " + std::to_string(n.memset.dst) + " v=" + std::to_string(n.memset.value) +
               " w=" + std::to_string(n.memset.width);
        break;
      case NodeKind::event_record: out += "R"; break;
      case NodeKind::event_wait: out += "W"; break;
      case NodeKind::empty: out += "E"; break;
    }
    out += ";";
  }
  return out;
}

void expect_nothing_alive() {
  EXPECT_EQ(live("graphs"), 0);
  EXPECT_EQ(live("execs"), 0);
  EXPECT_EQ(live("modules"), 0);
  EXPECT_EQ(live("events"), 0);
}

// ---- the child's part -------------------------------------------------------------------------
// VITRIFY_GRAPH_CHILD=no-module-loader (the parent also sets FAKE_CUDA_MISSING=cuModuleLoadData):
//   two graphs on one module, each its own template; loading the module throws (the entry point
//   is missing), so both builds must fail with that error, never find a "loaded" null module.
// The child's success status: not 0, so a child that ran the whole suite instead does not pass.
constexpr int kChildOk = 77;

int child_fail(const std::string& why) {
  std::fprintf(stderr, "child: %s\n", why.c_str());
  return 1;
}

int child_no_module_loader() {
  if (!vitrify::driver::available()) return child_fail(vitrify::driver::unavailable_reason());
  if (vitrify::driver::cu().cuModuleLoadData != nullptr)
    return child_fail("cuModuleLoadData is not hidden (FAKE_CUDA_MISSING)");
  {
    GraphSet set(0, /*share_templates=*/false);
    set.add_module(kImageA.data(), kImageA.size());
    const size_t a = set.add(pipeline(kBase, 256)), b = set.add(pipeline(kBase, 512));
    set.start(2);
    for (size_t x : {a, b}) {
      try {
        set.wait(x);
        return child_fail("graph " + std::to_string(x) + " was built without its module");
      } catch (const vitrify::DriverUnavailable& e) {
        const std::string m = e.what();
        if (m.find("lacks cuModuleLoadData") == std::string::npos)
          return child_fail("graph " + std::to_string(x) + ": " + m);
      } catch (const std::exception& e) {  // the old code: cuModuleGetFunction on a null module
        return child_fail("graph " + std::to_string(x) + " failed otherwise: " + e.what());
      }
    }
    if (set.stats().modules_loaded != 0) return child_fail("a module counted as loaded");
    if (set.stats().built_templates != 0) return child_fail("a template counted as built");
  }
  for (const char* what : {"graphs", "execs", "modules", "events"})
    if (live(what) != 0) return child_fail(std::string("fake ") + what + " left alive");
  return kChildOk;
}

class ChildMode : public ::testing::Environment {
 public:
  void SetUp() override {
    const char* mode = std::getenv("VITRIFY_GRAPH_CHILD");
    if (mode == nullptr || *mode == '\0') return;
    int rc;
    try {
      rc = std::string(mode) == "no-module-loader" ? child_no_module_loader()
                                                   : child_fail(std::string("mode ") + mode);
    } catch (const std::exception& e) {
      rc = child_fail(std::string("exception: ") + e.what());
    }
    std::fflush(stdout);
    std::fflush(stderr);
    ::_exit(rc);
  }
};
[[maybe_unused]] ::testing::Environment* const kChildMode =
    ::testing::AddGlobalTestEnvironment(new ChildMode);

// Runs this binary in child mode with `extra` added to the environment; its exit status (-1
// when it did not exit normally).
int run_child(const std::vector<std::string>& extra) {
  return vitrify::test::run_self("test_graph_fake", extra);
}

}  // namespace

TEST(GraphFake, DriverIsTheFake) {
  ASSERT_TRUE(vitrify::driver::available()) << vitrify::driver::unavailable_reason();
  ASSERT_NE(vitrify::test::fake_symbol("fake_graph_launches"), nullptr) << ::dlerror();
  EXPECT_EQ(vitrify::driver::table().library_path, VITRIFY_FAKE_CUDA_PATH);
}

TEST(GraphFake, RebuildLaunchAndCaptureBackIsTheSameGraph) {
  ASSERT_TRUE(vitrify::driver::available()) << vitrify::driver::unavailable_reason();
  const Graph g = pipeline(kBase, 1000);
  ModuleRegistry reg;
  reg.add(kImageA.data(), kImageA.size());
  {
    GraphSet set(0);
    set.add_module(kImageA.data(), kImageA.size());
    const size_t id = set.add(g);
    set.start(1);
    set.wait(id);
    const size_t before = launches();
    set.launch(id, 0);
    ASSERT_EQ(launches(), before + 1);
    EXPECT_EQ(launch_state(before), expected_state(g));
    // Walk the rebuilt graph: FREEZE of THAW's graph gives back the description.
    CUgraph built = last_graph();
    ASSERT_NE(built, nullptr);
    CaptureOptions opt;
    opt.region_base = kBase;
    opt.region_size = kSize;
    opt.live = {{0, 0x10000}, {0x10000, 0x10000}, {0x20000, 0x10000}};  // x, y, z
    const Graph back = capture_graph(built, reg, opt);
    EXPECT_EQ(back.nodes, g.nodes);
    EXPECT_EQ(back.edges, g.edges);
    EXPECT_EQ(back.relocations, g.relocations);
    EXPECT_EQ(back, g);
    EXPECT_EQ(live("execs"), 1);
    EXPECT_EQ(live("events"), 1);
    EXPECT_EQ(set.stats().modules_loaded, 1u);
  }
  expect_nothing_alive();
}

TEST(GraphFake, TemplateMembersSwitchOnlyTheNodesThatDiffer) {
  ASSERT_TRUE(vitrify::driver::available());
  std::vector<Graph> gs = {pipeline(kBase, 256), pipeline(kBase, 1000), pipeline(kBase, 4096, 9)};
  {
    GraphSet set(0);
    set.add_module(kImageA.data(), kImageA.size());
    for (const Graph& g : gs) set.add(g);
    set.start(2);
    set.wait_all();
    EXPECT_EQ(set.stats().templates, 1u);
    EXPECT_EQ(live("execs"), 1);
    const int updates0 = live("exec_updates");
    const size_t first = launches();
    const size_t order[] = {0, 1, 2, 0, 0, 2};
    for (size_t i : order) set.launch(i, 0);
    for (size_t j = 0; j < 6; ++j)
      EXPECT_EQ(launch_state(first + j), expected_state(gs[order[j]])) << "launch " << j;
    // 0->1: two kernels; 1->2: two kernels + memset value; 2->0: the same three; 0->0: none;
    // 0->2: three. The first launch of 0 needs nothing (the executable was built from it).
    const RebuildStats st = set.stats();
    EXPECT_EQ(st.parameter_switches, 4u);
    EXPECT_EQ(st.nodes_updated, 2u + 3u + 3u + 3u);
    EXPECT_EQ(live("exec_updates") - updates0, 11);
  }
  expect_nothing_alive();
}

TEST(GraphFake, WithoutTemplatesEveryGraphHasItsOwnExecutable) {
  ASSERT_TRUE(vitrify::driver::available());
  {
    GraphSet set(0, /*share_templates=*/false);
    set.add_module(kImageA.data(), kImageA.size());
    for (uint32_t n : {256u, 1000u, 4096u}) set.add(pipeline(kBase, n));
    Graph other = pipeline(kBase, 2048);
    other.nodes[4].kernel.func_attributes[0].value = 32768;
    set.add(other);
    set.start(3);
    set.wait_all();
    const RebuildStats st = set.stats();
    EXPECT_EQ(st.templates, 4u);
    EXPECT_EQ(live("execs"), 4);
    EXPECT_EQ(live("modules"), 1) << "a module is loaded once per GraphSet";
    // The span kernel's attribute is set once per value, not once per node (4 nodes, 2 values;
    // 3 calls when the other value lands between two of the first).
    EXPECT_GE(st.attributes_set, 2u);
    EXPECT_LE(st.attributes_set, 3u);
    EXPECT_EQ(st.built_templates, 4u);
    EXPECT_NEAR(st.build_seconds, st.module_seconds + st.nodes_seconds + st.instantiate_seconds,
                1e-6 + 0.01 * st.build_seconds + 0.01);
  }
  expect_nothing_alive();
}

TEST(GraphFake, RelocatedGraphLaunchesWithTheNewAddresses) {
  ASSERT_TRUE(vitrify::driver::available());
  const uint64_t other = 0x7d0000000000ull;
  Graph g = pipeline(kBase, 512);
  relocate(g, other);
  GraphSet set(0);
  set.add_module(kImageA.data(), kImageA.size());
  set.add(g);
  set.start(1);
  const size_t first = launches();
  set.launch(0, 0);
  Graph want = pipeline(other, 512);
  EXPECT_EQ(launch_state(first), expected_state(want));
}

TEST(GraphFake, SameNamedKernelsAreTellApartByTheirModule) {
  ASSERT_TRUE(vitrify::driver::available());
  ModuleRegistry reg;
  reg.add(kImageA.data(), kImageA.size());
  reg.add(kImageB.data(), kImageB.size());
  GraphSet set(0);
  set.add_module(kImageA.data(), kImageA.size());
  set.add(pipeline(kBase, 64));
  set.start(1);
  set.wait_all();
  const Graph back = capture_graph(last_graph(), reg, CaptureOptions{});
  EXPECT_EQ(back.nodes[3].kernel.module, hash_of(kImageA)) << "vitrify_axpy is in A and in B";
  // A second binary with A's very kernels but other bytes cannot be told apart: FREEZE error.
  reg.add(kImageA2.data(), kImageA2.size());
  try {
    capture_graph(last_graph(), reg, CaptureOptions{});
    FAIL() << "no FreezeError for an ambiguous kernel";
  } catch (const FreezeError& e) {
    EXPECT_NE(std::string(e.what()).find("'vitrify_axpy' is defined by 2 different recorded binaries"),
              std::string::npos) << e.what();
  }
}

TEST(GraphFake, FreezeErrorsNameTheKernelOrTheKind) {
  ASSERT_TRUE(vitrify::driver::available());
  GraphSet set(0);
  set.add_module(kImageA.data(), kImageA.size());
  set.add(pipeline(kBase, 64));
  set.start(1);
  set.wait_all();
  ModuleRegistry empty;
  try {
    capture_graph(last_graph(), empty, CaptureOptions{});
    FAIL() << "no FreezeError";
  } catch (const FreezeError& e) {
    EXPECT_NE(std::string(e.what()).find("graph node 3 of 7: the binary of kernel 'vitrify_axpy' was not recorded"),
              std::string::npos) << e.what();
  }
  const auto& d = vitrify::driver::cu();
  CUgraph parent = nullptr, child = nullptr;
  VITRIFY_CU(d.cuGraphCreate(&parent, 0));
  VITRIFY_CU(d.cuGraphCreate(&child, 0));
  CUgraphNode n = nullptr;
  VITRIFY_CU(d.cuGraphAddEmptyNode(&n, parent, nullptr, 0));
  VITRIFY_CU(d.cuGraphAddChildGraphNode(&n, parent, &n, 1, child));
  try {
    capture_graph(parent, empty, CaptureOptions{});
    FAIL() << "no FreezeError";
  } catch (const FreezeError& e) {
    EXPECT_NE(std::string(e.what()).find("graph node 1 of 2: unsupported node kind 'child graph'"),
              std::string::npos) << e.what();
  }
  d.cuGraphDestroy(parent);
  d.cuGraphDestroy(child);
}

TEST(GraphFake, BuildErrorsReachEveryWaiterWithTheNodeNamed) {
  ASSERT_TRUE(vitrify::driver::available());
  Graph g = pipeline(kBase, 64);
  g.nodes[4].kernel.name = "not_in_the_module";
  g.nodes[4].kernel.attributes.clear();
  g.nodes[4].kernel.func_attributes.clear();
  {
    GraphSet set(0);
    set.add_module(kImageA.data(), kImageA.size());
    set.add(g);
    set.add(g);
    set.start(1);
    for (size_t id : {0u, 1u}) {
      try {
        set.wait(id);
        FAIL() << "no error for graph " << id;
      } catch (const vitrify::CudaError& e) {
        const std::string m = e.what();
        EXPECT_NE(m.find("rebuilding graph 0 node 4 (kernel 'not_in_the_module')"), std::string::npos) << m;
        EXPECT_NE(m.find("CUDA_ERROR_NOT_FOUND"), std::string::npos) << m;
      }
    }
    EXPECT_THROW(set.launch(1, 0), vitrify::CudaError);
    EXPECT_EQ(set.stats().built_templates, 0u);
  }
  expect_nothing_alive();
}

TEST(GraphFake, ManyTemplatesOnFourBuildThreadsWaitedInAnyOrder) {
  ASSERT_TRUE(vitrify::driver::available());
  std::vector<Graph> gs;
  for (uint32_t t = 0; t < 24; ++t)
    for (uint32_t n : {64u, 640u, 6400u}) {
      Graph g = pipeline(kBase, n, t);
      g.nodes[3].kernel.block.x = 32 * (1 + t);  // 24 topologies of 3 members each
      gs.push_back(g);
    }
  {
    GraphSet set(0);
    set.add_module(kImageA.data(), kImageA.size());
    for (const Graph& g : gs) set.add(g);
    set.start(4);
    for (size_t i = gs.size(); i-- > 0;) set.wait(i);
    EXPECT_EQ(set.stats().templates, 24u);
    EXPECT_EQ(set.stats().built_templates, 24u);
    EXPECT_EQ(set.stats().ready_graphs, gs.size());
    EXPECT_EQ(live("execs"), 24);
    const size_t first = launches();
    for (size_t i = 0; i < gs.size(); ++i) set.launch((i * 7) % gs.size(), 0);
    for (size_t i = 0; i < gs.size(); ++i)
      ASSERT_EQ(launch_state(first + i), expected_state(gs[(i * 7) % gs.size()])) << "launch " << i;
  }
  expect_nothing_alive();
}

// Modules load once each, concurrently, before the builds; a module that fails to load fails only
// the graphs that use it, naming the load.
TEST(GraphFake, ModulesLoadOnceEachAndABadOneFailsOnlyItsGraphs) {
  ASSERT_TRUE(vitrify::driver::available());
  const std::string bad = ".version 8.0\n// no entries: the driver refuses this image\n";
  Graph with_b = pipeline(kBase, 512);
  with_b.nodes[3].kernel.module = hash_of(kImageB);  // vitrify_axpy from the second binary
  Graph with_bad = pipeline(kBase, 768);
  with_bad.nodes[3].kernel.module = hash_of(bad);
  {
    GraphSet set(0);
    set.add_module(kImageA.data(), kImageA.size());
    set.add_module(kImageB.data(), kImageB.size());
    set.add_module(bad.data(), bad.size());
    const size_t a = set.add(pipeline(kBase, 256));
    const size_t a2 = set.add(pipeline(kBase, 1000));
    const size_t b = set.add(with_b);
    const size_t x = set.add(with_bad);
    set.start(4);
    set.wait(a);
    set.wait(a2);
    set.wait(b);
    try {
      set.wait(x);
      ADD_FAILURE() << "a graph whose module cannot load was built";
    } catch (const vitrify::CudaError& e) {
      EXPECT_NE(std::string(e.what()).find("cuModuleLoadData(module " + to_hex(hash_of(bad))),
                std::string::npos) << e.what();
    }
    EXPECT_EQ(set.stats().modules_loaded, 2u);  // A and B, once each; the bad one never loaded
    EXPECT_EQ(set.stats().templates, 3u);
    const size_t first = launches();
    set.launch(b, 0);
    set.launch(a2, 0);
    EXPECT_EQ(launch_state(first), expected_state(with_b));
    EXPECT_EQ(launch_state(first + 1), expected_state(pipeline(kBase, 1000)));
    EXPECT_EQ(live("modules"), 2);
  }
  expect_nothing_alive();
}

// Issue 33 item 16: an edited module image (a mutated archive's) made the fake throw out of
// cuModuleLoadData, leaving a null module that cuModuleGetFunction then dereferenced. Like the
// driver, the fake answers every image it cannot parse with CUDA_ERROR_INVALID_IMAGE and a null
// module or name with an error code; THAW then fails naming the load, for every graph using it.
TEST(GraphFake, AnEditedModuleImageIsTheDriversErrorNeverACrash) {
  ASSERT_TRUE(vitrify::driver::available()) << vitrify::driver::unavailable_reason();
  const auto& cu = vitrify::driver::cu();
  const std::vector<std::string> edited = {
      ".entry vitrify_axpy ( // params 0:x 8:8\n",          // a size that is no number
      ".entry vitrify_axpy ( // params 12\n",               // an offset without a size
      ".entry vitrify_axpy ( // params 0:4 8:\n",           // a size cut off
      ".entry vitrify_axpy ( // params 0:99999999999999999999\n",  // out of any range
      ".entry ( // params 0:4\n",                           // no kernel name
      "\x7f" "ELF\x02\x01\x01 cubin bytes\n",               // not text: refused by its magic
  };
  {
    vitrify::driver::ContextGuard ctx(0);
    for (const std::string& img : edited) {
      CUmodule m = nullptr;
      EXPECT_EQ(cu.cuModuleLoadData(&m, img.c_str()), CUDA_ERROR_INVALID_IMAGE) << img;
      EXPECT_EQ(m, nullptr) << img;
    }
    CUfunction f = nullptr;
    EXPECT_EQ(cu.cuModuleGetFunction(&f, nullptr, "vitrify_axpy"), CUDA_ERROR_INVALID_HANDLE);
    CUmodule good = nullptr;
    ASSERT_EQ(cu.cuModuleLoadData(&good, kImageA.c_str()), CUDA_SUCCESS);
    EXPECT_EQ(cu.cuModuleGetFunction(&f, good, nullptr), CUDA_ERROR_INVALID_VALUE);
    EXPECT_EQ(cu.cuModuleGetFunction(&f, good, "edited_away"), CUDA_ERROR_NOT_FOUND);
    EXPECT_EQ(cu.cuModuleGetFunction(&f, good, "vitrify_axpy"), CUDA_SUCCESS);
    EXPECT_EQ(cu.cuModuleUnload(good), CUDA_SUCCESS);
  }
  // Two graphs on one edited module: both fail naming the load (the second used to find a null
  // module and crash in cuModuleGetFunction).
  const std::string bad = edited[0];
  Graph g1 = pipeline(kBase, 256), g2 = pipeline(kBase, 512);
  g1.nodes[3].kernel.module = hash_of(bad);
  g2.nodes[3].kernel.module = hash_of(bad);
  {
    GraphSet set(0);
    set.add_module(kImageA.data(), kImageA.size());
    set.add_module(bad.data(), bad.size());
    const size_t a = set.add(g1), b = set.add(g2);
    set.start(2);
    for (size_t x : {a, b}) {
      try {
        set.wait(x);
        ADD_FAILURE() << "a graph whose module image was edited was built";
      } catch (const vitrify::CudaError& e) {
        EXPECT_NE(std::string(e.what()).find("cuModuleLoadData(module " + to_hex(hash_of(bad))),
                  std::string::npos) << e.what();
        EXPECT_EQ(e.code(), CUDA_ERROR_INVALID_IMAGE);
      }
    }
  }
  expect_nothing_alive();
}

// A module load that throws (here DriverUnavailable: the driver lacks cuModuleLoadData) used to
// leave the module "loaded" with a null handle: every graph using it then went on to
// cuModuleGetFunction(nullptr) (the fake says INVALID_HANDLE; a driver may crash). Now the throw
// is the module's error, rethrown to every graph that needs it.
TEST(GraphFake, AModuleLoadThatThrowsFailsEveryGraphUsingItWithThatError) {
  EXPECT_EQ(run_child({"VITRIFY_GRAPH_CHILD=no-module-loader",
                       "FAKE_CUDA_MISSING=cuModuleLoadData"}),
            kChildOk)
      << "the child's reason is on stderr";
}
