// The fusion engine: named tensors, submitted from any thread in any order, run as few large
// collectives in the same order on every rank.
//
// A training step produces hundreds of gradients, and a framework hook submits each one by name
// the moment it is ready (kolo_allreduce_async). Ranks do not produce them in the same order, so
// they cannot simply call collectives in turn; and most gradients are small, so one collective
// each would pay the ring's 2(N-1) latencies hundreds of times per step. The engine negotiates
// which names every rank has submitted, packs them into a few large buffers and reduces those.
//
// Threads and connections. Each communicator gets one engine, created by its first named call.
// The engine thread connects a second full mesh, with a context id of its own (through its own
// store connection, since the communicator's is not thread-safe), and runs a Ring over it with
// its own sequence numbers. Ordered calls (kolo_allreduce, ...) keep the communicator's mesh, so
// the two kinds of traffic never interleave on a socket and may be used from different threads
// of one program. The engine's waits on its mesh yield the CPU from the first poll, where the
// communicator's spin a few microseconds first (transport/shm/waiting.hpp): the engine thread
// shares the CPUs with the application's threads that submit and wait. Application threads only
// queue requests; all communication and every access to the caller's buffers happens on the engine
// thread.
//
// A cycle (every KOLO_CYCLE_TIME_MS while there is work; at once after one that ran collectives
// while this rank had more, see loop()):
//   1. Every rank builds a RequestList: one bit per response-cache slot that holds a unit it has
//      pending, and the full spec of each pending unit that is not cached, announced once.
//   2. Ranks 1..N-1 send it to rank 0 (a 32-byte header and a payload), which hands all N lists
//      to the Coordinator (coordinator.hpp): a unit is ready when every rank has submitted it;
//      specs must agree (else KOLO_ERR_MISMATCH for that tensor on every rank, naming the ranks
//      and both specs); stalls are reported and optionally aborted; newly negotiated units get
//      cache slots; ready units are planned into batches.
//   3. Rank 0 sends the ResponseList to every rank. Each applies it in the same order: fails the
//      units named in errors, stores the new cache slots, and runs the batches, one collective
//      each, completing the requests.
// This is one round trip to rank 0 per cycle (2 hops rather than the 2(N-1) of a ring exchange,
// which matters more than bandwidth for messages this small). In a steady training loop every
// unit is cached, so each rank's message is a few words of bits and rank 0's answer a list of
// slot numbers: no names, no specs, no per-tensor bookkeeping on rank 0.
//
// Cache agreement. The cache changes only when a response is applied, and every rank applies the
// same responses in the same order, so slot s names the same unit everywhere. A RequestList is
// built after the previous response was applied, so its bits refer to the cache that rank 0 also
// holds when it reads them. Rank 0 alone chooses slots and never evicts a slot whose bit any rank
// set in the current cycle; a rank looks its pending units up afresh every cycle, so a unit whose
// slot was evicted is simply announced again. A name whose spec changes is announced (the cache
// lookup compares the whole spec) and takes over its old slot once every rank agrees.
//
// Fusion. A batch marked fused runs through one fusion buffer (allocated at the threshold size on
// first use, grown only for a larger group, and reused): copy every tensor in, one ring allreduce,
// copy every tensor out. The buffer is laid out chunk-major (fused_layout.hpp) so that every
// element is reduced in exactly the order it would be alone: fused results are bitwise identical
// to unfused ones for every dtype and op. A batch of one tensor (a broadcast, a tensor too large
// for fusing to pay, which rank 0 measures (fusion_cost.hpp) and which is never more than a
// megabyte, or anything when fusion is off) runs in place in the caller's buffers; tensors too
// large to fuse that the ring reduces share one ring allreduce over their buffers, up to the
// threshold (a batch on one ring, coordinator.hpp), bitwise as alone and never copied. A unit's
// schedule follows from its own size (engine_algorithm() in spec.hpp): recursive doubling up to
// kolo_allreduce's limit for it, the ring above, and only units of the same schedule are fused
// together, so that a tensor's result never depends on what it was batched with, and equals
// kolo_allreduce's on one host (across hosts kolo_allreduce runs the hierarchical schedules,
// whose results may differ in the last bit).
//
// Join (kolo_join). A rank with no more data says so in every RequestList until every rank has
// joined; rank 0 then counts it as having submitted whatever the others submit (coordinator.hpp),
// and when a response schedules a unit this rank has no request for, it runs the collective with
// a request of its own: zeros to send (nothing for an allgather) and a buffer of its own to
// receive into. The response of the cycle in which the last rank joins names that rank, and every
// rank's join() returns it.
//
// Allgathers (kolo_allgather_async) are negotiated like the rest, except that every rank sends
// its own count and receive capacity, and rank 0 answers with every rank's count (coordinator.hpp).
// They are never cached nor fused: each runs alone, as the communicator's allgatherv would, into
// the caller's buffer, and its request hands the counts back (kolo_request_counts).
//
// Idle. When a response says that no rank has anything pending, every engine sleeps in poll() on
// an eventfd (written by a submission or by shutdown) and on the transport's readiness fd. Rank 0
// keeps receives posted for the next RequestList of every rank, the others a receive for a WAKE
// from rank 0. The first rank to get a submission starts the next cycle: rank 0 directly, any
// other rank by sending its RequestList, whose arrival wakes rank 0, which then sends WAKE to
// every rank. An idle communicator thus costs no CPU time and sends nothing. A rank whose
// communicator is destroyed while every rank is idle sends BYE where its peers expect a message
// (to everyone if it is rank 0, else to rank 0, which passes it on); the peers' engines stop
// quietly, and later named calls report that rank's departure. Without it the connection closing
// under a posted receive would be a failure, and the ABORT it sends could cut short the last
// collective of a rank that has not finished it yet.
//
// A late rank. A response that schedules nothing while some rank has work pending means that a
// rank has not submitted yet (often by microseconds: ranks end a step at different times). Every
// rank then waits the same way as when idle, bounded by a retry that starts at kLateRankRetry and
// doubles up to the cycle time: the retry keeps stall reports coming and ends waits on ranks whose
// work differs. A rank that had nothing pending is the late one, and its first submission starts
// the next cycle for everyone at once; without that it waited, like the rest, for the next retry,
// which, once the retries had grown, came up to a cycle time after it.
//
// Failures. Transport errors (a lost peer, a timeout) break the engine: every pending and queued
// request fails with the error, which names the rank, and so does every later submission. The
// transport tells the peers' engines (an ABORT frame), so they fail with the same message. When
// the communicator's own transport breaks, the communicator tells the engine, which does the same.
//
// Autotuning (KOLO_AUTOTUNE=1, autotune.hpp). Rank 0's Autotuner measures the engine's throughput
// cycle by cycle and now and then chooses a new fusion threshold, cycle time and ring segment.
// Rank 0 plans the next response with the new threshold and adds the settings to it; every rank
// applies them when it reads that response, before its batches, so the segment (a message size
// the ranks must agree on) changes between the same two collectives everywhere. Without it no
// response carries settings and nothing changes.
//
// Destroying the communicator stops the engine thread at the end of the collective it may be
// running (every collective it starts, every rank runs to the end) and fails what is left with
// KOLO_ERR_CANCELLED.
//
// Where each part lives: this file holds the application side (submission, the queue,
// completion) and the engine thread's life (connect, the cycle, the idle sleep, stop); request.*
// a submission and its checks; negotiation.* the channel that carries a cycle's messages, the
// wake-up and the goodbye; coordinator.* rank 0's answers; executor.* the batches, run fused
// through the fusion buffer, on one ring or alone; autotune.* rank 0's search for settings;
// timeline.* the trace and all of its JSON.
#include "fusion/engine.hpp"

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <poll.h>
#include <sys/eventfd.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <list>
#include <utility>

#include "core/arguments.hpp"
#include "core/log.hpp"
#include "fusion/autotune.hpp"
#include "fusion/coordinator.hpp"
#include "fusion/negotiation.hpp"
#include "fusion/timeline.hpp"
#include "ring/ring.hpp"

namespace kolo::fusion {
namespace {

// Announcements sent per cycle are bounded so that the message stays far below kMaxPayloadBytes;
// the rest wait a cycle.
constexpr size_t kAnnouncementBudget = kMaxPayloadBytes / 2;
// With a transport that has no readiness fd, idle ranks look at it this often.
constexpr int kIdlePollMsWithoutFd = 2;
// The first wait for a late rank (FusionEngine::loop).
constexpr auto kLateRankRetry = std::chrono::microseconds(250);
// Allreduces of one float per rank timed when the engine connects: the first measure of a
// collective's latency (fusion_cost.hpp).
constexpr int kLatencyProbes = 5;

// For the message of a response that does not fit what this rank submitted: with an allgather's
// counts, which describe() leaves out.
std::string describe_scheduled(const UnitSpec& spec) {
  if (spec.kind != Kind::kAllgather) return describe(spec);
  return fmt::format("{} with counts [{}]", describe(spec), fmt::join(spec.gather_counts, ", "));
}

// What is left until `when` as ppoll's timeout, at most `cap`; nullopt once it has passed.
std::optional<timespec> timeout_until(Clock::time_point when, Clock::duration cap) {
  const int64_t left =
      std::chrono::duration_cast<std::chrono::nanoseconds>(std::min(when - Clock::now(), cap))
          .count();
  if (left <= 0) return std::nullopt;
  return timespec{static_cast<time_t>(left / 1000000000), static_cast<long>(left % 1000000000)};
}

std::string describe_submitted(const UnitSpec& spec) {
  if (spec.kind != Kind::kAllgather) return describe(spec);
  return fmt::format("{} with count {} and recv_capacity {}", describe(spec),
                     spec.members.front().count, spec.recv_capacity);
}

UnitSpec single_tensor_spec(Kind kind, DataType dtype, NamedTensor& tensor) {
  UnitSpec spec;
  spec.kind = kind;
  spec.dtype = dtype;
  spec.members.push_back({std::move(tensor.name), tensor.count});
  return spec;
}

}  // namespace

FusionEngine::FusionEngine(const Config& config, Connector connect)
    : config_(config),
      connect_(std::move(connect)),
      rank_(config.rank),
      size_(config.size),
      fusion_threshold_(config.fusion_threshold_bytes),
      cache_(static_cast<uint32_t>(config.cache_capacity)),
      executor_(config.size),
      by_slot_(cache_.capacity(), nullptr) {
  wake_fd_ = ::eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
  if (wake_fd_ < 0) {
    throw Error(Status::kSystem,
                fmt::format("fusion engine: eventfd failed: {}", std::strerror(errno)));
  }
}

FusionEngine::~FusionEngine() {
  if (thread_.joinable()) {
    // Only reached if shutdown() was never called; the last owner may be the thread itself.
    if (thread_.get_id() == std::this_thread::get_id()) {
      thread_.detach();
    } else {
      thread_.join();
    }
  }
  ::close(wake_fd_);
}

// ---- application side ---------------------------------------------------------------------------

void FusionEngine::set_fusion_threshold(uint64_t bytes) {
  if (bytes > kMaxFusionThresholdBytes) {
    throw arguments::invalid("kolo_comm_set_fusion_threshold",
                             fmt::format("{} bytes is more than the 4 GiB allowed", bytes));
  }
  fusion_threshold_ = bytes;
}

std::shared_ptr<Request> FusionEngine::allreduce(std::span<NamedTensor> tensors, DataType dtype,
                                                 ReduceOp op, SubmitOptions options) {
  UnitSpec spec;
  spec.kind = Kind::kAllreduce;
  spec.dtype = dtype;
  spec.op = op;
  spec.prescale = options.prescale;
  spec.postscale = options.postscale;
  std::vector<MemberBuffers> buffers;
  spec.members.reserve(tensors.size());
  buffers.reserve(tensors.size());
  for (NamedTensor& tensor : tensors) {
    spec.members.push_back({std::move(tensor.name), tensor.count});
    buffers.push_back({tensor.send, tensor.recv});
  }
  return submit(std::move(spec), std::move(buffers), std::move(options.callback));
}

std::shared_ptr<Request> FusionEngine::broadcast(NamedTensor tensor, DataType dtype, int root,
                                                 SubmitOptions options) {
  UnitSpec spec = single_tensor_spec(Kind::kBroadcast, dtype, tensor);
  spec.root = root;
  return submit(std::move(spec), {{tensor.recv, tensor.recv}}, std::move(options.callback));
}

std::shared_ptr<Request> FusionEngine::allgather(NamedTensor tensor, uint64_t recv_capacity,
                                                 DataType dtype, SubmitOptions options) {
  UnitSpec spec = single_tensor_spec(Kind::kAllgather, dtype, tensor);
  spec.recv_capacity = recv_capacity;
  return submit(std::move(spec), {{tensor.send, tensor.recv}}, std::move(options.callback));
}

std::shared_ptr<Request> FusionEngine::submit(UnitSpec spec, std::vector<MemberBuffers> buffers,
                                              Request::Callback callback) {
  if (std::string problem = check_spec(spec, size_); !problem.empty()) {
    throw Error(Status::kInvalidArgument,
                fmt::format("{}: {} (rank {})", call_name(spec), problem, rank_));
  }
  check_buffers(spec, buffers, rank_);
  auto request = std::make_shared<Request>(std::move(spec), std::move(buffers), std::move(callback),
                                           config_.timeout_s);
  bool wake;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (failure_) throw *failure_;
    if (joining_) {
      throw Error(Status::kInvalidArgument,
                  fmt::format("{}: rank {} has called kolo_join; it submits again once every rank "
                              "has joined",
                              call_name(request->spec()), rank_));
    }
    start_thread();
    const std::vector<Member>& members = request->spec().members;
    for (size_t m = 0; m < members.size(); ++m) {
      if (!in_flight_.insert(members[m].name).second) {
        for (size_t added = 0; added < m; ++added) in_flight_.erase(members[added].name);
        throw Error(Status::kInvalidArgument,
                    fmt::format("{}: tensor '{}' is already pending on rank {}; a name can be "
                                "submitted again once its request has completed",
                                call_name(request->spec()), members[m].name, rank_));
      }
    }
    queue_.push_back(request);
    tensors_submitted_ += members.size();
    // One write wakes the engine; the submissions that follow before it runs need none (a
    // burst of submissions wrote the eventfd over and over while the woken engine thread waited
    // for a CPU, often the one the submitting thread held).
    wake = std::exchange(idle_waiting_, false);
  }
  if (wake) signal();
  return request;
}

void FusionEngine::start_thread() {
  if (state_ != State::kNotStarted) return;
  thread_ = std::thread([self = shared_from_this()] { self->run(); });
  state_ = State::kConnecting;
}

int FusionEngine::join() {
  std::unique_lock<std::mutex> lock(mutex_);
  if (failure_) throw *failure_;
  start_thread();
  if (!joining_) {  // a new join (a second thread in join() waits for the same one)
    joining_ = true;
    join_result_.reset();
  }
  const bool wake = std::exchange(idle_waiting_, false);
  lock.unlock();
  if (wake) signal();
  lock.lock();
  const auto limit =
      std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(config_.timeout_s));
  if (!join_done_.wait_for(lock, limit, [&] { return join_result_ || failure_; })) {
    throw Error(Status::kTimeout,
                fmt::format("kolo_join: not every rank joined within {} s (KOLO_TIMEOUT); rank {} "
                            "stays joined and may call kolo_join again",
                            config_.timeout_s, rank_));
  }
  if (!join_result_) throw *failure_;
  return *join_result_;
}

void FusionEngine::communicator_failed(const Error& error) {
  bool connecting = false;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (failure_ || outside_failure_) return;
    if (state_ == State::kNotStarted) {
      failure_ = error;
      return;
    }
    outside_failure_ = error;
    // Still connecting, which cannot be interrupted and, if the break was a lost rank, waits for
    // it until KOLO_TIMEOUT: nothing has run yet, so the queued requests fail now, with this
    // error, and the thread stops once its connect returns.
    if (state_ == State::kConnecting) {
      connecting = true;
      stop_ = true;
    }
  }
  if (connecting) fail_queued(error);
  signal();
}

FusionStats FusionEngine::stats() const {
  FusionStats stats;
  {
    std::lock_guard<std::mutex> lock(stats_mutex_);
    stats = stats_;
  }
  {
    std::lock_guard<std::mutex> lock(mutex_);
    stats.tensors_submitted = tensors_submitted_;
    stats.requests_completed = requests_completed_;
    stats.requests_failed = requests_failed_;
  }
  const ExecutorStats ran = executor_.stats();
  stats.collectives = ran.collectives;
  stats.fused_collectives = ran.fused_collectives;
  stats.tensors_fused = ran.tensors_fused;
  stats.bytes_copied = ran.bytes_copied;
  stats.fusion_buffer_bytes = ran.fusion_buffer_bytes;
  stats.collective_ns = ran.collective_ns;
  stats.copy_ns = ran.copy_ns;
  stats.fusion_threshold = fusion_threshold_.load();
  return stats;
}

void FusionEngine::set_activity(std::string activity) {
  std::lock_guard<std::mutex> lock(activity_mutex_);
  activity_ = std::move(activity);
  running_.reset();
}

void FusionEngine::set_running(std::shared_ptr<const Request> first, size_t more) {
  std::lock_guard<std::mutex> lock(activity_mutex_);
  running_ = Running{cycle_, std::move(first), more};
}

std::string FusionEngine::report() const {
  constexpr size_t kNamesShown = 8;
  std::vector<std::string> names;
  size_t in_flight = 0;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    in_flight = in_flight_.size();
    names.assign(in_flight_.begin(), in_flight_.end());
  }
  std::sort(names.begin(), names.end());
  std::string listed;
  for (size_t i = 0; i < names.size() && i < kNamesShown; ++i) {
    listed += fmt::format("{}'{}'", i == 0 ? ": " : ", ", names[i]);
  }
  if (names.size() > kNamesShown)
    listed += fmt::format(" (and {} more)", names.size() - kNamesShown);
  std::lock_guard<std::mutex> lock(activity_mutex_);
  const std::string activity =
      running_ ? fmt::format("cycle {}: running {}{}", running_->cycle,
                             describe(running_->first->spec()),
                             running_->more > 0 ? fmt::format(" and {} more", running_->more) : "")
               : activity_;
  return fmt::format(
      "fusion engine: {} named operation(s) in flight on this rank{}; its thread: "
      "{}{}",
      in_flight, listed, activity,
      waiting_ranks_.empty() ? "" : "; not yet submitted by every rank: " + waiting_ranks_);
}

void FusionEngine::shutdown() {
  // A completion callback runs on the engine's thread, and may destroy the communicator.
  const bool own_thread = std::this_thread::get_id() == thread_.get_id();
  bool connecting;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (shut_down_) return;
    shut_down_ = true;
    stop_ = true;
    connecting = state_ == State::kConnecting;
    if (own_thread) cancel_when_stopped_ = true;  // written and read by the engine's thread alone
    if (!failure_) {
      failure_.emplace(Status::kCancelled,
                       fmt::format("the communicator was destroyed on rank {}", rank_));
    }
  }
  join_done_.notify_all();
  signal();
  if (thread_.joinable()) {
    // Connecting waits for every peer and cannot be interrupted: the thread finishes it on its
    // own (within KOLO_TIMEOUT), sees the stop request and exits, holding the engine alive. On
    // its own thread the engine cannot wait for itself: it stops once the callback has returned,
    // and cancels what is left then (run()), since the batch it is completing still uses its
    // units.
    if (connecting || own_thread) {
      thread_.detach();
    } else {
      thread_.join();
    }
  }
  if (!own_thread) cancel_remaining(/*pending=*/!connecting);
}

void FusionEngine::cancel_remaining(bool pending) {
  const std::string why =
      fmt::format("the communicator was destroyed on rank {} before the request completed", rank_);
  if (pending) {
    std::vector<std::string> keys;
    for (const auto& [key, unit] : pending_) keys.emplace_back(key);
    for (const std::string& key : keys) {
      fail_pending(key, Status::kCancelled,
                   fmt::format("{}: {}", describe(pending_.at(key).request->spec()), why));
    }
  }
  std::vector<std::shared_ptr<Request>> queued;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    queued.swap(queue_);
    in_flight_.clear();
    requests_failed_ += queued.size();
  }
  for (auto& request : queued) {
    request->complete(Status::kCancelled, fmt::format("{}: {}", describe(request->spec()), why));
  }
}

void FusionEngine::signal() {
  uint64_t one = 1;
  (void)!::write(wake_fd_, &one, sizeof(one));
}

void FusionEngine::drain_signal() {
  uint64_t value;
  (void)!::read(wake_fd_, &value, sizeof(value));
}

// ---- the engine thread ------------------------------------------------------------------------

void FusionEngine::run() {
  try {
    set_activity("connecting to the other ranks' engines");
    connect();
    {
      std::lock_guard<std::mutex> lock(mutex_);
      if (stop_) throw Stopped{};
      state_ = State::kRunning;
    }
    loop();
  } catch (const Stopped&) {
  } catch (const Departed& departed) {
    // Not a failure of this rank: nothing to tell the peers, who leave the same way.
    log::info("fusion engine: {}", departed.error.what());
    fail_everything(departed.error);
  } catch (const Error& error) {
    if (transport_) transport_->abort(error);
    fail_everything(error);
  } catch (const std::exception& error) {
    Error internal(Status::kInternal,
                   fmt::format("the fusion engine of rank {} failed: {}", rank_, error.what()));
    if (transport_) transport_->abort(internal);
    fail_everything(internal);
  }
  if (cancel_when_stopped_) cancel_remaining(/*pending=*/true);  // shutdown() on this thread
  set_activity("finished");
  executor_.attach(nullptr, nullptr);
  channel_.reset();
  ring_.reset();
  transport_.reset();  // says goodbye to the peers' engines
  timeline_.reset();   // closes the trace
  std::lock_guard<std::mutex> lock(mutex_);
  state_ = State::kFinished;
}

void FusionEngine::connect() {
  Links links = connect_();
  transport_ = std::move(links.transport);
  ring_ = std::move(links.ring);
  channel_ = std::make_unique<NegotiationChannel>(
      *transport_, rank_, size_, cache_.capacity(), config_.timeout_s,
      NegotiationChannel::Hooks{
          [this] { check_stop(); },
          [this](std::string activity) { set_activity(std::move(activity)); }});
  if (rank_ == 0) {
    const bool through_memory =
        transport_->through_memory(ring_->left()) && transport_->through_memory(ring_->right());
    coordinator_ = std::make_unique<Coordinator>(
        CoordinatorSettings{size_, config_.stall_warning_s, config_.stall_abort_s, !through_memory},
        cache_);
  }
  cycle_time_ = std::chrono::duration_cast<Clock::duration>(
      std::chrono::duration<double, std::milli>(config_.cycle_time_ms));
  {
    std::lock_guard<std::mutex> lock(stats_mutex_);
    stats_.cycle_time_ms = config_.cycle_time_ms;
    stats_.segment_bytes = ring_->segment_bytes();
  }
  if (rank_ == 0 && config_.autotune) {
    autotuner_ = std::make_unique<Autotuner>(
        EngineSettings{fusion_threshold_.load(), config_.cycle_time_ms, ring_->segment_bytes()},
        AutotuneOptions{config_.autotune_window_ms / 1000.0, 1, config_.autotune_log_path},
        Clock::now());
  }
  if (!config_.timeline_path.empty()) {
    try {
      timeline_ =
          std::make_unique<Timeline>(Timeline::path_for_rank(config_.timeline_path, rank_), rank_);
      cycles_row_ = timeline_->row("cycles");
    } catch (const Error& error) {
      log::warn("{}; running without a timeline", error.what());
    }
  }
  executor_.attach(ring_.get(), timeline_.get());
  executor_.probe_latency(kLatencyProbes);
  log::info(
      "fusion engine: rank {} connected ({} ranks, cycle {} ms, fusion threshold {} bytes, "
      "cache {} entries)",
      rank_, size_, config_.cycle_time_ms, fusion_threshold_.load(), cache_.capacity());
}

void FusionEngine::loop() {
  Clock::time_point next = Clock::now();
  for (;;) {
    if (idle_) {
      idle_wait(std::nullopt);
      idle_ = false;
      if (autotuner_) autotuner_->resume(Clock::now());
    } else if (late_rank_retry_ > Clock::duration::zero()) {
      idle_wait(next);  // every rank read the same response: every rank waits this way
    } else {
      sleep_until(next);
    }
    next = Clock::now() + cycle_time_;  // the cycle's response may change it
    run_cycle();
    // A cycle that found submissions on some ranks only was early for a late rank, which is
    // usually microseconds to a few milliseconds behind (ranks leave a step at different
    // times): asking again after a whole cycle would add up to KOLO_CYCLE_TIME_MS to the step.
    // So the next cycle comes after kLateRankRetry, then twice that, ..., up to the cycle time:
    // a rank that is seconds late costs a handful of extra cycles, not a busy loop. A late rank
    // that had nothing at all ends the wait with its first submission, as after an idle cycle
    // (idle_wait), rather than leaving every rank asleep until the retry.
    if (late_rank_retry_ > Clock::duration::zero()) {
      next = std::min(next, Clock::now() + late_rank_retry_);
    }
    // Submissions that arrived while the cycle's collectives ran have waited for them already;
    // waiting out the cycle time as well would leave the transport idle with work queued (a
    // step's small gradients submitted during its first, large collective waited up to
    // KOLO_CYCLE_TIME_MS). So a cycle that ran collectives is followed at once by the next while
    // this rank has anything left: the work that piled up during a collective is the next batch.
    // A rank with nothing left sleeps as before, and the others wait for it in the exchange.
    if (again_) next = Clock::now();
  }
}

void FusionEngine::check_stop() {
  std::optional<Error> failure;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (stop_) throw Stopped{};
    failure = outside_failure_;
  }
  if (failure) throw *failure;
}

void FusionEngine::sleep_until(Clock::time_point when) {
  for (;;) {
    check_stop();
    std::optional<timespec> timeout = timeout_until(when, Clock::duration::max());
    if (!timeout) return;
    pollfd wake{wake_fd_, POLLIN, 0};
    ::ppoll(&wake, 1, &*timeout, nullptr);
    drain_signal();
  }
}

void FusionEngine::run_cycle() {
  ++cycle_;
  const Clock::time_point started = Clock::now();
  RequestList mine = build_requests();
  const size_t announced = mine.announcements.size();
  had_nothing_ = pending_.empty();
  std::vector<Arrival> arrivals;
  ResponseList response;
  if (rank_ == 0) {
    std::vector<RequestList> lists = channel_->gather_requests(cycle_, std::move(mine));
    const uint64_t threshold =
        autotuner_ ? autotuner_->current().fusion_threshold : fusion_threshold_.load();
    update_alone_bytes();
    response = coordinator_->process(cycle_, lists, threshold, Clock::now(),
                                     timeline_ ? &arrivals : nullptr);
    response.settings = std::exchange(announce_, std::nullopt);
    channel_->send_response(cycle_, response);
  } else {
    response = channel_->exchange(cycle_, mine, cache_);
  }
  const Clock::time_point received = Clock::now();
  execute(response, received, arrivals);
  idle_ = response.idle;
  if (response.batches.empty() || idle_) {
    again_ = false;
  } else {
    std::lock_guard<std::mutex> lock(mutex_);
    again_ = !queue_.empty() || !pending_.empty();
  }
  const bool late_rank = !response.idle && response.batches.empty() && response.errors.empty();
  if (!late_rank) {
    late_rank_retry_ = Clock::duration::zero();
  } else {
    late_rank_retry_ = late_rank_retry_ == Clock::duration::zero()
                           ? Clock::duration(kLateRankRetry)
                           : std::min<Clock::duration>(2 * late_rank_retry_, cycle_time_);
  }
  if (autotuner_) tune(idle_, Clock::now());
  set_activity(idle_ ? "idle, asleep until the next submission" : "between cycles");
  if (coordinator_ && received - last_summary_ >= std::chrono::seconds(1)) {
    last_summary_ = received;
    std::string summary = coordinator_->waiting_summary(received);
    std::lock_guard<std::mutex> lock(activity_mutex_);
    waiting_ranks_ = std::move(summary);
  }
  {
    std::lock_guard<std::mutex> lock(stats_mutex_);
    ++stats_.cycles;
    if (idle_) ++stats_.idle_sleeps;
    stats_.negotiation_ns += static_cast<uint64_t>(
        std::chrono::duration_cast<std::chrono::nanoseconds>(received - started).count());
  }
  if (timeline_) {
    if (announced > 0 || !response.batches.empty() || !response.errors.empty()) {
      timeline_->span(
          cycles_row_, "CYCLE", started, received,
          Timeline::cycle_args(cycle_, announced, response.batches.size(), response.errors.size()));
    }
    if (idle_) timeline_->instant(cycles_row_, "IDLE", Clock::now());
  }
}

void FusionEngine::update_alone_bytes() {
  const FusionCost& cost = executor_.cost();
  const uint64_t bytes = cost.alone_bytes();
  coordinator_->set_alone_bytes(bytes);
  // Logged when it first moves and then whenever it has halved or doubled since last logged.
  if (bytes == logged_alone_bytes_ ||
      (bytes * 2 > logged_alone_bytes_ && bytes < 2 * logged_alone_bytes_)) {
    return;
  }
  logged_alone_bytes_ = bytes;
  log::info(
      "fusion engine: single tensors of {} bytes or more now run alone (a collective's latency "
      "{:.1f} us, copying in and out {:.3f} ns per byte)",
      bytes, cost.latency_s() * 1e6, cost.copy_s_per_byte() * 1e9);
}

RequestList FusionEngine::build_requests() {
  RequestList list;
  {
    // Swapped, not moved: both vectors keep their capacity, so a step's submissions do not grow
    // a fresh vector again every cycle.
    std::lock_guard<std::mutex> lock(mutex_);
    taken_.swap(queue_);
    list.joined = joining_;
  }
  joined_announced_ = list.joined;
  for (auto& request : taken_) {
    // submit() refused a name already in flight, so the key is new here.
    const std::string_view key = request->spec().key();
    pending_.emplace(key, LocalUnit{std::move(request), false});
  }
  taken_.clear();
  if (cache_.capacity() > 0) list.ready_words.assign((cache_.capacity() + 63) / 64, 0);
  for (uint32_t slot : marked_) by_slot_[slot] = nullptr;
  marked_.clear();
  std::vector<LocalUnit*> uncached;
  for (auto& [key, unit] : pending_) {
    if (unit.announced) continue;
    unit.slot = cache_.find(unit.request->spec());
    if (unit.slot >= 0) {
      list.ready_words[unit.slot / 64] |= uint64_t{1} << (unit.slot % 64);
      by_slot_[unit.slot] = &unit;
      marked_.push_back(static_cast<uint32_t>(unit.slot));
    } else {
      uncached.push_back(&unit);
    }
  }
  std::sort(uncached.begin(), uncached.end(), [](const LocalUnit* a, const LocalUnit* b) {
    return a->request->submitted() < b->request->submitted();
  });
  size_t budget = kAnnouncementBudget;
  unannounced_ = false;
  for (LocalUnit* unit : uncached) {
    size_t bytes = encoded_size(unit->request->spec());
    if (bytes > budget) {  // the rest next cycle
      unannounced_ = true;
      break;
    }
    budget -= bytes;
    list.announcements.push_back(unit->request->spec());
    unit->announced = true;
  }
  return list;
}

void FusionEngine::tune(bool idle, Clock::time_point now) {
  const uint64_t payload = executor_.stats().payload_bytes;
  std::optional<EngineSettings> next = autotuner_->observe(payload - payload_seen_, now, idle);
  payload_seen_ = payload;
  if (next) announce_ = next;
}

void FusionEngine::apply(const EngineSettings& settings) {
  fusion_threshold_ = settings.fusion_threshold;
  cycle_time_ = std::chrono::duration_cast<Clock::duration>(
      std::chrono::duration<double, std::milli>(settings.cycle_time_ms));
  ring_->set_segment_bytes(settings.segment_bytes);
  log::info(
      "fusion engine: rank {} applies {}settings from cycle {}: fusion threshold {} bytes, cycle "
      "{} ms, segment {} bytes",
      rank_, settings.final ? "the autotuner's final " : "", cycle_, settings.fusion_threshold,
      settings.cycle_time_ms, settings.segment_bytes);
  std::lock_guard<std::mutex> lock(stats_mutex_);
  ++stats_.autotune_updates;
  stats_.autotune_settled = settings.final;
  stats_.cycle_time_ms = settings.cycle_time_ms;
  stats_.segment_bytes = settings.segment_bytes;
}

void FusionEngine::execute(const ResponseList& response, Clock::time_point received,
                           const std::vector<Arrival>& arrivals) {
  if (response.settings) apply(*response.settings);
  for (const ResponseError& error : response.errors) {
    if (pending_.count(error.key)) fail_pending(error.key, error.status, error.message);
  }
  std::vector<std::vector<LocalUnit*>> units(response.batches.size());
  for (size_t b = 0; b < response.batches.size(); ++b) {
    units[b].reserve(response.batches[b].units.size());
  }
  uint64_t hits = 0, negotiated = 0;
  // Join: a rank that has joined takes part in what the others submitted, sending zeros (nothing
  // for an allgather) and receiving into a buffer of its own.
  struct Phantom {
    std::vector<std::byte> zeros, scratch;
    LocalUnit unit;
  };
  std::list<Phantom> phantoms;  // stable addresses; unlike a deque, allocates nothing unused
  auto phantom_for = [&](const UnitSpec& spec) -> LocalUnit& {
    Phantom& phantom = phantoms.emplace_back();
    const size_t element = dtype_size(spec.dtype);
    const bool gather = spec.kind == Kind::kAllgather;
    uint64_t elements = 0;
    for (uint64_t count : spec.gather_counts) elements += count;
    for (const Member& member : spec.members) elements += gather ? 0 : member.count;
    phantom.zeros.assign(gather ? 1 : std::max<uint64_t>(1, elements * element), std::byte{0});
    phantom.scratch.resize(std::max<uint64_t>(1, elements * element));
    std::vector<MemberBuffers> buffers;
    uint64_t offset = 0;
    for (const Member& member : spec.members) {
      buffers.push_back(
          {phantom.zeros.data() + (gather ? 0 : offset), phantom.scratch.data() + offset});
      offset += gather ? 0 : member.count * element;
    }
    UnitSpec mine = spec;
    if (gather) {
      mine.members.front().count = 0;
      mine.recv_capacity = elements;
    }
    phantom.unit.phantom = true;
    phantom.unit.request = std::make_shared<Request>(std::move(mine), std::move(buffers),
                                                     Request::Callback(), config_.timeout_s);
    return phantom.unit;
  };
  auto schedule = [&](LocalUnit& unit, size_t b) {
    if (unit.scheduled == cycle_) {
      throw Error(Status::kInternal,
                  fmt::format("fusion engine: rank 0 scheduled {} twice in one response",
                              describe(unit.request->spec())));
    }
    unit.scheduled = cycle_;
    units[b].push_back(&unit);
  };
  for (size_t b = 0; b < response.batches.size(); ++b) {
    for (const ResponseUnit& scheduled : response.batches[b].units) {
      ++(scheduled.hit ? hits : negotiated);
      // A hit on a slot whose bit this rank set is the unit that set it: build_requests found
      // the cached spec equal to the submitted one, and the cache has not changed since.
      LocalUnit* unit = scheduled.hit && scheduled.slot >= 0 &&
                                static_cast<size_t>(scheduled.slot) < by_slot_.size()
                            ? by_slot_[scheduled.slot]
                            : nullptr;
      if (unit) {
        schedule(*unit, b);
        continue;
      }
      const UnitSpec* spec = spec_of(scheduled, cache_);
      if (!spec) {
        throw Error(Status::kInternal,
                    fmt::format("fusion engine: rank 0 scheduled cache slot {}, which is empty "
                                "on rank {}",
                                scheduled.slot, rank_));
      }
      auto it = pending_.find(spec->key());
      if (it == pending_.end() && joined_announced_) {
        units[b].push_back(&phantom_for(*spec));
        continue;
      }
      if (it == pending_.end() || !matches_submission(it->second.request->spec(), *spec, rank_)) {
        throw Error(
            Status::kInternal,
            fmt::format("fusion engine: rank 0 scheduled {} but rank {} has {}",
                        describe_scheduled(*spec), rank_,
                        it == pending_.end()
                            ? std::string("not submitted it")
                            : "submitted " + describe_submitted(it->second.request->spec())));
      }
      schedule(it->second, b);
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
  executor_.start_response();
  for (size_t b = 0; b < units.size(); ++b) {
    if (units[b].empty()) continue;
    set_running(units[b][0]->request, units[b].size() - 1);
    std::vector<const Request*> requests;
    for (const LocalUnit* unit : units[b]) requests.push_back(unit->request.get());
    executor_.run(response.batches[b], requests, received, fusion_threshold_.load());
    complete_batch(units[b], response.batches[b]);
  }
  if (response.all_joined >= 0 && joined_announced_) {  // every rank has joined: join() returns
    {
      std::lock_guard<std::mutex> lock(mutex_);
      joining_ = false;
      join_result_ = response.all_joined;
    }
    joined_announced_ = false;
    join_done_.notify_all();
  }
}

void FusionEngine::idle_wait(std::optional<Clock::time_point> until) {
  const bool late = until.has_value();
  // Waiting for a late rank, a rank that had work wakes everyone only when the wait runs out:
  // its own new submissions are not what the others lack. One that had nothing is the late rank
  // (or one of them), and its first submission is.
  const bool woken_by_submission = !late || had_nothing_;
  const uint64_t next = cycle_ + 1;
  channel_->post_idle(next);
  const int ready_fd = channel_->readiness_fd();
  for (;;) {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      // Units still pending here were not announced yet (the announcement budget): rank 0 cannot
      // know them, so this rank wakes everyone itself (after an idle cycle every unit pending
      // here is such a unit). So does a join that rank 0 has not heard of.
      // Waiting for a late rank ends, at the latest, when it is time to ask again.
      if (stop_ || outside_failure_ || (woken_by_submission && !queue_.empty()) ||
          (late ? unannounced_ : !pending_.empty()) || (joining_ && !joined_announced_) ||
          channel_->woken() || (late && Clock::now() >= *until)) {
        idle_waiting_ = false;
        break;
      }
      idle_waiting_ = woken_by_submission;
    }
    pollfd fds[2] = {{wake_fd_, POLLIN, 0}, {ready_fd, POLLIN, 0}};
    // Unbounded when idle with a readiness fd; without one the transport is looked at every
    // kIdlePollMsWithoutFd. (A time already passed gives a zero timeout: the loop then ends.)
    const Clock::duration cap =
        ready_fd >= 0 ? Clock::duration::max()
                      : Clock::duration(std::chrono::milliseconds(kIdlePollMsWithoutFd));
    std::optional<timespec> timeout;
    if (late || ready_fd < 0) {
      timeout =
          timeout_until(late ? *until : Clock::time_point::max(), cap).value_or(timespec{0, 0});
    }
    ::ppoll(fds, ready_fd >= 0 ? 2 : 1, timeout ? &*timeout : nullptr, nullptr);
    drain_signal();
    channel_->progress_now();
  }
  bool stopping;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    stopping = stop_;
  }
  if (stopping) {
    // Every rank is idle and expects a message from this one: a BYE there lets the peers stop
    // quietly, where a vanished connection would be a failure that aborts them all.
    channel_->say_bye(next, -1);
    throw Stopped{};
  }
  check_stop();
  channel_->wake(next);
}

void FusionEngine::erase_pending(const LocalUnit& unit, std::string_view key) {
  if (unit.slot >= 0 && by_slot_[unit.slot] == &unit) by_slot_[unit.slot] = nullptr;
  pending_.erase(key);
}

void FusionEngine::fail_pending(const std::string& key, Status status, const std::string& message) {
  auto it = pending_.find(key);
  if (it == pending_.end()) return;
  std::shared_ptr<Request> request = std::move(it->second.request);
  erase_pending(it->second, request->spec().key());
  {
    std::lock_guard<std::mutex> lock(mutex_);
    for (const Member& member : request->spec().members) in_flight_.erase(member.name);
    ++requests_failed_;
  }
  if (timeline_) {
    timeline_->instant(timeline_->row(key), "ERROR", Clock::now(),
                       Timeline::error_args(status, message));
  }
  request->complete(status, message);
}

// One lock of the queue for the whole batch, which the application's threads take to submit,
// rather than two locks per request.
void FusionEngine::complete_batch(const std::vector<LocalUnit*>& units, const Batch& batch) {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    for (const LocalUnit* unit : units) {
      if (unit->phantom) continue;
      for (const Member& member : unit->request->spec().members) in_flight_.erase(member.name);
      ++requests_completed_;
    }
  }
  // Every request is complete before any waiter wakes: an application that waits for its
  // requests in an order of its own, woken by the first, would otherwise often find the next one
  // still pending and sleep again, a wake-up each time.
  completed_.clear();
  for (size_t i = 0; i < units.size(); ++i) {
    if (units[i]->phantom) continue;
    std::shared_ptr<Request>& request = completed_.emplace_back(std::move(units[i]->request));
    erase_pending(*units[i], request->spec().key());  // units[i] is gone
    // An allgather runs alone, its scheduled spec (never a cache hit) in the response.
    request->complete(Status::kSuccess, "",
                      request->spec().kind == Kind::kAllgather ? batch.units[i].spec.gather_counts
                                                               : std::vector<uint64_t>(),
                      false);
  }
  for (const std::shared_ptr<Request>& request : completed_) request->wake_waiters();
  completed_.clear();
}

void FusionEngine::fail_everything(const Error& error) {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (!failure_) failure_ = error;  // from now on a submission fails at once
  }
  if (!pending_.empty()) {
    log::info("fusion engine: failing {} request(s) in negotiation: {}", pending_.size(),
              error.what());
  }
  std::vector<std::string> keys;
  for (const auto& [key, unit] : pending_) keys.emplace_back(key);
  for (const std::string& key : keys) {
    fail_pending(key, error.status(),
                 fmt::format("{}: {}", describe(pending_.at(key).request->spec()), error.what()));
  }
  fail_queued(error);
}

void FusionEngine::fail_queued(const Error& error) {
  std::vector<std::shared_ptr<Request>> queued;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (!failure_) failure_ = error;
    queued.swap(queue_);
  }
  join_done_.notify_all();
  if (!queued.empty()) {
    log::info("fusion engine: failing {} queued request(s): {}", queued.size(), error.what());
  }
  for (auto& request : queued) {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      for (const Member& member : request->spec().members) in_flight_.erase(member.name);
      ++requests_failed_;
    }
    request->complete(error.status(),
                      fmt::format("{}: {}", describe(request->spec()), error.what()));
  }
}

}  // namespace kolo::fusion
