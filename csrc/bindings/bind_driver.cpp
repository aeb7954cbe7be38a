// The driver seam: availability, device facts, and a plain device buffer.
#include <nanobind/stl/string.h>

#include "bind.hpp"
#include "vitrify/device_memory.hpp"
#include "vitrify/driver.hpp"

namespace nb = nanobind;

namespace vitrify::bindings {

void bind_driver(nb::module_& m) {
  m.def("cuda_available", [] {
    nb::gil_scoped_release nogil;
    return driver::available();
  });
  m.def("cuda_unavailable_reason", [] {
    nb::gil_scoped_release nogil;
    return driver::unavailable_reason();
  });
  m.def("driver_version", [] { return driver::table().driver_version; });
  m.def("driver_library", [] { return driver::table().library_path; });
  m.def("driver_has", [](const std::string& entry) {
    const auto& t = driver::table();
    if (entry == "cuMemcpyBatchAsync") return t.cuMemcpyBatchAsync != nullptr;
    if (entry == "cuMemcpyBatchAsync_v12080") return t.cuMemcpyBatchAsync_v12080 != nullptr;
    throw std::invalid_argument("driver_has: unknown optional entry point " + entry);
  });
  m.def("device_count", [] { return driver::device_count(); });
  m.def(
      "device_info",
      [](int ordinal) {
        const driver::DeviceInfo i = driver::device_info(ordinal);
        nb::dict d;
        d["ordinal"] = i.ordinal;
        d["name"] = i.name;
        d["uuid"] = i.uuid;
        d["sm"] = std::to_string(i.sm_major) + "." + std::to_string(i.sm_minor);
        d["multiprocessors"] = i.multiprocessors;
        d["total_bytes"] = i.total_bytes;
        d["vmm_supported"] = i.vmm_supported;
        d["granularity_min"] = i.granularity_min;
        d["granularity_recommended"] = i.granularity_recommended;
        char pci[32];
        std::snprintf(pci, sizeof pci, "%04x:%02x:%02x", i.pci_domain, i.pci_bus, i.pci_device);
        d["pci"] = std::string(pci);
        return d;
      },
      nb::arg("ordinal") = 0);

  nb::class_<DeviceBuffer>(m, "DeviceBuffer",
                           "A plain cuMemAlloc allocation with one owner (freed on close or "
                           "when collected).")
      .def(nb::init<size_t, int>(), nb::arg("nbytes"), nb::arg("device") = 0)
      .def_prop_ro("ptr", &DeviceBuffer::ptr)
      .def_prop_ro("nbytes", &DeviceBuffer::size)
      .def_prop_ro("device", &DeviceBuffer::device)
      .def(
          "write",
          [](DeviceBuffer& b, nb::bytes data, size_t offset) {
            const char* p = data.c_str();
            const size_t n = data.size();
            nb::gil_scoped_release nogil;
            b.copy_from_host(p, n, offset);
          },
          nb::arg("data"), nb::arg("offset") = 0)
      .def(
          "read",
          [](const DeviceBuffer& b, size_t nbytes, size_t offset) {
            std::string out(nbytes, '\0');
            {
              nb::gil_scoped_release nogil;
              b.copy_to_host(out.data(), nbytes, offset);
            }
            return nb::bytes(out.data(), out.size());
          },
          nb::arg("nbytes"), nb::arg("offset") = 0)
      .def("fill", [](DeviceBuffer& b, uint8_t v) {
        nb::gil_scoped_release nogil;
        b.fill(v);
      });
}

}  // namespace vitrify::bindings
