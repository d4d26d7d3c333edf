// Agreement, and the barrier built on it.
//
// Every rank's descriptor travels once round the ring: at step s = 0 .. N-2, rank r sends to r+1
// the descriptor it learnt at step s-1 (its own at step 0) together with the rank it came from,
// and receives one from r-1, which it compares with its own. After N-1 steps each rank has
// compared its call with every other rank's, so either every rank agrees, or every rank that
// finishes has seen a difference: no rank can return success while another reports
// KOLO_ERR_MISMATCH. Cost: (N-1)·a, 48 bytes a step.
//
// Since every rank's descriptor leaves only once that rank has entered the call, a rank that has
// received all N-1 of them knows that every rank has entered: that is a barrier.
#include <fmt/format.h>

#include "ring/ring.hpp"

namespace kolo {
namespace {

struct Announcement {
  int32_t rank = -1;
  uint32_t reserved = 0;
  OpDescriptor descriptor;
};

}  // namespace

void ring_agree(Ring& ring, const OpDescriptor& op) {
  const int n = ring.size();
  Announcement outgoing{ring.rank(), 0, op};
  Announcement incoming;
  ring.begin();
  for (int step = 0; step < n - 1; ++step) {
    Transfer* transfers = ring.transfers(2);
    transfers[0].reset(ring.right(), op, &outgoing, sizeof(outgoing));
    transfers[1].reset(ring.left(), op, &incoming, sizeof(incoming));
    ring.transport().post_send(transfers[0]);
    ring.transport().post_recv(transfers[1]);
    while (!transfers[1].complete) ring.wait(op, ring.left());
    while (!transfers[0].complete) ring.wait(op, ring.right());
    ring.made_progress();
    if (!(incoming.descriptor == op)) {
      Error error(Status::kMismatch,
                  fmt::format("ranks disagree: rank {} called {} but rank {} called {}",
                              ring.rank(), describe(op), incoming.rank,
                              describe(incoming.descriptor)));
      ring.transport().abort(error);
      throw error;
    }
    outgoing = incoming;
  }
}

void ring_barrier(Ring& ring, const OpDescriptor& op) { ring_agree(ring, op); }

}  // namespace kolo
