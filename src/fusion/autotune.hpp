// The fusion engine's autotuner (KOLO_AUTOTUNE=1): rank 0 tries settings of the fusion threshold,
// the cycle time and the ring's pipeline segment while the job runs, measures what each gives,
// and keeps the best.
//
// What is measured. The score of a setting is the engine's throughput: the payload bytes of the
// collectives it ran, divided by the time it was busy, over a window of at least
// KOLO_AUTOTUNE_WINDOW_MS of busy time; when the window holds kMinStepsForMedian steps or more,
// the throughput of its median step (a step's bytes over its busy time), so that a burst of
// another process's load that slows one or two steps does not decide the trial. Busy time is wall
// time on rank 0 less the time its engine slept because no rank had anything pending: between a
// training loop's steps the engine waits for the framework, and that wait does not depend on the
// settings (and an evaluation pass or a checkpoint would otherwise drown a trial's score). A window
// ends at the first idle response after its time is up, so that it holds whole steps (a step ends
// when every rank's gradients are done), or at any cycle after twice its time, for a loop that is
// never idle. The first window after start-up is discarded: it holds the first negotiation of every
// tensor and the first touch of every buffer.
//
// What is tried. A coordinate search over three short lists (kCycleTimesMs, kThresholds,
// kSegments below): first the settings the job started with (its KOLO_* values), then every other
// cycle time with the best threshold and segment so far, then every other threshold with the best
// cycle time, then every other segment; a setting is measured once in the search, and a later
// one is kept only if it scores strictly higher. One window on a shared machine can be lucky
// (other processes' load can move a step's time by more than the settings do; the README's
// "Autotuning" has measurements), so the kFinalists best of the search are then measured once
// more, in turn, and the search settles on the one whose two windows average highest: the
// settings stop changing for the life of the communicator. So it ends after at most
// max_trials() windows past the warm-up, whatever the measurements. Coordinate search assumes that
// the parameters act mostly independently, which they do here: the cycle time is the latency until
// a step's tensors are negotiated, the threshold how many collectives carry the small tensors, the
// segment how the large ones pipeline.
//
// How settings reach the ranks. A new setting is decided at the end of a cycle; rank 0 plans the
// next response with its threshold and adds the settings to that response (wire.hpp), and every
// rank applies them before running its batches: the same collectives run with the same segment
// everywhere, which the ring needs (a segment is a message). The last change is marked final.
//
// The log (KOLO_AUTOTUNE_LOG): a CSV file written by rank 0, a header then one row per window:
//   trial,fusion_threshold_bytes,cycle_time_ms,segment_bytes,bytes,busy_s,score_bytes_per_s,outcome
// (bytes and busy_s: the window's; the score as above)
// with outcome `warmup` (trial 0, discarded), `kept` (the best so far), `dropped`, `confirm` (a
// finalist's second window), and last a row `final`: the search trial whose settings stay, and
// the mean score of its two windows.
#pragma once

#include <cstdint>
#include <cstdio>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <tuple>
#include <vector>

#include "core/deadline.hpp"
#include "fusion/wire.hpp"

namespace kolo::fusion {

struct AutotuneOptions {
  double window_s = 1.0;   // busy seconds per trial (KOLO_AUTOTUNE_WINDOW_MS)
  int warmup_windows = 1;  // discarded at start-up
  std::string log_path;    // KOLO_AUTOTUNE_LOG; "" = none
};

class Autotuner {
 public:
  inline static const std::vector<double> kCycleTimesMs = {0.5, 1, 2, 5, 10, 20};
  inline static const std::vector<uint64_t> kThresholds = {0,           1ull << 20,  4ull << 20,
                                                           16ull << 20, 64ull << 20, 256ull << 20};
  inline static const std::vector<uint64_t> kSegments = {256ull << 10, 1ull << 20, 4ull << 20,
                                                         16ull << 20};
  static constexpr size_t kFinalists = 3;
  static constexpr size_t kMinStepsForMedian = 3;

  // `start`: the settings in force (the job's own). Opens the log; if it cannot, warns and tunes
  // without one.
  Autotuner(const EngineSettings& start, AutotuneOptions options, Clock::time_point now);
  ~Autotuner();
  Autotuner(const Autotuner&) = delete;
  Autotuner& operator=(const Autotuner&) = delete;

  // The engine is busy again from `now`, after sleeping while every rank was idle.
  void resume(Clock::time_point now);
  // The end of a cycle on rank 0: its response's collectives carried `bytes`, and `idle` says
  // that no rank has anything left. Returns the settings to send in the next response when they
  // change (the final ones included, marked final); nothing once settled.
  std::optional<EngineSettings> observe(uint64_t bytes, Clock::time_point now, bool idle);

  // The settings being measured (after settling, the final ones).
  const EngineSettings& current() const { return current_; }
  bool settled() const { return settled_; }
  int trials() const { return trials_; }
  // The most trials before settling: the start, every value of each list (one fewer for each
  // list that holds the start's own value: it is not measured twice), and the finalists again.
  static int max_trials() {
    return 1 + static_cast<int>(kCycleTimesMs.size() + kThresholds.size() + kSegments.size() +
                                kFinalists);
  }

 private:
  struct Scored {
    EngineSettings settings;
    int trial = 0;  // in the search
    double score = 0;
    double second_score = 0;  // a finalist's second window
    double mean() const { return (score + second_score) / 2; }
  };
  using Key = std::tuple<uint64_t, double, uint64_t>;
  static Key key_of(const EngineSettings& settings) {
    return {settings.fusion_threshold, settings.cycle_time_ms, settings.segment_bytes};
  }
  std::optional<EngineSettings> next_candidate();
  void write_row(int trial, const EngineSettings& settings, uint64_t bytes, double busy_s,
                 double score, const char* outcome);

  const AutotuneOptions options_;
  std::FILE* log_ = nullptr;
  EngineSettings current_;
  EngineSettings best_;
  double best_score_ = -1;
  int trials_ = 0;
  int warmup_left_;
  bool settled_ = false;
  std::set<Key> measured_;
  std::vector<Scored> searched_;   // every trial of the search
  std::vector<Scored> finalists_;  // the best of the search, once it is over
  size_t confirmed_ = 0;           // finalists measured again
  size_t axis_ = 0;                // 0: cycle time, 1: threshold, 2: segment; 3: done
  size_t candidate_ = 0;           // index into the axis's list
  // The window being measured.
  Clock::time_point last_;
  double busy_s_ = 0;
  uint64_t bytes_ = 0;
  // The step being measured (a step ends with an idle response), and the window's whole steps.
  double step_busy_s_ = 0;
  uint64_t step_bytes_ = 0;
  std::vector<double> step_rates_;
};

}  // namespace kolo::fusion
