// CodeBindings: which recorded binary a driver handle's code came from (see graph_cuda.hpp and
// DESIGN.md, "Kernel identity"). No driver calls here: the CUPTI callbacks (cupti.cpp) feed it,
// capture.cpp reads it, and CPU tests drive it directly.
#include <utility>

#include "vitrify/graph_cuda.hpp"

namespace vitrify::graph {
namespace {

// The calls in progress on this thread, innermost last, with the modules loaded during each.
// Keyed by owner so several CodeBindings (tests) never see each other's frames.
struct Frame {
  const CodeBindings* owner;
  CodeBindings::Call call;
  std::vector<Hash> loads;
};
// Never destroyed: CUPTI calls back during process exit (modules unloaded by static
// destructors) after a thread_local with a destructor would be gone. One small vector per thread
// that ever made a traced driver call is left behind when the thread ends.
std::vector<Frame>& frames() {
  thread_local std::vector<Frame>* f = new std::vector<Frame>();
  return *f;
}

}  // namespace

void CodeBindings::enter(Call c) { frames().push_back(Frame{this, c, {}}); }

void CodeBindings::loaded(const Hash& h) {
  std::vector<Frame>& t_frames = frames();
  for (auto it = t_frames.rbegin(); it != t_frames.rend(); ++it) {
    if (it->owner != this) continue;
    it->loads.push_back(h);
    std::lock_guard<std::mutex> lock(mu_);
    ++stats_.loads_in_calls;
    return;
  }
  std::lock_guard<std::mutex> lock(mu_);
  ++stats_.loads_outside;
}

void CodeBindings::exit(Call c, bool ok, const void* out, const void* in) {
  // Pop this owner's innermost frame (it must be this call; a mismatch means a lost exit, and
  // the frames above it are dropped with it rather than mis-attributed).
  std::vector<Frame>& t_frames = frames();
  std::vector<Hash> loads;
  bool found = false;
  for (size_t i = t_frames.size(); i-- > 0;) {
    if (t_frames[i].owner != this) continue;
    if (t_frames[i].call == c) {
      loads = std::move(t_frames[i].loads);
      found = true;
    }
    t_frames.erase(t_frames.begin() + static_cast<std::ptrdiff_t>(i), t_frames.end());
    break;
  }
  std::lock_guard<std::mutex> lock(mu_);
  if (c == Call::kModuleUnload || c == Call::kLibraryUnload) {
    if (ok && in != nullptr) {
      exact_.erase(in);
      if (auto it = library_modules_.find(in); it != library_modules_.end()) {
        for (const void* m : it->second) exact_.erase(m);  // its per-context modules
        library_modules_.erase(it);
      }
    }
    if (ok) handles_.clear();  // function/kernel handles of the unloaded code may be reused
  } else if (found && loads.size() > 1) {
    ++stats_.ambiguous_calls;
  } else if (found && ok && loads.size() == 1) {
    const Hash& h = loads[0];
    auto bind_exact = [&](const void* p) { if (p != nullptr) exact_[p] = h; };
    auto bind_handle = [&](const void* p) { if (p != nullptr) handles_[p] = h; };
    switch (c) {
      case Call::kModuleLoad:
      case Call::kLibraryLoad: bind_exact(out); break;
      case Call::kLibraryGetModule:
        bind_exact(out);
        bind_exact(in);
        if (out != nullptr && in != nullptr) library_modules_[in].push_back(out);
        break;
      case Call::kLibraryGetKernel: bind_handle(out); bind_exact(in); break;
      case Call::kKernelGetFunction: bind_handle(out); bind_handle(in); break;
      case Call::kLaunch: bind_handle(in); break;
      case Call::kModuleUnload:
      case Call::kLibraryUnload: break;
    }
  }
  stats_.exact = exact_.size();
  stats_.handles = handles_.size();
}

std::optional<Hash> CodeBindings::exact(const void* handle) const {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = exact_.find(handle);
  if (it == exact_.end()) return std::nullopt;
  return it->second;
}

std::optional<Hash> CodeBindings::handle(const void* handle) const {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = handles_.find(handle);
  if (it == handles_.end()) return std::nullopt;
  return it->second;
}

CodeBindings::Stats CodeBindings::stats() const {
  std::lock_guard<std::mutex> lock(mu_);
  return stats_;
}

void CodeBindings::clear() {
  std::lock_guard<std::mutex> lock(mu_);
  exact_.clear();
  handles_.clear();
  library_modules_.clear();
  stats_ = Stats{};
}

}  // namespace vitrify::graph
