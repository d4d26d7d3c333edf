// The one logger: KOLO_DEBUG=WARN|INFO|TRACE (default WARN), lines go to stderr as
//   kolo <host>:<rank> WARN  message
// Thread-safe; a line is written with one write() so lines of different threads never interleave.
#pragma once

#include <fmt/format.h>

#include <string_view>

namespace kolo::log {

enum class Level { kWarn = 0, kInfo = 1, kTrace = 2 };

// Reads KOLO_DEBUG once (first call); later calls are cheap.
Level level();
// Rank shown in the prefix; -1 (the default) shows "?". Set once the rank is known.
void set_rank(int rank);
void write(Level level, std::string_view message);

template <typename... Args>
void warn(fmt::format_string<Args...> format, Args&&... args) {
  write(Level::kWarn, fmt::format(format, std::forward<Args>(args)...));
}
template <typename... Args>
void info(fmt::format_string<Args...> format, Args&&... args) {
  if (level() >= Level::kInfo) write(Level::kInfo, fmt::format(format, std::forward<Args>(args)...));
}
template <typename... Args>
void trace(fmt::format_string<Args...> format, Args&&... args) {
  if (level() >= Level::kTrace) write(Level::kTrace, fmt::format(format, std::forward<Args>(args)...));
}

}  // namespace kolo::log
