// Graph persistence: the file format and its description as Python dicts, relocation,
// topology, kernel binaries, the CUPTI recorder, capture (FREEZE), GraphSet (THAW).
#include <nanobind/stl/optional.h>
#include <nanobind/stl/pair.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/shared_ptr.h>
#include <nanobind/stl/vector.h>

#include "bind.hpp"
#include "vitrify/graph.hpp"
#include "vitrify/graph_cuda.hpp"

namespace nb = nanobind;

namespace vitrify::bindings {
namespace {

using namespace vitrify::graph;

nb::bytes to_bytes(const std::vector<uint8_t>& v) {
  return nb::bytes(reinterpret_cast<const char*>(v.data()), v.size());
}
std::vector<uint8_t> from_bytes(const nb::bytes& b) {
  const uint8_t* p = reinterpret_cast<const uint8_t*>(b.c_str());
  return std::vector<uint8_t>(p, p + b.size());
}
Graph parse(const nb::bytes& b) {
  const char* p = b.c_str();
  const size_t n = b.size();
  nb::gil_scoped_release nogil;
  return deserialize(p, n);
}
nb::tuple dim(const Dim3& d) { return nb::make_tuple(d.x, d.y, d.z); }
Dim3 to_dim(nb::handle h) {
  nb::tuple t = nb::cast<nb::tuple>(h);
  VITRIFY_EXPECT(t.size() == 3, "a dimension is (x, y, z)");
  return {nb::cast<uint32_t>(t[0]), nb::cast<uint32_t>(t[1]), nb::cast<uint32_t>(t[2])};
}

nb::dict describe(const Graph& g) {
  nb::list nodes;
  for (const Node& n : g.nodes) {
    nb::dict d;
    d["kind"] = kind_name(n.kind);
    switch (n.kind) {
      case NodeKind::kernel: {
        const KernelNode& k = n.kernel;
        d["module"] = to_hex(k.module);
        d["name"] = k.name;
        d["grid"] = dim(k.grid);
        d["block"] = dim(k.block);
        d["shared_mem"] = k.shared_mem;
        d["params"] = to_bytes(k.params);
        nb::list slots, attrs, fattrs;
        for (const ParamSlot& s : k.slots) slots.append(nb::make_tuple(s.offset, s.size));
        for (const LaunchAttribute& a : k.attributes) attrs.append(nb::make_tuple(a.id, to_bytes(a.value)));
        for (const FuncAttribute& a : k.func_attributes) fattrs.append(nb::make_tuple(a.id, a.value));
        d["slots"] = slots;
        d["attributes"] = attrs;
        d["func_attributes"] = fattrs;
        break;
      }
      case NodeKind::memcpy: {
        const MemcpyNode& m = n.memcpy;
        d["src_type"] = m.src_type; d["dst_type"] = m.dst_type;
        d["src"] = m.src; d["dst"] = m.dst;
        d["src_x"] = m.src_x; d["src_y"] = m.src_y; d["src_z"] = m.src_z;
        d["src_pitch"] = m.src_pitch; d["src_height"] = m.src_height;
        d["dst_x"] = m.dst_x; d["dst_y"] = m.dst_y; d["dst_z"] = m.dst_z;
        d["dst_pitch"] = m.dst_pitch; d["dst_height"] = m.dst_height;
        d["width"] = m.width; d["height"] = m.height; d["depth"] = m.depth;
        break;
      }
      case NodeKind::memset: {
        const MemsetNode& m = n.memset;
        d["dst"] = m.dst; d["pitch"] = m.pitch; d["value"] = m.value;
        d["element_size"] = m.element_size; d["width"] = m.width; d["height"] = m.height;
        break;
      }
      case NodeKind::event_record:
      case NodeKind::event_wait:
        d["event"] = n.event;
        break;
      case NodeKind::empty:
        break;
    }
    nodes.append(d);
  }
  nb::list edges, relocs;
  for (const Edge& e : g.edges) edges.append(nb::make_tuple(e.from, e.to, e.from_port, e.to_port, e.type));
  for (const Relocation& r : g.relocations)
    relocs.append(nb::make_tuple(r.node, r.offset, r.region_offset, word_kind_name(r.kind)));
  nb::list notes;
  for (const WordNote& w : g.notes) {
    nb::dict d;
    d["node"] = w.node;
    d["offset"] = w.offset;
    d["value"] = w.value;
    d["reason"] = word_reason_name(w.reason);
    d["unclassified"] = is_unclassified(w.reason);
    notes.append(d);
  }
  nb::dict out;
  out["notes"] = notes;
  out["relocatable"] = relocatable(g);
  out["nodes"] = nodes;
  out["edges"] = edges;
  out["event_count"] = g.event_count;
  out["region_base"] = g.region_base;
  out["region_size"] = g.region_size;
  out["relocations"] = relocs;
  return out;
}

template <typename T>
T get(const nb::dict& d, const char* key, T fallback) {
  return d.contains(key) ? nb::cast<T>(d[key]) : fallback;
}

Graph build(const nb::dict& in) {
  Graph g;
  for (nb::handle h : nb::cast<nb::list>(in["nodes"])) {
    nb::dict d = nb::cast<nb::dict>(h);
    const std::string kind = nb::cast<std::string>(d["kind"]);
    Node n;
    if (kind == "kernel") {
      n.kind = NodeKind::kernel;
      KernelNode& k = n.kernel;
      k.module = hash_from_hex(nb::cast<std::string>(d["module"]));
      k.name = nb::cast<std::string>(d["name"]);
      k.grid = to_dim(d["grid"]);
      k.block = to_dim(d["block"]);
      k.shared_mem = get<uint32_t>(d, "shared_mem", 0);
      k.params = from_bytes(nb::cast<nb::bytes>(d["params"]));
      for (nb::handle s : nb::cast<nb::list>(d["slots"]))
        k.slots.push_back({nb::cast<uint32_t>(s[0]), nb::cast<uint32_t>(s[1])});
      if (d.contains("attributes"))
        for (nb::handle a : nb::cast<nb::list>(d["attributes"]))
          k.attributes.push_back({nb::cast<uint32_t>(a[0]), from_bytes(nb::cast<nb::bytes>(a[1]))});
      if (d.contains("func_attributes"))
        for (nb::handle a : nb::cast<nb::list>(d["func_attributes"]))
          k.func_attributes.push_back({nb::cast<uint32_t>(a[0]), nb::cast<int32_t>(a[1])});
    } else if (kind == "memcpy") {
      n.kind = NodeKind::memcpy;
      MemcpyNode& m = n.memcpy;
      m.src_type = get<uint8_t>(d, "src_type", 2); m.dst_type = get<uint8_t>(d, "dst_type", 2);
      m.src = get<uint64_t>(d, "src", 0); m.dst = get<uint64_t>(d, "dst", 0);
      m.src_x = get<uint64_t>(d, "src_x", 0); m.src_y = get<uint64_t>(d, "src_y", 0);
      m.src_z = get<uint64_t>(d, "src_z", 0); m.src_pitch = get<uint64_t>(d, "src_pitch", 0);
      m.src_height = get<uint64_t>(d, "src_height", 0);
      m.dst_x = get<uint64_t>(d, "dst_x", 0); m.dst_y = get<uint64_t>(d, "dst_y", 0);
      m.dst_z = get<uint64_t>(d, "dst_z", 0); m.dst_pitch = get<uint64_t>(d, "dst_pitch", 0);
      m.dst_height = get<uint64_t>(d, "dst_height", 0);
      m.width = get<uint64_t>(d, "width", 0); m.height = get<uint64_t>(d, "height", 1);
      m.depth = get<uint64_t>(d, "depth", 1);
    } else if (kind == "memset") {
      n.kind = NodeKind::memset;
      MemsetNode& m = n.memset;
      m.dst = get<uint64_t>(d, "dst", 0); m.pitch = get<uint64_t>(d, "pitch", 0);
      m.value = get<uint32_t>(d, "value", 0); m.element_size = get<uint32_t>(d, "element_size", 1);
      m.width = get<uint64_t>(d, "width", 0); m.height = get<uint64_t>(d, "height", 1);
    } else if (kind == "event_record" || kind == "event_wait") {
      n.kind = kind == "event_record" ? NodeKind::event_record : NodeKind::event_wait;
      n.event = nb::cast<uint32_t>(d["event"]);
    } else if (kind == "empty") {
      n.kind = NodeKind::empty;
    } else {
      VITRIFY_EXPECT(false, "unknown node kind '" + kind + "'");
    }
    g.nodes.push_back(std::move(n));
  }
  if (in.contains("edges"))
    for (nb::handle e : nb::cast<nb::list>(in["edges"])) {
      nb::tuple t = nb::cast<nb::tuple>(e);
      Edge ed{nb::cast<uint32_t>(t[0]), nb::cast<uint32_t>(t[1])};
      if (t.size() == 5) {
        ed.from_port = nb::cast<uint8_t>(t[2]);
        ed.to_port = nb::cast<uint8_t>(t[3]);
        ed.type = nb::cast<uint8_t>(t[4]);
      }
      g.edges.push_back(ed);
    }
  g.event_count = get<uint32_t>(in, "event_count", 0);
  g.region_base = get<uint64_t>(in, "region_base", 0);
  g.region_size = get<uint64_t>(in, "region_size", 0);
  if (in.contains("relocations"))
    for (nb::handle r : nb::cast<nb::list>(in["relocations"]))
      g.relocations.push_back({nb::cast<uint32_t>(r[0]), nb::cast<uint32_t>(r[1]),
                               nb::cast<uint64_t>(r[2]), WordKind::pointer_param});
  return g;
}

nb::dict stats_dict(const RebuildStats& s) {
  nb::dict d;
  d["graphs"] = s.graphs;
  d["templates"] = s.templates;
  d["built_templates"] = s.built_templates;
  d["ready_graphs"] = s.ready_graphs;
  d["modules_loaded"] = s.modules_loaded;
  d["parameter_switches"] = s.parameter_switches;
  d["nodes_updated"] = s.nodes_updated;
  d["build_seconds"] = s.build_seconds;
  d["module_seconds"] = s.module_seconds;
  d["nodes_seconds"] = s.nodes_seconds;
  d["instantiate_seconds"] = s.instantiate_seconds;
  d["attributes_set"] = s.attributes_set;
  return d;
}

}  // namespace

void bind_graph(nb::module_& m) {
  nb::exception<FreezeError>(m, "GraphFreezeError", PyExc_RuntimeError);
  m.def("graph_format_version", [] { return kGraphFormatVersion; });
  m.def("graph_sha256", [](nb::bytes b) {
    const char* p = b.c_str();
    const size_t n = b.size();
    nb::gil_scoped_release nogil;
    return to_hex(sha256(p, n));
  });
  m.def("graph_binary_kind", [](nb::bytes b) { return std::string(binary_kind_name(detect_binary_kind(b.c_str(), b.size()))); });
  m.def("graph_kernel_names", [](nb::bytes b) { return kernel_names(b.c_str(), b.size()); });
  m.def("graph_build", [](nb::dict d) { return to_bytes(serialize(build(d))); },
        "A description dict -> graph file bytes (validated).");
  m.def("graph_describe", [](nb::bytes b) { return describe(parse(b)); },
        "Graph file bytes -> description dict (checks magic, version, checksums).");
  m.def("graph_topology", [](nb::bytes b) { return to_hex(topology_hash(parse(b))); });
  m.def("graph_modules", [](nb::bytes b) {
    std::vector<std::string> out;
    for (const Hash& h : referenced_modules(parse(b))) out.push_back(to_hex(h));
    return out;
  });
  nb::class_<FieldEvidence>(m, "FieldEvidence",
                            "Kernel fields seen holding a non-address (integer evidence).")
      .def(nb::init<>())
      .def("__len__", &FieldEvidence::size)
      .def("clear", &FieldEvidence::clear);
  m.def("graph_find_relocations",
        [](nb::bytes b, uint64_t base, uint64_t size,
           std::optional<std::vector<std::pair<uint64_t, uint64_t>>> live, FieldEvidence* evidence) {
          Graph g = parse(b);
          ScanOptions opt;
          opt.base = base;
          opt.size = size;
          opt.live = live ? *live : std::vector<std::pair<uint64_t, uint64_t>>{{0, size}};
          opt.small_offset_check = live.has_value();
          find_relocations(g, opt, evidence);
          return to_bytes(serialize(g));
        },
        nb::arg("data"), nb::arg("base"), nb::arg("size"), nb::arg("live") = nb::none(),
        nb::arg("evidence") = nb::none());
  m.def("graph_apply_evidence", [](nb::bytes b, const FieldEvidence& evidence) {
    Graph g = parse(b);
    const size_t changed = apply_evidence(g, evidence);
    return nb::make_tuple(to_bytes(serialize(g)), changed);
  });
  m.def("graph_relocate", [](nb::bytes b, uint64_t new_base) {
    Graph g = parse(b);
    relocate(g, new_base);
    return to_bytes(serialize(g));
  });
  m.def("graph_group_by_topology", [](std::vector<nb::bytes> files) {
    std::vector<Graph> gs;
    for (const nb::bytes& b : files) gs.push_back(parse(b));
    std::vector<const Graph*> ptrs;
    for (const Graph& g : gs) ptrs.push_back(&g);
    return group_by_topology(ptrs);
  });

  // --- recording (CUPTI) and capture
  m.def("graph_record_modules", [](std::vector<std::string> extra) {
    nb::gil_scoped_release nogil;
    ModuleRecorder::instance().start(extra);
  }, nb::arg("extra_paths") = std::vector<std::string>());
  m.def("graph_stop_recording", [] { ModuleRecorder::instance().stop(); });
  m.def("graph_recorder_info", [] {
    ModuleRecorder& r = ModuleRecorder::instance();
    nb::dict d;
    d["active"] = r.active();
    d["library"] = r.library_path();
    d["modules"] = r.registry().size();
    d["bytes"] = r.registry().total_bytes();
    d["callbacks"] = r.modules_seen();
    const CodeBindings::Stats b = r.bindings().stats();
    d["loads_in_calls"] = b.loads_in_calls;
    d["loads_outside_calls"] = b.loads_outside;
    d["ambiguous_calls"] = b.ambiguous_calls;
    d["bound_exact"] = b.exact;
    d["bound_handles"] = b.handles;
    return d;
  });
  m.def("graph_recorded_module", [](const std::string& hex) {
    auto mod = ModuleRecorder::instance().registry().get(hash_from_hex(hex));
    VITRIFY_EXPECT(mod != nullptr, "no recorded module " + hex);
    nb::dict d;
    d["hash"] = hex;
    d["kind"] = binary_kind_name(mod->kind);
    d["kernels"] = mod->kernels;
    d["bytes"] = to_bytes(mod->bytes);
    return d;
  });
  m.def("graph_add_recorded_module", [](nb::bytes b) {
    return to_hex(ModuleRecorder::instance().registry().add(b.c_str(), b.size()));
  }, "Adds a binary to the recorder's registry by hand (e.g. one loaded before recording began).");
  m.def("graph_capture", [](uint64_t handle, uint64_t base, uint64_t size, int device,
                            std::vector<std::pair<uint64_t, uint64_t>> live,
                            FieldEvidence* evidence) {
    std::vector<uint8_t> out;
    {
      nb::gil_scoped_release nogil;
      CaptureOptions opt;
      opt.device = device;
      opt.region_base = base;
      opt.region_size = size;
      opt.live = std::move(live);
      opt.evidence = evidence;
      opt.bindings = &ModuleRecorder::instance().bindings();
      out = serialize(capture_graph(reinterpret_cast<CUgraph>(handle),
                                    ModuleRecorder::instance().registry(), opt));
    }
    return to_bytes(out);
  }, nb::arg("handle"), nb::arg("region_base") = 0, nb::arg("region_size") = 0,
     nb::arg("device") = 0, nb::arg("live") = std::vector<std::pair<uint64_t, uint64_t>>{},
     nb::arg("evidence") = nb::none());

  nb::class_<GraphSet>(m, "GraphSet", "Rebuilt graphs: one executable per topology template.")
      .def(nb::init<int, bool>(), nb::arg("device") = 0, nb::arg("share_templates") = true)
      .def("add_module", [](GraphSet& s, nb::bytes b, std::optional<std::string> expected) {
        const char* p = b.c_str();
        const size_t n = b.size();
        Hash want{};
        if (expected) want = hash_from_hex(*expected);
        nb::gil_scoped_release nogil;
        return to_hex(s.add_module(p, n, expected ? &want : nullptr));
      }, nb::arg("data"), nb::arg("expected") = nb::none())
      .def("add_modules", [](GraphSet& s, const std::vector<std::pair<nb::bytes, std::string>>& mods,
                             bool check) {
        // Many modules, the GIL released once (a THAW loads ~100 beside a busy main thread).
        std::vector<std::pair<std::string_view, Hash>> in;
        in.reserve(mods.size());
        for (const auto& [b, hex] : mods)
          in.emplace_back(std::string_view(b.c_str(), b.size()), hash_from_hex(hex));
        std::vector<std::string> out;
        out.reserve(in.size());
        nb::gil_scoped_release nogil;
        for (const auto& [data, want] : in)
          out.push_back(to_hex(s.add_module(data.data(), data.size(), &want, check)));
        return out;
      }, nb::arg("modules"), nb::arg("check") = true,
      "add_module for [(data, expected SHA-256 hex)], in order; check=False trusts the names "
      "(the bytes were verified by another checksum) instead of hashing every byte again.")
      .def("add", [](GraphSet& s, nb::bytes b, std::optional<uint64_t> relocate_to,
                     std::optional<std::string> expected, bool check) {
        if (expected && check) {  // graphs are small: checked under the GIL, no hand-over
          const std::string got = to_hex(sha256(b.c_str(), b.size()));
          if (got != *expected)
            throw std::invalid_argument("graph SHA-256 " + got + " differs from the index's " +
                                        *expected);
        }
        Graph g = parse(b);
        if (relocate_to && *relocate_to != g.region_base) relocate(g, *relocate_to);
        return s.add(std::move(g));
      }, nb::arg("data"), nb::arg("relocate_to") = nb::none(), nb::arg("expected") = nb::none(),
         nb::arg("check") = true)
      .def("start", [](GraphSet& s, unsigned threads) {
        nb::gil_scoped_release nogil;
        s.start(threads);
      }, nb::arg("threads") = 2)
      .def("wait", [](GraphSet& s, size_t id) {
        nb::gil_scoped_release nogil;
        s.wait(id);
      })
      .def("wait_all", [](GraphSet& s) {
        nb::gil_scoped_release nogil;
        s.wait_all();
      })
      .def("launch", [](GraphSet& s, size_t id, uint64_t stream) {
        nb::gil_scoped_release nogil;
        s.launch(id, stream);
      }, nb::arg("id"), nb::arg("stream") = 0)
      .def("synchronize", [](GraphSet& s) {
        nb::gil_scoped_release nogil;
        s.synchronize();
      })
      .def("template_of", &GraphSet::template_of)
      .def("__len__", &GraphSet::size)
      .def("stats", [](const GraphSet& s) { return stats_dict(s.stats()); });
}

}  // namespace vitrify::bindings
