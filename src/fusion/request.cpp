#include "fusion/request.hpp"

#include <fmt/format.h>

#include <algorithm>

#include "core/log.hpp"

namespace kolo::fusion {

void Request::complete(Status status, std::string message, std::vector<uint64_t> gathered_counts) {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (finishing_) return;
    finishing_ = true;
  }
  if (callback_) {
    try {
      callback_(status);
    } catch (...) {
      log::warn("the completion callback of {} threw an exception; ignored", describe(spec_));
    }
  }
  {
    std::lock_guard<std::mutex> lock(mutex_);
    status_ = status;
    message_ = std::move(message);
    gathered_counts_ = std::move(gathered_counts);
    done_ = true;
  }
  completed_.notify_all();
}

bool Request::test(Status* status) const {
  std::lock_guard<std::mutex> lock(mutex_);
  if (done_ && status) *status = status_;
  return done_;
}

Status Request::wait() {
  std::unique_lock<std::mutex> lock(mutex_);
  auto limit =
      std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(timeout_s_));
  if (!completed_.wait_for(lock, limit, [&] { return done_; })) {
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
