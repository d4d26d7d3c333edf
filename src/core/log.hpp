// The one logger: KOLO_DEBUG=WARN|INFO|TRACE (default WARN), lines go to stderr as
//   kolo <host>:<rank> WARN  message
// Thread-safe; a line is written with one write() so lines of different threads never interleave.
#pragma once

#include <fmt/format.h>

#include <chrono>
#include <cstdint>
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

// Rate-limits one kind of line: at most `burst` pass per `period`, the rest are counted, so that a
// flood (of strangers knocking, say) costs a few lines and then one that says how many were held
// back. Not thread-safe: one owner calls it.
class Throttle {
 public:
  using Clock = std::chrono::steady_clock;

  Throttle(uint32_t burst, Clock::duration period) : burst_(burst), period_(period) {}

  // True when a line may be written now; otherwise it is counted as held back.
  bool allow(Clock::time_point now) {
    if (now - window_start_ >= period_ && held_back_ == 0) {
      window_start_ = now;
      passed_ = 0;
    }
    if (passed_ < burst_) {
      ++passed_;
      return true;
    }
    ++held_back_;
    return false;
  }

  // The lines held back, once the period in which they were held back is over (or at once when
  // final), and a fresh period; 0 when there is nothing to report yet.
  uint64_t take_held_back(Clock::time_point now, bool final = false) {
    if (held_back_ == 0 || (!final && now - window_start_ < period_)) return 0;
    uint64_t count = held_back_;
    held_back_ = 0;
    window_start_ = now;
    passed_ = 0;
    return count;
  }

  // When take_held_back will next have something to report; Clock::time_point::max() if never.
  Clock::time_point report_due() const {
    return held_back_ == 0 ? Clock::time_point::max() : window_start_ + period_;
  }

 private:
  uint32_t burst_;
  Clock::duration period_;
  Clock::time_point window_start_{};
  uint32_t passed_ = 0;
  uint64_t held_back_ = 0;
};

}  // namespace kolo::log
