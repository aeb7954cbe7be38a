// Internal helpers for the GPU half of csrc/src/graph.
#pragma once

#include <string>
#include <vector>

#include "vitrify/driver.hpp"
#include "vitrify/error.hpp"
#include "vitrify/graph.hpp"

namespace vitrify::graph::detail {

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

}  // namespace vitrify::graph::detail

// VITRIFY_CU(CU_NEED(cuGraphGetNodes)(graph, nullptr, &n));
#define CU_NEED(name) ::vitrify::graph::detail::need(::vitrify::driver::cu().name, #name)
