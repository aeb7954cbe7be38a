// CodeBindings: which recorded binary a driver handle's code came from (see graph_cuda.hpp and
// DESIGN.md, "Kernel identity"). No driver calls here: the CUPTI callbacks (cupti.cpp) feed it,
// capture.cpp reads it, and CPU tests drive it directly.
#include <algorithm>
#include <utility>

#include "vitrify/graph_cuda.hpp"

namespace vitrify::graph {
namespace {

// The calls in progress on this thread, innermost last, with the binaries loaded during each.
// Keyed by owner and generation so several CodeBindings (tests) never see each other's frames
// and frames left open across stop()/start()/clear() are ignored.
struct Frame {
  const CodeBindings* owner;
  uint64_t generation;
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
thread_local int t_paused = 0;

}  // namespace

CodeBindings::Pause::Pause() { ++t_paused; }
CodeBindings::Pause::~Pause() { --t_paused; }

void CodeBindings::enter(Call c) {
  if (t_paused) return;
  frames().push_back(Frame{this, generation_.load(), c, {}});
}

void CodeBindings::loaded(const Hash& h) {
  if (t_paused) return;
  const uint64_t gen = generation_.load();
  std::vector<Frame>& fs = frames();
  for (auto it = fs.rbegin(); it != fs.rend(); ++it) {
    if (it->owner != this || it->generation != gen) continue;
    it->loads.push_back(h);
    std::lock_guard<std::mutex> lock(mu_);
    ++stats_.loads_in_calls;
    return;
  }
  std::lock_guard<std::mutex> lock(mu_);
  ++stats_.loads_outside;
}

void CodeBindings::unloading() {
  if (t_paused) return;
  const uint64_t gen = generation_.load();
  const std::vector<Frame>& fs = frames();
  for (auto it = fs.rbegin(); it != fs.rend(); ++it) {
    if (it->owner != this || it->generation != gen) continue;
    if (it->call == Call::kModuleUnload || it->call == Call::kLibraryUnload) return;  // at exit
    break;
  }
  std::lock_guard<std::mutex> lock(mu_);
  drop_all_locked();
}

void CodeBindings::exit(Call c, bool ok, const void* out, const void* in) {
  if (t_paused) return;
  // Pop this owner's innermost current frame when it is this call; otherwise (its enter was
  // never seen) leave the stack as it is and bind nothing.
  const uint64_t gen = generation_.load();
  std::vector<Frame>& fs = frames();
  std::vector<Hash> loads;
  bool found = false;
  fs.erase(std::remove_if(fs.begin(), fs.end(),
                          [&](const Frame& f) { return f.owner == this && f.generation != gen; }),
           fs.end());
  for (size_t i = fs.size(); i-- > 0;) {
    if (fs[i].owner != this) continue;
    if (fs[i].call == c) {
      loads = std::move(fs[i].loads);
      fs.erase(fs.begin() + static_cast<std::ptrdiff_t>(i));
      found = true;
    }
    break;
  }
  const bool unload = c == Call::kModuleUnload || c == Call::kLibraryUnload;
  if (!unload && loads.empty()) return;  // the common case (every traced launch): nothing to do
  std::sort(loads.begin(), loads.end());  // one binary loaded into several contexts is one
  loads.erase(std::unique(loads.begin(), loads.end()), loads.end());
  std::lock_guard<std::mutex> lock(mu_);
  if (unload) {
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
      case Call::kModuleGetFunction: bind_handle(out); bind_exact(in); break;
      case Call::kLibraryGetKernel: bind_handle(out); bind_exact(in); break;
      case Call::kKernelGetFunction: bind_handle(out); bind_handle(in); break;
      case Call::kUse: bind_handle(in); break;
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

void CodeBindings::drop_all_locked() {
  exact_.clear();
  handles_.clear();
  library_modules_.clear();
  ++stats_.dropped;
  stats_.exact = stats_.handles = 0;
}

void CodeBindings::clear() {
  ++generation_;  // every open frame, on every thread, is ignored from now on
  std::lock_guard<std::mutex> lock(mu_);
  exact_.clear();
  handles_.clear();
  library_modules_.clear();
  stats_ = Stats{};
}

}  // namespace vitrify::graph
