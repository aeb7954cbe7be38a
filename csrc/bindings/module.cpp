#include "bind.hpp"

NB_MODULE(_native, m) {
  m.doc() = "vitrify's private native module; use the `vitrify` package instead.";
  vitrify::bindings::bind_common(m);
  vitrify::bindings::bind_driver(m);
  vitrify::bindings::bind_disk(m);
  vitrify::bindings::bind_region(m);
  vitrify::bindings::bind_shared(m);
  vitrify::bindings::bind_snapshot(m);
  vitrify::bindings::bind_host(m);
  vitrify::bindings::bind_graph(m);
}
