// CPU tests of the graph description: SHA-256, the file format, relocation, topology templates,
// kernel-name extraction and the module registry (csrc/src/graph/DESIGN.md, invariants G1-G7).
#include <gtest/gtest.h>

#include <cstring>
#include <fstream>
#include <random>
#include <set>
#include <stdexcept>
#include <thread>
#include <algorithm>
#include "vitrify/crc32c.hpp"

#include "vitrify/driver.hpp"
#include "vitrify/graph.hpp"

using namespace vitrify::graph;

namespace {

std::string hex_of(const std::string& s) { return to_hex(sha256(s.data(), s.size())); }

void put64(std::vector<uint8_t>& b, size_t off, uint64_t v) { std::memcpy(b.data() + off, &v, 8); }
uint64_t get64(const std::vector<uint8_t>& b, size_t off) {
  uint64_t v;
  std::memcpy(&v, b.data() + off, 8);
  return v;
}

constexpr uint64_t kBase = 0x7f0000000000ull;
constexpr uint64_t kSize = 1ull << 30;

Hash module_hash(char c) {
  std::string s(10, c);
  return sha256(s.data(), s.size());
}

// A kernel with (float a, float* x, float* y, int n) = offsets 0,8,16,24.
Node axpy_node(uint64_t x, uint64_t y, uint32_t grid) {
  Node n;
  n.kind = NodeKind::kernel;
  n.kernel.module = module_hash('a');
  n.kernel.name = "vitrify_axpy";
  n.kernel.grid = {grid, 1, 1};
  n.kernel.block = {256, 1, 1};
  n.kernel.params.assign(28, 0);
  float a = 2.0f;
  std::memcpy(n.kernel.params.data(), &a, 4);
  put64(n.kernel.params, 8, x);
  put64(n.kernel.params, 16, y);
  int32_t count = 1000;
  std::memcpy(n.kernel.params.data() + 24, &count, 4);
  n.kernel.slots = {{0, 4}, {8, 8}, {16, 8}, {24, 4}};
  return n;
}

Graph sample_graph(uint64_t base = kBase, uint32_t grid = 4) {
  Graph g;
  g.event_count = 1;
  g.nodes.push_back(axpy_node(base + 0x1000, base + 0x2000, grid));
  Node span;  // struct {float* data; int n;} by value, then float
  span.kind = NodeKind::kernel;
  span.kernel.module = module_hash('b');
  span.kernel.name = "vitrify_add_span";
  span.kernel.grid = {grid, 2, 1};
  span.kernel.block = {128, 1, 1};
  span.kernel.shared_mem = 1024;
  span.kernel.params.assign(20, 0);
  put64(span.kernel.params, 0, base + 0x3000);
  span.kernel.slots = {{0, 16}, {16, 4}};
  span.kernel.attributes.push_back({4, std::vector<uint8_t>{2, 0, 0, 0, 1, 0, 0, 0, 1, 0, 0, 0}});
  span.kernel.func_attributes.push_back({8, 65536});
  g.nodes.push_back(span);
  Node cp;
  cp.kind = NodeKind::memcpy;
  cp.memcpy.src_type = 2;
  cp.memcpy.dst_type = 2;
  cp.memcpy.src = base + 0x4000;
  cp.memcpy.dst = 0x1234;  // outside the region: not relocated
  cp.memcpy.width = 4096;
  cp.memcpy.height = 1;
  cp.memcpy.depth = 1;
  g.nodes.push_back(cp);
  Node ms;
  ms.kind = NodeKind::memset;
  ms.memset.dst = base + 0x5000;
  ms.memset.value = 7;
  ms.memset.element_size = 4;
  ms.memset.width = 64;
  g.nodes.push_back(ms);
  Node rec;
  rec.kind = NodeKind::event_record;
  rec.event = 0;
  g.nodes.push_back(rec);
  Node wait;
  wait.kind = NodeKind::event_wait;
  wait.event = 0;
  g.nodes.push_back(wait);
  g.nodes.push_back(Node{});  // empty
  g.edges = {{0, 1}, {1, 2}, {2, 3}, {0, 4}, {4, 5, 0, 0, 0}, {5, 6}, {3, 6, 1, 0, 2}};
  find_relocations(g, base, kSize);
  return g;
}

std::vector<uint8_t> read_file(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  return std::vector<uint8_t>((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
}

std::string fixture(const char* name) {
  const std::string dir = VITRIFY_GRAPH_FIXTURES;
  return dir.empty() ? std::string() : dir + "/" + name;
}

#define REQUIRE_FIXTURES()                                                          \
  do {                                                                              \
    if (std::string(VITRIFY_GRAPH_FIXTURES).empty())                                   \
      GTEST_SKIP() << "nvcc was not found at configure time: no compiled fixtures"; \
  } while (0)

const std::set<std::string> kFixtureKernels = {"vitrify_add_span", "vitrify_axpy", "vitrify_helper_apply",
                                               "_Z13vitrify_scaleIfEvPT_S0_i"};

}  // namespace

// ------------------------------------------------------------------------------------ SHA-256
TEST(Sha256, KnownVectors) {
  EXPECT_EQ(hex_of(""), "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855");
  EXPECT_EQ(hex_of("abc"), "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad");
  EXPECT_EQ(hex_of("abcdbcdecdefdefgefghfghighijhijkijkljklmklmnlmnomnopnopq"),
            "248d6a61d20638b8e5c026930c3e6039a33ce45964ff2167f6ecedd419db06c1");
  EXPECT_EQ(hex_of("abcdefghbcdefghicdefghijdefghijkefghijklfghijklmghijklmnhijklmnoijklmnopjklmnopq"
                   "klmnopqrlmnopqrsmnopqrstnopqrstu"),
            "cf5b16a778af8380036ce59e7b0492370b249b11e8f07a51afac45037afee9d1");
  EXPECT_EQ(hex_of(std::string(1000000, 'a')),
            "cdc76e5c9914fb9281a1c7e284d73e67f1809a48a497200e046d39ccc7112cd0");
}

TEST(Sha256, IncrementalEqualsOneShot) {
  std::mt19937 rng(7);
  std::vector<uint8_t> data(10000);
  for (auto& b : data) b = uint8_t(rng());
  for (size_t len : {0, 1, 55, 56, 63, 64, 65, 119, 120, 128, 10000}) {
    const Hash one = sha256(data.data(), len);
    Sha256 s;
    size_t pos = 0;
    while (pos < len) {
      const size_t k = std::min<size_t>(len - pos, 1 + rng() % 70);
      s.update(data.data() + pos, k);
      pos += k;
    }
    EXPECT_EQ(s.finish(), one) << "length " << len;
  }
}

TEST(Sha256, HexRoundTripAndErrors) {
  const Hash h = sha256("x", 1);
  EXPECT_EQ(hash_from_hex(to_hex(h)), h);
  std::string upper = to_hex(h);
  for (char& c : upper) c = char(std::toupper(c));
  EXPECT_EQ(hash_from_hex(upper), h);
  EXPECT_THROW(hash_from_hex("abc"), std::invalid_argument);
  EXPECT_THROW(hash_from_hex(std::string(63, '0') + "g"), std::invalid_argument);
}

// ------------------------------------------------------------------------------------- format
TEST(GraphFormat, RoundTripIsExact) {
  const Graph g = sample_graph();
  EXPECT_EQ(g.relocations.size(), 5u);  // x, y, span.data, memcpy src, memset dst
  const std::vector<uint8_t> bytes = serialize(g);
  EXPECT_EQ(std::memcmp(bytes.data(), "VTRFGRPH", 8), 0);
  const Graph back = deserialize(bytes.data(), bytes.size());
  EXPECT_EQ(back, g);
  EXPECT_EQ(serialize(back), bytes) << "serialization is deterministic";
}

TEST(GraphFormat, EmptyGraphRoundTrips) {
  const Graph g;
  const auto bytes = serialize(g);
  EXPECT_EQ(deserialize(bytes.data(), bytes.size()), g);
}

TEST(GraphFormat, KernelNamesAndModulesAreStoredOnce) {
  Graph g;
  for (int i = 0; i < 50; ++i) g.nodes.push_back(axpy_node(1, 2, 1 + i));
  const size_t many = serialize(g).size();
  Graph one;
  one.nodes.push_back(axpy_node(1, 2, 1));
  const size_t single = serialize(one).size();
  // A repeated node costs its shape and parameters, not its name or its 32-byte module hash.
  EXPECT_LT((many - single) / 49, 120u);
}

TEST(GraphFormat, RejectsBadMagicVersionAndChecksums) {
  const auto good = serialize(sample_graph());
  auto expect_error = [&](std::vector<uint8_t> b, const std::string& needle) {
    try {
      deserialize(b.data(), b.size());
      ADD_FAILURE() << "no error, expected one mentioning '" << needle << "'";
    } catch (const std::invalid_argument& e) {
      EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
    }
  };
  auto bad_magic = good;
  bad_magic[0] = 'X';
  expect_error(bad_magic, "bad magic");
  auto bad_version = good;
  bad_version[8] = 1;  // version 1, header CRC refreshed so only the version is wrong
  const uint32_t crc = vitrify::crc32c(bad_version.data(), 28);
  std::memcpy(bad_version.data() + 28, &crc, 4);
  expect_error(bad_version, "version 1 is not supported");
  auto bad_header = good;
  bad_header[17] ^= 1;
  expect_error(bad_header, "header checksum");
  auto bad_body = good;
  bad_body[good.size() - 3] ^= 0x40;
  expect_error(bad_body, "body checksum");
  auto trailing = good;
  trailing.push_back(0);
  expect_error(trailing, "trailing");
}

TEST(GraphFormat, EveryTruncationIsAnError) {
  const auto good = serialize(sample_graph());
  for (size_t n = 0; n < good.size(); ++n)
    EXPECT_THROW(deserialize(good.data(), n), std::invalid_argument) << "length " << n;
}

TEST(GraphFormat, EveryFlippedByteIsAnError) {
  const auto good = serialize(sample_graph());
  for (size_t i = 0; i < good.size(); ++i) {
    auto b = good;
    b[i] ^= 0x5A;
    EXPECT_THROW(deserialize(b.data(), b.size()), std::invalid_argument) << "byte " << i;
  }
}

TEST(GraphFormat, ValidateNamesTheProblem) {
  auto expect_error = [](const Graph& g, const std::string& needle) {
    try {
      serialize(g);
      ADD_FAILURE() << "no error, expected '" << needle << "'";
    } catch (const std::invalid_argument& e) {
      EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
    }
  };
  Graph g = sample_graph();
  g.edges.push_back({0, 99});
  expect_error(g, "names a node >= 7");
  g = sample_graph();
  g.edges.push_back({3, 3});
  expect_error(g, "self loop");
  g = sample_graph();
  g.nodes[4].event = 5;
  expect_error(g, "event index 5 >= event count 1");
  g = sample_graph();
  g.nodes[0].kernel.slots.push_back({26, 4});
  expect_error(g, "outside the 28-byte parameter buffer");
  g = sample_graph();
  g.nodes[3].memset.element_size = 3;
  expect_error(g, "element size must be 1, 2 or 4");
  g = sample_graph();
  put64(g.nodes[0].kernel.params, 8, 42);  // a relocated word edited behind the table's back
  expect_error(g, "expected base + ");
  g = sample_graph();
  g.nodes[0].kernel.block.y = 0;
  expect_error(g, "zero grid or block");
}

// --------------------------------------------------------------------------------- relocation
TEST(Relocation, FindsPointerWordsOnlyInsideTheRange) {
  Graph g;
  Node n = axpy_node(kBase, kBase + kSize, 1);  // first word: base (in), second: base+size (out)
  g.nodes.push_back(n);
  EXPECT_EQ(find_relocations(g, kBase, kSize), 1u);
  EXPECT_EQ(g.relocations[0], (Relocation{0, 8, 0}));
  // 4-byte parameters are never read as pointers, even when their bytes would match.
  Graph small;
  Node k = axpy_node(0, 0, 1);
  const uint32_t lo = uint32_t(kBase + 16), hi = uint32_t((kBase + 16) >> 32);
  std::memcpy(k.kernel.params.data() + 0, &lo, 4);  // slot 0 (4 bytes) + padding
  std::memcpy(k.kernel.params.data() + 4, &hi, 4);
  small.nodes.push_back(k);
  EXPECT_EQ(find_relocations(small, kBase, kSize), 0u);
  // A 4-aligned struct holds no naturally aligned pointer: region-like windows inside it are
  // integers (noted for the audit), never relocated.
  Graph odd;
  Node u = axpy_node(0, 0, 1);
  u.kernel.params.assign(24, 0);
  u.kernel.slots = {{4, 20}};
  put64(u.kernel.params, 4, kBase + 8);
  put64(u.kernel.params, 16, kBase + 24);
  odd.nodes.push_back(u);
  EXPECT_EQ(find_relocations(odd, kBase, kSize), 0u);
  ASSERT_EQ(odd.notes.size(), 2u);
  EXPECT_EQ(odd.notes[0], (WordNote{0, 4, kBase + 8, WordReason::unaligned}));
  EXPECT_EQ(odd.notes[1], (WordNote{0, 16, kBase + 24, WordReason::unaligned}));
  EXPECT_TRUE(relocatable(odd));
}

TEST(Relocation, RelocateRewritesAndRoundTrips) {
  const Graph g = sample_graph(kBase);
  const uint64_t other = 0x7e0000000000ull;
  Graph moved = g;
  relocate(moved, other);
  EXPECT_EQ(moved.region_base, other);
  EXPECT_EQ(get64(moved.nodes[0].kernel.params, 8), other + 0x1000);
  EXPECT_EQ(get64(moved.nodes[0].kernel.params, 16), other + 0x2000);
  EXPECT_EQ(get64(moved.nodes[1].kernel.params, 0), other + 0x3000);
  EXPECT_EQ(moved.nodes[2].memcpy.src, other + 0x4000);
  EXPECT_EQ(moved.nodes[2].memcpy.dst, 0x1234u) << "outside the region: untouched";
  EXPECT_EQ(moved.nodes[3].memset.dst, other + 0x5000);
  // The same graph captured at the other base is what relocation produced.
  EXPECT_EQ(moved, sample_graph(other));
  // The table survives the format; relocating back restores the original bytes.
  const auto bytes = serialize(moved);
  Graph back = deserialize(bytes.data(), bytes.size());
  relocate(back, kBase);
  EXPECT_EQ(back, g);
  // Parameter bytes that are not relocated stay identical.
  EXPECT_EQ(std::memcmp(moved.nodes[0].kernel.params.data(), g.nodes[0].kernel.params.data(), 8), 0);
}

TEST(Relocation, DetectsAnEditedWord) {
  Graph g = sample_graph();
  g.nodes[2].memcpy.src += 8;
  EXPECT_THROW(relocate(g, 0x100000000ull), std::invalid_argument);
}

TEST(Relocation, RandomGraphsRelocateExactly) {
  std::mt19937_64 rng(11);
  for (int round = 0; round < 200; ++round) {
    Graph g;
    const size_t nodes = 1 + rng() % 8;
    std::vector<std::pair<uint32_t, uint64_t>> planted;  // (node, offset) of in-region words
    for (size_t i = 0; i < nodes; ++i) {
      Node n;
      n.kind = NodeKind::kernel;
      n.kernel.module = module_hash(char('a' + i));
      n.kernel.name = "k" + std::to_string(i);
      const size_t words = 1 + rng() % 6;
      n.kernel.params.assign(words * 8, 0);
      n.kernel.slots = {{0, uint32_t(words * 8)}};
      for (size_t w = 0; w < words; ++w) {
        const bool in = rng() % 2;
        const uint64_t v = in ? kBase + (rng() % kSize) : (rng() % kBase);
        put64(n.kernel.params, w * 8, v);
      }
      g.nodes.push_back(n);
    }
    const Graph orig = g;
    find_relocations(g, kBase, kSize);
    Graph moved = g;
    const uint64_t nb = (rng() % 1000 + 1) << 32;
    relocate(moved, nb);
    for (size_t i = 0; i < nodes; ++i)
      for (size_t w = 0; w * 8 < g.nodes[i].kernel.params.size(); ++w) {
        const uint64_t before = get64(orig.nodes[i].kernel.params, w * 8);
        const uint64_t after = get64(moved.nodes[i].kernel.params, w * 8);
        const bool in = before >= kBase && before < kBase + kSize;
        EXPECT_EQ(after, in ? before - kBase + nb : before);
      }
    const auto bytes = serialize(moved);
    EXPECT_EQ(deserialize(bytes.data(), bytes.size()), moved);
  }
}

// ---------------------------------------------------------------------------------- topology
TEST(Topology, ParametersAndGridDoNotChangeTheHash) {
  const Graph a = sample_graph(kBase, 4);
  Graph b = sample_graph(kBase, 9);  // another batch size: other grid
  put64(b.nodes[0].kernel.params, 8, kBase + 0x9000);
  b.nodes[3].memset.value = 99;
  EXPECT_EQ(topology_hash(a), topology_hash(b));
  Graph shuffled = a;  // edge order does not matter
  std::reverse(shuffled.edges.begin(), shuffled.edges.end());
  EXPECT_EQ(topology_hash(a), topology_hash(shuffled));
}

TEST(Topology, StructureChangesTheHash) {
  const Hash h = topology_hash(sample_graph());
  auto differs = [&](auto edit, const char* what) {
    Graph g = sample_graph();
    edit(g);
    EXPECT_NE(topology_hash(g), h) << what;
  };
  differs([](Graph& g) { g.nodes[0].kernel.block.x = 128; }, "block");
  differs([](Graph& g) { g.nodes[0].kernel.name = "other"; }, "kernel name");
  differs([](Graph& g) { g.nodes[0].kernel.module = module_hash('z'); }, "module");
  differs([](Graph& g) { g.nodes[1].kernel.shared_mem = 0; }, "shared memory");
  differs([](Graph& g) { g.nodes[1].kernel.attributes.clear(); }, "attributes");
  differs([](Graph& g) { g.nodes[1].kernel.func_attributes[0].value = 1; }, "function attribute");
  differs([](Graph& g) { g.nodes[0].kernel.slots[3].size = 2; }, "parameter layout");
  differs([](Graph& g) { g.edges.pop_back(); }, "edges");
  differs([](Graph& g) { g.edges[0].type = 1; }, "edge type");
  differs([](Graph& g) { g.nodes[2].memcpy.width = 8; }, "memcpy width");
  differs([](Graph& g) { g.nodes.push_back(Node{}); }, "node count");
  differs([](Graph& g) { g.event_count = 2; }, "event count");
}

TEST(Topology, MultiDimensionalCopiesKeepTheirAddresses) {
  Graph a = sample_graph();
  a.nodes[2].memcpy.height = 4;
  a.nodes[2].memcpy.src_pitch = a.nodes[2].memcpy.dst_pitch = 4096;
  Graph b = a;
  b.nodes[2].memcpy.dst = 0x9999;
  EXPECT_NE(topology_hash(a), topology_hash(b));
}

TEST(Topology, GroupsInOrderOfFirstAppearance) {
  const Graph a1 = sample_graph(kBase, 1), a2 = sample_graph(kBase, 2), a3 = sample_graph(kBase, 3);
  Graph b = sample_graph();
  b.nodes.pop_back();
  b.edges.pop_back();
  b.edges.pop_back();
  const auto groups = group_by_topology({&b, &a1, &a2, &b, &a3});
  ASSERT_EQ(groups.size(), 2u);
  EXPECT_EQ(groups[0], (std::vector<size_t>{0, 3}));
  EXPECT_EQ(groups[1], (std::vector<size_t>{1, 2, 4}));
}

TEST(Topology, ReferencedModulesAreUnique) {
  Graph g = sample_graph();
  g.nodes.push_back(axpy_node(0, 0, 1));
  const auto mods = referenced_modules(g);
  EXPECT_EQ(mods.size(), 2u);
  EXPECT_TRUE(std::is_sorted(mods.begin(), mods.end()));
}

// ---------------------------------------------------------------------------- kernel binaries
TEST(KernelNames, CubinEntriesOnly) {
  REQUIRE_FIXTURES();
  const auto cubin = read_file(fixture("graph_kernels.cubin"));
  ASSERT_FALSE(cubin.empty());
  EXPECT_EQ(detect_binary_kind(cubin.data(), cubin.size()), BinaryKind::elf);
  const auto names = kernel_names(cubin.data(), cubin.size());
  EXPECT_EQ(std::set<std::string>(names.begin(), names.end()), kFixtureKernels)
      << "__global__ functions only; the __device__ helper is not an entry";
}

TEST(KernelNames, FatbinAndPtx) {
  REQUIRE_FIXTURES();
  const auto fat = read_file(fixture("graph_kernels.fatbin"));
  EXPECT_EQ(detect_binary_kind(fat.data(), fat.size()), BinaryKind::fatbin);
  const auto fn = kernel_names(fat.data(), fat.size());
  EXPECT_EQ(std::set<std::string>(fn.begin(), fn.end()), kFixtureKernels);
  const auto ptx = read_file(fixture("graph_kernels.ptx"));
  EXPECT_EQ(detect_binary_kind(ptx.data(), ptx.size()), BinaryKind::ptx);
  const auto pn = kernel_names(ptx.data(), ptx.size());
  EXPECT_EQ(std::set<std::string>(pn.begin(), pn.end()), kFixtureKernels);
}

TEST(KernelNames, TruncatedOrCorruptElfNeverCrashes) {
  REQUIRE_FIXTURES();
  const auto cubin = read_file(fixture("graph_kernels.cubin"));
  size_t errors = 0;
  for (size_t n = 0; n < cubin.size(); n += 7) {
    try {
      kernel_code_hash(cubin.data(), n, "vitrify_axpy");
    } catch (const std::invalid_argument&) {
    }
    try {
      const auto names = kernel_names(cubin.data(), n);
      for (const auto& s : names) EXPECT_TRUE(kFixtureKernels.count(s)) << s;
    } catch (const std::invalid_argument&) {
      ++errors;
    }
  }
  EXPECT_GT(errors, 0u) << "a truncated section table must be reported";
  std::mt19937 rng(3);
  for (int i = 0; i < 300; ++i) {
    auto b = cubin;
    b[rng() % b.size()] ^= uint8_t(1 + rng() % 255);
    try {
      kernel_names(b.data(), b.size());
    } catch (const std::invalid_argument&) {
    }
    try {
      kernel_code_hash(b.data(), b.size(), "vitrify_axpy");
    } catch (const std::invalid_argument&) {
    }
  }
}

TEST(KernelNames, UnknownBytesHaveNoKernels) {
  const std::string junk = "\x01\x02\x03 not a binary";
  EXPECT_EQ(detect_binary_kind(junk.data(), junk.size()), BinaryKind::unknown);
  EXPECT_TRUE(kernel_names(junk.data(), junk.size()).empty());
  const std::string ptx = "//\n.version 8.0\n.target sm_90\n.visible .entry foo_1(\n) {}\n"
                          ".entry  bar$x (\n.func notme()\nx.entry no(";
  const auto names = kernel_names(ptx.data(), ptx.size());
  EXPECT_EQ(names, (std::vector<std::string>{"bar$x", "foo_1"}));
}

TEST(ModuleRegistry, DedupesAndIndexesKernels) {
  REQUIRE_FIXTURES();
  const auto cubin = read_file(fixture("graph_kernels.cubin"));
  const auto ptx = read_file(fixture("graph_kernels.ptx"));
  ModuleRegistry reg;
  const Hash h1 = reg.add(cubin.data(), cubin.size());
  EXPECT_EQ(reg.add(cubin.data(), cubin.size()), h1);
  EXPECT_EQ(h1, sha256(cubin.data(), cubin.size()));
  const Hash h2 = reg.add(ptx.data(), ptx.size());
  EXPECT_EQ(reg.size(), 2u);
  EXPECT_EQ(reg.total_bytes(), cubin.size() + ptx.size());
  auto m = reg.get(h1);
  ASSERT_TRUE(m);
  EXPECT_EQ(m->bytes, cubin);
  EXPECT_EQ(m->kind, BinaryKind::elf);
  auto both = reg.modules_with_kernel("vitrify_axpy");
  std::vector<Hash> expect = {h1, h2};
  std::sort(expect.begin(), expect.end());
  EXPECT_EQ(both, expect);
  EXPECT_TRUE(reg.modules_with_kernel("vitrify_helper").empty());
  EXPECT_EQ(reg.get(module_hash('q')), nullptr);
  reg.clear();
  EXPECT_EQ(reg.size(), 0u);
  EXPECT_TRUE(reg.modules_with_kernel("vitrify_axpy").empty());
}

TEST(ModuleRegistry, ConcurrentAddsAreSafe) {
  ModuleRegistry reg;
  std::vector<std::thread> threads;
  for (int t = 0; t < 4; ++t)
    threads.emplace_back([&reg] {
      for (int i = 0; i < 200; ++i) {
        const std::string s = ".version 8.0\n.entry k" + std::to_string(i % 50) + "(\n";
        reg.add(s.data(), s.size());
      }
    });
  for (auto& t : threads) t.join();
  EXPECT_EQ(reg.size(), 50u);
  EXPECT_EQ(reg.modules_with_kernel("k7").size(), 1u);
}

// ------------------------------------------------------- GraphSet and the recorder, no driver
#include "vitrify/graph_cuda.hpp"

TEST(GraphSetCpu, AddNamesAMissingModule) {
  GraphSet set(0);
  Graph g = sample_graph();
  try {
    set.add(g);
    FAIL() << "no error";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("vitrify_axpy"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find(to_hex(module_hash('a'))), std::string::npos) << e.what();
  }
}

TEST(GraphSetCpu, ModuleHashIsChecked) {
  GraphSet set(0);
  const std::string bytes = ".version 8.0\n.entry k(\n";
  const Hash right = sha256(bytes.data(), bytes.size());
  EXPECT_EQ(set.add_module(bytes.data(), bytes.size(), &right), right);
  const Hash wrong = module_hash('w');
  EXPECT_THROW(set.add_module(bytes.data(), bytes.size(), &wrong), std::invalid_argument);
  // check=false: bytes another checksum verified keep the name they were saved under, unhashed
  EXPECT_EQ(set.add_module(bytes.data(), bytes.size(), &wrong, false), wrong);
  // ...and without a name they are hashed all the same
  EXPECT_EQ(set.add_module(bytes.data(), bytes.size(), nullptr, false), right);
}

TEST(GraphSetCpu, TemplatesAndLifecycleWithoutADriver) {
  GraphSet set(0);
  for (char c : {'a', 'b'}) {
    const std::string s(10, c);  // module_hash(c) is sha256 of these bytes
    set.add_module(s.data(), s.size());
  }
  EXPECT_EQ(set.add(sample_graph(kBase, 1)), 0u);
  EXPECT_EQ(set.add(sample_graph(kBase, 7)), 1u);
  Graph other = sample_graph();
  other.nodes[0].kernel.block.x = 64;
  EXPECT_EQ(set.add(other), 2u);
  EXPECT_EQ(set.template_of(0), set.template_of(1));
  EXPECT_NE(set.template_of(0), set.template_of(2));
  EXPECT_THROW(set.wait(0), std::invalid_argument) << "wait before start";
  EXPECT_THROW(set.start(0), std::invalid_argument);
  set.start(2);
  EXPECT_THROW(set.start(1), std::invalid_argument);
  EXPECT_THROW(set.add(sample_graph()), std::invalid_argument) << "add after start";
  EXPECT_THROW(set.wait(3), std::invalid_argument);
  if (vitrify::driver::available()) GTEST_SKIP() << "a driver is present: the build would succeed";
  // Without a driver each build fails, and waiting (or launching) reports why.
  EXPECT_THROW(set.wait(1), vitrify::DriverUnavailable);
  EXPECT_THROW(set.launch(2, 0), vitrify::DriverUnavailable);
  EXPECT_THROW(set.wait_all(), vitrify::DriverUnavailable);
  const RebuildStats st = set.stats();
  EXPECT_EQ(st.graphs, 3u);
  EXPECT_EQ(st.templates, 2u);
  EXPECT_EQ(st.built_templates, 0u);
}

TEST(ModuleRecorderCpu, UnloadableCuptiIsAClearError) {
  ModuleRecorder::instance().set_cupti_path("/nonexistent/libcupti.so.13");
  try {
    ModuleRecorder::instance().start();
    FAIL() << "no error";
  } catch (const vitrify::Error& e) {
    EXPECT_NE(std::string(e.what()).find("/nonexistent/libcupti.so.13"), std::string::npos)
        << e.what();
    EXPECT_NE(std::string(e.what()).find("VITRIFY_CUPTI_PATH"), std::string::npos) << e.what();
  }
  ModuleRecorder::instance().set_cupti_path("");
  EXPECT_FALSE(ModuleRecorder::instance().active());
}

TEST(KernelNames, CodeHashIdentifiesTheSameMachineCodeAcrossBinaries) {
  REQUIRE_FIXTURES();
  const auto a = read_file(fixture("graph_kernels.cubin"));
  const auto b = read_file(fixture("graph_kernels2.cubin"));
  ASSERT_FALSE(b.empty());
  ASSERT_NE(sha256(a.data(), a.size()), sha256(b.data(), b.size()));
  const std::string scale = "_Z13vitrify_scaleIfEvPT_S0_i";
  const Hash ha = kernel_code_hash(a.data(), a.size(), scale);
  EXPECT_NE(ha, Hash{});
  EXPECT_EQ(ha, kernel_code_hash(b.data(), b.size(), scale));
  EXPECT_NE(kernel_code_hash(a.data(), a.size(), "vitrify_axpy"), ha);
  EXPECT_NE(kernel_code_hash(a.data(), a.size(), "vitrify_axpy"), Hash{});
  EXPECT_EQ(kernel_code_hash(b.data(), b.size(), "vitrify_axpy"), Hash{}) << "not in b";
  const auto ptx = read_file(fixture("graph_kernels.ptx"));
  EXPECT_EQ(kernel_code_hash(ptx.data(), ptx.size(), scale), Hash{}) << "PTX has no machine code";
}

// ------------------------------------------------- relocation safety (layout + provenance)
namespace {

// The region base of the relocation bug: the upper half of every address is 0x6000 = 24576,
// a dimension real models use (6 x 4096, 24 x 1024).
constexpr uint64_t kLowBase = 0x600000000000ull;
constexpr uint64_t kLowSize = 64ull << 30;
constexpr uint32_t kHi = uint32_t(kLowBase >> 32);                   // 24576
constexpr uint32_t kHiLast = uint32_t((kLowBase + kLowSize - 1) >> 32);

void put32(std::vector<uint8_t>& b, size_t off, uint32_t v) { std::memcpy(b.data() + off, &v, 4); }

Node kernel_node(const char* name, size_t bytes, std::vector<ParamSlot> slots) {
  Node n;
  n.kind = NodeKind::kernel;
  n.kernel.module = module_hash('r');
  n.kernel.name = name;
  n.kernel.grid = {1, 1, 1};
  n.kernel.block = {32, 1, 1};
  n.kernel.params.assign(bytes, 0);
  n.kernel.slots = std::move(slots);
  return n;
}

ScanOptions low_scan(std::vector<std::pair<uint64_t, uint64_t>> live) {
  ScanOptions o;
  o.base = kLowBase;
  o.size = kLowSize;
  o.live = std::move(live);
  return o;
}

// Every byte of every kernel node except the words the test names as pointers is unchanged
// after relocating by `shift`; the pointers moved by exactly `shift`.
void expect_only_pointers_moved(const Graph& before, const Graph& after, int64_t shift,
                                const std::set<std::pair<uint32_t, uint32_t>>& pointers) {
  for (uint32_t i = 0; i < before.nodes.size(); ++i) {
    if (before.nodes[i].kind != NodeKind::kernel) continue;
    const auto& a = before.nodes[i].kernel.params;
    const auto& b = after.nodes[i].kernel.params;
    ASSERT_EQ(a.size(), b.size());
    for (uint32_t o = 0; o < a.size();) {
      if (pointers.count({i, o})) {
        uint64_t x, y;
        std::memcpy(&x, a.data() + o, 8);
        std::memcpy(&y, b.data() + o, 8);
        EXPECT_EQ(int64_t(y - x), shift) << "node " << i << " pointer at byte " << o;
        o += 8;
      } else {
        EXPECT_EQ(a[o], b[o]) << "node " << i << " byte " << o << " changed";
        ++o;
      }
    }
  }
}

}  // namespace

TEST(RelocationSafety, PairsOfInt32ParametersAreNeverReadAsPointers) {
  // (int32 n, int32 m) with m = base >> 32, and a pair equal to base + size - 1: two 4-byte
  // parameters, never one 8-byte word — the relocation bug at hidden size 4096.
  Graph g;
  Node k = kernel_node("pair_kernel", 24, {{0, 4}, {4, 4}, {8, 4}, {12, 4}, {16, 8}});
  put32(k.kernel.params, 0, 7);
  put32(k.kernel.params, 4, kHi);
  const uint64_t last = kLowBase + kLowSize - 1;
  put32(k.kernel.params, 8, uint32_t(last));
  put32(k.kernel.params, 12, kHiLast);
  put64(k.kernel.params, 16, kLowBase + 0x1000);  // a real pointer parameter
  g.nodes.push_back(k);
  EXPECT_EQ(find_relocations(g, low_scan({{0, kLowSize}})), 1u);
  EXPECT_EQ(g.relocations[0], (Relocation{0, 16, 0x1000, WordKind::pointer_param}));
  EXPECT_TRUE(g.notes.empty());
  for (int64_t shift : {int64_t(2) << 20, int64_t(1) << 30, int64_t(64) << 30, -(int64_t(4) << 40)}) {
    Graph moved = g;
    relocate(moved, kLowBase + shift);
    expect_only_pointers_moved(g, moved, shift, {{0, 16}});
  }
}

TEST(RelocationSafety, EightByteParametersNeedALiveAllocation) {
  // An int64 size that falls in the range but in no live allocation: may be a dangling pointer
  // or an integer — unclassified, the graph refuses to move (at its own base it still loads).
  Graph g;
  Node k = kernel_node("int64_kernel", 24, {{0, 8}, {8, 8}, {16, 8}});
  put64(k.kernel.params, 0, 4096);                          // a plain size: not region-like
  put64(k.kernel.params, 8, kLowBase + (8ull << 30));       // region-like, nothing allocated there
  put64(k.kernel.params, 16, kLowBase + 0x10);              // a live pointer
  g.nodes.push_back(k);
  EXPECT_EQ(find_relocations(g, low_scan({{0, 1 << 20}})), 1u);
  ASSERT_EQ(g.notes.size(), 1u);
  EXPECT_EQ(g.notes[0], (WordNote{0, 8, kLowBase + (8ull << 30), WordReason::dangling_param}));
  EXPECT_FALSE(relocatable(g));
  Graph same = g;
  EXPECT_NO_THROW(relocate(same, kLowBase));
  EXPECT_EQ(same, g);
  Graph other = g;
  try {
    relocate(other, kLowBase + (64ull << 30));
    ADD_FAILURE() << "relocating a graph with an unclassified word must fail";
  } catch (const std::invalid_argument& e) {
    const std::string m = e.what();
    EXPECT_NE(m.find("not relocatable"), std::string::npos) << m;
    EXPECT_NE(m.find("int64_kernel"), std::string::npos) << m;
    EXPECT_NE(m.find("parameter byte 8"), std::string::npos) << m;
  }
  EXPECT_EQ(other, g);  // nothing was rewritten
}

TEST(RelocationSafety, StructsMixingIntegersAndPointers) {
  // struct { int32 a; int32 b; float* p; int64 n; float* q; int32 c; int32 d; } by value,
  // 40 bytes at offset 8 after a 4-byte int (padding 4..8).
  Graph g;
  Node k = kernel_node("struct_kernel", 48, {{0, 4}, {8, 40}});
  auto& p = k.kernel.params;
  put32(p, 0, kHi);                            // a 4-byte parameter equal to base >> 32
  put32(p, 8, 5);                              // a = 5
  put32(p, 12, kHi);                           // b = 24576: (a, b) reads as base + 5
  put64(p, 16, kLowBase + 0x200000);           // p: live
  put64(p, 24, 24576ull * 4096);               // n: a large integer, not region-like
  put64(p, 32, kLowBase + (1ull << 30) + 64);  // q: live (second allocation)
  put32(p, 40, 0x100000);                      // (c, d) = base + 1 MiB: in range, in no allocation
  put32(p, 44, kHi);
  g.nodes.push_back(k);
  const std::vector<std::pair<uint64_t, uint64_t>> live = {{0x200000, 0x200000},
                                                            {1ull << 30, 2 << 20}};
  EXPECT_EQ(find_relocations(g, low_scan(live)), 2u);
  EXPECT_EQ(g.relocations[0], (Relocation{0, 16, 0x200000, WordKind::struct_word}));
  EXPECT_EQ(g.relocations[1], (Relocation{0, 32, (1ull << 30) + 64, WordKind::struct_word}));
  ASSERT_EQ(g.notes.size(), 2u);
  EXPECT_EQ(g.notes[0], (WordNote{0, 8, kLowBase + 5, WordReason::no_allocation}));
  EXPECT_EQ(g.notes[1], (WordNote{0, 40, kLowBase + 0x100000, WordReason::no_allocation}));
  EXPECT_TRUE(relocatable(g));
  for (int64_t shift : {int64_t(2) << 20, int64_t(1) << 30, int64_t(64) << 30, -(int64_t(1) << 40)}) {
    Graph moved = g;
    relocate(moved, kLowBase + shift);
    expect_only_pointers_moved(g, moved, shift, {{0, 16}, {0, 32}});
    Graph back = moved;  // and back again, exactly
    relocate(back, kLowBase);
    EXPECT_EQ(back.nodes, g.nodes);
  }
}

TEST(RelocationSafety, AStructWordAtTheEndOfAnAllocationIsUnclassified) {
  Graph g;
  Node k = kernel_node("end_kernel", 16, {{0, 16}});
  put64(k.kernel.params, 0, kLowBase + 0x1000);  // begin: live
  put64(k.kernel.params, 8, kLowBase + 0x3000);  // end: one past the allocation
  g.nodes.push_back(k);
  EXPECT_EQ(find_relocations(g, low_scan({{0x1000, 0x2000}})), 1u);
  ASSERT_EQ(g.notes.size(), 1u);
  EXPECT_EQ(g.notes[0].reason, WordReason::allocation_end);
  EXPECT_FALSE(relocatable(g));
}

TEST(RelocationSafety, WindowsAtFourModEightAreIntegersByTheAbi) {
  // cuBLAS's GEMM parameter struct holds (0, N) at a 4-mod-8 offset; with N = 24576 the window
  // reads as the region base itself. The ABI aligns every pointer to 8 bytes, so such windows
  // are integer pairs: never rewritten, noted for the audit, the graph stays relocatable. (A
  // packed struct { int32 a; float* p; } would hide p the same way: not supported.)
  Graph g;
  Node k = kernel_node("gemm_params", 24, {{0, 24}});
  put32(k.kernel.params, 0, 3);
  put32(k.kernel.params, 4, 0);    // (0, 24576) at byte 4 reads as base + 0
  put32(k.kernel.params, 8, kHi);
  put64(k.kernel.params, 16, kLowBase + (2 << 20));  // an aligned pointer
  g.nodes.push_back(k);
  EXPECT_EQ(find_relocations(g, low_scan({{0, 1 << 20}, {2 << 20, 1 << 20}})), 1u);
  ASSERT_EQ(g.notes.size(), 1u);
  EXPECT_EQ(g.notes[0], (WordNote{0, 4, kLowBase, WordReason::unaligned}));
  EXPECT_TRUE(relocatable(g));
  Graph moved = g;
  relocate(moved, kLowBase + (1ull << 30));
  expect_only_pointers_moved(g, moved, int64_t(1) << 30, {{0, 16}});
}

TEST(RelocationSafety, FieldEvidenceTurnsRegionLikeIntegersBackIntoIntegers) {
  // The same kernel launched twice (batch sizes 6 and 8 of a ladder): a struct field holds
  // (x, 6 * 4096) in one launch — base + x, inside the live weights — and (x, 8 * 4096) =
  // 0x8000xxxxxxxx, no user address, in the other. The field is an integer in both.
  FieldEvidence ev;
  const std::vector<std::pair<uint64_t, uint64_t>> live = {{0, 16ull << 30}};
  auto launch = [&](uint32_t hi) {
    Graph g;
    Node k = kernel_node("ladder_kernel", 24, {{0, 24}});
    put32(k.kernel.params, 0, 3 << 20);  // (3 MiB, hi): past the small-offset check
    put32(k.kernel.params, 4, hi);
    put64(k.kernel.params, 8, kLowBase + (5ull << 30));  // a real pointer, the same in both
    put64(k.kernel.params, 16, 0);                 // a null pointer
    g.nodes.push_back(k);
    find_relocations(g, low_scan(live), &ev);
    return g;
  };
  Graph bs6 = launch(6 * 4096), bs8 = launch(8 * 4096);
  EXPECT_EQ(bs6.relocations.size(), 2u);  // before the evidence: (3 MiB, 24576) looks like a pointer
  EXPECT_EQ(bs8.relocations.size(), 1u);
  // Noted: byte 0 (the (3 MiB, 8 * 4096) launch), and the unaligned windows at byte 4 (the
  // dimension followed by the pointer's low half 0x40000000: above the user address space) and
  // byte 12 (the pointer's upper half followed by the null word: a small integer).
  EXPECT_EQ(ev.size(), 3u);
  EXPECT_TRUE(ev.is_integer(module_hash('r'), "ladder_kernel", 4));
  EXPECT_TRUE(ev.is_integer(module_hash('r'), "ladder_kernel", 0));
  EXPECT_TRUE(ev.is_integer(module_hash('r'), "ladder_kernel", 12));
  EXPECT_FALSE(ev.is_integer(module_hash('r'), "ladder_kernel", 8));
  EXPECT_EQ(apply_evidence(bs6, ev), 1u);
  ASSERT_EQ(bs6.relocations.size(), 1u);
  EXPECT_EQ(bs6.relocations[0].offset, 8u);
  ASSERT_EQ(bs6.notes.size(), 1u);
  EXPECT_EQ(bs6.notes[0].reason, WordReason::integer_field);
  Graph moved = bs6;
  relocate(moved, kLowBase + (64ull << 30));
  expect_only_pointers_moved(bs6, moved, int64_t(64) << 30, {{0, 8}});
  // Evidence also resolves unclassified words of that field.
  Graph dangling;
  Node k = kernel_node("int64_ladder", 8, {{0, 8}});
  put64(k.kernel.params, 0, kLowBase + (32ull << 30));  // an int64 in the range, in no allocation
  dangling.nodes.push_back(k);
  find_relocations(dangling, low_scan(live), nullptr);
  ASSERT_FALSE(relocatable(dangling));
  ev.note_integer(module_hash('r'), "int64_ladder", 0);
  EXPECT_EQ(apply_evidence(dangling, ev), 1u);
  EXPECT_TRUE(relocatable(dangling));
}

TEST(RelocationSafety, DriverKnowledgeDecidesAddressesOutsideTheRange) {
  FieldEvidence ev;
  ScanOptions o = low_scan({{0, 1 << 20}});
  o.is_device_pointer = [](uint64_t v) { return v == 0x7f1200000000ull; };
  Graph g;
  Node k = kernel_node("outside_kernel", 24, {{0, 8}, {8, 8}, {16, 8}});
  put64(k.kernel.params, 0, 0x7f1200000000ull);   // a device pointer outside the region
  put64(k.kernel.params, 8, 0x123400000001ull);   // unknown to the driver: an integer
  put64(k.kernel.params, 16, ~uint64_t(0));       // the all-ones sentinel says nothing
  g.nodes.push_back(k);
  find_relocations(g, o, &ev);
  EXPECT_FALSE(ev.is_integer(module_hash('r'), "outside_kernel", 0));
  EXPECT_TRUE(ev.is_integer(module_hash('r'), "outside_kernel", 8));
  EXPECT_FALSE(ev.is_integer(module_hash('r'), "outside_kernel", 16));
}

TEST(RelocationSafety, TensorMapsAndCopiesAreRelocatedByKind) {
  Graph g;
  Node k = kernel_node("tma_kernel", 192, {{0, 8}, {64, 128}});
  put64(k.kernel.params, 0, kLowBase + 0x100);
  put64(k.kernel.params, 64, kLowBase + 0x8000);   // the tensor map's global address word
  put32(k.kernel.params, 72, 4096);                 // dims: not region-like
  put32(k.kernel.params, 76, kHi);                  // (4096, 24576) = base + 4096: no allocation
  g.nodes.push_back(k);
  Node cp;
  cp.kind = NodeKind::memcpy;
  cp.memcpy.src_type = cp.memcpy.dst_type = 2;
  cp.memcpy.src = kLowBase + (32ull << 30);  // not live: copies are pointers by type
  cp.memcpy.dst = kLowBase + 0x100;
  cp.memcpy.width = 16;
  cp.memcpy.height = cp.memcpy.depth = 1;
  g.nodes.push_back(cp);
  EXPECT_EQ(find_relocations(g, low_scan({{0x100, 0x100}, {0x8000, 0x1000}})), 4u);
  EXPECT_EQ(g.relocations[0].kind, WordKind::pointer_param);
  EXPECT_EQ(g.relocations[1].kind, WordKind::tensor_map);
  EXPECT_EQ(g.relocations[2].kind, WordKind::copy_address);
  EXPECT_EQ(g.relocations[3].kind, WordKind::copy_address);
  ASSERT_EQ(g.notes.size(), 1u);
  EXPECT_EQ(g.notes[0], (WordNote{0, 72, kLowBase + 4096, WordReason::no_allocation}));
}

TEST(RelocationSafety, KindsAndNotesSurviveTheFileFormat) {
  Graph g;
  Node k = kernel_node("struct_kernel", 48, {{0, 4}, {8, 40}});
  put32(k.kernel.params, 8, 5);
  put32(k.kernel.params, 12, kHi);
  put64(k.kernel.params, 16, kLowBase + 0x200000);
  put64(k.kernel.params, 36, kLowBase + 0x200010);  // unaligned, live
  g.nodes.push_back(k);
  find_relocations(g, low_scan({{0x200000, 0x200000}}));
  ASSERT_EQ(g.notes.size(), 2u);
  const auto bytes = serialize(g);
  EXPECT_EQ(deserialize(bytes.data(), bytes.size()), g);
  for (size_t i = 0; i < bytes.size(); ++i) {
    auto b = bytes;
    b[i] ^= 0x5A;
    EXPECT_THROW(deserialize(b.data(), b.size()), std::invalid_argument) << "byte " << i;
  }
  for (size_t n = 0; n < bytes.size(); ++n)
    EXPECT_THROW(deserialize(bytes.data(), n), std::invalid_argument) << "length " << n;
}

TEST(RelocationSafety, SquareDimensionsAtTheBaseUpperHalfAreUnclassified) {
  // cuBLAS's scal kernel and cuDNN's attention hold (24576, 24576) as one aligned struct word:
  // base + 24576 at base 0x600000000000, inside the first live allocation. Such a word (low half
  // below 1 MiB, no allocation's start) is unclassified: refused at another base, never moved.
  Graph g;
  Node k = kernel_node("cudnn_like", 32, {{0, 32}});
  put32(k.kernel.params, 0, 24576);
  put32(k.kernel.params, 4, kHi);
  put64(k.kernel.params, 8, kLowBase);                   // the first allocation's start
  put64(k.kernel.params, 16, kLowBase + (256ull << 20));  // inside it, 256 MiB in
  g.nodes.push_back(k);
  EXPECT_EQ(find_relocations(g, low_scan({{0, 1ull << 30}})), 2u);
  ASSERT_EQ(g.notes.size(), 1u);
  EXPECT_EQ(g.notes[0], (WordNote{0, 0, kLowBase + 24576, WordReason::small_offset}));
  EXPECT_FALSE(relocatable(g));
  Graph moved = g;
  EXPECT_THROW(relocate(moved, kLowBase + (64ull << 30)), std::invalid_argument);
  EXPECT_EQ(moved, g);
}
