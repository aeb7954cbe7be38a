// Native log messages. The Python layer installs a sink that forwards to the `vitrify` logger
// (logging.getLogger("vitrify.native")); without a sink, messages at or above VITRIFY_LOG_LEVEL go to
// stderr (default: nothing below WARNING). Levels use Python's numbers.
#pragma once

#include <string>

namespace vitrify::log {

enum Level : int { kDebug = 10, kInfo = 20, kWarning = 30, kError = 40 };

using Sink = void (*)(int level, const char* message) noexcept;

// Install (or with nullptr remove) the sink and the lowest level it wants.
void set_sink(Sink sink, int min_level) noexcept;
// True when a message at `level` would go anywhere (check before building expensive text).
bool enabled(int level) noexcept;
void write(int level, const std::string& message) noexcept;

inline void debug(const std::string& m) noexcept { write(kDebug, m); }
inline void info(const std::string& m) noexcept { write(kInfo, m); }
inline void warning(const std::string& m) noexcept { write(kWarning, m); }
inline void error(const std::string& m) noexcept { write(kError, m); }

// Parse "DEBUG"/"info"/"30"...; returns `fallback` for empty or unknown text.
int parse_level(const char* text, int fallback) noexcept;

}  // namespace vitrify::log
