// CUDA graph persistence, the CPU half: an in-memory description of a captured graph, its
// versioned binary file format, relocation of region addresses, topology templates, the
// registry of kernel binaries (keyed by SHA-256) and kernel-name extraction from cubins.
// Nothing here calls the driver; vitrify/graph_cuda.hpp walks and rebuilds real CUgraphs.
// The format and the invariants are documented in csrc/src/graph/DESIGN.md.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "vitrify/error.hpp"

namespace vitrify::graph {

// ---------------------------------------------------------------------------------- hashing
using Hash = std::array<uint8_t, 32>;

// SHA-256 (FIPS 180-4), incremental.
class Sha256 {
 public:
  Sha256() noexcept;
  void update(const void* data, size_t n) noexcept;
  Hash finish() noexcept;  // the object must not be updated afterwards

 private:
  void block(const uint8_t* p) noexcept;
  uint32_t h_[8];
  uint8_t buf_[64];
  size_t buf_len_ = 0;
  uint64_t total_ = 0;
};
Hash sha256(const void* data, size_t n) noexcept;
std::string to_hex(const Hash& h);
// 64 hex digits -> Hash; anything else is a ValueError naming the text.
Hash hash_from_hex(const std::string& hex);

// ------------------------------------------------------------------------------ description
enum class NodeKind : uint8_t {
  kernel = 1,
  memcpy = 2,
  memset = 3,
  event_record = 4,
  event_wait = 5,
  empty = 6,
};
const char* kind_name(NodeKind k) noexcept;

struct Dim3 {
  uint32_t x = 1, y = 1, z = 1;
  bool operator==(const Dim3&) const = default;
};

// One kernel parameter inside KernelNode::params (from cuFuncGetParamInfo).
struct ParamSlot {
  uint32_t offset = 0;
  uint32_t size = 0;
  bool operator==(const ParamSlot&) const = default;
};

// A kernel node launch attribute (CUlaunchAttributeID + the raw bytes of its value).
struct LaunchAttribute {
  uint32_t id = 0;
  std::vector<uint8_t> value;
  bool operator==(const LaunchAttribute&) const = default;
};

// A function attribute that must be set on the reloaded function (CUfunction_attribute, value).
struct FuncAttribute {
  uint32_t id = 0;
  int32_t value = 0;
  bool operator==(const FuncAttribute&) const = default;
};

struct KernelNode {
  Hash module{};     // SHA-256 of the binary that holds the kernel
  std::string name;  // the entry name (mangled) in that binary
  Dim3 grid, block;
  uint32_t shared_mem = 0;     // dynamic shared memory bytes
  std::vector<uint8_t> params;  // the packed parameter buffer
  std::vector<ParamSlot> slots;  // one per parameter, ascending offsets, inside params
  std::vector<LaunchAttribute> attributes;
  std::vector<FuncAttribute> func_attributes;
  bool operator==(const KernelNode&) const = default;
};

// CUDA_MEMCPY3D restricted to linear memory (no arrays): memory types are CUmemorytype values.
struct MemcpyNode {
  uint8_t src_type = 0, dst_type = 0;
  uint64_t src = 0, dst = 0;  // relocatable addresses (relocation offsets 0 and 8)
  uint64_t src_x = 0, src_y = 0, src_z = 0, src_pitch = 0, src_height = 0;
  uint64_t dst_x = 0, dst_y = 0, dst_z = 0, dst_pitch = 0, dst_height = 0;
  uint64_t width = 0, height = 0, depth = 0;
  bool operator==(const MemcpyNode&) const = default;
};

struct MemsetNode {
  uint64_t dst = 0;  // relocatable address (relocation offset 0)
  uint64_t pitch = 0;
  uint32_t value = 0;
  uint32_t element_size = 1;  // 1, 2 or 4
  uint64_t width = 0, height = 1;
  bool operator==(const MemsetNode&) const = default;
};

struct Node {
  NodeKind kind = NodeKind::empty;
  KernelNode kernel;   // kind == kernel
  MemcpyNode memcpy;   // kind == memcpy
  MemsetNode memset;   // kind == memset
  uint32_t event = 0;  // kind == event_record / event_wait: index into the graph's events
  bool operator==(const Node&) const = default;
};

// A dependency from -> to (CUgraphEdgeData: ports and type; 0 = the default full dependency).
struct Edge {
  uint32_t from = 0, to = 0;
  uint8_t from_port = 0, to_port = 0, type = 0;
  bool operator==(const Edge&) const = default;
};

// What a relocated word is (how FREEZE knew it is a pointer).
enum class WordKind : uint8_t {
  pointer_param = 1,  // a whole 8-byte kernel parameter pointing into a live allocation
  struct_word = 2,    // an aligned 8-byte word inside a by-value struct, pointing into one
  copy_address = 3,   // a memcpy source/destination or memset destination (pointers by type)
  tensor_map = 4,     // a plain address word inside a CUtensorMap-shaped (128 B, 64-aligned) one
};
const char* word_kind_name(WordKind k) noexcept;

// An 8-byte word that holds base + region_offset. For kernel nodes `offset` is the byte offset in
// KernelNode::params; for memcpy nodes 0 = src and 8 = dst; for memset nodes 0 = dst.
struct Relocation {
  uint32_t node = 0;
  uint32_t offset = 0;
  uint64_t region_offset = 0;
  WordKind kind = WordKind::pointer_param;
  bool operator==(const Relocation&) const = default;
};

// Why a region-like word was not relocated (WordNote::reason). The first three leave the graph
// non-relocatable ("unclassified": it may or may not be a pointer); the last two are integers.
enum class WordReason : uint8_t {
  allocation_end = 1,   // a struct word equal to the end of a live allocation (an end pointer?)
  unaligned = 2,        // an unaligned 8-byte window inside a struct points into a live allocation
  dangling_param = 3,   // an 8-byte parameter in the region range, in no live allocation
  no_allocation = 4,    // a struct word in the range that points into no allocation: an integer
  integer_field = 5,    // the same kernel field held a non-address in another launch: an integer
};
const char* word_reason_name(WordReason r) noexcept;
bool is_unclassified(WordReason r) noexcept;  // reasons 1-3

// A kernel-parameter window (byte `offset` in KernelNode::params, 8 bytes, 4-aligned) holding a
// value inside [region_base, region_base + region_size) that is not relocated.
struct WordNote {
  uint32_t node = 0;
  uint32_t offset = 0;
  uint64_t value = 0;
  WordReason reason = WordReason::no_allocation;
  bool operator==(const WordNote&) const = default;
};

struct Graph {
  std::vector<Node> nodes;
  std::vector<Edge> edges;
  uint32_t event_count = 0;
  uint64_t region_base = 0, region_size = 0;  // the range relocations refer to (size 0: none)
  std::vector<Relocation> relocations;
  std::vector<WordNote> notes;  // region-like words left as they are, ascending (node, offset)
  bool operator==(const Graph&) const = default;
};

// True when every region-like word was classified: relocate() to another base is allowed.
bool relocatable(const Graph& g) noexcept;
// The first unclassified word (nullptr when relocatable).
const WordNote* first_unclassified(const Graph& g) noexcept;

// Structural checks (indices in range, slots inside params, relocations on real words, events
// below event_count, no self edges): a ValueError naming the first problem. serialize() and
// deserialize() both run it.
void validate(const Graph& g);

// ---------------------------------------------------------------------------------- format
inline constexpr char kGraphMagic[8] = {'V', 'T', 'R', 'F', 'G', 'R', 'P', 'H'};
inline constexpr uint32_t kGraphFormatVersion = 2;

std::vector<uint8_t> serialize(const Graph& g);
// Bad magic, another version, a checksum mismatch, truncation or an inconsistent body is a
// ValueError that says which.
Graph deserialize(const void* data, size_t n);

// ------------------------------------------------------------------------------ relocation
// Kernel fields (module, entry name, byte offset of a 4-aligned 8-byte window in the parameter
// buffer) seen holding a value that is no device address (a non-zero value below 4 GiB or above
// the user address space, or one the driver does not know), in any launch of any graph captured
// so far. A struct's layout is the same in every launch of one kernel, so a region-like value
// in such a field is an integer, not a pointer (DESIGN.md, "Relocation"). Thread-safe.
class FieldEvidence {
 public:
  void note_integer(const Hash& module, const std::string& name, uint32_t offset);
  bool is_integer(const Hash& module, const std::string& name, uint32_t offset) const;
  size_t size() const;  // fields noted
  void clear();

 private:
  mutable std::mutex mu_;
  std::map<std::pair<Hash, std::string>, std::vector<uint32_t>> fields_;  // sorted offsets
};

struct ScanOptions {
  uint64_t base = 0, size = 0;  // the relocation range
  // Live allocations as region offsets (offset, size), any order. A kernel word is relocated
  // only when it points into one of them.
  std::vector<std::pair<uint64_t, uint64_t>> live;
  // For values outside the range: does the driver know this address? Empty: unknown (no
  // evidence is taken from such values).
  std::function<bool(uint64_t)> is_device_pointer;
};

// Classifies every region-like word of g (DESIGN.md, "Relocation"): kernel parameters by their
// layout (slots) and the live allocations, memcpy/memset addresses as pointers. Replaces g's
// relocations and notes, records the range, and notes integer evidence into `evidence` (may be
// null). Returns the number of relocations.
size_t find_relocations(Graph& g, const ScanOptions& opt, FieldEvidence* evidence = nullptr);
// The same with the whole range [base, base+size) taken as one live allocation (tests).
size_t find_relocations(Graph& g, uint64_t base, uint64_t size);
// Moves relocations and unclassified words of fields that `evidence` knows to be integers into
// the notes as integer_field. Returns how many words changed.
size_t apply_evidence(Graph& g, const FieldEvidence& evidence);
// Rewrites every relocated word to new_base + region_offset and sets region_base = new_base.
// Each word must still hold old base + region_offset (else ValueError: the graph was edited).
// A graph with an unclassified word is refused (ValueError naming the kernel and the word)
// unless new_base equals its base.
void relocate(Graph& g, uint64_t new_base);

// ------------------------------------------------------------------------------- templates
// Hash of what an executable graph fixes: node kinds, kernel identities (module, name), block
// dims, dynamic shared memory, parameter layout, launch and function attributes, memcpy/memset
// shapes, event indices and edges. Not hashed (per-graph parameters, applied to a shared
// executable): kernel grid dims and parameter bytes, memcpy/memset addresses, memset value.
Hash topology_hash(const Graph& g);

// Groups graphs by topology_hash, in order of first appearance: result[i] lists indices into
// `graphs` sharing one template.
std::vector<std::vector<size_t>> group_by_topology(const std::vector<const Graph*>& graphs);

// ----------------------------------------------------------------------- kernel binaries
enum class BinaryKind : uint8_t { unknown = 0, elf = 1, fatbin = 2, ptx = 3 };
const char* binary_kind_name(BinaryKind k) noexcept;
BinaryKind detect_binary_kind(const void* data, size_t n) noexcept;

// Kernel entry names a binary defines: ELF cubins (STT_FUNC symbols marked STO_CUDA_ENTRY),
// fatbins (their uncompressed ELF and PTX members; compressed members are skipped) and PTX
// text (`.entry name`). A malformed ELF is a ValueError; an unknown kind returns {}.
std::vector<std::string> kernel_names(const void* data, size_t n);

// A fingerprint of one kernel's machine code in an ELF cubin: SHA-256 over the name, the bytes
// and flags (register count) of `.text.<name>`, the size of its parameter constant bank, and its
// relocations with target symbols by name (indices differ between binaries). Two binaries with
// equal fingerprints run the same code for that kernel. All zero when `data` is not an ELF
// cubin or has no `.text.<name>`.
Hash kernel_code_hash(const void* data, size_t n, const std::string& name);

struct Module {
  Hash hash{};
  BinaryKind kind = BinaryKind::unknown;
  std::vector<uint8_t> bytes;
  std::vector<std::string> kernels;  // sorted, unique
};

// Binaries keyed by content hash; thread-safe (CUPTI callbacks add from driver threads).
class ModuleRegistry {
 public:
  // Adds a copy of the bytes (no-op when already present); returns the content hash.
  Hash add(const void* data, size_t n);
  bool contains(const Hash& h) const;
  std::shared_ptr<const Module> get(const Hash& h) const;  // nullptr when absent
  // Hashes of the modules defining `kernel`, ascending.
  std::vector<Hash> modules_with_kernel(const std::string& kernel) const;
  std::vector<Hash> hashes() const;  // ascending
  size_t size() const;
  size_t total_bytes() const;
  void clear();

 private:
  mutable std::mutex mu_;
  std::map<Hash, std::shared_ptr<const Module>> modules_;
  std::multimap<std::string, Hash> by_kernel_;
  size_t total_bytes_ = 0;
};

// The module hashes a graph's kernel nodes reference, ascending and unique.
std::vector<Hash> referenced_modules(const Graph& g);

}  // namespace vitrify::graph
