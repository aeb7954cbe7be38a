// One bind_<area>() per area, called from module.cpp. Bindings convert arguments and release
// the GIL; logic lives in vitrify_core.
#pragma once

#include <nanobind/nanobind.h>

#include <initializer_list>
#include <utility>

namespace vitrify::bindings {
// Sets the Python error to `exc` (an instance of `type`, a new reference this takes over) with
// the attributes `attrs` (name -> new reference each, taken over; a null one means its creation
// failed: then no attribute is set and the creation's error gives way to `exc`).
void raise_with_attributes(PyObject* type, PyObject* exc,
                           std::initializer_list<std::pair<const char*, PyObject*>> attrs);

void bind_common(nanobind::module_& m);
void bind_driver(nanobind::module_& m);
void bind_disk(nanobind::module_& m);
void bind_region(nanobind::module_& m);
void bind_shared(nanobind::module_& m);
void bind_snapshot(nanobind::module_& m);
void bind_host(nanobind::module_& m);
void bind_graph(nanobind::module_& m);
}  // namespace vitrify::bindings
