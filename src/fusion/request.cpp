#include "fusion/request.hpp"

#include <fmt/format.h>

#include <algorithm>

#include "core/arguments.hpp"
#include "core/log.hpp"
#include "gpu/gpu.hpp"

namespace kolo::fusion {
namespace {

using arguments::overlap;
using arguments::partially_overlap;

// An allgather's send buffer holds this rank's count, its receive buffer recv_capacity elements;
// the two must be apart (where this rank's block lands is known only once every rank's count is).
void check_allgather_buffers(const UnitSpec& spec, const MemberBuffers& buffers, int rank) {
  const char* call = call_name(spec);
  const Member& member = spec.members.front();
  const size_t element = dtype_size(spec.dtype);
  if ((member.count > 0 && gpu::is_device_memory(buffers.send)) ||
      (spec.recv_capacity > 0 && gpu::is_device_memory(buffers.recv))) {
    throw Error(Status::kUnsupported,
                fmt::format("{}: tensor '{}' is in GPU memory; named operations take host "
                            "memory only so far",
                            call, member.name));
  }
  if (!buffers.send && member.count > 0) {
    throw Error(Status::kInvalidArgument,
                fmt::format("{}: the send buffer of tensor '{}' is NULL but count is {} (rank {})",
                            call, member.name, member.count, rank));
  }
  if (!buffers.recv && spec.recv_capacity > 0) {
    throw Error(Status::kInvalidArgument,
                fmt::format("{}: the receive buffer of tensor '{}' is NULL but recv_capacity is "
                            "{} (rank {})",
                            call, member.name, spec.recv_capacity, rank));
  }
  if (overlap(buffers.send, member.count * element, buffers.recv, spec.recv_capacity * element)) {
    throw Error(Status::kInvalidArgument,
                fmt::format("{}: the send and receive buffers of tensor '{}' overlap; a named "
                            "allgather does not run in place (rank {})",
                            call, member.name, rank));
  }
}

}  // namespace

const char* call_name(const UnitSpec& spec) {
  if (spec.kind == Kind::kBroadcast) return "kolo_broadcast_async";
  if (spec.kind == Kind::kAllgather) return "kolo_allgather_async";
  return spec.members.size() > 1 ? "kolo_allreduce_group_async" : "kolo_allreduce_async";
}

// Buffers must be there for every element and must not overlap in ways that would make the
// result depend on the order of copies.
void check_buffers(const UnitSpec& spec, const std::vector<MemberBuffers>& buffers, int rank) {
  const char* call = call_name(spec);
  if (buffers.size() != spec.members.size()) {
    throw Error(Status::kInternal, fmt::format("{}: {} buffers for {} tensors", call,
                                               buffers.size(), spec.members.size()));
  }
  if (spec.kind == Kind::kAllgather) return check_allgather_buffers(spec, buffers.front(), rank);
  const size_t element = dtype_size(spec.dtype);
  struct Region {
    const std::byte* begin;
    const std::byte* end;
    const std::string* name;
  };
  std::vector<Region> outputs;  // only a group's outputs can overlap each other
  if (buffers.size() > 1) outputs.reserve(buffers.size());
  for (size_t i = 0; i < buffers.size(); ++i) {
    const Member& member = spec.members[i];
    const size_t bytes = member.count * element;
    if (member.count == 0) continue;
    if (gpu::is_device_memory(buffers[i].send) || gpu::is_device_memory(buffers[i].recv)) {
      throw Error(Status::kUnsupported,
                  fmt::format("{}: tensor '{}' is in GPU memory; named operations take host "
                              "memory only so far (kolo_allreduce takes device buffers)",
                              call, member.name));
    }
    if (spec.kind == Kind::kAllreduce && !buffers[i].send) {
      throw Error(
          Status::kInvalidArgument,
          fmt::format("{}: the send buffer of tensor '{}' is NULL but count is {} (rank {})", call,
                      member.name, member.count, rank));
    }
    if (!buffers[i].recv) {
      throw Error(Status::kInvalidArgument,
                  fmt::format("{}: the {} buffer of tensor '{}' is NULL but count is {} (rank {})",
                              call, spec.kind == Kind::kAllreduce ? "receive" : "", member.name,
                              member.count, rank));
    }
    if (spec.kind == Kind::kAllreduce &&
        partially_overlap(buffers[i].send, buffers[i].recv, bytes)) {
      throw Error(Status::kInvalidArgument,
                  fmt::format("{}: the send and receive buffers of tensor '{}' overlap without "
                              "being the same buffer",
                              call, member.name));
    }
    if (buffers.size() == 1) continue;
    auto* begin = static_cast<const std::byte*>(buffers[i].recv);
    outputs.push_back({begin, begin + bytes, &member.name});
  }
  std::sort(outputs.begin(), outputs.end(),
            [](const Region& a, const Region& b) { return a.begin < b.begin; });
  for (size_t i = 1; i < outputs.size(); ++i) {
    if (outputs[i].begin < outputs[i - 1].end) {
      throw Error(Status::kInvalidArgument,
                  fmt::format("{}: the output buffers of tensors '{}' and '{}' overlap", call,
                              *outputs[i - 1].name, *outputs[i].name));
    }
  }
}

void Request::complete(Status status, std::string message, std::vector<uint64_t> gathered_counts,
                       bool wake) {
  std::unique_lock<std::mutex> lock(mutex_);
  if (finishing_) return;
  finishing_ = true;
  if (callback_) {  // run unlocked: it may call back into the request
    lock.unlock();
    try {
      callback_(status);
    } catch (...) {
      log::warn("the completion callback of {} threw an exception; ignored", describe(spec_));
    }
    lock.lock();
  }
  status_ = status;
  message_ = std::move(message);
  gathered_counts_ = std::move(gathered_counts);
  done_.store(true, std::memory_order_release);
  lock.unlock();
  if (wake) wake_waiters();
}

bool Request::test(Status* status) const {
  if (!done_.load(std::memory_order_acquire)) return false;
  if (status) *status = status_;  // written before done_, never after
  return true;
}

Status Request::wait() {
  if (done_.load(std::memory_order_acquire)) return status_;
  std::unique_lock<std::mutex> lock(mutex_);
  auto limit =
      std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(timeout_s_));
  if (!completed_.wait_for(lock, limit, [&] { return done_.load(std::memory_order_relaxed); })) {
    message_ = fmt::format("{} has not completed within {} s (KOLO_TIMEOUT); it is still pending",
                           describe(spec_), timeout_s_);
    return Status::kTimeout;
  }
  return status_;
}

Status Request::copy_gathered_counts(uint64_t* counts, int n, std::string* refusal) const {
  auto refuse = [&](std::string why) {
    *refusal = std::move(why);
    return Status::kInvalidArgument;
  };
  if (!counts) return refuse("counts is NULL");
  if (spec_.kind != Kind::kAllgather) {
    return refuse(fmt::format("the request of {} is not an allgather", describe(spec_)));
  }
  std::lock_guard<std::mutex> lock(mutex_);
  if (!done_) return refuse(fmt::format("{} is still pending; wait for it first", describe(spec_)));
  if (status_ != Status::kSuccess) return status_;
  if (n < 0 || static_cast<size_t>(n) < gathered_counts_.size()) {
    return refuse(fmt::format("counts has room for {} entries but {} gathered from {} ranks", n,
                              describe(spec_), gathered_counts_.size()));
  }
  std::copy(gathered_counts_.begin(), gathered_counts_.end(), counts);
  return Status::kSuccess;
}

std::string Request::message() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return message_;
}

}  // namespace kolo::fusion
