// region::SharedBuffer (VMM memory exported as a POSIX fd): argument conversion and GIL release.
#include <nanobind/stl/pair.h>
#include <nanobind/stl/vector.h>

#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "bind.hpp"
#include "vitrify/shared_buffer.hpp"

namespace nb = nanobind;

namespace vitrify::bindings {

void bind_shared(nb::module_& m) {
  using region::SharedBuffer;
  nb::class_<SharedBuffer>(m, "SharedBuffer",
                           "Device memory another process can map: export_fd() gives an fd to "
                           "send to it (SCM_RIGHTS), import_fd() maps one (R14 in "
                           "csrc/src/region/DESIGN.md).")
      .def(
          "__init__",
          [](SharedBuffer* self, uint64_t size, int device) {
            nb::gil_scoped_release nogil;
            new (self) SharedBuffer(size, device);
          },
          nb::arg("size"), nb::arg("device") = 0)
      .def_static(
          "import_fd",
          [](int fd, uint64_t size, int device) {
            std::optional<SharedBuffer> out;
            {
              nb::gil_scoped_release nogil;
              out.emplace(SharedBuffer::import_fd(fd, size, device));
            }
            return SharedBuffer(std::move(*out));
          },
          nb::arg("fd"), nb::arg("size"), nb::arg("device") = 0,
          "Maps the buffer exported as `fd` (not consumed: close it afterwards). `size` must be "
          "the exporter's size.")
      .def_static(
          "import_fds",
          [](std::vector<std::pair<int, uint64_t>> pieces, int device) {
            std::optional<SharedBuffer> out;
            {
              nb::gil_scoped_release nogil;
              out.emplace(SharedBuffer::import_fds(pieces, device));
            }
            return SharedBuffer(std::move(*out));
          },
          nb::arg("pieces"), nb::arg("device") = 0,
          "Maps the exported allocations [(fd, size), ...] consecutively as one range (an "
          "exportable Region's chunks: Region.export). The fds are not consumed.")
      .def(
          "export_fd",
          [](const SharedBuffer& b) {
            nb::gil_scoped_release nogil;
            return b.export_fd();
          },
          "A new close-on-exec file descriptor for the buffer; the caller closes it.")
      .def(
          "release",
          [](SharedBuffer& b) {
            nb::gil_scoped_release nogil;
            return b.release();
          },
          "Unmaps, releases the handle and frees the range; returns the first failing CUresult "
          "(0 when all succeeded or already released).")
      .def("__enter__", [](nb::handle self) { return self; })
      .def("__exit__",
           [](SharedBuffer& b, nb::args) {
             nb::gil_scoped_release nogil;
             (void)b.release();
           })
      .def_prop_ro("ptr", &SharedBuffer::ptr)
      .def_prop_ro("size", &SharedBuffer::size)
      .def_prop_ro("device", &SharedBuffer::device)
      .def_prop_ro("imported", &SharedBuffer::imported)
      .def_prop_ro("released", &SharedBuffer::released)
      .def(
          "write",
          [](SharedBuffer& b, uint64_t offset, nb::bytes data) {
            const char* p = data.c_str();
            const size_t n = data.size();
            nb::gil_scoped_release nogil;
            b.write(offset, p, n);
          },
          nb::arg("offset"), nb::arg("data"))
      .def(
          "read",
          [](const SharedBuffer& b, uint64_t offset, size_t n) {
            std::string out(n, '\0');
            {
              nb::gil_scoped_release nogil;
              b.read(offset, out.data(), n);
            }
            return nb::bytes(out.data(), out.size());
          },
          nb::arg("offset"), nb::arg("nbytes"));
}

}  // namespace vitrify::bindings
