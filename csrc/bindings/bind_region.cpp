// The region allocator: argument conversion and GIL release only.
#include <nanobind/stl/optional.h>
#include <nanobind/stl/pair.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/vector.h>

#include <tuple>
#include <vector>

#include "bind.hpp"
#include "vitrify/region.hpp"

namespace nb = nanobind;

namespace vitrify::bindings {

void bind_region(nb::module_& m) {
  nb::exception<AddressUnavailable>(m, "RegionAddressError", PyExc_RuntimeError);

  m.def("region_candidate_bases", &region::candidate_bases, nb::arg("size"));
  m.def("region_round_up", &region::round_up, nb::arg("n"), nb::arg("granularity"));
  m.attr("REGION_SEARCH_FIRST") = region::kSearchFirst;
  m.attr("REGION_SEARCH_LIMIT") = region::kSearchLimit;
  m.attr("REGION_DEFAULT_PREALLOC_CHUNK") = region::kDefaultPreallocChunk;

  nb::class_<Region>(m, "Region")
      .def(
          "__init__",
          [](Region* self, std::optional<uint64_t> base, uint64_t size, int device,
             bool exportable) {
            nb::gil_scoped_release nogil;
            new (self) Region(base, size, device, exportable);
          },
          nb::arg("base").none(), nb::arg("size"), nb::arg("device"),
          nb::arg("exportable") = false)
      .def("close", [](Region& r) {
        nb::gil_scoped_release nogil;
        r.close();
      })
      .def_prop_ro("closed", &Region::closed)
      .def_prop_ro("base", &Region::base)
      .def_prop_ro("size", &Region::size)
      .def_prop_ro("granularity", &Region::granularity)
      .def_prop_ro("device", &Region::device)
      .def_prop_ro("exportable", &Region::exportable)
      .def("export_range", [](const Region& r, uint64_t offset, uint64_t nbytes) {
        std::vector<region::ExportedChunk> cs;
        {
          nb::gil_scoped_release nogil;
          cs = r.export_range(offset, nbytes);
        }
        std::vector<std::tuple<uint64_t, uint64_t, int>> out;
        out.reserve(cs.size());
        for (const auto& c : cs) out.emplace_back(c.offset, c.size, c.fd);
        return out;
      }, nb::arg("offset"), nb::arg("nbytes"),
         "(offset, size, fd) of each mapped chunk covering the range; the caller closes the fds.")
      .def("describe", &Region::describe)
      .def("allocate", [](Region& r, uint64_t n, bool at_cursor) {
        nb::gil_scoped_release nogil;
        return r.allocate(n, at_cursor);
      }, nb::arg("nbytes"), nb::arg("at_cursor") = false)
      .def("free", [](Region& r, uint64_t p) {
        nb::gil_scoped_release nogil;
        r.free(p);
      }, nb::arg("ptr"))
      .def("owns", &Region::owns, nb::arg("ptr"))
      .def("stop", &Region::stop)
      .def("resume", &Region::resume)
      .def_prop_ro("stopped", &Region::stopped)
      .def_prop_ro("offset", &Region::offset)
      .def("set_offset", [](Region& r, uint64_t n) {
        nb::gil_scoped_release nogil;
        r.set_offset(n);
      }, nb::arg("offset"))
      .def("preallocate", [](Region& r, uint64_t upto, uint64_t chunk) {
        nb::gil_scoped_release nogil;
        return r.preallocate(upto, chunk);
      }, nb::arg("upto"), nb::arg("chunk_bytes"))
      .def("checkpoint", &Region::checkpoint, nb::arg("name"))
      .def("checkpoints", &Region::checkpoints)
      .def("live_allocations", [](const Region& r) {
        std::vector<std::pair<uint64_t, uint64_t>> out;
        for (const region::Span& s : r.live_allocations()) out.emplace_back(s.offset, s.size);
        return out;
      })
      .def("stats", [](const Region& r) {
        const RegionStats s = r.stats();
        nb::dict d;
        d["base"] = s.base;
        d["device"] = s.device;
        d["stopped"] = s.stopped;
        d["reserved"] = s.layout.size;
        d["granularity"] = s.layout.granularity;
        d["cursor"] = s.layout.cursor;
        d["frontier"] = s.layout.frontier;
        d["mapped"] = s.layout.mapped_bytes;
        d["chunks"] = s.layout.chunks;
        d["live_allocations"] = s.layout.live_allocations;
        d["live_bytes"] = s.layout.live_bytes;
        d["allocations_total"] = s.layout.allocations_total;
        d["frees_total"] = s.layout.frees_total;
        d["chunks_created"] = s.layout.chunks_created;
        d["chunks_released"] = s.layout.chunks_released;
        d["fallback_live"] = s.fallback_live;
        d["fallback_bytes"] = s.fallback_bytes;
        d["released_chunks"] = s.released_chunks;
        d["released_bytes"] = s.released_bytes;
        d["kept_bytes"] = s.kept_bytes;
        return d;
      })
      .def("release_memory", [](Region& r, uint64_t offset, uint64_t nbytes, bool keep) {
        nb::gil_scoped_release nogil;
        return r.release_memory(offset, nbytes, keep);
      }, nb::arg("offset"), nb::arg("nbytes"), nb::arg("keep"))
      .def("restore_memory", [](Region& r, uint64_t offset, uint64_t nbytes) {
        nb::gil_scoped_release nogil;
        return r.restore_memory(offset, nbytes);
      }, nb::arg("offset"), nb::arg("nbytes"))
      .def("released", [](const Region& r) {
        std::vector<std::tuple<uint64_t, uint64_t, bool>> out;
        for (const auto& c : r.released()) out.emplace_back(c.offset, c.size, c.kept);
        return out;
      })
      .def("write", [](Region& r, uint64_t dst, nb::bytes data) {
        const char* p = data.c_str();
        const size_t n = data.size();
        nb::gil_scoped_release nogil;
        r.write(dst, p, n);
      }, nb::arg("ptr"), nb::arg("data"))
      .def("read", [](const Region& r, uint64_t src, size_t n) {
        std::string out(n, '\0');
        {
          nb::gil_scoped_release nogil;
          r.read(src, out.data(), n);
        }
        return nb::bytes(out.data(), out.size());
      }, nb::arg("ptr"), nb::arg("nbytes"));

  m.def("region_set_active", [](Region* r, int device) { region::set_active(r, device); },
        nb::arg("region").none(), nb::arg("device"));
  m.def("region_active_base", [](int device) -> std::optional<uint64_t> {
    Region* r = region::active(device);
    if (r == nullptr) return std::nullopt;
    return r->base();
  }, nb::arg("device"));
  m.def("region_last_abi_error", &region::last_abi_error);
  // The C ABI, callable from Python for tests (torch calls the exported symbols directly).
  m.def("_region_abi_malloc", [](int64_t size, int device) {
    nb::gil_scoped_release nogil;
    return reinterpret_cast<uint64_t>(vitrify_region_malloc(size, device, nullptr));
  });
  m.def("_region_abi_free", [](uint64_t p, int64_t size, int device) {
    nb::gil_scoped_release nogil;
    vitrify_region_free(reinterpret_cast<void*>(p), size, device, nullptr);
  });
}

}  // namespace vitrify::bindings
