// A submitted named operation as the application and the engine both see it.
//
// The application holds a request through its kolo_request_t, the engine while the operation is
// pending; whichever lets go last frees it, so a request may be freed before it completes (the
// operation goes on) and waited on after its communicator is gone (it then reports
// KOLO_ERR_CANCELLED). The caller's buffers are used by the engine thread only, and never after
// complete() has been called.
#pragma once

#include <atomic>
#include <condition_variable>
#include <functional>
#include <mutex>
#include <string>
#include <vector>

#include "core/deadline.hpp"
#include "fusion/spec.hpp"
#include "kolo/status.hpp"

namespace kolo::fusion {

// The buffers of one member: send is read, recv written (the same pointer in place; a broadcast
// uses recv only; an allgather's are apart, recv holding the spec's recv_capacity elements).
struct MemberBuffers {
  const void* send = nullptr;
  void* recv = nullptr;
};

// The name of the C call that submits `spec` (kolo_allreduce_async, ...), for messages.
const char* call_name(const UnitSpec& spec);

// Checks the caller's buffers of a submission: one per member, there for every element, not
// overlapping in ways that would make the result depend on the order of copies, in host memory.
// Throws kolo::Error (kInvalidArgument, kUnsupported) naming the call, the tensor and `rank`.
void check_buffers(const UnitSpec& spec, const std::vector<MemberBuffers>& buffers, int rank);

class Request {
 public:
  using Callback = std::function<void(Status)>;

  Request(UnitSpec spec, std::vector<MemberBuffers> buffers, Callback callback, double timeout_s)
      : spec_(std::move(spec)),
        buffers_(std::move(buffers)),
        callback_(std::move(callback)),
        timeout_s_(timeout_s),
        submitted_(Clock::now()) {}

  const UnitSpec& spec() const { return spec_; }
  const std::vector<MemberBuffers>& buffers() const { return buffers_; }
  Clock::time_point submitted() const { return submitted_; }

  // Finishes the request once (later calls are ignored): runs the callback, then publishes the
  // status, so that a waiter returns only after the callback has finished. A successful allgather
  // passes every rank's count, in rank order. Threads blocked in wait() are woken unless `wake` is
  // false, when the caller calls wake_waiters() afterwards.
  void complete(Status status, std::string message, std::vector<uint64_t> gathered_counts = {},
                bool wake = true);
  void wake_waiters() { completed_.notify_all(); }

  // Non-blocking: true and *status once complete.
  bool test(Status* status) const;
  // Blocks until complete or the communicator's timeout passes (kTimeout then, and message() says
  // so; the request stays pending); returns the request's status.
  Status wait();
  // The error message: "" on success and while pending (unless a wait timed out).
  std::string message() const;
  // An allgather's counts, every rank's in rank order, copied into counts[0 .. n): kSuccess once
  // it completed successfully; its own status once it failed; kInvalidArgument, with *refusal
  // saying why, for a request that is no allgather or still pending, a null counts or n smaller
  // than the number of ranks.
  Status copy_gathered_counts(uint64_t* counts, int n, std::string* refusal) const;

 private:
  const UnitSpec spec_;
  const std::vector<MemberBuffers> buffers_;
  Callback callback_;
  const double timeout_s_;
  const Clock::time_point submitted_;

  mutable std::mutex mutex_;
  mutable std::condition_variable completed_;
  bool finishing_ = false;
  // Set under mutex_ after status_, and read without it by test() and wait() once it is true: an
  // application waits for every request of a step, most of them long complete.
  std::atomic<bool> done_ = false;
  Status status_ = Status::kSuccess;
  std::string message_;
  std::vector<uint64_t> gathered_counts_;
};

}  // namespace kolo::fusion
