// The C ABI for torch.cuda.memory.CUDAPluggableAllocator and the registry behind it (R11).
// Locks: the registry mutex is taken before a region's own mutex, never the other way round,
// and nothing is logged (the log sink may call into Python) while either is held.
#include <algorithm>
#include <map>
#include <mutex>
#include <string>
#include <vector>

#include "vitrify/log.hpp"
#include "vitrify/region.hpp"

namespace vitrify::region {
namespace {

struct Registry {
  std::mutex mu;
  std::vector<Region*> live;
  std::map<int, Region*> active;
};

Registry& registry() {
  static Registry* r = new Registry();  // leaked: usable during process exit
  return *r;
}

thread_local std::string t_last_error;

}  // namespace

void register_region(Region* r) {
  Registry& g = registry();
  std::lock_guard<std::mutex> lk(g.mu);
  g.live.push_back(r);
}

void unregister_region(Region* r) noexcept {
  Registry& g = registry();
  std::lock_guard<std::mutex> lk(g.mu);
  g.live.erase(std::remove(g.live.begin(), g.live.end(), r), g.live.end());
  for (auto it = g.active.begin(); it != g.active.end();)
    it = (it->second == r) ? g.active.erase(it) : std::next(it);
}

void set_active(Region* r, int device) {
  VITRIFY_EXPECT(device >= 0, "device ordinal must be non-negative, got " + std::to_string(device));
  Registry& g = registry();
  std::lock_guard<std::mutex> lk(g.mu);
  if (r == nullptr) {
    g.active.erase(device);
    return;
  }
  VITRIFY_EXPECT(std::find(g.live.begin(), g.live.end(), r) != g.live.end(),
              "cannot activate a closed region");
  VITRIFY_EXPECT(r->device() == device, "region " + r->describe() +
                                         " cannot be the active region of device " +
                                         std::to_string(device));
  g.active[device] = r;
}

Region* active(int device) {
  Registry& g = registry();
  std::lock_guard<std::mutex> lk(g.mu);
  auto it = g.active.find(device);
  return it == g.active.end() ? nullptr : it->second;
}

std::string last_abi_error() { return t_last_error; }

}  // namespace vitrify::region

using vitrify::region::hex;
using vitrify::region::registry;

extern "C" __attribute__((visibility("default"))) void* vitrify_region_malloc(ssize_t size, int device,
                                                                         void* stream) {
  (void)stream;
  std::string error;
  void* out = nullptr;
  try {
    auto& g = registry();
    std::lock_guard<std::mutex> lk(g.mu);
    auto it = g.active.find(device);
    if (size <= 0) {
      error = "vitrify_region_malloc: size must be positive, got " + std::to_string(size);
    } else if (it == g.active.end()) {
      error = "vitrify_region_malloc: no active region for device " + std::to_string(device) +
              " (allocate inside vitrify.integrations.torch.region_allocations(region))";
    } else {
      out = reinterpret_cast<void*>(it->second->allocate(static_cast<uint64_t>(size)));
    }
  } catch (const std::exception& e) {
    error = std::string("vitrify_region_malloc(") + std::to_string(size) + ", device " +
            std::to_string(device) + "): " + e.what();
  } catch (...) {
    error = "vitrify_region_malloc: unknown error";
  }
  vitrify::region::t_last_error = error;
  if (!error.empty()) vitrify::log::error(error);
  return out;
}

extern "C" __attribute__((visibility("default"))) void vitrify_region_free(void* ptr, ssize_t size,
                                                                      int device, void* stream) {
  (void)size;
  (void)stream;
  if (ptr == nullptr) return;
  const uint64_t p = reinterpret_cast<uint64_t>(ptr);
  std::string error;
  try {
    auto& g = registry();
    std::lock_guard<std::mutex> lk(g.mu);
    vitrify::Region* owner = nullptr;
    for (vitrify::Region* r : g.live)
      if (r->owns(p) && (owner == nullptr || r->device() == device)) owner = r;
    if (owner == nullptr)
      error = "vitrify_region_free: " + hex(p) + " (device " + std::to_string(device) +
              ") belongs to no live region (closed before torch freed it?); ignored";
    else
      owner->free(p);
  } catch (const std::exception& e) {
    error = "vitrify_region_free(" + hex(p) + "): " + e.what();
  } catch (...) {
    error = "vitrify_region_free: unknown error";
  }
  // A successful free leaves the last error alone: torch frees cached blocks between a failed
  // allocation and the OutOfMemoryError it raises, and the region's reason must survive that.
  if (error.empty()) return;
  vitrify::region::t_last_error = error;
  vitrify::log::warning(error);
}
