// The fusion engine's negotiation (engine.cpp has the essay): one round trip to rank 0 per cycle
// over the engine's own mesh, the idle sleep and its wake-up, and the goodbye of a rank that
// leaves while every rank is idle. Engine thread only.
//
// Each message is a MessageHeader and, when it says so, a payload (fusion/wire.hpp); the
// transport matches the k-th message between two ranks with the k-th receive, and every message
// carries the descriptor of its cycle and kind, so a rank a cycle ahead or behind is a mismatch,
// never a misread.
#include <fmt/format.h>
#include <poll.h>

#include <algorithm>

#include "core/log.hpp"
#include "fusion/coordinator.hpp"
#include "fusion/engine.hpp"
#include "fusion/timeline.hpp"

namespace kolo::fusion {
namespace {

// Announcements sent per cycle are bounded so that the message stays far below kMaxPayloadBytes;
// the rest wait a cycle.
constexpr size_t kAnnouncementBudget = kMaxPayloadBytes / 2;
// How often waits inside a cycle look at a stop request.
constexpr double kStopCheckSeconds = 0.05;
// With a transport that has no readiness fd, idle ranks look at it this often.
constexpr int kIdlePollMsWithoutFd = 2;

}  // namespace

// Progresses the transport until done(); a stop request or an outside failure interrupts it, and
// KOLO_TIMEOUT bounds it (what() then names what was awaited, such as "the requests of rank 3").
template <typename Done, typename Describe>
void FusionEngine::wait_for(Done&& done, Describe&& what) {
  Deadline deadline(config_.timeout_s);
  if (!done()) set_activity(fmt::format("negotiation cycle {}: waiting for {}", cycle_, what()));
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
  // The transport checks that both sides expect the same message of the same cycle, as it checks
  // every other. A BYE travels under the descriptor of the message it stands in for.
  OpDescriptor descriptor;
  descriptor.collective = Collective::kNegotiation;
  descriptor.dtype = DataType::kUInt8;
  descriptor.detail = static_cast<uint64_t>(kind);
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
    return decode_responses(in_payloads_[0].data(), bytes, size_, cache_);
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

}  // namespace kolo::fusion
