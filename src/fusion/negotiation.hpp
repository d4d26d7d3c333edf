// The fusion engine's negotiation channel: the messages of a cycle between rank 0 and every other
// rank over the engine's own mesh (one round trip per cycle), the wake-up after an idle cycle and
// the goodbye of a rank that leaves while every rank is idle. It moves RequestLists and
// ResponseLists (wire.hpp) and knows nothing of what they mean: the engine (engine.hpp) builds
// them and the Coordinator (coordinator.hpp) answers them. Engine thread only.
//
// Each message is a MessageHeader and, when it says so, a payload; the transport matches the k-th
// message between two ranks with the k-th receive, and every message travels under a descriptor
// of its cycle and kind, so a rank a cycle ahead or behind is a mismatch, never a misread.
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "fusion/cache.hpp"
#include "fusion/wire.hpp"
#include "transport/transport.hpp"

namespace kolo::fusion {

// Thrown when a peer said goodbye while every rank was idle: not a failure of this rank, so
// nothing is sent to the peers, who leave the same way.
struct Departed {
  Error error;
};

class NegotiationChannel {
 public:
  // What the channel asks of its engine while it waits.
  struct Hooks {
    std::function<void()> check_stop;               // throws to interrupt a wait
    std::function<void(std::string)> set_activity;  // what a wait is for (the report)
  };

  NegotiationChannel(Transport& transport, int rank, int size, uint32_t cache_capacity,
                     double timeout_s, Hooks hooks);

  // Rank 0: every rank's RequestList of `cycle`, `mine` at index 0, the others as received.
  std::vector<RequestList> gather_requests(uint64_t cycle, RequestList mine);
  // Rank 0: sends `response` to every other rank and waits until each has taken it.
  void send_response(uint64_t cycle, const ResponseList& response);
  // Ranks 1..N-1: sends `mine` to rank 0 and returns its response, decoded against `cache`.
  ResponseList exchange(uint64_t cycle, const RequestList& mine, const ResponseCache& cache);

  // After an idle response: posts what wakes this rank for cycle `next` (rank 0: every rank's
  // next RequestList; the others: rank 0's WAKE). Then the engine waits, on its own wake-up and
  // readiness_fd(), until woken() or it has work itself, and calls wake(next).
  void post_idle(uint64_t next);
  // A message that ends the idle wait has arrived.
  bool woken() const;
  // An fd that becomes readable when the transport has something to progress (-1: none).
  int readiness_fd() const;
  // Progresses the transport without waiting.
  void progress_now();
  // Ends an idle wait: throws Departed when the message that ended it is a peer's BYE; rank 0
  // sends WAKE to every other rank.
  void wake(uint64_t next);
  // Best effort and brief, for a rank that leaves while every rank is idle: a BYE where each
  // peer expects its next message (rank 0: in place of the WAKE, to all but `departed`; the
  // others: in place of their RequestList, to rank 0), and none to a rank whose BYE has arrived.
  void say_bye(uint64_t cycle, int departed) noexcept;

 private:
  template <typename Done, typename Describe>
  void wait_for(uint64_t cycle, Done&& done, Describe&& what);
  MessageHeader header(MessageKind kind, uint64_t cycle, uint64_t payload_bytes) const;
  void check_header(const MessageHeader& header, MessageKind kind, uint64_t cycle, int from) const;

  Transport& transport_;
  const int rank_;
  const int size_;
  const uint32_t cache_capacity_;
  const double timeout_s_;
  const Hooks hooks_;

  // This rank's outgoing and incoming headers, payloads and transfers, [peer] where per peer.
  MessageHeader out_header_;
  std::vector<uint8_t> out_payload_;
  MessageHeader wake_header_;
  std::vector<MessageHeader> in_headers_;
  std::vector<std::vector<uint8_t>> in_payloads_;
  std::vector<Transfer> out_header_transfers_;
  std::vector<Transfer> out_payload_transfers_;
  std::vector<Transfer> in_header_transfers_;
  std::vector<Transfer> in_payload_transfers_;
  std::vector<Transfer> wake_transfers_;
  bool requests_posted_ = false;  // rank 0: next cycle's headers are posted
  bool wake_posted_ = false;      // WAKE receive (others) or sends (rank 0)
};

}  // namespace kolo::fusion
