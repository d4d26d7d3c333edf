// The fusion engine's executor (engine.cpp has the essay): runs the batches of a response in
// order, every rank the same collectives, fused through the fusion buffer (fused_layout.hpp) or
// alone in the caller's buffers, then completes the requests. Engine thread only.
#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <cstring>

#include "core/log.hpp"
#include "fusion/coordinator.hpp"
#include "fusion/engine.hpp"
#include "fusion/fused_layout.hpp"
#include "fusion/timeline.hpp"
#include "ring/algorithms.hpp"
#include "ring/ring.hpp"

namespace kolo::fusion {
namespace {

// For the message of a response that does not fit what this rank submitted: with an allgather's
// counts, which describe() leaves out.
std::string describe_scheduled(const UnitSpec& spec) {
  if (spec.kind != Kind::kAllgather) return describe(spec);
  return fmt::format("{} with counts [{}]", describe(spec), fmt::join(spec.gather_counts, ", "));
}

std::string describe_submitted(const UnitSpec& spec) {
  if (spec.kind != Kind::kAllgather) return describe(spec);
  return fmt::format("{} with count {} and recv_capacity {}", describe(spec),
                     spec.members.front().count, spec.recv_capacity);
}

}  // namespace

void FusionEngine::execute(const ResponseList& response, Clock::time_point received,
                           const std::vector<Arrival>& arrivals) {
  for (const ResponseError& error : response.errors) {
    if (pending_.count(error.key)) finish(error.key, error.status, error.message);
  }
  std::vector<std::vector<LocalUnit*>> units(response.batches.size());
  std::unordered_set<const LocalUnit*> scheduled_units;
  uint64_t hits = 0, negotiated = 0;
  for (size_t b = 0; b < response.batches.size(); ++b) {
    for (const ResponseUnit& scheduled : response.batches[b].units) {
      const UnitSpec* spec = spec_of(scheduled, cache_);
      if (!spec) {
        throw Error(Status::kInternal,
                    fmt::format("fusion engine: rank 0 scheduled cache slot {}, which is empty "
                                "on rank {}",
                                scheduled.slot, rank_));
      }
      auto it = pending_.find(spec->key());
      if (it == pending_.end() || !matches_submission(it->second.request->spec(), *spec, rank_)) {
        throw Error(
            Status::kInternal,
            fmt::format("fusion engine: rank 0 scheduled {} but rank {} has {}",
                        describe_scheduled(*spec), rank_,
                        it == pending_.end()
                            ? std::string("not submitted it")
                            : "submitted " + describe_submitted(it->second.request->spec())));
      }
      if (!scheduled_units.insert(&it->second).second) {
        throw Error(Status::kInternal,
                    fmt::format("fusion engine: rank 0 scheduled {} twice in one response",
                                describe(*spec)));
      }
      units[b].push_back(&it->second);
      ++(scheduled.hit ? hits : negotiated);
    }
  }
  for (const Batch& batch : response.batches) {
    for (const ResponseUnit& scheduled : batch.units) {
      if (!scheduled.hit && scheduled.slot >= 0) {
        cache_.store(static_cast<uint32_t>(scheduled.slot), scheduled.spec);
      }
    }
  }
  {
    std::lock_guard<std::mutex> lock(stats_mutex_);
    stats_.cache_hits += hits;
    stats_.negotiated += negotiated;
  }
  if (timeline_) {
    for (const Arrival& arrival : arrivals) {
      uint32_t row = timeline_->row(arrival.key);
      for (int rank = 0; rank < size_; ++rank) {
        timeline_->instant(row, "SUBMITTED", arrival.per_rank[rank],
                           Timeline::submitted_args(rank));
      }
    }
    for (size_t b = 0; b < units.size(); ++b) {
      for (const LocalUnit* unit : units[b]) {
        const std::string args = Timeline::negotiate_args(cycle_, !unit->announced);
        for (const Member& member : unit->request->spec().members) {
          timeline_->span(timeline_->row(member.name), "NEGOTIATE", unit->request->submitted(),
                          received, args);
        }
      }
    }
  }
  for (size_t b = 0; b < units.size(); ++b) run_batch(response.batches[b], units[b], received);
}

void FusionEngine::run_batch(const Batch& batch, const std::vector<LocalUnit*>& units,
                             Clock::time_point received) {
  if (!units.empty()) {
    set_activity(
        fmt::format("cycle {}: running {}{}", cycle_, describe(units[0]->request->spec()),
                    units.size() > 1 ? fmt::format(" and {} more", units.size() - 1) : ""));
  }
  if (batch.fused) {
    run_fused(units, received);
    return;
  }
  for (size_t i = 0; i < units.size(); ++i) {
    // An allgather is never a cache hit (coordinator.hpp): its scheduled spec, with every rank's
    // count, is in the response.
    if (units[i]->request->spec().kind == Kind::kAllgather) {
      run_allgather(*units[i], batch.units[i].spec.gather_counts, received);
    } else {
      run_alone(*units[i], received);
    }
  }
}

// Every rank's block in rank order into the caller's receive buffer, as kolo_allgatherv does (the
// ring, or Bruck's schedule for small totals at four ranks or more: no arithmetic, so the choice
// cannot change a result). Elements of recvbuf past the gathered total are not touched.
void FusionEngine::run_allgather(LocalUnit& unit, const std::vector<uint64_t>& counts,
                                 Clock::time_point received) {
  const UnitSpec& spec = unit.request->spec();
  const MemberBuffers& buffers = unit.request->buffers().front();
  const Blocks blocks = Blocks::from_counts(counts);  // the total was checked by rank 0 and here
  OpDescriptor descriptor;
  descriptor.collective = Collective::kAllgatherv;
  descriptor.dtype = spec.dtype;
  descriptor.count = blocks.total;
  descriptor.detail = hash_counts(counts);
  descriptor.algorithm = allgather_algorithm(blocks.total * dtype_size(spec.dtype), size_);
  descriptor.sequence = ++sequence_;
  const Clock::time_point start = Clock::now();
  allgather_blocks(*ring_, descriptor, buffers.send, buffers.recv, blocks);
  const Clock::time_point end = Clock::now();
  {
    std::lock_guard<std::mutex> lock(stats_mutex_);
    ++stats_.collectives;
  }
  if (timeline_) {
    uint32_t row = timeline_->row(spec.key());
    timeline_->span(row, "QUEUE", received, start);
    timeline_->span(row, "ALLGATHER", start, end,
                    Timeline::collective_args(descriptor.sequence, 1,
                                              blocks.total * dtype_size(spec.dtype), spec, false));
  }
  finish(spec.key(), Status::kSuccess, "", counts);
}

// One collective per member, in the caller's buffers.
void FusionEngine::run_alone(LocalUnit& unit, Clock::time_point received) {
  const UnitSpec& spec = unit.request->spec();
  const std::vector<MemberBuffers>& buffers = unit.request->buffers();
  for (size_t m = 0; m < spec.members.size(); ++m) {
    OpDescriptor descriptor;
    descriptor.collective =
        spec.kind == Kind::kBroadcast ? Collective::kBroadcast : Collective::kAllreduce;
    descriptor.dtype = spec.dtype;
    descriptor.count = spec.members[m].count;
    descriptor.sequence = ++sequence_;
    const Clock::time_point start = Clock::now();
    if (spec.kind == Kind::kBroadcast) {
      descriptor.root = spec.root;
      ring_broadcast(*ring_, descriptor, buffers[m].recv);
    } else {
      descriptor.op = spec.op;
      descriptor.prescale = spec.prescale;
      descriptor.postscale = spec.postscale;
      ring_allreduce(*ring_, descriptor, buffers[m].send, buffers[m].recv);
    }
    const Clock::time_point end = Clock::now();
    {
      std::lock_guard<std::mutex> lock(stats_mutex_);
      ++stats_.collectives;
    }
    if (timeline_) {
      uint32_t row = timeline_->row(spec.members[m].name);
      timeline_->span(row, "QUEUE", received, start);
      timeline_->span(
          row, spec.kind == Kind::kBroadcast ? "BROADCAST" : "ALLREDUCE", start, end,
          Timeline::collective_args(descriptor.sequence, 1,
                                    spec.members[m].count * dtype_size(spec.dtype), spec, false));
    }
  }
  finish(spec.key(), Status::kSuccess, "");
}

// Every member of every unit through the fusion buffer, in one allreduce.
void FusionEngine::run_fused(const std::vector<LocalUnit*>& units, Clock::time_point received) {
  const UnitSpec& first = units.front()->request->spec();
  const size_t element = dtype_size(first.dtype);
  struct Placed {
    const UnitSpec* spec;
    size_t member;
    const MemberBuffers* buffers;
  };
  std::vector<Placed> placed;
  std::vector<uint64_t> counts;
  uint64_t payload = 0;
  for (const LocalUnit* unit : units) {
    const UnitSpec& spec = unit->request->spec();
    for (size_t m = 0; m < spec.members.size(); ++m) {
      placed.push_back({&spec, m, &unit->request->buffers()[m]});
      counts.push_back(spec.members[m].count);
      payload += spec.members[m].count * element;
    }
  }
  const FusedLayout layout(counts, size_);
  std::byte* buffer = fusion_buffer(layout.total_elements() * element);

  const bool timed = timeline_ != nullptr;
  std::vector<Clock::time_point> marks(timed ? placed.size() + 1 : 0);
  const Clock::time_point start = Clock::now();
  if (timed) marks[0] = start;
  for (size_t i = 0; i < placed.size(); ++i) {
    layout.copy_in(i, placed[i].buffers->send, buffer, element);
    if (timed) marks[i + 1] = Clock::now();
  }
  layout.zero_padding(buffer, element);

  OpDescriptor descriptor;
  descriptor.collective = Collective::kAllreduce;
  descriptor.dtype = first.dtype;
  descriptor.op = first.op;
  descriptor.prescale = first.prescale;
  descriptor.postscale = first.postscale;
  descriptor.count = layout.total_elements();
  descriptor.sequence = ++sequence_;
  const Clock::time_point reduce_start = Clock::now();
  ring_allreduce(*ring_, descriptor, buffer, buffer);
  const Clock::time_point reduce_end = Clock::now();

  std::vector<Clock::time_point> out_marks(timed ? placed.size() + 1 : 0);
  if (timed) out_marks[0] = reduce_end;
  for (size_t i = 0; i < placed.size(); ++i) {
    layout.copy_out(i, buffer, placed[i].buffers->recv, element);
    if (timed) out_marks[i + 1] = Clock::now();
  }
  {
    std::lock_guard<std::mutex> lock(stats_mutex_);
    ++stats_.collectives;
    ++stats_.fused_collectives;
    stats_.tensors_fused += placed.size();
    stats_.bytes_copied += 2 * payload;
  }
  if (timed) {
    const std::string args =
        Timeline::collective_args(descriptor.sequence, placed.size(), payload, first, true);
    for (size_t i = 0; i < placed.size(); ++i) {
      uint32_t row = timeline_->row(placed[i].spec->members[placed[i].member].name);
      timeline_->span(row, "QUEUE", received, start);
      timeline_->span(row, "COPY_IN", marks[i], marks[i + 1]);
      timeline_->span(row, "ALLREDUCE", reduce_start, reduce_end, args);
      timeline_->span(row, "COPY_OUT", out_marks[i], out_marks[i + 1]);
    }
  }
  std::vector<std::string> keys;
  for (const LocalUnit* unit : units) keys.push_back(unit->request->spec().key());
  for (const std::string& key : keys) finish(key, Status::kSuccess, "");
}

std::byte* FusionEngine::fusion_buffer(size_t bytes) {
  if (bytes > fusion_buffer_bytes_) {
    // Allocated once at the threshold (pages are touched only as far as they are used), larger
    // only for a group that exceeds it.
    size_t size = std::max<size_t>(bytes, fusion_threshold_.load());
    fusion_buffer_.reset();
    fusion_buffer_.reset(new std::byte[size]);
    fusion_buffer_bytes_ = size;
    std::lock_guard<std::mutex> lock(stats_mutex_);
    stats_.fusion_buffer_bytes = size;
  }
  return fusion_buffer_.get();
}

}  // namespace kolo::fusion
