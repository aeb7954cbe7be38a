// One bind_<area>() per area, called from module.cpp. Bindings convert arguments and release
// the GIL; logic lives in vitrify_core.
#pragma once

#include <nanobind/nanobind.h>

namespace vitrify::bindings {
void bind_common(nanobind::module_& m);
void bind_driver(nanobind::module_& m);
void bind_disk(nanobind::module_& m);
void bind_region(nanobind::module_& m);
void bind_shared(nanobind::module_& m);
void bind_snapshot(nanobind::module_& m);
void bind_host(nanobind::module_& m);
void bind_graph(nanobind::module_& m);
}  // namespace vitrify::bindings
