#include "bind.hpp"

NB_MODULE(_native, m) {
  m.doc() = "thaw's private native module; use the `thaw` package instead.";
  thaw::bindings::bind_common(m);
  thaw::bindings::bind_driver(m);
  thaw::bindings::bind_disk(m);
  thaw::bindings::bind_region(m);
  thaw::bindings::bind_snapshot(m);
  thaw::bindings::bind_host(m);
  thaw::bindings::bind_graph(m);
}
