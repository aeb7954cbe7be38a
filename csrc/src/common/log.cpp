#include "vitrify/log.hpp"

#include <atomic>
#include <cstdio>

namespace vitrify::log {
namespace {

std::atomic<Sink> g_sink{nullptr};
std::atomic<int> g_stderr_min{kWarning};  // the level without a sink
std::atomic<int> g_min{kWarning};         // the level in force (the sink's, or g_stderr_min)

}  // namespace

void set_sink(Sink sink, int level) noexcept {
  g_sink.store(sink);
  g_min.store(sink != nullptr ? level : g_stderr_min.load());
}

void set_stderr_level(int level) noexcept {
  g_stderr_min.store(level);
  if (g_sink.load() == nullptr) g_min.store(level);
}

bool enabled(int level) noexcept { return level >= g_min.load(std::memory_order_relaxed); }

void write(int level, const std::string& message) noexcept {
  if (!enabled(level)) return;
  if (Sink s = g_sink.load()) {
    s(level, message.c_str());
    return;
  }
  std::fprintf(stderr, "vitrify[%d]: %s\n", level, message.c_str());
}

}  // namespace vitrify::log
