// The fusion timeline: a Chrome trace (the JSON array format, which Perfetto and chrome://tracing
// load) of what the fusion engine did with every tensor.
//
// One file per rank (KOLO_TIMELINE=trace.json gives trace.rank0.json, trace.rank1.json, ...),
// process id = rank, one row (thread id) per tensor name plus a "cycles" row. Timestamps are
// CLOCK_MONOTONIC microseconds, which ranks on one machine share, so their files line up when
// loaded together.
//
// The engine thread only appends small records to a queue; a writer thread formats them and
// writes the file through a large buffer, so recording costs the engine a clock read and a
// push per event. The array is closed when the communicator is destroyed; a file cut short by a
// crash still loads in both viewers.
#pragma once

#include <condition_variable>
#include <cstdint>
#include <cstdio>
#include <mutex>
#include <string>
#include <string_view>
#include <thread>
#include <unordered_map>
#include <vector>

#include "core/deadline.hpp"
#include "fusion/spec.hpp"
#include "kolo/status.hpp"

namespace kolo::fusion {

class Timeline {
 public:
  // Creates the file; throws kolo::Error(kSystem) naming it when it cannot be opened.
  Timeline(const std::string& path, int rank);
  ~Timeline();
  Timeline(const Timeline&) = delete;
  Timeline& operator=(const Timeline&) = delete;

  // The file a rank writes for KOLO_TIMELINE=path: ".rank<r>" goes before a final ".json", or
  // "path.rank<r>.json" otherwise.
  static std::string path_for_rank(const std::string& path, int rank);
  // `text` escaped for use inside a JSON string.
  static std::string escape(std::string_view text);

  // The "args" objects of the engine's events, all of the trace's JSON in this one file:
  // a collective it ran (ALLREDUCE, BROADCAST, ALLGATHER), a CYCLE, a SUBMITTED mark, a
  // NEGOTIATE span and an ERROR mark.
  static std::string collective_args(uint64_t sequence, size_t tensors, uint64_t bytes,
                                     const UnitSpec& spec, bool fused);
  static std::string cycle_args(uint64_t cycle, size_t announced, size_t collectives,
                                size_t errors);
  static std::string submitted_args(int rank);
  static std::string negotiate_args(uint64_t cycle, bool cached);
  static std::string error_args(Status status, const std::string& message);

  // The row of a tensor (or "cycles"), named on first use. Engine thread only.
  uint32_t row(const std::string& name);
  // A complete event; `args` is a JSON object ("{...}") or empty.
  void span(uint32_t row, const char* name, Clock::time_point begin, Clock::time_point end,
            std::string args = {});
  void instant(uint32_t row, const char* name, Clock::time_point at, std::string args = {});

 private:
  struct Event {
    char phase;        // 'X' complete, 'i' instant, 'M' metadata
    const char* name;  // a string literal
    uint32_t row;
    int64_t begin_ns;
    int64_t end_ns;
    std::string args;
  };

  void push(Event event);
  void write_loop();
  void format(const Event& event, std::string& out) const;

  const int rank_;
  std::FILE* file_ = nullptr;
  std::unordered_map<std::string, uint32_t> rows_;

  std::mutex mutex_;
  std::condition_variable wake_;
  std::vector<Event> queue_;
  bool stopping_ = false;
  std::thread writer_;
  bool first_event_ = true;  // writer thread only
};

}  // namespace kolo::fusion
