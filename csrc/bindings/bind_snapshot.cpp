// Span snapshots: interval arithmetic, dump/restore in memory and through span files, the host
// backend for CPU tests, and ScratchSpan (a VMM span for GPU tests and benchmarks).
#include <nanobind/stl/function.h>
#include <nanobind/stl/pair.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/unique_ptr.h>
#include <nanobind/stl/vector.h>

#include <cstring>
#include <memory>
#include <string>

#include "bind.hpp"
#include "vitrify/file_io.hpp"
#include "vitrify/snapshot.hpp"

namespace nb = nanobind;
using namespace vitrify::snapshot;

namespace vitrify::bindings {
namespace {

PyObject* g_span_file_error = nullptr;

using Pairs = std::vector<std::pair<uint64_t, uint64_t>>;

Intervals to_intervals(const Pairs& v) {
  Intervals out;
  out.reserve(v.size());
  for (const auto& [b, e] : v) out.push_back({b, e});
  return out;
}
Pairs to_pairs(const Intervals& v) {
  Pairs out;
  out.reserve(v.size());
  for (const Interval& i : v) out.emplace_back(i.begin, i.end);
  return out;
}

// `target` is a device ordinal (the CUDA driver) or a HostBackend (CPU tests). Runs fn(backend)
// without the GIL.
template <class F>
auto with_backend(nb::handle target, F&& fn) {
  if (nb::isinstance<HostBackend>(target)) {
    HostBackend* hb = nb::cast<HostBackend*>(target);
    nb::gil_scoped_release nogil;
    return fn(*hb);
  }
  if (!PyLong_Check(target.ptr()))
    throw std::invalid_argument("target must be a device ordinal (int) or a HostBackend, got " +
                                std::string(nb::str(target.type()).c_str()));
  const int device = nb::cast<int>(target);
  nb::gil_scoped_release nogil;
  auto be = make_driver_backend(device);
  return fn(*be);
}

// Progress into Python: takes the GIL per call; a raising callback is reported as unraisable and
// never aborts the copy.
Progress to_progress(nb::object cb) {
  if (cb.is_none()) return {};
  auto holder = std::make_shared<nb::object>(std::move(cb));
  return [holder](uint64_t done, uint64_t total) {
    nb::gil_scoped_acquire gil;
    try {
      (*holder)(done, total);
    } catch (nb::python_error& e) {
      e.discard_as_unraisable("vitrify span progress callback");
    }
  };
}

FileOptions options(uint64_t chunk_bytes, uint64_t granularity, const std::string& direct_io,
                    nb::object progress) {
  FileOptions o;
  o.chunk_bytes = chunk_bytes;
  o.granularity = granularity;
  o.direct_io = file_io::parse_direct_io(direct_io);
  o.progress = to_progress(std::move(progress));
  return o;
}

nb::dict stats_dict(const FileStats& s) {
  nb::dict d;
  d["bytes"] = s.bytes;
  d["bytes_written"] = s.bytes_written;
  d["bytes_dropped"] = s.bytes_dropped;
  d["intervals"] = to_pairs(s.intervals);
  d["direct_io"] = s.direct_io;
  d["seconds"] = s.seconds;
  if (s.file_bytes) {  // a dump: the written file's size and whole-file CRC32C
    d["file_bytes"] = s.file_bytes;
    d["file_crc32c"] = s.file_crc32c;
  }
  return d;
}

struct PyScratchSpan {
  std::unique_ptr<ScratchSpan> span;
  ScratchSpan& get() {
    if (!span) throw std::invalid_argument("ScratchSpan is closed");
    return *span;
  }
};

}  // namespace

void bind_snapshot(nb::module_& m) {
  g_span_file_error = PyErr_NewExceptionWithDoc(
      "vitrify.snapshot.SpanFileError",
      "A span file is corrupt, truncated, or not a span file; the message names the part.",
      PyExc_RuntimeError, nullptr);
  m.attr("SpanFileError") = nb::handle(g_span_file_error);
  nb::register_exception_translator([](const std::exception_ptr& p, void*) {
    try {
      std::rethrow_exception(p);
    } catch (const SpanFileError& e) {
      PyErr_SetString(g_span_file_error, e.what());
    }
  });

  m.def("span_merge", [](const Pairs& v) { return to_pairs(merge(to_intervals(v))); });
  m.def("span_clamp", [](const Pairs& v, uint64_t c) { return to_pairs(clamp(to_intervals(v), c)); });
  m.def("span_intersect", [](const Pairs& v, uint64_t lo, uint64_t hi) {
    return to_pairs(intersect(to_intervals(v), lo, hi));
  });
  m.def("span_total", [](const Pairs& v) { return total_bytes(to_intervals(v)); });
  m.def("span_split_aligned", [](uint64_t base, uint64_t start, uint64_t end, uint64_t g) {
    return to_pairs(split_aligned(base, start, end, g));
  });
  m.def("span_is_normalized", [](const Pairs& v) { return is_normalized(to_intervals(v)); });

  nb::class_<HostBackend>(m, "HostBackend",
                          "Host memory posing as device memory, with unmapped holes (CPU tests).")
      .def("__init__",
           [](HostBackend* self, size_t size, const Pairs& holes, size_t alignment) {
             new (self) HostBackend(size, to_intervals(holes), alignment);
           },
           nb::arg("size"), nb::arg("holes") = Pairs{}, nb::arg("alignment") = size_t(2) << 20)
      .def_prop_ro("base", &HostBackend::base)
      .def_prop_ro("size", &HostBackend::size)
      .def_prop_ro("holes", [](const HostBackend& b) { return to_pairs(b.holes()); })
      .def_prop_ro("bytes_to_device", &HostBackend::bytes_to_device)
      .def("read", [](HostBackend& b, size_t off, size_t n) {
        VITRIFY_EXPECT(off <= b.size() && n <= b.size() - off, "read beyond the HostBackend");
        return nb::bytes(reinterpret_cast<const char*>(b.data() + off), n);
      }, nb::arg("offset"), nb::arg("nbytes"))
      .def("write", [](HostBackend& b, size_t off, nb::bytes data) {
        VITRIFY_EXPECT(off <= b.size() && data.size() <= b.size() - off, "write beyond the HostBackend");
        std::memcpy(b.data() + off, data.c_str(), data.size());
      }, nb::arg("offset"), nb::arg("data"));

  nb::class_<Snapshot>(m, "Snapshot", "Bytes of the mapped parts of a span, in host memory.")
      .def_prop_ro("base", [](const Snapshot& s) { return s.base; })
      .def_prop_ro("start", [](const Snapshot& s) { return s.start; })
      .def_prop_ro("end", [](const Snapshot& s) { return s.end; })
      .def_prop_ro("granularity", [](const Snapshot& s) { return s.granularity; })
      .def_prop_ro("intervals", [](const Snapshot& s) { return to_pairs(s.intervals); })
      .def_prop_ro("nbytes", &Snapshot::bytes)
      .def_prop_ro("pinned", [](const Snapshot& s) { return s.pin != nullptr; })
      .def("tobytes", [](const Snapshot& s) {
        return nb::bytes(reinterpret_cast<const char*>(s.data.data()), s.bytes());
      });

  m.def("span_dump",
        [](nb::handle target, uint64_t base, uint64_t start, uint64_t end, uint64_t g, bool pin) {
          return with_backend(target, [&](CopyBackend& be) {
            return std::make_unique<Snapshot>(dump(be, base, start, end, g, pin));
          });
        },
        nb::arg("target"), nb::arg("base"), nb::arg("start"), nb::arg("end"),
        nb::arg("granularity"), nb::arg("pin"));
  m.def("span_restore",
        [](nb::handle target, const Snapshot& snap, uint64_t base, uint64_t ceiling) {
          const RestoreStats st = with_backend(
              target, [&](CopyBackend& be) { return restore(be, snap, base, ceiling); });
          nb::dict d;
          d["bytes_written"] = st.bytes_written;
          d["bytes_dropped"] = st.bytes_dropped;
          d["intervals_written"] = st.intervals_written;
          return d;
        },
        nb::arg("target"), nb::arg("snapshot"), nb::arg("base"), nb::arg("ceiling"));
  m.def("span_dump_file",
        [](nb::handle target, const std::string& path, uint64_t base, uint64_t start,
           uint64_t end, uint64_t chunk_bytes, uint64_t g, const std::string& direct_io,
           nb::object progress) {
          const FileOptions o = options(chunk_bytes, g, direct_io, std::move(progress));
          return stats_dict(with_backend(target, [&](CopyBackend& be) {
            return dump_to_file(be, base, start, end, path, o);
          }));
        },
        nb::arg("target"), nb::arg("path"), nb::arg("base"), nb::arg("start"), nb::arg("end"),
        nb::arg("chunk_bytes"), nb::arg("granularity"), nb::arg("direct_io"),
        nb::arg("progress").none());
  m.def("span_restore_file",
        [](nb::handle target, const std::string& path, uint64_t base, uint64_t ceiling,
           const std::string& direct_io, nb::object progress) {
          const FileOptions o = options(4096, 1, direct_io, std::move(progress));
          return stats_dict(with_backend(target, [&](CopyBackend& be) {
            return restore_from_file(be, path, base, ceiling, o);
          }));
        },
        nb::arg("target"), nb::arg("path"), nb::arg("base"), nb::arg("ceiling"),
        nb::arg("direct_io"), nb::arg("progress").none());
  m.def("span_file_info", [](const std::string& path) {
    SpanFileInfo i;
    {
      nb::gil_scoped_release nogil;
      i = read_span_file_info(path);
    }
    nb::dict d;
    d["version"] = i.version;
    d["base"] = i.base;
    d["start"] = i.start;
    d["end"] = i.end;
    d["chunk_bytes"] = i.chunk_bytes;
    d["granularity"] = i.granularity;
    d["intervals"] = to_pairs(i.intervals);
    d["data_bytes"] = i.data_bytes;
    d["chunks"] = i.chunk_crcs.size();
    d["file_bytes"] = i.file_bytes;
    return d;
  });
  m.def("span_verify_file",
        [](const std::string& path, const std::string& direct_io) {
          FileOptions o;
          o.direct_io = file_io::parse_direct_io(direct_io);
          nb::gil_scoped_release nogil;
          verify_span_file(path, o);
        },
        nb::arg("path"), nb::arg("direct_io") = "auto");
  m.def("file_crc32c", [](const std::string& path) {
    nb::gil_scoped_release nogil;
    return file_crc32c(path);
  }, nb::arg("path"), "CRC32C of a whole file (read in large blocks, without the GIL).");
  m.def("read_whole_files", [](const std::vector<std::string>& paths,
                               const std::vector<uint64_t>& expect, unsigned threads) {
    std::vector<file_io::WholeFile> files;
    {
      nb::gil_scoped_release nogil;
      files = file_io::read_whole_files(paths, expect, threads);
    }
    nb::list out;
    for (file_io::WholeFile& f : files) {
      nb::object data = f.size == 0 || !f.data.empty()
                            ? nb::object(nb::bytes(reinterpret_cast<const char*>(f.data.data()),
                                                   f.data.size()))
                            : nb::none();
      out.append(nb::make_tuple(f.size, data, f.crc32c));
      std::vector<uint8_t>().swap(f.data);
    }
    return out;
  }, nb::arg("paths"), nb::arg("expect"), nb::arg("threads") = 8,
     "Reads each file whole when it has its expected size, several at a time, without the GIL: "
     "[(size, bytes or None when the size differs, crc32c)].");

  nb::class_<PyScratchSpan>(m, "ScratchSpan",
                            "A VMM reservation with chosen granules mapped (tests, benchmarks).")
      .def("__init__",
           [](PyScratchSpan* self, int device, uint64_t size, uint64_t base_hint,
              const std::vector<bool>& mapped) {
             std::unique_ptr<ScratchSpan> s;
             {
               nb::gil_scoped_release nogil;
               s = std::make_unique<ScratchSpan>(device, size, base_hint, mapped);
             }
             new (self) PyScratchSpan{std::move(s)};
           },
           nb::arg("device"), nb::arg("size"), nb::arg("base_hint"), nb::arg("mapped"))
      .def_prop_ro("base", [](PyScratchSpan& s) { return s.get().base(); })
      .def_prop_ro("size", [](PyScratchSpan& s) { return s.get().size(); })
      .def_prop_ro("granularity", [](PyScratchSpan& s) { return s.get().granularity(); })
      .def("write", [](PyScratchSpan& s, uint64_t offset, nb::bytes data) {
        const char* p = data.c_str();
        const size_t n = data.size();
        nb::gil_scoped_release nogil;
        s.get().write(offset, p, n);
      }, nb::arg("offset"), nb::arg("data"))
      .def("read", [](PyScratchSpan& s, uint64_t offset, size_t n) {
        std::string out(n, '\0');
        {
          nb::gil_scoped_release nogil;
          s.get().read(offset, out.data(), n);
        }
        return nb::bytes(out.data(), out.size());
      }, nb::arg("offset"), nb::arg("nbytes"))
      .def("close", [](PyScratchSpan& s) {
        nb::gil_scoped_release nogil;
        s.span.reset();
      });

  m.def("measure_pinned_h2d", [](int device, uint64_t dst, uint64_t bytes, int reps) {
    nb::gil_scoped_release nogil;
    return measure_pinned_h2d(device, dst, bytes, reps);
  }, nb::arg("device"), nb::arg("dst"), nb::arg("nbytes"), nb::arg("reps") = 3,
     "Seconds of the fastest single pinned cuMemcpyHtoD of nbytes to dst (a benchmark baseline).");
}

}  // namespace vitrify::bindings
