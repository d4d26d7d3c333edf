// The fusion engine's negotiation channel (negotiation.hpp; engine.cpp has the essay).
#include "fusion/negotiation.hpp"

#include <fmt/format.h>

#include <algorithm>

#include "core/log.hpp"
#include "fusion/coordinator.hpp"

namespace kolo::fusion {
namespace {

// How often waits inside a cycle look at a stop request.
constexpr double kStopCheckSeconds = 0.05;

// The transport checks that both sides expect the same message of the same cycle, as it checks
// every other. A BYE travels under the descriptor of the message it stands in for.
OpDescriptor control_descriptor(MessageKind kind, uint64_t cycle) {
  OpDescriptor descriptor;
  descriptor.collective = Collective::kNegotiation;
  descriptor.dtype = DataType::kUInt8;
  descriptor.detail = static_cast<uint64_t>(kind);
  descriptor.sequence = cycle;
  return descriptor;
}

}  // namespace

NegotiationChannel::NegotiationChannel(Transport& transport, int rank, int size,
                                       uint32_t cache_capacity, double timeout_s, Hooks hooks)
    : transport_(transport),
      rank_(rank),
      size_(size),
      cache_capacity_(cache_capacity),
      timeout_s_(timeout_s),
      hooks_(std::move(hooks)),
      in_headers_(static_cast<size_t>(size)),
      in_payloads_(static_cast<size_t>(size)),
      out_header_transfers_(static_cast<size_t>(size)),
      out_payload_transfers_(static_cast<size_t>(size)),
      in_header_transfers_(static_cast<size_t>(size)),
      in_payload_transfers_(static_cast<size_t>(size)),
      wake_transfers_(static_cast<size_t>(size)) {}

// Progresses the transport until done(); the engine's check_stop() interrupts it, and
// KOLO_TIMEOUT bounds it (what() then names what was awaited, such as "the requests of rank 3").
template <typename Done, typename Describe>
void NegotiationChannel::wait_for(uint64_t cycle, Done&& done, Describe&& what) {
  Deadline deadline(timeout_s_);
  if (!done()) {
    hooks_.set_activity(fmt::format("negotiation cycle {}: waiting for {}", cycle, what()));
  }
  while (!done()) {
    hooks_.check_stop();
    if (deadline.expired()) {
      Error error(Status::kTimeout,
                  fmt::format("fusion engine: rank {} waited {} s for {} in negotiation cycle {} "
                              "(KOLO_TIMEOUT)",
                              rank_, timeout_s_, what(), cycle));
      transport_.abort(error);
      throw error;
    }
    transport_.progress(Deadline(std::min(kStopCheckSeconds, deadline.remaining_s())));
  }
}

MessageHeader NegotiationChannel::header(MessageKind kind, uint64_t cycle,
                                         uint64_t payload_bytes) const {
  MessageHeader header;
  header.kind = static_cast<uint8_t>(kind);
  header.cache_capacity = cache_capacity_;
  header.cycle = cycle;
  header.payload_bytes = payload_bytes;
  return header;
}

void NegotiationChannel::check_header(const MessageHeader& header, MessageKind kind, uint64_t cycle,
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
  if (header.cache_capacity != cache_capacity_) {
    throw Error(Status::kConfig,
                fmt::format("KOLO_CACHE_CAPACITY differs between ranks: rank {} has {} but rank "
                            "{} has {}; set the same value on every rank",
                            rank_, cache_capacity_, from, header.cache_capacity));
  }
}

ResponseList NegotiationChannel::exchange(uint64_t cycle, const RequestList& mine,
                                          const ResponseCache& cache) {
  encode(mine, out_payload_);
  out_header_ = header(MessageKind::kRequests, cycle, out_payload_.size());
  const OpDescriptor requests = control_descriptor(MessageKind::kRequests, cycle);
  const OpDescriptor responses = control_descriptor(MessageKind::kResponses, cycle);
  Transfer& send_header = out_header_transfers_[0];
  Transfer& send_payload = out_payload_transfers_[0];
  Transfer& receive_header = in_header_transfers_[0];
  Transfer& receive_payload = in_payload_transfers_[0];
  const bool sends_payload = !out_payload_.empty();
  send_header.reset(0, requests, &out_header_, sizeof(out_header_));
  transport_.post_send(send_header);
  if (sends_payload) {
    send_payload.reset(0, requests, out_payload_.data(), out_payload_.size());
    transport_.post_send(send_payload);
  }
  // After an idle cycle, rank 0's WAKE comes first (its receive is already posted).
  receive_header.reset(0, responses, &in_headers_[0], sizeof(MessageHeader));
  transport_.post_recv(receive_header);
  auto from_rank_0 = [] { return std::string("rank 0's response"); };
  wait_for(
      cycle,
      [&] {
        // Rank 0 may have left while this rank was waking up: its BYE then stands for the WAKE.
        if (wake_posted_ && wake_transfers_[0].complete) {
          check_header(wake_header_, MessageKind::kWake, cycle, 0);
        }
        return receive_header.complete;
      },
      from_rank_0);
  check_header(in_headers_[0], MessageKind::kResponses, cycle, 0);
  const uint64_t bytes = in_headers_[0].payload_bytes;
  in_payloads_[0].resize(bytes);
  if (bytes > 0) {
    receive_payload.reset(0, responses, in_payloads_[0].data(), bytes);
    transport_.post_recv(receive_payload);
    wait_for(
        cycle, [&] { return receive_payload.complete; }, from_rank_0);
  }
  wait_for(
      cycle,
      [&] {
        return send_header.complete && (!sends_payload || send_payload.complete) &&
               (!wake_posted_ || wake_transfers_[0].complete);
      },
      [] { return std::string("rank 0 to take this rank's requests"); });
  if (wake_posted_) {
    check_header(wake_header_, MessageKind::kWake, cycle, 0);
    wake_posted_ = false;
  }
  try {
    return decode_responses(in_payloads_[0].data(), bytes, size_, cache);
  } catch (const Error& error) {
    throw Error(error.status(),
                fmt::format("fusion engine: rank 0 sent rank {} a {}", rank_, error.what()));
  }
}

std::vector<RequestList> NegotiationChannel::gather_requests(uint64_t cycle, RequestList mine) {
  const OpDescriptor requests = control_descriptor(MessageKind::kRequests, cycle);
  if (!requests_posted_) {
    for (int peer = 1; peer < size_; ++peer) {
      in_header_transfers_[peer].reset(peer, requests, &in_headers_[peer], sizeof(MessageHeader));
      transport_.post_recv(in_header_transfers_[peer]);
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
        check_header(in_headers_[peer], MessageKind::kRequests, cycle, peer);
        const uint64_t bytes = in_headers_[peer].payload_bytes;
        in_payloads_[peer].resize(bytes);
        if (bytes > 0) {
          in_payload_transfers_[peer].reset(peer, requests, in_payloads_[peer].data(), bytes);
          transport_.post_recv(in_payload_transfers_[peer]);
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
  wait_for(cycle, all_received, missing);

  std::vector<RequestList> lists(static_cast<size_t>(size_));
  lists[0] = std::move(mine);
  for (int peer = 1; peer < size_; ++peer) {
    try {
      lists[peer] = decode_requests(in_payloads_[peer].data(), in_payloads_[peer].size(), size_,
                                    cache_capacity_);
    } catch (const Error& error) {
      throw Error(error.status(),
                  fmt::format("fusion engine: rank {} sent rank 0 a {}", peer, error.what()));
    }
  }
  return lists;
}

void NegotiationChannel::send_response(uint64_t cycle, const ResponseList& response) {
  encode(response, out_payload_);
  if (out_payload_.size() > kMaxPayloadBytes) {
    throw Error(Status::kInternal,
                fmt::format("fusion engine: a response of {} bytes exceeds the limit of {}",
                            out_payload_.size(), kMaxPayloadBytes));
  }
  const OpDescriptor responses = control_descriptor(MessageKind::kResponses, cycle);
  out_header_ = header(MessageKind::kResponses, cycle, out_payload_.size());
  for (int peer = 1; peer < size_; ++peer) {
    out_header_transfers_[peer].reset(peer, responses, &out_header_, sizeof(out_header_));
    transport_.post_send(out_header_transfers_[peer]);
    if (!out_payload_.empty()) {
      out_payload_transfers_[peer].reset(peer, responses, out_payload_.data(), out_payload_.size());
      transport_.post_send(out_payload_transfers_[peer]);
    }
  }
  int unsent = 0;
  wait_for(
      cycle,
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
}

void NegotiationChannel::post_idle(uint64_t next) {
  if (rank_ == 0) {
    const OpDescriptor requests = control_descriptor(MessageKind::kRequests, next);
    for (int peer = 1; peer < size_; ++peer) {
      in_header_transfers_[peer].reset(peer, requests, &in_headers_[peer], sizeof(MessageHeader));
      transport_.post_recv(in_header_transfers_[peer]);
    }
    requests_posted_ = true;
  } else {
    wake_transfers_[0].reset(0, control_descriptor(MessageKind::kWake, next), &wake_header_,
                             sizeof(wake_header_));
    transport_.post_recv(wake_transfers_[0]);
    wake_posted_ = true;
  }
}

bool NegotiationChannel::woken() const {
  if (rank_ != 0) return wake_transfers_[0].complete;
  for (int peer = 1; peer < size_; ++peer) {
    if (in_header_transfers_[peer].complete) return true;
  }
  return false;
}

int NegotiationChannel::readiness_fd() const {
  return transport_.readiness_fd();
}

void NegotiationChannel::progress_now() {
  transport_.progress(Deadline(0));
}

void NegotiationChannel::wake(uint64_t next) {
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
      transport_.post_send(wake_transfers_[peer]);
    }
    wake_posted_ = true;
  }
}

void NegotiationChannel::say_bye(uint64_t cycle, int departed) noexcept {
  // No BYE to a rank whose own BYE has arrived: it is leaving or gone, and a message to a peer
  // that has gone only fails (a PeerLeft, this rank's alone: transport/control_channel.hpp).
  // When the transports still told every rank of such a failure, ranks leaving at about the same
  // time cut short a collective others were finishing (ucx over TCP: the [threads] test at N = 3,
  // four copies at once, failed its last rank in about one run of 25 to 50).
  auto bye_from = [&](int peer) {
    if (rank_ == 0) {
      return in_header_transfers_[peer].complete &&
             in_headers_[peer].kind == static_cast<uint8_t>(MessageKind::kBye);
    }
    return wake_transfers_[0].complete &&
           wake_header_.kind == static_cast<uint8_t>(MessageKind::kBye);
  };
  try {
    transport_.progress(Deadline(0));  // takes in a BYE that has arrived since the last look
    std::vector<Transfer*> sent;
    if (rank_ == 0) {
      std::vector<bool> skip(size_, false);
      for (int peer = 1; peer < size_; ++peer) skip[peer] = peer == departed || bye_from(peer);
      wake_header_ = header(MessageKind::kBye, cycle, 0);
      const OpDescriptor wake = control_descriptor(MessageKind::kWake, cycle);
      for (int peer = 1; peer < size_; ++peer) {
        if (skip[peer]) continue;
        wake_transfers_[peer].reset(peer, wake, &wake_header_, sizeof(wake_header_));
        transport_.post_send(wake_transfers_[peer]);
        sent.push_back(&wake_transfers_[peer]);
      }
    } else if (!bye_from(0)) {
      out_header_ = header(MessageKind::kBye, cycle, 0);
      out_header_transfers_[0].reset(0, control_descriptor(MessageKind::kRequests, cycle),
                                     &out_header_, sizeof(out_header_));
      transport_.post_send(out_header_transfers_[0]);
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
      transport_.progress(Deadline(std::min(kStopCheckSeconds, deadline.remaining_s())));
    }
  } catch (const Error& error) {
    log::info("fusion engine: could not say goodbye to every peer: {}", error.what());
  }
}

}  // namespace kolo::fusion
