// How a transport waits beside kolo's shared-memory rings (shm_channel.hpp): the spin before
// sleeping, and the readiness flag that keeps a caller who sleeps on readiness_fd() from missing
// data the rings already hold. The UCX and TCP transports both run the rings and wait this way.
//
// Spinning: poll for kPureSpin (a message through the rings arrives in about a microsecond), then
// keep polling but call sched_yield() between polls until kSpin, then sleep. Yielding matters on a
// busy machine: a spinning rank that shares its CPU with the peer it waits for would otherwise
// hold the CPU for the whole spin while the peer cannot send (docs/architecture.md, "The UCX
// transport", has the figures). There is no plain spin at all (pure_spin_for) when this host runs
// more ranks than this process may use CPUs, unless kolo bound each rank to a core of its own (a
// process bound to one core may use one CPU, yet shares it with no other rank), nor for the fusion
// engine's thread, which shares its CPU with the application's threads that submit and wait
// (docs/tuning.md, "Spinning and binding"). The next piece of a pipeline comes within a 256 KiB
// copy (tens of microseconds), so the same spin covers it; a longer spin after each copy measured
// no better.
//
// Ranks may share a CPU even where there are enough CPUs for all: the scheduler starts two ranks
// on one CPU and separates them only later, or other programs keep the other CPUs busy. Then every
// wait spins its kPureSpin for nothing (the peer cannot run meanwhile) before it yields, and two
// ranks exchanging small messages alternate a call of twice that and a call of nothing. A Spinner
// notices from its own yields: one that took longer than kGaveAway gave the CPU to another task,
// so the next wait yields between polls from the start; a wait whose yields all came straight back
// (nobody else wanted this CPU) brings the plain spin back.
#pragma once

#include <chrono>

#include "net/socket.hpp"
#include "transport/transport.hpp"

namespace kolo {

constexpr auto kPureSpin = std::chrono::microseconds(5);
constexpr auto kSpin = std::chrono::microseconds(50);
// A sched_yield() with nobody else to run returns in well under a microsecond (0.6 us in a VM);
// one that ran another task first takes at least two context switches.
constexpr auto kGaveAway = std::chrono::microseconds(2);
// Polls between two reads of the clock during the plain spin (Spinner::next).
constexpr unsigned kClockStride = 8;

// kPureSpin, or none (see above).
std::chrono::steady_clock::duration pure_spin_for(const TransportSettings& settings);

// One waiting thread's spin (see above). A wait calls begin() when it starts, polls, and after
// each poll that found nothing calls next(): true while the spin goes on, false when it is over
// (then sleep). next() reads the clock (20-odd ns a read on the virtual machines measured, about
// as long as a poll of the rings) every kClockStride-th empty poll while the spin is plain, the
// first time after kClockStride polls (most waits for a small message through the rings end
// before), and at every poll once it yields; a poll that copied through shared memory starts the
// spin again, since the peer is busy on the other side of a ring and will most likely free or
// fill a slot within microseconds. Not thread-safe: one per waiter.
class Spinner {
 public:
  explicit Spinner(const TransportSettings& settings) : ceiling_(pure_spin_for(settings)) {}
  // spin = false (an expired deadline: a caller that sleeps on readiness_fd() itself): one poll.
  void begin(bool spin = true);
  bool next(bool copied) {
    if (!spin_) return false;
    copied_since_ = copied_since_ || copied;
    if (++polls_ % kClockStride != 0 && !yielding_) return true;
    return next_timed();
  }
  std::chrono::steady_clock::duration pure_spin() const {
    return shared_ ? std::chrono::steady_clock::duration::zero() : ceiling_;
  }
  // sched_yield(), timed: what it took is what yielded() learns from.
  void yield();
  void yielded(std::chrono::steady_clock::duration took);

 private:
  bool next_timed();

  std::chrono::steady_clock::duration ceiling_;
  bool shared_ = false;     // the last wait that yielded gave the CPU away
  bool yielded_ = false;    // in this wait
  bool gave_away_ = false;  // in this wait
  // This wait's spin.
  bool spin_ = true;
  unsigned polls_ = 0;
  bool timed_ = false;  // the clock was read in this wait
  bool yielding_ = false;
  bool copied_since_ = false;  // since the clock was last read
  std::chrono::steady_clock::time_point from_{};
};

// An eventfd that a transport sets whenever progress() returns without having asked its peers for
// a doorbell (ShmChannel::prepare_sleep), and clears just before asking: part of the transport's
// readiness set, so that a caller sleeping in poll() on it is woken by data that moved while
// nobody was asked to ring. Setting costs one write() the first time only, clearing one read().
class AwakeFlag {
 public:
  AwakeFlag();  // throws kolo::Error when no eventfd can be made
  int fd() const { return fd_.fd(); }
  void set();
  void clear();

 private:
  net::Socket fd_;
  bool set_ = false;
};

}  // namespace kolo
