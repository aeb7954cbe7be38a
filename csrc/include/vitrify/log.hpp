// Native log messages. The Python layer installs a sink that forwards to the `vitrify` logger
// (logging.getLogger("vitrify.native")); without a sink, messages at or above the stderr level go
// to stderr (default WARNING; the Python layer passes VITRIFY_LOG_LEVEL down through
// set_stderr_level at import). Levels use Python's numbers. The core reads no environment
// variable.
#pragma once

#include <string>

namespace vitrify::log {

enum Level : int { kDebug = 10, kInfo = 20, kWarning = 30, kError = 40 };

using Sink = void (*)(int level, const char* message) noexcept;

// Install (or with nullptr remove) the sink and the lowest level it wants.
void set_sink(Sink sink, int min_level) noexcept;
// The lowest level written to stderr while no sink is installed (default kWarning).
void set_stderr_level(int min_level) noexcept;
// True when a message at `level` would go anywhere (check before building expensive text).
bool enabled(int level) noexcept;
void write(int level, const std::string& message) noexcept;

inline void debug(const std::string& m) noexcept { write(kDebug, m); }
inline void info(const std::string& m) noexcept { write(kInfo, m); }
inline void warning(const std::string& m) noexcept { write(kWarning, m); }
inline void error(const std::string& m) noexcept { write(kError, m); }

}  // namespace vitrify::log
