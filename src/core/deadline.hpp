// One timer for every bounded wait in kolo.
#pragma once

#include <time.h>

#include <chrono>

namespace kolo {

using Clock = std::chrono::steady_clock;

// A monotonic clock at the kernel tick's resolution (1-10 ms) that reads in a few nanoseconds,
// where Clock takes about 20 ns on the virtual machines kolo is measured on. Deadlines and the
// report of who is stuck count seconds, and every collective reads them several times: with
// Clock that was a fifth of an 8-byte allreduce over shared memory. Spins, which count
// microseconds, keep Clock.
struct CoarseClock {
  using duration = std::chrono::nanoseconds;
  using rep = duration::rep;
  using period = duration::period;
  using time_point = std::chrono::time_point<CoarseClock>;
  static constexpr bool is_steady = true;
  static time_point now() noexcept {
    timespec now{};
    ::clock_gettime(CLOCK_MONOTONIC_COARSE, &now);
    return time_point(std::chrono::seconds(now.tv_sec) + std::chrono::nanoseconds(now.tv_nsec));
  }
};

class Deadline {
 public:
  explicit Deadline(double seconds_from_now)
      : end_(CoarseClock::now() + std::chrono::duration_cast<CoarseClock::duration>(
                                      std::chrono::duration<double>(seconds_from_now))) {}
  bool expired() const { return CoarseClock::now() >= end_; }
  // Milliseconds left, rounded up (so that a caller polling until expired() sleeps instead of
  // spinning through the last tick) and clamped to [0, INT_MAX]; for poll() and epoll_wait().
  int remaining_ms() const {
    auto left = std::chrono::ceil<std::chrono::milliseconds>(end_ - CoarseClock::now()).count();
    if (left < 0) return 0;
    if (left > 0x7fffffff) return 0x7fffffff;
    return static_cast<int>(left);
  }
  double remaining_s() const {
    return std::chrono::duration<double>(end_ - CoarseClock::now()).count();
  }

 private:
  CoarseClock::time_point end_;
};

}  // namespace kolo
