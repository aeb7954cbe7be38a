#include "vitrify/log.hpp"

#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <strings.h>

namespace vitrify::log {
namespace {

std::atomic<Sink> g_sink{nullptr};
std::atomic<int> g_min{-1};  // -1: not read from the environment yet

int env_level() noexcept { return parse_level(std::getenv("VITRIFY_LOG_LEVEL"), kWarning); }

int min_level() noexcept {
  int m = g_min.load(std::memory_order_relaxed);
  if (m < 0) {
    m = env_level();
    g_min.store(m, std::memory_order_relaxed);
  }
  return m;
}

}  // namespace

int parse_level(const char* text, int fallback) noexcept {
  if (text == nullptr || *text == '\0') return fallback;
  static const struct {
    const char* name;
    int level;
  } names[] = {{"DEBUG", kDebug}, {"INFO", kInfo},   {"WARNING", kWarning},
               {"WARN", kWarning}, {"ERROR", kError}, {"CRITICAL", 50}};
  for (const auto& n : names)
    if (::strcasecmp(text, n.name) == 0) return n.level;
  char* end = nullptr;
  const long v = std::strtol(text, &end, 10);
  if (end != text && *end == '\0' && v >= 0 && v <= 100) return static_cast<int>(v);
  return fallback;
}

void set_sink(Sink sink, int level) noexcept {
  g_sink.store(sink);
  g_min.store(sink != nullptr ? level : env_level());
}

bool enabled(int level) noexcept { return level >= min_level(); }

void write(int level, const std::string& message) noexcept {
  if (!enabled(level)) return;
  if (Sink s = g_sink.load()) {
    s(level, message.c_str());
    return;
  }
  std::fprintf(stderr, "vitrify[%d]: %s\n", level, message.c_str());
}

}  // namespace vitrify::log
