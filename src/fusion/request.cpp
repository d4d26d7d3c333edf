#include "fusion/request.hpp"

#include <fmt/format.h>

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

bool Request::gathered_counts(Status* status, std::vector<uint64_t>* counts) const {
  std::lock_guard<std::mutex> lock(mutex_);
  if (!done_) return false;
  *status = status_;
  *counts = gathered_counts_;
  return true;
}

std::string Request::message() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return message_;
}

}  // namespace kolo::fusion
