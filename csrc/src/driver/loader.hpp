// Internal: load a driver table from one library path without touching the process-wide one.
// Used by the process-wide loader and by tests (with a fake driver library).
#pragma once

#include <string>

#include "vitrify/driver.hpp"

namespace vitrify::driver {

struct LoadResult {
  bool ok = false;
  std::string reason;      // why not, when !ok
  void* handle = nullptr;  // dlopen handle (never closed: entry points may still be in use)
  Table table;
};

// dlopen(path), resolve every entry through cuGetProcAddress_v2 gated by the driver version,
// then cuInit(0). Never throws for a missing/broken driver: returns ok=false and a reason.
LoadResult load_table(const std::string& path);

}  // namespace vitrify::driver
