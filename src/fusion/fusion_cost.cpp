// The cost of fusing a tensor, measured (fusion_cost.hpp).
#include "fusion/fusion_cost.hpp"

#include <algorithm>
#include <cmath>
#include <utility>
#include <vector>

#include "fusion/coordinator.hpp"

namespace kolo::fusion {
namespace {

void keep(std::deque<double>& samples, double value) {
  samples.push_back(value);
  if (samples.size() > FusionCost::kSamples) samples.pop_front();
}

double median(const std::deque<double>& samples) {
  if (samples.empty()) return 0;
  std::vector<double> sorted(samples.begin(), samples.end());
  std::nth_element(sorted.begin(), sorted.begin() + sorted.size() / 2, sorted.end());
  return sorted[sorted.size() / 2];
}

}  // namespace

void FusionCost::alone(uint64_t bytes, Clock::duration elapsed) {
  const bool first = !std::exchange(aligned_, true);
  if (!first && bytes <= kLatencyBytes) {
    keep(latency_, std::chrono::duration<double>(elapsed).count());
  }
}

void FusionCost::copied(uint64_t bytes, uint64_t tensors, Clock::duration elapsed) {
  if (bytes >= kCopyBytes && bytes >= tensors * kCopyTensorBytes) {
    keep(copy_, std::chrono::duration<double>(elapsed).count() / static_cast<double>(bytes));
  }
}

double FusionCost::latency_s() const {
  return median(latency_);
}

double FusionCost::copy_s_per_byte() const {
  return median(copy_);
}

uint64_t FusionCost::alone_bytes() const {
  const double alpha = latency_s(), gamma = copy_s_per_byte();
  if (alpha <= 0 || gamma <= 0 || copy_.size() < kMinCopySamples) return kAloneBytes;
  const double bytes = alpha / gamma;
  return bytes >= static_cast<double>(kAloneBytes) ? kAloneBytes : std::llround(bytes);
}

}  // namespace kolo::fusion
