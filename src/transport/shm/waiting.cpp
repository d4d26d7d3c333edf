// Waiting beside kolo's shared-memory rings (waiting.hpp).
#include "transport/shm/waiting.hpp"

#include <fmt/format.h>
#include <sched.h>
#include <sys/eventfd.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdint>
#include <cstring>

#include "kolo/status.hpp"

namespace kolo {

std::chrono::steady_clock::duration pure_spin_for(const TransportSettings& settings) {
  if (settings.yield_at_once) return std::chrono::steady_clock::duration::zero();
  if (settings.own_core) return kPureSpin;
  cpu_set_t cpus;
  const int usable = ::sched_getaffinity(0, sizeof(cpus), &cpus) == 0 ? CPU_COUNT(&cpus) : 1;
  if (settings.local_size > std::max(1, usable)) return std::chrono::steady_clock::duration::zero();
  return kPureSpin;
}

void Spinner::begin(bool spin) {
  if (yielded_) shared_ = gave_away_;
  yielded_ = gave_away_ = false;
  spin_ = spin;
  polls_ = 0;
  timed_ = yielding_ = copied_since_ = false;
}

bool Spinner::next_timed() {
  const auto now = std::chrono::steady_clock::now();
  if (!timed_ || copied_since_) from_ = now;
  timed_ = true;
  copied_since_ = false;
  if (now >= from_ + kSpin) return false;
  yielding_ = now >= from_ + pure_spin();
  if (yielding_) yield();
  return true;
}

void Spinner::yield() {
  const auto before = std::chrono::steady_clock::now();
  ::sched_yield();
  yielded(std::chrono::steady_clock::now() - before);
}

void Spinner::yielded(std::chrono::steady_clock::duration took) {
  yielded_ = true;
  if (took > kGaveAway) gave_away_ = true;
}

AwakeFlag::AwakeFlag() : fd_(::eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC)) {
  if (!fd_.valid()) {
    throw Error(Status::kSystem, fmt::format("eventfd failed: {}", std::strerror(errno)));
  }
}

void AwakeFlag::set() {
  if (set_) return;
  uint64_t one = 1;
  if (::write(fd_.fd(), &one, sizeof(one)) == static_cast<ssize_t>(sizeof(one))) set_ = true;
}

void AwakeFlag::clear() {
  if (!set_) return;
  uint64_t value = 0;
  while (::read(fd_.fd(), &value, sizeof(value)) < 0 && errno == EINTR) {
  }
  set_ = false;
}

}  // namespace kolo
