// Internal helpers for the GPU half of csrc/src/graph.
#pragma once

#include <string>

#include "thaw/driver.hpp"
#include "thaw/error.hpp"

namespace thaw::graph::detail {

// An optional driver entry the graph code cannot do without: names it when it is absent.
template <typename F>
F need(F f, const char* name) {
  if (f == nullptr)
    throw DriverUnavailable(std::string("the CUDA driver (version ") +
                            std::to_string(driver::table().driver_version) + ") lacks " + name +
                            ", which CUDA graph persistence needs");
  return f;
}

}  // namespace thaw::graph::detail

// THAW_CU(CU_NEED(cuGraphGetNodes)(graph, nullptr, &n));
#define CU_NEED(name) ::thaw::graph::detail::need(::thaw::driver::cu().name, #name)
