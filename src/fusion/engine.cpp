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
// of one program. Application threads only queue requests; all communication and every access to
// the caller's buffers happens on the engine thread.
//
// A cycle (every KOLO_CYCLE_TIME_MS while there is work):
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
// to unfused ones for every dtype and op. A batch of one tensor (a broadcast, a tensor of a
// megabyte or more, or anything when fusion is off) runs in place in the caller's buffers. The
// engine always uses the ring schedule, whatever the size, so that a tensor's result never
// depends on what it was batched with (kolo_allreduce uses recursive doubling for small buffers,
// whose results may differ in the last bit).
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
// Failures. Transport errors (a lost peer, a timeout) break the engine: every pending and queued
// request fails with the error, which names the rank, and so does every later submission. The
// transport tells the peers' engines (an ABORT frame), so they fail with the same message. When
// the communicator's own transport breaks, the communicator tells the engine, which does the same.
// Destroying the communicator stops the engine thread at the end of the collective it may be
// running (every collective it starts, every rank runs to the end) and fails what is left with
// KOLO_ERR_CANCELLED.
#include "fusion/engine.hpp"

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <poll.h>
#include <sys/eventfd.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>

#include "core/arguments.hpp"
#include "core/log.hpp"
#include "fusion/coordinator.hpp"
#include "fusion/fused_layout.hpp"
#include "fusion/timeline.hpp"
#include "gpu/gpu.hpp"
#include "ring/algorithms.hpp"
#include "ring/ring.hpp"

namespace kolo::fusion {
namespace {

// Announcements sent per cycle are bounded so that the message stays far below kMaxPayloadBytes;
// the rest wait a cycle.
constexpr size_t kAnnouncementBudget = kMaxPayloadBytes / 2;
// How often waits inside a cycle look at a stop request.
constexpr double kStopCheckSeconds = 0.05;
// With a transport that has no readiness fd, idle ranks look at it this often.
constexpr int kIdlePollMsWithoutFd = 2;

const char* call_name(const UnitSpec& spec) {
  if (spec.kind == Kind::kBroadcast) return "kolo_broadcast_async";
  if (spec.kind == Kind::kAllgather) return "kolo_allgather_async";
  return spec.members.size() > 1 ? "kolo_allreduce_group_async" : "kolo_allreduce_async";
}

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
  std::vector<Region> outputs;
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

UnitSpec single_tensor_spec(Kind kind, DataType dtype, NamedTensor& tensor) {
  UnitSpec spec;
  spec.kind = kind;
  spec.dtype = dtype;
  spec.members.push_back({std::move(tensor.name), tensor.count});
  return spec;
}

std::string collective_args(uint64_t sequence, size_t tensors, uint64_t bytes, const UnitSpec& spec,
                            bool fused) {
  if (spec.kind == Kind::kBroadcast) {
    return fmt::format("{{\"collective\":{},\"bytes\":{},\"dtype\":\"{}\",\"root\":{}}}", sequence,
                       bytes, dtype_name(spec.dtype), spec.root);
  }
  if (spec.kind == Kind::kAllgather) {
    return fmt::format("{{\"collective\":{},\"bytes\":{},\"dtype\":\"{}\"}}", sequence, bytes,
                       dtype_name(spec.dtype));
  }
  return fmt::format(
      "{{\"collective\":{},\"tensors\":{},\"bytes\":{},\"dtype\":\"{}\",\"op\":\"{}\",\"fused\":{}}"
      "}",
      sequence, tensors, bytes, dtype_name(spec.dtype), op_name(spec.op), fused);
}

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

FusionEngine::FusionEngine(const Config& config, Connector connect)
    : config_(config),
      connect_(std::move(connect)),
      rank_(config.rank),
      size_(config.size),
      fusion_threshold_(config.fusion_threshold_bytes),
      cache_(static_cast<uint32_t>(config.cache_capacity)) {
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

std::shared_ptr<Request> FusionEngine::allreduce(std::vector<NamedTensor> tensors, DataType dtype,
                                                 ReduceOp op, SubmitOptions options) {
  UnitSpec spec;
  spec.kind = Kind::kAllreduce;
  spec.dtype = dtype;
  spec.op = op;
  spec.prescale = options.prescale;
  spec.postscale = options.postscale;
  std::vector<MemberBuffers> buffers;
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
  const size_t tensors = spec.members.size();
  auto request = std::make_shared<Request>(std::move(spec), std::move(buffers), std::move(callback),
                                           config_.timeout_s);
  bool wake;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (failure_) throw *failure_;
    for (const Member& member : request->spec().members) {
      if (in_flight_.count(member.name)) {
        throw Error(Status::kInvalidArgument,
                    fmt::format("{}: tensor '{}' is already pending on rank {}; a name can be "
                                "submitted again once its request has completed",
                                call_name(request->spec()), member.name, rank_));
      }
    }
    if (state_ == State::kNotStarted) {
      thread_ = std::thread([self = shared_from_this()] { self->run(); });
      state_ = State::kConnecting;
    }
    for (const Member& member : request->spec().members) in_flight_.insert(member.name);
    queue_.push_back(request);
    wake = idle_waiting_;
  }
  {
    std::lock_guard<std::mutex> lock(stats_mutex_);
    stats_.tensors_submitted += tensors;
  }
  if (wake) signal();
  return request;
}

void FusionEngine::communicator_failed(const Error& error) {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (failure_ || outside_failure_) return;
    if (state_ == State::kNotStarted) {
      failure_ = error;
      return;
    }
    outside_failure_ = error;
  }
  signal();
}

FusionStats FusionEngine::stats() const {
  std::lock_guard<std::mutex> lock(stats_mutex_);
  return stats_;
}

void FusionEngine::shutdown() {
  bool connecting;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (shut_down_) return;
    shut_down_ = true;
    stop_ = true;
    connecting = state_ == State::kConnecting;
    if (!failure_) {
      failure_.emplace(Status::kCancelled,
                       fmt::format("the communicator was destroyed on rank {}", rank_));
    }
  }
  signal();
  if (thread_.joinable()) {
    // Connecting waits for every peer and cannot be interrupted: the thread finishes it on its
    // own (within KOLO_TIMEOUT), sees the stop request and exits, holding the engine alive.
    if (connecting) {
      thread_.detach();
    } else {
      thread_.join();
    }
  }
  const std::string why =
      fmt::format("the communicator was destroyed on rank {} before the request completed", rank_);
  if (!connecting) {
    std::vector<std::string> keys;
    for (const auto& [key, unit] : pending_) keys.push_back(key);
    for (const std::string& key : keys) {
      finish(key, Status::kCancelled,
             fmt::format("{}: {}", describe(pending_.at(key).request->spec()), why));
    }
  }
  std::vector<std::shared_ptr<Request>> queued;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    queued.swap(queue_);
    in_flight_.clear();
  }
  for (auto& request : queued) {
    {
      std::lock_guard<std::mutex> lock(stats_mutex_);
      ++stats_.requests_failed;
    }
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
    if (transport_ && !transport_->failure()) transport_->abort(error);
    fail_everything(error);
  } catch (const std::exception& error) {
    Error internal(Status::kInternal,
                   fmt::format("the fusion engine of rank {} failed: {}", rank_, error.what()));
    if (transport_ && !transport_->failure()) transport_->abort(internal);
    fail_everything(internal);
  }
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
  if (rank_ == 0) {
    coordinator_ = std::make_unique<Coordinator>(
        CoordinatorSettings{size_, config_.stall_warning_s, config_.stall_abort_s}, cache_);
  }
  const size_t peers = static_cast<size_t>(size_);
  in_headers_.resize(peers);
  in_payloads_.resize(peers);
  out_header_transfers_.resize(peers);
  out_payload_transfers_.resize(peers);
  in_header_transfers_.resize(peers);
  in_payload_transfers_.resize(peers);
  wake_transfers_.resize(peers);
  if (!config_.timeline_path.empty()) {
    try {
      timeline_ =
          std::make_unique<Timeline>(Timeline::path_for_rank(config_.timeline_path, rank_), rank_);
      cycles_row_ = timeline_->row("cycles");
    } catch (const Error& error) {
      log::warn("{}; running without a timeline", error.what());
    }
  }
  log::info(
      "fusion engine: rank {} connected ({} ranks, cycle {} ms, fusion threshold {} bytes, "
      "cache {} entries)",
      rank_, size_, config_.cycle_time_ms, fusion_threshold_.load(), cache_.capacity());
}

void FusionEngine::loop() {
  const auto cycle_time = std::chrono::duration_cast<Clock::duration>(
      std::chrono::duration<double, std::milli>(config_.cycle_time_ms));
  Clock::time_point next = Clock::now();
  for (;;) {
    if (idle_) {
      idle_wait();
      idle_ = false;
    } else {
      sleep_until(next);
    }
    next = Clock::now() + cycle_time;
    run_cycle();
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
    auto left = std::chrono::duration_cast<std::chrono::nanoseconds>(when - Clock::now()).count();
    if (left <= 0) return;
    timespec timeout{static_cast<time_t>(left / 1000000000), static_cast<long>(left % 1000000000)};
    pollfd wake{wake_fd_, POLLIN, 0};
    ::ppoll(&wake, 1, &timeout, nullptr);
    drain_signal();
  }
}

// Progresses the transport until done(); a stop request or an outside failure interrupts it, and
// KOLO_TIMEOUT bounds it (what() then names what was awaited, such as "the requests of rank 3").
template <typename Done, typename Describe>
void FusionEngine::wait_for(Done&& done, Describe&& what) {
  Deadline deadline(config_.timeout_s);
  while (!done()) {
    check_stop();
    if (deadline.expired()) {
      Error error(Status::kTimeout,
                  fmt::format("fusion engine: rank {} waited {} s for {} in negotiation cycle {} "
                              "(KOLO_TIMEOUT)",
                              rank_, config_.timeout_s, what(), cycle_));
      transport_->abort(error);
      throw error;
    }
    transport_->progress(Deadline(std::min(kStopCheckSeconds, deadline.remaining_s())));
  }
}

OpDescriptor FusionEngine::control_descriptor(MessageKind kind, uint64_t cycle) const {
  // Negotiation messages travel as "barriers" numbered by cycle: the transport checks that both
  // sides expect the same message, like every other.
  OpDescriptor descriptor;
  descriptor.collective = Collective::kBarrier;
  descriptor.dtype = DataType::kUInt8;
  descriptor.count = static_cast<uint64_t>(kind);
  descriptor.sequence = cycle;
  return descriptor;
}

MessageHeader FusionEngine::header(MessageKind kind, uint64_t cycle, uint64_t payload_bytes) const {
  MessageHeader header;
  header.kind = static_cast<uint8_t>(kind);
  header.cache_capacity = cache_.capacity();
  header.cycle = cycle;
  header.payload_bytes = payload_bytes;
  return header;
}

void FusionEngine::check_header(const MessageHeader& header, MessageKind kind, uint64_t cycle,
                                int from) const {
  if (header.magic == kMessageMagic && header.kind == static_cast<uint8_t>(MessageKind::kBye)) {
    throw Error(Status::kPeerLost,
                fmt::format("rank {} destroyed its communicator while rank {} still had named "
                            "operations to run with it",
                            from, rank_));
  }
  if (header.magic != kMessageMagic || header.kind != static_cast<uint8_t>(kind) ||
      header.cycle != cycle || header.payload_bytes > kMaxPayloadBytes) {
    throw Error(Status::kInternal,
                fmt::format("fusion engine: rank {} sent rank {} a malformed negotiation header "
                            "(magic {:#x}, kind {} where {} was expected, cycle {} of {}, {} "
                            "payload bytes)",
                            from, rank_, header.magic, header.kind, static_cast<int>(kind),
                            header.cycle, cycle, header.payload_bytes));
  }
  if (header.cache_capacity != cache_.capacity()) {
    throw Error(Status::kConfig,
                fmt::format("KOLO_CACHE_CAPACITY differs between ranks: rank {} has {} but rank "
                            "{} has {}; set the same value on every rank",
                            rank_, cache_.capacity(), from, header.cache_capacity));
  }
}

void FusionEngine::run_cycle() {
  ++cycle_;
  const Clock::time_point started = Clock::now();
  RequestList mine = build_requests();
  const size_t announced = mine.announcements.size();
  std::vector<Arrival> arrivals;
  ResponseList response =
      rank_ == 0 ? exchange_as_coordinator(std::move(mine), &arrivals) : exchange_as_member(mine);
  const Clock::time_point received = Clock::now();
  execute(response, received, arrivals);
  idle_ = response.idle;
  {
    std::lock_guard<std::mutex> lock(stats_mutex_);
    ++stats_.cycles;
    if (idle_) ++stats_.idle_sleeps;
  }
  if (timeline_) {
    if (announced > 0 || !response.batches.empty() || !response.errors.empty()) {
      timeline_->span(
          cycles_row_, "CYCLE", started, received,
          fmt::format("{{\"cycle\":{},\"announced\":{},\"collectives\":{},"
                      "\"errors\":{}}}",
                      cycle_, announced, response.batches.size(), response.errors.size()));
    }
    if (idle_) timeline_->instant(cycles_row_, "IDLE", Clock::now());
  }
}

RequestList FusionEngine::build_requests() {
  std::vector<std::shared_ptr<Request>> fresh;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    fresh.swap(queue_);
  }
  for (auto& request : fresh) {
    std::string key = request->spec().key();
    pending_.emplace(std::move(key), LocalUnit{std::move(request), false});
  }
  RequestList list;
  if (cache_.capacity() > 0) list.ready_words.assign((cache_.capacity() + 63) / 64, 0);
  std::vector<LocalUnit*> uncached;
  for (auto& [key, unit] : pending_) {
    if (unit.announced) continue;
    int32_t slot = cache_.find(unit.request->spec());
    if (slot >= 0) {
      list.ready_words[slot / 64] |= uint64_t{1} << (slot % 64);
    } else {
      uncached.push_back(&unit);
    }
  }
  std::sort(uncached.begin(), uncached.end(), [](const LocalUnit* a, const LocalUnit* b) {
    return a->request->submitted() < b->request->submitted();
  });
  size_t budget = kAnnouncementBudget;
  for (LocalUnit* unit : uncached) {
    size_t bytes = encoded_size(unit->request->spec());
    if (bytes > budget) break;  // the rest next cycle
    budget -= bytes;
    list.announcements.push_back(unit->request->spec());
    unit->announced = true;
  }
  return list;
}

ResponseList FusionEngine::exchange_as_member(const RequestList& mine) {
  encode(mine, out_payload_);
  out_header_ = header(MessageKind::kRequests, cycle_, out_payload_.size());
  const OpDescriptor requests = control_descriptor(MessageKind::kRequests, cycle_);
  const OpDescriptor responses = control_descriptor(MessageKind::kResponses, cycle_);
  Transfer& send_header = out_header_transfers_[0];
  Transfer& send_payload = out_payload_transfers_[0];
  Transfer& receive_header = in_header_transfers_[0];
  Transfer& receive_payload = in_payload_transfers_[0];
  const bool sends_payload = !out_payload_.empty();
  send_header.reset(0, requests, &out_header_, sizeof(out_header_));
  transport_->post_send(send_header);
  if (sends_payload) {
    send_payload.reset(0, requests, out_payload_.data(), out_payload_.size());
    transport_->post_send(send_payload);
  }
  // After an idle cycle, rank 0's WAKE comes first (its receive is already posted).
  receive_header.reset(0, responses, &in_headers_[0], sizeof(MessageHeader));
  transport_->post_recv(receive_header);
  wait_for(
      [&] {
        // Rank 0 may have left while this rank was waking up: its BYE then stands for the WAKE.
        if (wake_posted_ && wake_transfers_[0].complete) {
          check_header(wake_header_, MessageKind::kWake, cycle_, 0);
        }
        return receive_header.complete;
      },
      [] { return std::string("rank 0's response"); });
  check_header(in_headers_[0], MessageKind::kResponses, cycle_, 0);
  const uint64_t bytes = in_headers_[0].payload_bytes;
  in_payloads_[0].resize(bytes);
  if (bytes > 0) {
    receive_payload.reset(0, responses, in_payloads_[0].data(), bytes);
    transport_->post_recv(receive_payload);
    wait_for([&] { return receive_payload.complete; },
             [] { return std::string("rank 0's response"); });
  }
  wait_for(
      [&] {
        return send_header.complete && (!sends_payload || send_payload.complete) &&
               (!wake_posted_ || wake_transfers_[0].complete);
      },
      [] { return std::string("rank 0 to take this rank's requests"); });
  if (wake_posted_) {
    check_header(wake_header_, MessageKind::kWake, cycle_, 0);
    wake_posted_ = false;
  }
  try {
    return decode_responses(in_payloads_[0].data(), bytes, size_, cache_.capacity());
  } catch (const Error& error) {
    throw Error(error.status(),
                fmt::format("fusion engine: rank 0 sent rank {} a {}", rank_, error.what()));
  }
}

ResponseList FusionEngine::exchange_as_coordinator(RequestList mine,
                                                   std::vector<Arrival>* arrivals) {
  const OpDescriptor requests = control_descriptor(MessageKind::kRequests, cycle_);
  const OpDescriptor responses = control_descriptor(MessageKind::kResponses, cycle_);
  if (!requests_posted_) {
    for (int peer = 1; peer < size_; ++peer) {
      in_header_transfers_[peer].reset(peer, requests, &in_headers_[peer], sizeof(MessageHeader));
      transport_->post_recv(in_header_transfers_[peer]);
    }
  }
  requests_posted_ = false;
  std::vector<bool> payload_posted(static_cast<size_t>(size_), false);
  auto all_received = [&] {
    bool all = true;
    for (int peer = 1; peer < size_; ++peer) {
      if (!payload_posted[peer]) {
        if (!in_header_transfers_[peer].complete) {
          all = false;
          continue;
        }
        check_header(in_headers_[peer], MessageKind::kRequests, cycle_, peer);
        const uint64_t bytes = in_headers_[peer].payload_bytes;
        in_payloads_[peer].resize(bytes);
        if (bytes > 0) {
          in_payload_transfers_[peer].reset(peer, requests, in_payloads_[peer].data(), bytes);
          transport_->post_recv(in_payload_transfers_[peer]);
        }
        payload_posted[peer] = true;
      }
      if (in_headers_[peer].payload_bytes > 0 && !in_payload_transfers_[peer].complete) {
        all = false;
      }
    }
    return all;
  };
  auto missing = [&] {
    std::vector<int> ranks;
    for (int peer = 1; peer < size_; ++peer) {
      if (!payload_posted[peer] ||
          (in_headers_[peer].payload_bytes > 0 && !in_payload_transfers_[peer].complete)) {
        ranks.push_back(peer);
      }
    }
    return "the requests of " + format_ranks(ranks);
  };
  wait_for(all_received, missing);

  std::vector<RequestList> lists(static_cast<size_t>(size_));
  lists[0] = std::move(mine);
  for (int peer = 1; peer < size_; ++peer) {
    try {
      lists[peer] = decode_requests(in_payloads_[peer].data(), in_payloads_[peer].size(), size_,
                                    cache_.capacity());
    } catch (const Error& error) {
      throw Error(error.status(),
                  fmt::format("fusion engine: rank {} sent rank 0 a {}", peer, error.what()));
    }
  }
  ResponseList response = coordinator_->process(cycle_, lists, fusion_threshold_.load(),
                                                Clock::now(), timeline_ ? arrivals : nullptr);
  encode(response, out_payload_);
  if (out_payload_.size() > kMaxPayloadBytes) {
    throw Error(Status::kInternal,
                fmt::format("fusion engine: a response of {} bytes exceeds the limit of {}",
                            out_payload_.size(), kMaxPayloadBytes));
  }
  out_header_ = header(MessageKind::kResponses, cycle_, out_payload_.size());
  for (int peer = 1; peer < size_; ++peer) {
    out_header_transfers_[peer].reset(peer, responses, &out_header_, sizeof(out_header_));
    transport_->post_send(out_header_transfers_[peer]);
    if (!out_payload_.empty()) {
      out_payload_transfers_[peer].reset(peer, responses, out_payload_.data(), out_payload_.size());
      transport_->post_send(out_payload_transfers_[peer]);
    }
  }
  int unsent = 0;
  wait_for(
      [&] {
        for (int peer = 1; peer < size_; ++peer) {
          if (!out_header_transfers_[peer].complete ||
              (!out_payload_.empty() && !out_payload_transfers_[peer].complete) ||
              (wake_posted_ && !wake_transfers_[peer].complete)) {
            unsent = peer;
            return false;
          }
        }
        return true;
      },
      [&] { return fmt::format("rank {} to take the response", unsent); });
  wake_posted_ = false;
  return response;
}

void FusionEngine::idle_wait() {
  const uint64_t next = cycle_ + 1;
  if (rank_ == 0) {
    const OpDescriptor requests = control_descriptor(MessageKind::kRequests, next);
    for (int peer = 1; peer < size_; ++peer) {
      in_header_transfers_[peer].reset(peer, requests, &in_headers_[peer], sizeof(MessageHeader));
      transport_->post_recv(in_header_transfers_[peer]);
    }
    requests_posted_ = true;
  } else {
    wake_transfers_[0].reset(0, control_descriptor(MessageKind::kWake, next), &wake_header_,
                             sizeof(wake_header_));
    transport_->post_recv(wake_transfers_[0]);
    wake_posted_ = true;
  }
  auto woken = [&] {
    if (rank_ != 0) return wake_transfers_[0].complete;
    for (int peer = 1; peer < size_; ++peer) {
      if (in_header_transfers_[peer].complete) return true;
    }
    return false;
  };
  const int ready_fd = transport_->readiness_fd();
  for (;;) {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      // Units still pending here were not announced yet (the announcement budget): rank 0 cannot
      // know them, so this rank wakes everyone itself.
      if (stop_ || outside_failure_ || !queue_.empty() || !pending_.empty() || woken()) {
        idle_waiting_ = false;
        break;
      }
      idle_waiting_ = true;
    }
    pollfd fds[2] = {{wake_fd_, POLLIN, 0}, {ready_fd, POLLIN, 0}};
    ::poll(fds, ready_fd >= 0 ? 2 : 1, ready_fd >= 0 ? -1 : kIdlePollMsWithoutFd);
    drain_signal();
    transport_->progress(Deadline(0));
  }
  bool stopping;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    stopping = stop_;
  }
  if (stopping) {
    // Every rank is idle and expects a message from this one: a BYE there lets the peers stop
    // quietly, where a vanished connection would be a failure that aborts them all.
    say_bye(next, -1);
    throw Stopped{};
  }
  check_stop();
  if (rank_ != 0 && wake_transfers_[0].complete &&
      wake_header_.kind == static_cast<uint8_t>(MessageKind::kBye)) {
    wake_posted_ = false;
    throw Departed{Error(Status::kPeerLost,
                         fmt::format("rank 0 destroyed its communicator; named operations need "
                                     "every rank (rank {})",
                                     rank_))};
  }
  for (int peer = 1; rank_ == 0 && peer < size_; ++peer) {
    if (in_header_transfers_[peer].complete &&
        in_headers_[peer].kind == static_cast<uint8_t>(MessageKind::kBye)) {
      say_bye(next, peer);
      throw Departed{Error(Status::kPeerLost,
                           fmt::format("rank {} destroyed its communicator; named operations "
                                       "need every rank (rank 0)",
                                       peer))};
    }
  }
  if (rank_ == 0) {
    wake_header_ = header(MessageKind::kWake, next, 0);
    const OpDescriptor wake = control_descriptor(MessageKind::kWake, next);
    for (int peer = 1; peer < size_; ++peer) {
      wake_transfers_[peer].reset(peer, wake, &wake_header_, sizeof(wake_header_));
      transport_->post_send(wake_transfers_[peer]);
    }
    wake_posted_ = true;
  }
}

// A BYE where each peer expects a message while every rank is idle: rank 0 sends it in place of
// the WAKE every other rank awaits, the others in place of the RequestList rank 0 awaits. Best
// effort and brief: a peer that leaves at the same moment may be gone already.
void FusionEngine::say_bye(uint64_t cycle, int departed) noexcept {
  try {
    std::vector<Transfer*> sent;
    if (rank_ == 0) {
      wake_header_ = header(MessageKind::kBye, cycle, 0);
      const OpDescriptor wake = control_descriptor(MessageKind::kWake, cycle);
      for (int peer = 1; peer < size_; ++peer) {
        if (peer == departed) continue;
        wake_transfers_[peer].reset(peer, wake, &wake_header_, sizeof(wake_header_));
        transport_->post_send(wake_transfers_[peer]);
        sent.push_back(&wake_transfers_[peer]);
      }
    } else {
      out_header_ = header(MessageKind::kBye, cycle, 0);
      out_header_transfers_[0].reset(0, control_descriptor(MessageKind::kRequests, cycle),
                                     &out_header_, sizeof(out_header_));
      transport_->post_send(out_header_transfers_[0]);
      sent.push_back(&out_header_transfers_[0]);
    }
    Deadline deadline(1.0);
    auto all_sent = [&] {
      for (const Transfer* transfer : sent) {
        if (!transfer->complete) return false;
      }
      return true;
    };
    while (!all_sent() && !deadline.expired()) {
      transport_->progress(Deadline(std::min(kStopCheckSeconds, deadline.remaining_s())));
    }
  } catch (const Error& error) {
    log::info("fusion engine: could not say goodbye to every peer: {}", error.what());
  }
}

// ---- execution ----------------------------------------------------------------------------------

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
      const UnitSpec* spec =
          scheduled.hit ? cache_.at(static_cast<uint32_t>(scheduled.slot)) : &scheduled.spec;
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
                           fmt::format("{{\"rank\":{}}}", rank));
      }
    }
    for (size_t b = 0; b < units.size(); ++b) {
      for (const LocalUnit* unit : units[b]) {
        const std::string args =
            fmt::format("{{\"cycle\":{},\"cached\":{}}}", cycle_, !unit->announced);
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
                    collective_args(descriptor.sequence, 1, blocks.total * dtype_size(spec.dtype),
                                    spec, false));
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
      timeline_->span(row, spec.kind == Kind::kBroadcast ? "BROADCAST" : "ALLREDUCE", start, end,
                      collective_args(descriptor.sequence, 1,
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
        collective_args(descriptor.sequence, placed.size(), payload, first, true);
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

void FusionEngine::finish(const std::string& key, Status status, const std::string& message,
                          std::vector<uint64_t> gathered_counts) {
  auto it = pending_.find(key);
  if (it == pending_.end()) return;
  std::shared_ptr<Request> request = std::move(it->second.request);
  pending_.erase(it);
  {
    std::lock_guard<std::mutex> lock(mutex_);
    for (const Member& member : request->spec().members) in_flight_.erase(member.name);
  }
  {
    std::lock_guard<std::mutex> lock(stats_mutex_);
    ++(status == Status::kSuccess ? stats_.requests_completed : stats_.requests_failed);
  }
  if (timeline_ && status != Status::kSuccess) {
    timeline_->instant(
        timeline_->row(key), "ERROR", Clock::now(),
        fmt::format("{{\"status\":\"{}\",\"message\":\"{}\"}}",
                    Timeline::escape(status_name(status)), Timeline::escape(message)));
  }
  request->complete(status, message, std::move(gathered_counts));
}

void FusionEngine::fail_everything(const Error& error) {
  std::vector<std::shared_ptr<Request>> queued;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (!failure_) failure_ = error;
    queued.swap(queue_);
  }
  if (!pending_.empty() || !queued.empty()) {
    log::info("fusion engine: failing {} pending request(s): {}", pending_.size() + queued.size(),
              error.what());
  }
  std::vector<std::string> keys;
  for (const auto& [key, unit] : pending_) keys.push_back(key);
  for (const std::string& key : keys) {
    finish(key, error.status(),
           fmt::format("{}: {}", describe(pending_.at(key).request->spec()), error.what()));
  }
  for (auto& request : queued) {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      for (const Member& member : request->spec().members) in_flight_.erase(member.name);
    }
    {
      std::lock_guard<std::mutex> lock(stats_mutex_);
      ++stats_.requests_failed;
    }
    request->complete(error.status(),
                      fmt::format("{}: {}", describe(request->spec()), error.what()));
  }
}

}  // namespace kolo::fusion
