// Internal helpers for the GPU half of csrc/src/graph.
#pragma once

#include <string>
#include <vector>

#include "thaw/driver.hpp"
#include "thaw/error.hpp"
#include "thaw/graph.hpp"

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

// cuModuleLoadData of a recorded binary. PTX (and anything not self-sized) is read by the driver
// as a NUL-terminated string, so it gets a terminated copy; cubins and fatbins go as they are.
inline CUresult load_module(CUmodule* out, const Module& m) {
  auto load = need(driver::cu().cuModuleLoadData, "cuModuleLoadData");
  if (m.kind == BinaryKind::elf || m.kind == BinaryKind::fatbin) return load(out, m.bytes.data());
  std::vector<uint8_t> text(m.bytes);
  text.push_back(0);
  return load(out, text.data());
}

}  // namespace thaw::graph::detail

// THAW_CU(CU_NEED(cuGraphGetNodes)(graph, nullptr, &n));
#define CU_NEED(name) ::thaw::graph::detail::need(::thaw::driver::cu().name, #name)
