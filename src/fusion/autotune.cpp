// The fusion engine's autotuner (autotune.hpp has the essay).
#include "fusion/autotune.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <cerrno>
#include <cstring>

#include "core/log.hpp"

namespace kolo::fusion {

Autotuner::Autotuner(const EngineSettings& start, AutotuneOptions options, Clock::time_point now)
    : options_(std::move(options)),
      current_(start),
      best_(start),
      warmup_left_(options_.warmup_windows),
      last_(now) {
  current_.final = false;
  best_.final = false;
  if (!options_.log_path.empty()) {
    log_ = std::fopen(options_.log_path.c_str(), "w");
    if (log_ == nullptr) {
      log::warn("fusion autotune: cannot write KOLO_AUTOTUNE_LOG={}: {}; tuning without a log",
                options_.log_path, std::strerror(errno));
    } else {
      fmt::print(log_,
                 "trial,fusion_threshold_bytes,cycle_time_ms,segment_bytes,bytes,busy_s,"
                 "score_bytes_per_s,outcome\n");
      std::fflush(log_);
    }
  }
  log::info(
      "fusion autotune: starting from fusion threshold {} bytes, cycle {} ms, segment {} bytes; "
      "windows of {} s, at most {} trials",
      start.fusion_threshold, start.cycle_time_ms, start.segment_bytes, options_.window_s,
      max_trials());
}

Autotuner::~Autotuner() {
  if (log_ != nullptr) std::fclose(log_);
}

void Autotuner::resume(Clock::time_point now) {
  last_ = now;
}

std::optional<EngineSettings> Autotuner::observe(uint64_t bytes, Clock::time_point now, bool idle) {
  if (settled_) return std::nullopt;
  const double busy = std::chrono::duration<double>(now - last_).count();
  last_ = now;
  busy_s_ += busy;
  bytes_ += bytes;
  step_busy_s_ += busy;
  step_bytes_ += bytes;
  if (idle) {  // a step ended
    if (step_bytes_ > 0 && step_busy_s_ > 0) step_rates_.push_back(step_bytes_ / step_busy_s_);
    step_busy_s_ = 0;
    step_bytes_ = 0;
  }
  if (busy_s_ < options_.window_s || (!idle && busy_s_ < 2 * options_.window_s)) {
    return std::nullopt;
  }
  const double busy_s = busy_s_;
  const uint64_t window_bytes = bytes_;
  std::vector<double> rates;
  rates.swap(step_rates_);
  busy_s_ = 0;
  bytes_ = 0;
  step_busy_s_ = 0;
  step_bytes_ = 0;
  if (window_bytes == 0) return std::nullopt;  // nothing ran: nothing to judge by
  // The median step: a burst of someone else's load that slows one step of the window does not
  // move it, where it would move the window's total.
  double score = window_bytes / busy_s;
  if (rates.size() >= kMinStepsForMedian) {
    std::nth_element(rates.begin(), rates.begin() + rates.size() / 2, rates.end());
    score = rates[rates.size() / 2];
  }
  if (warmup_left_ > 0) {
    --warmup_left_;
    write_row(0, current_, window_bytes, busy_s, score, "warmup");
    return std::nullopt;
  }
  ++trials_;
  if (finalists_.empty()) {
    measured_.insert(key_of(current_));
    searched_.push_back({current_, trials_, score, 0});
    const bool kept = score > best_score_;
    if (kept) {
      best_ = current_;
      best_score_ = score;
    }
    write_row(trials_, current_, window_bytes, busy_s, score, kept ? "kept" : "dropped");
    log::info(
        "fusion autotune: trial {}: threshold {} bytes, cycle {} ms, segment {} bytes: {:.1f} "
        "MB/s ({})",
        trials_, current_.fusion_threshold, current_.cycle_time_ms, current_.segment_bytes,
        score / 1e6, kept ? "kept" : "dropped");
    if (std::optional<EngineSettings> next = next_candidate()) {
      current_ = *next;
      return current_;
    }
    // The search is over: its best few are measured once more, in turn.
    std::vector<Scored> ranked = searched_;
    std::stable_sort(ranked.begin(), ranked.end(),
                     [](const Scored& a, const Scored& b) { return a.score > b.score; });
    ranked.resize(std::min(ranked.size(), kFinalists));
    finalists_ = std::move(ranked);
  } else {
    finalists_[confirmed_].second_score = score;
    write_row(trials_, current_, window_bytes, busy_s, score, "confirm");
    log::info(
        "fusion autotune: trial {} (again): threshold {} bytes, cycle {} ms, segment {} bytes: "
        "{:.1f} MB/s",
        trials_, current_.fusion_threshold, current_.cycle_time_ms, current_.segment_bytes,
        score / 1e6);
    ++confirmed_;
  }
  if (confirmed_ < finalists_.size()) {
    current_ = finalists_[confirmed_].settings;
    return current_;
  }
  const Scored* chosen = &finalists_.front();
  for (const Scored& finalist : finalists_) {
    if (finalist.mean() > chosen->mean()) chosen = &finalist;
  }
  settled_ = true;
  current_ = chosen->settings;
  current_.final = true;
  write_row(chosen->trial, current_, 0, 0, chosen->mean(), "final");
  log::info(
      "fusion autotune: settled after {} trials on threshold {} bytes, cycle {} ms, segment "
      "{} bytes ({:.1f} MB/s)",
      trials_, current_.fusion_threshold, current_.cycle_time_ms, current_.segment_bytes,
      chosen->mean() / 1e6);
  return current_;
}

// The next setting of the coordinate search: the best so far with one parameter changed, that
// parameter's list in order, skipping what was measured already.
std::optional<EngineSettings> Autotuner::next_candidate() {
  for (; axis_ < 3; ++axis_, candidate_ = 0) {
    const size_t values = axis_ == 0   ? kCycleTimesMs.size()
                          : axis_ == 1 ? kThresholds.size()
                                       : kSegments.size();
    while (candidate_ < values) {
      EngineSettings next = best_;
      if (axis_ == 0) next.cycle_time_ms = kCycleTimesMs[candidate_];
      if (axis_ == 1) next.fusion_threshold = kThresholds[candidate_];
      if (axis_ == 2) next.segment_bytes = kSegments[candidate_];
      ++candidate_;
      if (!measured_.count(key_of(next))) return next;
    }
  }
  return std::nullopt;
}

void Autotuner::write_row(int trial, const EngineSettings& settings, uint64_t bytes, double busy_s,
                          double score, const char* outcome) {
  if (log_ == nullptr) return;
  fmt::print(log_, "{},{},{},{},{},{:.6f},{:.0f},{}\n", trial, settings.fusion_threshold,
             settings.cycle_time_ms, settings.segment_bytes, bytes, busy_s, score, outcome);
  std::fflush(log_);
}

}  // namespace kolo::fusion
