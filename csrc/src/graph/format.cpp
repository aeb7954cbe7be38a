// The graph description: validation, the binary file format, relocation and topology hashing.
// DESIGN.md in this directory documents the layout byte by byte.
#include <algorithm>
#include <cstring>
#include <set>
#include <sstream>
#include <tuple>
#include <unordered_map>

#include "vitrify/crc32c.hpp"
#include "vitrify/graph.hpp"

namespace vitrify::graph {

const char* kind_name(NodeKind k) noexcept {
  switch (k) {
    case NodeKind::kernel: return "kernel";
    case NodeKind::memcpy: return "memcpy";
    case NodeKind::memset: return "memset";
    case NodeKind::event_record: return "event_record";
    case NodeKind::event_wait: return "event_wait";
    case NodeKind::empty: return "empty";
  }
  return "invalid";
}

namespace {

std::string node_label(const Graph& g, size_t i) {
  std::string s = "node " + std::to_string(i);
  if (i < g.nodes.size()) {
    s += std::string(" (") + kind_name(g.nodes[i].kind);
    if (g.nodes[i].kind == NodeKind::kernel) s += " " + g.nodes[i].kernel.name;
    s += ")";
  }
  return s;
}

uint64_t load_u64(const uint8_t* p) {
  uint64_t v;
  std::memcpy(&v, p, 8);  // the format and all CUDA hosts are little-endian
  return v;
}
void store_u64(uint8_t* p, uint64_t v) { std::memcpy(p, &v, 8); }

// The 8-byte word a relocation points at, or nullptr when the relocation is malformed.
uint64_t* reloc_word(Node& n, uint32_t offset) {
  switch (n.kind) {
    case NodeKind::kernel:
      return nullptr;  // kernel words live in a byte buffer; handled by callers
    case NodeKind::memcpy:
      if (offset == 0) return &n.memcpy.src;
      if (offset == 8) return &n.memcpy.dst;
      return nullptr;
    case NodeKind::memset:
      return offset == 0 ? &n.memset.dst : nullptr;
    default:
      return nullptr;
  }
}

// Reads the word a relocation names; false when it names no word.
bool read_reloc(const Graph& g, const Relocation& r, uint64_t* out) {
  if (r.node >= g.nodes.size()) return false;
  Node& n = const_cast<Node&>(g.nodes[r.node]);
  if (n.kind == NodeKind::kernel) {
    if (r.offset % 8 != 0 || size_t(r.offset) + 8 > n.kernel.params.size()) return false;
    *out = load_u64(n.kernel.params.data() + r.offset);
    return true;
  }
  const uint64_t* w = reloc_word(n, r.offset);
  if (w == nullptr) return false;
  *out = *w;
  return true;
}

void write_reloc(Graph& g, const Relocation& r, uint64_t v) {
  Node& n = g.nodes[r.node];
  if (n.kind == NodeKind::kernel)
    store_u64(n.kernel.params.data() + r.offset, v);
  else
    *reloc_word(n, r.offset) = v;
}

}  // namespace

void validate(const Graph& g) {
  const size_t n = g.nodes.size();
  VITRIFY_EXPECT(n <= UINT32_MAX, "graph has too many nodes: " + std::to_string(n));
  for (size_t i = 0; i < n; ++i) {
    const Node& node = g.nodes[i];
    switch (node.kind) {
      case NodeKind::kernel: {
        const KernelNode& k = node.kernel;
        VITRIFY_EXPECT(!k.name.empty(), node_label(g, i) + ": kernel without a name");
        VITRIFY_EXPECT(k.grid.x && k.grid.y && k.grid.z && k.block.x && k.block.y && k.block.z,
                    node_label(g, i) + ": zero grid or block dimension");
        VITRIFY_EXPECT(k.params.size() <= UINT32_MAX, node_label(g, i) + ": parameter buffer too large");
        for (size_t s = 0; s < k.slots.size(); ++s) {
          const ParamSlot& p = k.slots[s];
          VITRIFY_EXPECT(uint64_t(p.offset) + p.size <= k.params.size(),
                      node_label(g, i) + ": parameter " + std::to_string(s) + " [" +
                          std::to_string(p.offset) + ", +" + std::to_string(p.size) +
                          ") lies outside the " + std::to_string(k.params.size()) +
                          "-byte parameter buffer");
          VITRIFY_EXPECT(s == 0 || p.offset >= k.slots[s - 1].offset + k.slots[s - 1].size,
                      node_label(g, i) + ": parameter " + std::to_string(s) +
                          " overlaps or precedes the previous one");
        }
        for (const LaunchAttribute& a : k.attributes)
          VITRIFY_EXPECT(a.value.size() <= 0xFFFF, node_label(g, i) + ": attribute " +
                                                    std::to_string(a.id) + " value too large");
        VITRIFY_EXPECT(k.attributes.size() <= 0xFFFF && k.func_attributes.size() <= 0xFFFF,
                    node_label(g, i) + ": too many attributes");
        break;
      }
      case NodeKind::memcpy:
        break;
      case NodeKind::memset:
        VITRIFY_EXPECT(node.memset.element_size == 1 || node.memset.element_size == 2 ||
                        node.memset.element_size == 4,
                    node_label(g, i) + ": memset element size must be 1, 2 or 4, got " +
                        std::to_string(node.memset.element_size));
        break;
      case NodeKind::event_record:
      case NodeKind::event_wait:
        VITRIFY_EXPECT(node.event < g.event_count,
                    node_label(g, i) + ": event index " + std::to_string(node.event) +
                        " >= event count " + std::to_string(g.event_count));
        break;
      case NodeKind::empty:
        break;
      default:
        VITRIFY_EXPECT(false, "node " + std::to_string(i) + ": invalid node kind " +
                               std::to_string(int(node.kind)));
    }
  }
  for (size_t e = 0; e < g.edges.size(); ++e) {
    const Edge& ed = g.edges[e];
    VITRIFY_EXPECT(ed.from < n && ed.to < n, "edge " + std::to_string(e) + " (" +
                                              std::to_string(ed.from) + " -> " +
                                              std::to_string(ed.to) + ") names a node >= " +
                                              std::to_string(n));
    VITRIFY_EXPECT(ed.from != ed.to, "edge " + std::to_string(e) + " is a self loop on node " +
                                      std::to_string(ed.from));
  }
  VITRIFY_EXPECT(g.region_base + g.region_size >= g.region_base,
              "relocation range wraps around: base " + std::to_string(g.region_base) + " size " +
                  std::to_string(g.region_size));
  for (size_t r = 0; r < g.relocations.size(); ++r) {
    const Relocation& rl = g.relocations[r];
    uint64_t word = 0;
    VITRIFY_EXPECT(read_reloc(g, rl, &word), "relocation " + std::to_string(r) + " names no " +
                                              "8-byte word: " + node_label(g, rl.node) +
                                              " offset " + std::to_string(rl.offset));
    VITRIFY_EXPECT(rl.region_offset < g.region_size,
                "relocation " + std::to_string(r) + ": region offset " +
                    std::to_string(rl.region_offset) + " >= region size " +
                    std::to_string(g.region_size));
    VITRIFY_EXPECT(word == g.region_base + rl.region_offset,
                "relocation " + std::to_string(r) + " (" + node_label(g, rl.node) + " offset " +
                    std::to_string(rl.offset) + "): word holds " + std::to_string(word) +
                    ", expected base + " + std::to_string(rl.region_offset) + " = " +
                    std::to_string(g.region_base + rl.region_offset));
    VITRIFY_EXPECT(r == 0 || std::tie(g.relocations[r - 1].node, g.relocations[r - 1].offset) <
                              std::tie(rl.node, rl.offset),
                "relocation " + std::to_string(r) + " is not in ascending (node, offset) order");
    VITRIFY_EXPECT(uint8_t(rl.kind) >= 1 && uint8_t(rl.kind) <= 4,
                   "relocation " + std::to_string(r) + ": unknown word kind " +
                       std::to_string(int(rl.kind)));
    VITRIFY_EXPECT((rl.kind == WordKind::copy_address) == (g.nodes[rl.node].kind != NodeKind::kernel),
                   "relocation " + std::to_string(r) + " (" + node_label(g, rl.node) +
                       "): word kind " + word_kind_name(rl.kind) + " does not fit the node");
  }
  for (size_t i = 0; i < g.notes.size(); ++i) {
    const WordNote& w = g.notes[i];
    VITRIFY_EXPECT(w.node < n && g.nodes[w.node].kind == NodeKind::kernel,
                   "word note " + std::to_string(i) + " names node " + std::to_string(w.node) +
                       ", not a kernel node");
    VITRIFY_EXPECT(w.offset % 4 == 0 && uint64_t(w.offset) + 8 <= g.nodes[w.node].kernel.params.size(),
                   "word note " + std::to_string(i) + " (" + node_label(g, w.node) + " offset " +
                       std::to_string(w.offset) + ") names no 4-aligned 8-byte window");
    VITRIFY_EXPECT(uint8_t(w.reason) >= 1 && uint8_t(w.reason) <= 5,
                   "word note " + std::to_string(i) + ": unknown reason " + std::to_string(int(w.reason)));
    VITRIFY_EXPECT(i == 0 || std::tie(g.notes[i - 1].node, g.notes[i - 1].offset) <
                                 std::tie(w.node, w.offset),
                   "word note " + std::to_string(i) + " is not in ascending (node, offset) order");
  }
}

const char* word_kind_name(WordKind k) noexcept {
  switch (k) {
    case WordKind::pointer_param: return "pointer parameter";
    case WordKind::struct_word: return "struct word";
    case WordKind::copy_address: return "memcpy/memset address";
    case WordKind::tensor_map: return "TMA descriptor";
  }
  return "unknown";
}

const char* word_reason_name(WordReason r) noexcept {
  switch (r) {
    case WordReason::allocation_end: return "end of an allocation";
    case WordReason::unaligned: return "unaligned window";
    case WordReason::dangling_param: return "8-byte parameter in no allocation";
    case WordReason::no_allocation: return "integer: points into no allocation";
    case WordReason::integer_field: return "integer: the field held a non-address elsewhere";
  }
  return "unknown";
}

bool is_unclassified(WordReason r) noexcept {
  return r == WordReason::allocation_end || r == WordReason::unaligned ||
         r == WordReason::dangling_param;
}

const WordNote* first_unclassified(const Graph& g) noexcept {
  for (const WordNote& w : g.notes)
    if (is_unclassified(w.reason)) return &w;
  return nullptr;
}

bool relocatable(const Graph& g) noexcept { return first_unclassified(g) == nullptr; }

// ------------------------------------------------------------------------------------ writer
namespace {

class Writer {
 public:
  void u8(uint8_t v) { out.push_back(v); }
  void u16(uint16_t v) { raw(&v, 2); }
  void u32(uint32_t v) { raw(&v, 4); }
  void i32(int32_t v) { raw(&v, 4); }
  void u64(uint64_t v) { raw(&v, 8); }
  void raw(const void* p, size_t n) {
    const uint8_t* b = static_cast<const uint8_t*>(p);
    out.insert(out.end(), b, b + n);
  }
  void dim(const Dim3& d) { u32(d.x); u32(d.y); u32(d.z); }
  std::vector<uint8_t> out;
};

class Reader {
 public:
  Reader(const uint8_t* p, size_t n, size_t base) : p_(p), n_(n), base_(base) {}
  void need(size_t k, const char* what) {
    VITRIFY_EXPECT(k <= n_ - pos_, std::string("graph file truncated: ") + what + " needs " +
                                    std::to_string(k) + " bytes at offset " +
                                    std::to_string(base_ + pos_) + ", " +
                                    std::to_string(n_ - pos_) + " left");
  }
  template <typename T>
  T get(const char* what) {
    need(sizeof(T), what);
    T v;
    std::memcpy(&v, p_ + pos_, sizeof(T));
    pos_ += sizeof(T);
    return v;
  }
  uint8_t u8(const char* w) { return get<uint8_t>(w); }
  uint16_t u16(const char* w) { return get<uint16_t>(w); }
  uint32_t u32(const char* w) { return get<uint32_t>(w); }
  int32_t i32(const char* w) { return get<int32_t>(w); }
  uint64_t u64(const char* w) { return get<uint64_t>(w); }
  void raw(void* dst, size_t k, const char* what) {
    need(k, what);
    if (k) std::memcpy(dst, p_ + pos_, k);
    pos_ += k;
  }
  Dim3 dim(const char* w) {
    Dim3 d;
    d.x = u32(w);
    d.y = u32(w);
    d.z = u32(w);
    return d;
  }
  // A count of items each at least `min_item` bytes: rejects counts the rest cannot hold, so a
  // corrupt count never allocates gigabytes.
  uint32_t count(size_t min_item, const char* what) {
    const uint32_t c = u32(what);
    VITRIFY_EXPECT(uint64_t(c) * min_item <= n_ - pos_,
                std::string("graph file truncated or corrupt: ") + what + " = " +
                    std::to_string(c) + " at offset " + std::to_string(base_ + pos_ - 4) +
                    " but only " + std::to_string(n_ - pos_) + " bytes follow");
    return c;
  }
  size_t left() const { return n_ - pos_; }
  size_t pos() const { return base_ + pos_; }

 private:
  const uint8_t* p_;
  size_t n_, pos_ = 0, base_;
};

constexpr size_t kHeaderSize = 32;

}  // namespace

std::vector<uint8_t> serialize(const Graph& g) {
  validate(g);
  // Tables of module hashes and kernel names, in order of first use.
  std::vector<Hash> modules;
  std::map<Hash, uint32_t> module_index;
  std::vector<const std::string*> names;
  std::map<std::string, uint32_t> name_index;
  for (const Node& n : g.nodes) {
    if (n.kind != NodeKind::kernel) continue;
    if (module_index.emplace(n.kernel.module, uint32_t(modules.size())).second)
      modules.push_back(n.kernel.module);
    auto [it, fresh] = name_index.emplace(n.kernel.name, uint32_t(names.size()));
    if (fresh) names.push_back(&it->first);
  }
  Writer w;
  w.out.resize(kHeaderSize);
  w.u32(uint32_t(g.nodes.size()));
  w.u32(uint32_t(g.edges.size()));
  w.u32(g.event_count);
  w.u32(uint32_t(g.relocations.size()));
  w.u64(g.region_base);
  w.u64(g.region_size);
  w.u32(uint32_t(modules.size()));
  for (const Hash& h : modules) w.raw(h.data(), h.size());
  w.u32(uint32_t(names.size()));
  for (const std::string* s : names) {
    w.u32(uint32_t(s->size()));
    w.raw(s->data(), s->size());
  }
  for (const Node& n : g.nodes) {
    w.u8(uint8_t(n.kind));
    switch (n.kind) {
      case NodeKind::kernel: {
        const KernelNode& k = n.kernel;
        w.u32(module_index.at(k.module));
        w.u32(name_index.at(k.name));
        w.dim(k.grid);
        w.dim(k.block);
        w.u32(k.shared_mem);
        w.u32(uint32_t(k.params.size()));
        w.raw(k.params.data(), k.params.size());
        w.u32(uint32_t(k.slots.size()));
        for (const ParamSlot& s : k.slots) {
          w.u32(s.offset);
          w.u32(s.size);
        }
        w.u16(uint16_t(k.attributes.size()));
        for (const LaunchAttribute& a : k.attributes) {
          w.u32(a.id);
          w.u16(uint16_t(a.value.size()));
          w.raw(a.value.data(), a.value.size());
        }
        w.u16(uint16_t(k.func_attributes.size()));
        for (const FuncAttribute& a : k.func_attributes) {
          w.u32(a.id);
          w.i32(a.value);
        }
        break;
      }
      case NodeKind::memcpy: {
        const MemcpyNode& m = n.memcpy;
        w.u8(m.src_type);
        w.u8(m.dst_type);
        for (uint64_t v : {m.src, m.src_x, m.src_y, m.src_z, m.src_pitch, m.src_height, m.dst,
                           m.dst_x, m.dst_y, m.dst_z, m.dst_pitch, m.dst_height, m.width,
                           m.height, m.depth})
          w.u64(v);
        break;
      }
      case NodeKind::memset: {
        const MemsetNode& m = n.memset;
        w.u64(m.dst);
        w.u64(m.pitch);
        w.u32(m.value);
        w.u32(m.element_size);
        w.u64(m.width);
        w.u64(m.height);
        break;
      }
      case NodeKind::event_record:
      case NodeKind::event_wait:
        w.u32(n.event);
        break;
      case NodeKind::empty:
        break;
    }
  }
  for (const Edge& e : g.edges) {
    w.u32(e.from);
    w.u32(e.to);
    w.u8(e.from_port);
    w.u8(e.to_port);
    w.u8(e.type);
  }
  for (const Relocation& r : g.relocations) {
    w.u32(r.node);
    w.u32(r.offset);
    w.u64(r.region_offset);
    w.u8(uint8_t(r.kind));
  }
  w.u32(uint32_t(g.notes.size()));
  for (const WordNote& n : g.notes) {
    w.u32(n.node);
    w.u32(n.offset);
    w.u64(n.value);
    w.u8(uint8_t(n.reason));
  }
  // Header: magic, version, header size, body size, body CRC32C, header CRC32C.
  std::vector<uint8_t>& out = w.out;
  const uint64_t body = out.size() - kHeaderSize;
  const uint32_t version = kGraphFormatVersion, header_size = kHeaderSize;
  const uint32_t body_crc = crc32c(out.data() + kHeaderSize, body);
  std::memcpy(out.data(), kGraphMagic, 8);
  std::memcpy(out.data() + 8, &version, 4);
  std::memcpy(out.data() + 12, &header_size, 4);
  std::memcpy(out.data() + 16, &body, 8);
  std::memcpy(out.data() + 24, &body_crc, 4);
  const uint32_t header_crc = crc32c(out.data(), 28);
  std::memcpy(out.data() + 28, &header_crc, 4);
  return out;
}

Graph deserialize(const void* data, size_t n) {
  const uint8_t* p = static_cast<const uint8_t*>(data);
  VITRIFY_EXPECT(n >= kHeaderSize, "graph file truncated: " + std::to_string(n) +
                                    " bytes, the header alone is " + std::to_string(kHeaderSize));
  VITRIFY_EXPECT(std::memcmp(p, kGraphMagic, 8) == 0,
              "not a vitrify graph file: bad magic (expected \"VTRFGRPH\")");
  uint32_t version, header_size, body_crc, header_crc;
  uint64_t body;
  std::memcpy(&version, p + 8, 4);
  std::memcpy(&header_size, p + 12, 4);
  std::memcpy(&body, p + 16, 8);
  std::memcpy(&body_crc, p + 24, 4);
  std::memcpy(&header_crc, p + 28, 4);
  VITRIFY_EXPECT(crc32c(p, 28) == header_crc, "graph file header checksum mismatch (corrupt header)");
  VITRIFY_EXPECT(version == kGraphFormatVersion,
              "graph file format version " + std::to_string(version) + " is not supported (this " +
                  "build reads version " + std::to_string(kGraphFormatVersion) + ")");
  VITRIFY_EXPECT(header_size == kHeaderSize,
              "graph file header size " + std::to_string(header_size) + ", expected " +
                  std::to_string(kHeaderSize));
  VITRIFY_EXPECT(body <= n - kHeaderSize, "graph file truncated: header announces " +
                                           std::to_string(body) + " body bytes, file has " +
                                           std::to_string(n - kHeaderSize));
  VITRIFY_EXPECT(body == n - kHeaderSize, "graph file has " + std::to_string(n - kHeaderSize - body) +
                                           " trailing bytes after the announced body");
  VITRIFY_EXPECT(crc32c(p + kHeaderSize, body) == body_crc,
              "graph file body checksum mismatch (corrupt data)");

  Reader r(p + kHeaderSize, body, kHeaderSize);
  Graph g;
  const uint32_t node_count = r.count(1, "node count");
  const uint32_t edge_count = r.count(0, "edge count");
  g.event_count = r.u32("event count");
  const uint32_t reloc_count = r.count(0, "relocation count");
  g.region_base = r.u64("region base");
  g.region_size = r.u64("region size");
  std::vector<Hash> modules(r.count(32, "module count"));
  for (Hash& h : modules) r.raw(h.data(), 32, "module hash");
  std::vector<std::string> names(r.count(4, "name count"));
  for (std::string& s : names) {
    const uint32_t len = r.count(1, "name length");
    s.resize(len);
    r.raw(s.data(), len, "kernel name");
  }
  g.nodes.resize(node_count);
  for (uint32_t i = 0; i < node_count; ++i) {
    Node& node = g.nodes[i];
    const uint8_t kind = r.u8("node kind");
    VITRIFY_EXPECT(kind >= 1 && kind <= 6, "graph file: node " + std::to_string(i) +
                                            " has invalid kind " + std::to_string(kind) +
                                            " at offset " + std::to_string(r.pos() - 1));
    node.kind = NodeKind(kind);
    switch (node.kind) {
      case NodeKind::kernel: {
        KernelNode& k = node.kernel;
        const uint32_t mi = r.u32("module index"), ni = r.u32("name index");
        VITRIFY_EXPECT(mi < modules.size() && ni < names.size(),
                    "graph file: node " + std::to_string(i) + " names module " +
                        std::to_string(mi) + "/" + std::to_string(modules.size()) + ", name " +
                        std::to_string(ni) + "/" + std::to_string(names.size()));
        k.module = modules[mi];
        k.name = names[ni];
        k.grid = r.dim("grid");
        k.block = r.dim("block");
        k.shared_mem = r.u32("shared memory");
        k.params.resize(r.count(1, "parameter bytes"));
        r.raw(k.params.data(), k.params.size(), "parameters");
        k.slots.resize(r.count(8, "parameter count"));
        for (ParamSlot& s : k.slots) {
          s.offset = r.u32("parameter offset");
          s.size = r.u32("parameter size");
        }
        k.attributes.resize(r.u16("attribute count"));
        for (LaunchAttribute& a : k.attributes) {
          a.id = r.u32("attribute id");
          a.value.resize(r.u16("attribute size"));
          r.raw(a.value.data(), a.value.size(), "attribute value");
        }
        k.func_attributes.resize(r.u16("function attribute count"));
        for (FuncAttribute& a : k.func_attributes) {
          a.id = r.u32("function attribute id");
          a.value = r.i32("function attribute value");
        }
        break;
      }
      case NodeKind::memcpy: {
        MemcpyNode& m = node.memcpy;
        m.src_type = r.u8("memcpy source type");
        m.dst_type = r.u8("memcpy destination type");
        for (uint64_t* v : {&m.src, &m.src_x, &m.src_y, &m.src_z, &m.src_pitch, &m.src_height,
                            &m.dst, &m.dst_x, &m.dst_y, &m.dst_z, &m.dst_pitch, &m.dst_height,
                            &m.width, &m.height, &m.depth})
          *v = r.u64("memcpy field");
        break;
      }
      case NodeKind::memset: {
        MemsetNode& m = node.memset;
        m.dst = r.u64("memset destination");
        m.pitch = r.u64("memset pitch");
        m.value = r.u32("memset value");
        m.element_size = r.u32("memset element size");
        m.width = r.u64("memset width");
        m.height = r.u64("memset height");
        break;
      }
      case NodeKind::event_record:
      case NodeKind::event_wait:
        node.event = r.u32("event index");
        break;
      case NodeKind::empty:
        break;
    }
  }
  g.edges.resize(edge_count);
  for (Edge& e : g.edges) {
    e.from = r.u32("edge");
    e.to = r.u32("edge");
    e.from_port = r.u8("edge");
    e.to_port = r.u8("edge");
    e.type = r.u8("edge");
  }
  g.relocations.resize(reloc_count);
  for (Relocation& rl : g.relocations) {
    rl.node = r.u32("relocation");
    rl.offset = r.u32("relocation");
    rl.region_offset = r.u64("relocation");
    rl.kind = WordKind(r.u8("relocation"));
  }
  g.notes.resize(r.count(17, "word note count"));
  for (WordNote& wn : g.notes) {
    wn.node = r.u32("word note");
    wn.offset = r.u32("word note");
    wn.value = r.u64("word note");
    wn.reason = WordReason(r.u8("word note"));
  }
  VITRIFY_EXPECT(r.left() == 0, "graph file: " + std::to_string(r.left()) +
                                 " unexplained bytes at the end of the body");
  validate(g);
  return g;
}

// -------------------------------------------------------------------------------- relocation
void FieldEvidence::note_integer(const Hash& module, const std::string& name, uint32_t offset) {
  std::lock_guard<std::mutex> l(mu_);
  auto& v = fields_[{module, name}];
  auto it = std::lower_bound(v.begin(), v.end(), offset);
  if (it == v.end() || *it != offset) v.insert(it, offset);
}

bool FieldEvidence::is_integer(const Hash& module, const std::string& name, uint32_t offset) const {
  std::lock_guard<std::mutex> l(mu_);
  auto it = fields_.find({module, name});
  return it != fields_.end() && std::binary_search(it->second.begin(), it->second.end(), offset);
}

size_t FieldEvidence::size() const {
  std::lock_guard<std::mutex> l(mu_);
  size_t n = 0;
  for (const auto& [k, v] : fields_) n += v.size();
  return n;
}

void FieldEvidence::clear() {
  std::lock_guard<std::mutex> l(mu_);
  fields_.clear();
}

namespace {

constexpr uint64_t kUserSpaceEnd = uint64_t(1) << 47;  // x86-64 / aarch64 48-bit user addresses

// Live allocations as sorted, merged [begin, end) region offsets.
class LiveSet {
 public:
  explicit LiveSet(std::vector<std::pair<uint64_t, uint64_t>> live) {
    std::sort(live.begin(), live.end());
    for (const auto& [off, size] : live) {
      if (size == 0) continue;
      VITRIFY_EXPECT(off + size >= off, "live allocation at offset " + std::to_string(off) +
                                            " of " + std::to_string(size) + " bytes wraps around");
      ends_.insert(off + size);
      if (!spans_.empty() && off <= spans_.back().second)
        spans_.back().second = std::max(spans_.back().second, off + size);
      else
        spans_.push_back({off, off + size});
    }
  }
  bool contains(uint64_t off) const {
    auto it = std::upper_bound(spans_.begin(), spans_.end(), std::make_pair(off, UINT64_MAX));
    return it != spans_.begin() && off < std::prev(it)->second;
  }
  bool is_end(uint64_t off) const { return ends_.count(off) != 0; }

 private:
  std::vector<std::pair<uint64_t, uint64_t>> spans_;
  std::set<uint64_t> ends_;
};

}  // namespace

size_t find_relocations(Graph& g, const ScanOptions& opt, FieldEvidence* evidence) {
  const uint64_t base = opt.base, size = opt.size;
  VITRIFY_EXPECT(base + size >= base, "relocation range wraps around: base " + std::to_string(base) +
                                       " size " + std::to_string(size));
  const LiveSet live(opt.live);
  std::vector<Relocation> found;
  std::vector<WordNote> notes;
  std::unordered_map<uint64_t, bool> known;  // is_device_pointer answers, per value
  auto in_range = [&](uint64_t v) { return v >= base && v - base < size; };
  // A value outside the range that cannot be a device address (see FieldEvidence).
  auto non_address = [&](uint64_t v) {
    if (v == 0 || v == UINT64_MAX) return false;  // null and the all-ones sentinel say nothing
    if (v < (uint64_t(1) << 32) || v >= kUserSpaceEnd) return true;
    if (!opt.is_device_pointer) return false;
    auto it = known.find(v);
    if (it == known.end()) it = known.emplace(v, opt.is_device_pointer(v)).first;
    return !it->second;
  };
  for (size_t i = 0; i < g.nodes.size(); ++i) {
    const Node& n = g.nodes[i];
    const uint32_t ni = uint32_t(i);
    if (n.kind == NodeKind::memcpy) {
      if (in_range(n.memcpy.src)) found.push_back({ni, 0, n.memcpy.src - base, WordKind::copy_address});
      if (in_range(n.memcpy.dst)) found.push_back({ni, 8, n.memcpy.dst - base, WordKind::copy_address});
      continue;
    }
    if (n.kind == NodeKind::memset) {
      if (in_range(n.memset.dst)) found.push_back({ni, 0, n.memset.dst - base, WordKind::copy_address});
      continue;
    }
    if (n.kind != NodeKind::kernel) continue;
    const KernelNode& k = n.kernel;
    for (const ParamSlot& s : k.slots) {
      if (s.size < 8) continue;  // a 1/2/4-byte parameter holds no pointer
      const uint64_t end = uint64_t(s.offset) + s.size;
      if (s.size == 8 && s.offset % 8 != 0) continue;  // two 4-byte values (4-aligned: no pointer)
      const bool whole = s.size == 8;
      const bool aligned_struct = s.offset % 8 == 0;  // 8-aligned: may hold naturally aligned pointers
      const bool tensor_map = s.size == 128 && s.offset % 64 == 0;
      for (uint64_t o = (uint64_t(s.offset) + 3) & ~uint64_t(3); o + 8 <= end; o += 4) {
        const uint64_t v = load_u64(k.params.data() + o);
        const uint32_t off = uint32_t(o);
        if (!in_range(v)) {
          if (evidence != nullptr && non_address(v)) evidence->note_integer(k.module, k.name, off);
          continue;
        }
        const uint64_t ro = v - base;
        const bool is_live = live.contains(ro);
        const bool aligned_word = aligned_struct && o % 8 == 0;
        if (whole) {
          if (is_live)
            found.push_back({ni, off, ro, WordKind::pointer_param});
          else
            notes.push_back({ni, off, v, WordReason::dangling_param});
        } else if (aligned_word) {
          if (is_live)
            found.push_back({ni, off, ro, tensor_map ? WordKind::tensor_map : WordKind::struct_word});
          else
            notes.push_back({ni, off, v, live.is_end(ro) ? WordReason::allocation_end
                                                         : WordReason::no_allocation});
        } else if (is_live) {
          notes.push_back({ni, off, v, WordReason::unaligned});
        }
      }
    }
  }
  g.region_base = base;
  g.region_size = size;
  g.relocations = std::move(found);
  g.notes = std::move(notes);
  return g.relocations.size();
}

size_t find_relocations(Graph& g, uint64_t base, uint64_t size) {
  ScanOptions opt;
  opt.base = base;
  opt.size = size;
  opt.live = {{0, size}};
  return find_relocations(g, opt, nullptr);
}

size_t apply_evidence(Graph& g, const FieldEvidence& evidence) {
  auto integer = [&](uint32_t node, uint32_t offset) {
    const Node& n = g.nodes[node];
    return n.kind == NodeKind::kernel && evidence.is_integer(n.kernel.module, n.kernel.name, offset);
  };
  size_t changed = 0;
  std::vector<Relocation> keep;
  for (const Relocation& r : g.relocations) {
    if (r.kind != WordKind::copy_address && integer(r.node, r.offset)) {
      g.notes.push_back({r.node, r.offset, g.region_base + r.region_offset, WordReason::integer_field});
      ++changed;
    } else {
      keep.push_back(r);
    }
  }
  g.relocations = std::move(keep);
  for (WordNote& w : g.notes)
    if (is_unclassified(w.reason) && integer(w.node, w.offset)) {
      w.reason = WordReason::integer_field;
      ++changed;
    }
  std::sort(g.notes.begin(), g.notes.end(), [](const WordNote& a, const WordNote& b) {
    return std::tie(a.node, a.offset) < std::tie(b.node, b.offset);
  });
  return changed;
}

void relocate(Graph& g, uint64_t new_base) {
  VITRIFY_EXPECT(new_base + g.region_size >= new_base,
              "relocation to base " + std::to_string(new_base) + " wraps around with size " +
                  std::to_string(g.region_size));
  if (new_base != g.region_base) {
    if (const WordNote* w = first_unclassified(g)) {
      size_t count = 0;
      for (const WordNote& x : g.notes) count += is_unclassified(x.reason);
      std::ostringstream v;
      v << std::hex << "0x" << w->value;
      VITRIFY_EXPECT(false, "the graph is not relocatable: " + node_label(g, w->node) +
                                " parameter byte " + std::to_string(w->offset) + " holds " +
                                v.str() + " (" + word_reason_name(w->reason) +
                                "), which may or may not be a pointer (" + std::to_string(count) +
                                " such word(s)); thaw it at its frozen base or capture it again");
    }
  }
  for (size_t i = 0; i < g.relocations.size(); ++i) {
    const Relocation& r = g.relocations[i];
    uint64_t word = 0;
    VITRIFY_EXPECT(read_reloc(g, r, &word) && word == g.region_base + r.region_offset,
                "relocation " + std::to_string(i) + " (" + node_label(g, r.node) + " offset " +
                    std::to_string(r.offset) + ") no longer holds base + " +
                    std::to_string(r.region_offset) + ": the graph was modified");
  }
  for (const Relocation& r : g.relocations) write_reloc(g, r, new_base + r.region_offset);
  g.region_base = new_base;
}

// --------------------------------------------------------------------------------- topology
namespace {
bool memcpy_updatable(const MemcpyNode& m) { return m.height <= 1 && m.depth <= 1; }
bool memset_updatable(const MemsetNode& m) { return m.height <= 1; }
}  // namespace

Hash topology_hash(const Graph& g) {
  Sha256 s;
  auto u8 = [&](uint8_t v) { s.update(&v, 1); };
  auto u32 = [&](uint32_t v) { s.update(&v, 4); };
  auto u64 = [&](uint64_t v) { s.update(&v, 8); };
  s.update("vitrify-topology-1", 15);
  u32(uint32_t(g.nodes.size()));
  u32(g.event_count);
  for (const Node& n : g.nodes) {
    u8(uint8_t(n.kind));
    switch (n.kind) {
      case NodeKind::kernel: {
        const KernelNode& k = n.kernel;
        s.update(k.module.data(), 32);
        u32(uint32_t(k.name.size()));
        s.update(k.name.data(), k.name.size());
        u32(k.block.x);
        u32(k.block.y);
        u32(k.block.z);
        u32(k.shared_mem);
        u32(uint32_t(k.params.size()));
        u32(uint32_t(k.slots.size()));
        for (const ParamSlot& p : k.slots) {
          u32(p.offset);
          u32(p.size);
        }
        u32(uint32_t(k.attributes.size()));
        for (const LaunchAttribute& a : k.attributes) {
          u32(a.id);
          u32(uint32_t(a.value.size()));
          s.update(a.value.data(), a.value.size());
        }
        u32(uint32_t(k.func_attributes.size()));
        for (const FuncAttribute& a : k.func_attributes) {
          u32(a.id);
          u32(uint32_t(a.value));
        }
        break;
      }
      case NodeKind::memcpy: {
        const MemcpyNode& m = n.memcpy;
        u8(m.src_type);
        u8(m.dst_type);
        for (uint64_t v : {m.src_x, m.src_y, m.src_z, m.src_pitch, m.src_height, m.dst_x, m.dst_y,
                           m.dst_z, m.dst_pitch, m.dst_height, m.width, m.height, m.depth})
          u64(v);
        if (!memcpy_updatable(m)) {  // multi-dimensional copies cannot change address per exec
          u64(m.src);
          u64(m.dst);
        }
        break;
      }
      case NodeKind::memset: {
        const MemsetNode& m = n.memset;
        u64(m.pitch);
        u32(m.element_size);
        u64(m.width);
        u64(m.height);
        if (!memset_updatable(m)) u64(m.dst);
        break;
      }
      case NodeKind::event_record:
      case NodeKind::event_wait:
        u32(n.event);
        break;
      case NodeKind::empty:
        break;
    }
  }
  std::vector<Edge> edges = g.edges;
  std::sort(edges.begin(), edges.end(), [](const Edge& a, const Edge& b) {
    return std::tie(a.from, a.to, a.from_port, a.to_port, a.type) <
           std::tie(b.from, b.to, b.from_port, b.to_port, b.type);
  });
  u32(uint32_t(edges.size()));
  for (const Edge& e : edges) {
    u32(e.from);
    u32(e.to);
    u8(e.from_port);
    u8(e.to_port);
    u8(e.type);
  }
  return s.finish();
}

std::vector<std::vector<size_t>> group_by_topology(const std::vector<const Graph*>& graphs) {
  std::vector<std::vector<size_t>> groups;
  std::map<Hash, size_t> index;
  for (size_t i = 0; i < graphs.size(); ++i) {
    VITRIFY_EXPECT(graphs[i] != nullptr, "group_by_topology: graph " + std::to_string(i) + " is null");
    auto [it, fresh] = index.emplace(topology_hash(*graphs[i]), groups.size());
    if (fresh) groups.emplace_back();
    groups[it->second].push_back(i);
  }
  return groups;
}

std::vector<Hash> referenced_modules(const Graph& g) {
  std::vector<Hash> out;
  for (const Node& n : g.nodes)
    if (n.kind == NodeKind::kernel) out.push_back(n.kernel.module);
  std::sort(out.begin(), out.end());
  out.erase(std::unique(out.begin(), out.end()), out.end());
  return out;
}

}  // namespace vitrify::graph
