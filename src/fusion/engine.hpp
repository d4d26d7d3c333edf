// The fusion engine of a communicator: named asynchronous operations, negotiated, fused and run
// by a background thread on connections of its own. See engine.cpp for how it works. This class
// is the application side (submission, the queue, completion) and the engine thread's cycle; the
// NegotiationChannel (negotiation.hpp) carries a cycle's messages, the Coordinator
// (coordinator.hpp) answers them on rank 0, the Executor (executor.hpp) runs what they schedule,
// and the Timeline (timeline.hpp) writes the trace.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <thread>
#include <unordered_map>
#include <unordered_set>
#include <vector>

#include "core/config.hpp"
#include "core/op_descriptor.hpp"
#include "fusion/cache.hpp"
#include "fusion/coordinator.hpp"
#include "fusion/executor.hpp"
#include "fusion/request.hpp"
#include "fusion/wire.hpp"
#include "ring/ring.hpp"
#include "transport/transport.hpp"

namespace kolo {
namespace fusion {

class Autotuner;
class Coordinator;
class NegotiationChannel;
class Timeline;
struct Arrival;

// Counters of one rank's engine, for tests, benchmarks and tuning (kolo_comm_fusion_stats).
struct FusionStats {
  uint64_t cycles = 0;               // negotiation cycles this rank took part in
  uint64_t idle_sleeps = 0;          // times every rank was idle and the engine slept
  uint64_t tensors_submitted = 0;    // group members count one each
  uint64_t requests_completed = 0;   // successfully
  uint64_t requests_failed = 0;      // with an error, cancellation included
  uint64_t negotiated = 0;           // units agreed through full specs sent to rank 0
  uint64_t cache_hits = 0;           // units agreed through the ready bits alone
  uint64_t collectives = 0;          // collectives the engine ran
  uint64_t fused_collectives = 0;    // of which through the fusion buffer
  uint64_t tensors_fused = 0;        // tensors that went through the fusion buffer
  uint64_t bytes_copied = 0;         // into and out of the fusion buffer
  uint64_t fusion_buffer_bytes = 0;  // its size now
  // The settings in force on this rank, and how many responses carried the autotuner's
  // (autotune.hpp).
  uint64_t autotune_updates = 0;
  bool autotune_settled = false;  // the autotuner sent its final settings
  uint64_t fusion_threshold = 0;
  double cycle_time_ms = 0;
  uint64_t segment_bytes = 0;
  // Where the engine's thread spent its time (wall clock): inside collectives, copying into and
  // out of the fusion buffer, and in negotiation cycles (building this rank's list, the exchange
  // with rank 0 and the wait for the slowest rank in it, rank 0's planning).
  uint64_t collective_ns = 0;
  uint64_t copy_ns = 0;
  uint64_t negotiation_ns = 0;
};

// One tensor of a named call, in the caller's memory (which must stay valid until the request
// completes): for allreduce and allgather `send` is read and `recv` written; a broadcast works in
// `recv` alone. For an allgather `count` is this rank's share.
struct NamedTensor {
  std::string name;
  const void* send = nullptr;
  void* recv = nullptr;
  uint64_t count = 0;
};

// What every named call may add: scale factors (allreduce only) and a completion callback.
struct SubmitOptions {
  double prescale = 1.0;
  double postscale = 1.0;
  Request::Callback callback;
};

class FusionEngine : public std::enable_shared_from_this<FusionEngine> {
 public:
  // Connects the engine's own mesh, called once from the engine thread: the communicator gives
  // one that connects under a context of the engine's own (comm/connect.hpp), so that the
  // engine's connections are told apart from the communicator's and from other engines'.
  using Connector = std::function<Links()>;

  // Nothing starts until the first submission.
  FusionEngine(const Config& config, Connector connect);
  ~FusionEngine();
  FusionEngine(const FusionEngine&) = delete;
  FusionEngine& operator=(const FusionEngine&) = delete;

  // The named calls (capi/kolo.h documents each). Each queues its operation and returns at once;
  // throws kolo::Error: kInvalidArgument (bad arguments, or a name that is already pending on
  // this rank), kUnsupported (device memory), or the engine's failure once it is broken. The
  // first call starts the engine thread, which connects to the peers. Several tensors make a
  // group: reduced together, completed as one request; their names are moved out.
  std::shared_ptr<Request> allreduce(std::span<NamedTensor> tensors, DataType dtype, ReduceOp op,
                                     SubmitOptions options);
  std::shared_ptr<Request> broadcast(NamedTensor tensor, DataType dtype, int root,
                                     SubmitOptions options);
  std::shared_ptr<Request> allgather(NamedTensor tensor, uint64_t recv_capacity, DataType dtype,
                                     SubmitOptions options);

  // kolo_join: this rank has no more to submit until every rank has joined. Until then it takes
  // part in what the others submit with zeros (engine.cpp, "Join"), and its own submissions are
  // refused. Blocks until every rank has joined and returns the rank that joined last; throws
  // kolo::Error: the engine's failure, or kTimeout after KOLO_TIMEOUT (the rank stays joined, and
  // a later join() waits on).
  int join();

  // The communicator broke (a lost peer, a mismatch in an ordered call): every pending and later
  // request fails with this error, and the peers' engines are told.
  void communicator_failed(const Error& error);

  // Bytes per fused collective from the next cycle on; 0 disables fusion. Rank 0 plans the
  // fusion for every rank, so its value is the one that counts; while rank 0 autotunes
  // (KOLO_AUTOTUNE), the autotuner's threshold counts instead. Throws kInvalidArgument above
  // kMaxFusionThresholdBytes.
  void set_fusion_threshold(uint64_t bytes);
  FusionStats stats() const;
  // What the engine is doing, for the report of who is stuck (comm/report.hpp): the names in
  // flight on this rank, what its thread last started to wait for or run, and on rank 0 the
  // pending names some ranks have not submitted. Safe from any thread, even while the engine's
  // thread is stuck.
  std::string report() const;

  // Stops the engine thread (at the end of the collective it may be running; connecting is not
  // waited for), then fails every request still pending with kCancelled. Called when the
  // communicator is destroyed; idempotent. Called on the engine's own thread (from a completion
  // callback) it waits for nothing: the thread stops once the callback has returned, and fails
  // what is still pending itself.
  void shutdown();

 private:
  struct LocalUnit {
    std::shared_ptr<Request> request;
    bool announced = false;  // its spec went to rank 0 (not a cache hit)
    bool phantom = false;    // a joined rank's stand-in (execute()), not in pending_
    int32_t slot = -1;       // the cache slot whose bit it set in this cycle's list, or -1
    uint64_t scheduled = 0;  // the last cycle whose response scheduled it
  };
  struct Stopped {};  // thrown inside the engine thread when shutdown() asks it to stop
  enum class State { kNotStarted, kConnecting, kRunning, kFinished };

  // Queues a named operation, checked first (what the calls above build).
  std::shared_ptr<Request> submit(UnitSpec spec, std::vector<MemberBuffers> buffers,
                                  Request::Callback callback);

  // Starts the engine thread on the first submission or join (under mutex_).
  void start_thread();
  // shutdown()'s last step: fails the queued requests, and the pending ones if `pending` (those
  // belong to the engine's thread, which must have stopped), with kCancelled.
  void cancel_remaining(bool pending);
  void run();
  void connect();
  void loop();
  void run_cycle();
  RequestList build_requests();
  // Rank 0: hands the coordinator the alone size measured so far (fusion_cost.hpp).
  void update_alone_bytes();
  void execute(const ResponseList& response, Clock::time_point received,
               const std::vector<Arrival>& arrivals);
  // Settings from a response, before its batches (every rank at the same point).
  void apply(const EngineSettings& settings);
  // Rank 0, autotuning: measures the cycle that just ended, and may choose the next settings.
  void tune(bool idle, Clock::time_point now);
  // Takes a unit, whose request the caller has taken, out of pending_ and by_slot_.
  void erase_pending(const LocalUnit& unit, std::string_view key);
  // Fails the pending unit `key`, if there is one.
  void fail_pending(const std::string& key, Status status, const std::string& message);
  // Completes the units of a batch that ran to the end (`units` in the batch's order).
  void complete_batch(const std::vector<LocalUnit*>& units, const Batch& batch);
  void fail_everything(const Error& error);
  // Fails the requests not yet taken from the queue (all of them while connecting); any thread.
  void fail_queued(const Error& error);
  // After an idle response (until: none), or one that found some rank late (until: when to ask
  // again): sleeps until a message from a peer, this rank's own submission or the time says to
  // start the next cycle, then starts it with the wake-up (negotiation.hpp).
  void idle_wait(std::optional<Clock::time_point> until);
  void sleep_until(Clock::time_point when);
  void check_stop();
  void signal();
  void drain_signal();

  const Config config_;
  const Connector connect_;
  const int rank_;
  const int size_;
  std::atomic<uint64_t> fusion_threshold_;
  int wake_fd_ = -1;  // eventfd: a submission while idle, shutdown, failure

  // Shared with the application's threads.
  mutable std::mutex mutex_;
  std::vector<std::shared_ptr<Request>> queue_;  // submitted, not yet seen by the engine
  // The member names of every pending request, viewing the names in the requests (queued or
  // pending, so alive until complete_batch() or a failure takes them out of here).
  std::unordered_set<std::string_view> in_flight_;
  // FusionStats' three counters of requests, kept where this lock is held anyway.
  uint64_t tensors_submitted_ = 0;
  uint64_t requests_completed_ = 0;
  uint64_t requests_failed_ = 0;
  std::optional<Error> failure_;                 // broken: every submission fails with it
  std::optional<Error> outside_failure_;         // the communicator broke
  State state_ = State::kNotStarted;
  bool stop_ = false;
  bool shut_down_ = false;
  // shutdown() was called on the engine's own thread (from a completion callback), which then
  // cancels what is left itself once it has stopped.
  bool cancel_when_stopped_ = false;
  bool idle_waiting_ = false;          // asleep in idle_wait(), and nothing has signalled it since
  bool joining_ = false;               // join() was called and not every rank has joined
  std::optional<int> join_result_;     // the last rank to join, once every rank has
  std::condition_variable join_done_;  // join_result_ set, or failure_
  std::thread thread_;
  mutable std::mutex stats_mutex_;
  FusionStats stats_;
  mutable std::mutex activity_mutex_;  // guards the three below, written by the engine's thread
  std::string activity_ = "not started";
  // Running a batch: formatted only when a report asks (a batch is often a single tensor).
  struct Running {
    uint64_t cycle;
    std::shared_ptr<const Request> first;
    size_t more;  // the batch's other units
  };
  std::optional<Running> running_;  // set instead of activity_ while a batch runs
  std::string waiting_ranks_;  // rank 0: names submitted by some ranks only (the coordinator's)
  void set_activity(std::string activity);
  void set_running(std::shared_ptr<const Request> first, size_t more);

  // The engine thread's own.
  std::unique_ptr<Transport> transport_;
  std::unique_ptr<Ring> ring_;
  ResponseCache cache_;
  std::unique_ptr<NegotiationChannel> channel_;
  std::unique_ptr<Coordinator> coordinator_;  // rank 0
  std::unique_ptr<Autotuner> autotuner_;      // rank 0 with KOLO_AUTOTUNE=1
  std::optional<EngineSettings> announce_;    // rank 0: settings for the next response
  uint64_t payload_seen_ = 0;                 // rank 0: the executor's payload bytes, measured
  Clock::duration cycle_time_{};
  std::unique_ptr<Timeline> timeline_;
  Executor executor_;
  uint32_t cycles_row_ = 0;
  // By key, viewing the key in the unit's request (which the unit holds).
  std::unordered_map<std::string_view, LocalUnit> pending_;
  // [slot]: the pending unit whose bit this cycle's list set (build_requests), so that a response's
  // cache hits find their units without a lookup by name; `marked_` lists the slots set.
  std::vector<LocalUnit*> by_slot_;
  std::vector<uint32_t> marked_;
  std::vector<std::shared_ptr<Request>> taken_;  // build_requests: queue_'s last contents
  std::vector<std::shared_ptr<Request>> completed_;  // complete_batch: its requests
  uint64_t cycle_ = 0;
  bool joined_announced_ = false;     // rank 0 has been told that this rank joined
  Clock::time_point last_summary_{};  // rank 0: when waiting_ranks_ was last refreshed
  bool idle_ = false;
  // After a response with work pending on some rank but nothing ready on all (a rank is late):
  // how soon the next cycle starts, doubled each time up to the cycle time; zero otherwise.
  Clock::duration late_rank_retry_{};
  // The cycle ran collectives and this rank still had work afterwards: the next starts at once.
  bool again_ = false;
  // This rank had no unit pending in the cycle just run (it is the late one, if any is).
  bool had_nothing_ = false;
  // build_requests left units unannounced (the announcement budget): the next cycle must come.
  bool unannounced_ = false;
  uint64_t logged_alone_bytes_ = kAloneBytes;  // rank 0: the alone size last logged
};

}  // namespace fusion
}  // namespace kolo
