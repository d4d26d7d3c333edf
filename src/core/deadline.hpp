// One timer for every bounded wait in kolo.
#pragma once

#include <chrono>

namespace kolo {

using Clock = std::chrono::steady_clock;

class Deadline {
 public:
  explicit Deadline(double seconds_from_now)
      : end_(Clock::now() + std::chrono::duration_cast<Clock::duration>(
                                std::chrono::duration<double>(seconds_from_now))) {}
  bool expired() const { return Clock::now() >= end_; }
  // Milliseconds left, clamped to [0, INT_MAX]; suitable for poll() and epoll_wait().
  int remaining_ms() const {
    auto left = std::chrono::duration_cast<std::chrono::milliseconds>(end_ - Clock::now()).count();
    if (left < 0) return 0;
    if (left > 0x7fffffff) return 0x7fffffff;
    return static_cast<int>(left);
  }
  double remaining_s() const { return std::chrono::duration<double>(end_ - Clock::now()).count(); }

 private:
  Clock::time_point end_;
};

}  // namespace kolo
