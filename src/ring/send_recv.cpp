// Point-to-point send and receive between two ranks, for pipeline parallelism.
//
// The message goes straight from the sender's buffer into the receiver's, as one transport
// message whose descriptor says what the sender called: kSendRecv, dtype, count, root = the
// sender's rank, detail = the tag, and sequence = how many messages this sender has sent this
// receiver before (the receiver counts the same way). The transport matches the messages between
// two ranks in order, so the k-th receive from a peer takes the k-th message that peer sent, on
// the same ordered streams as the collectives: like NCCL's send/recv, both ranks must call in the
// same order (a send and the matching receive may be separated by collectives, as long as both
// ranks issue those collectives in the same order too). The receiver compares the descriptor with
// its own call, so a different count, dtype or tag is KOLO_ERR_MISMATCH.
//
// The send is synchronous: once the receiver has checked and taken the data it returns a receipt
// (an empty kSendRecvReceipt message), and the sender returns only when the receipt has come. So
// a disagreement found by the receiver reaches the sender too (the receiver's ABORT arrives where
// the receipt would have), and neither side of a mismatched pair can return success. The price is
// one more message latency per send, and the usual rule of synchronous sends: two ranks that both
// send to each other before receiving wait for each other (here until KOLO_TIMEOUT, or, since the
// message each of them finds is a send where it expected a receipt, a KOLO_ERR_MISMATCH at once).
// Cost: a + S/B for the data, and a for the receipt.
#include "ring/ring.hpp"

namespace kolo {
namespace {

OpDescriptor receipt_of(const OpDescriptor& op) {
  OpDescriptor receipt = op;
  receipt.collective = Collective::kSendRecvReceipt;
  return receipt;
}

}  // namespace

void send_to_peer(Ring& ring, const OpDescriptor& op, const void* buffer, int peer) {
  Transfer* transfers = ring.transfers(2);
  ring.begin();
  transfers[0].reset(peer, op, const_cast<void*>(buffer), op.count * dtype_size(op.dtype));
  transfers[1].reset(peer, receipt_of(op), nullptr, 0);
  ring.transport().post_send(transfers[0]);
  ring.transport().post_recv(transfers[1]);
  while (!transfers[0].complete) ring.wait(op, peer);
  ring.made_progress();
  while (!transfers[1].complete) ring.wait(op, peer);
  ring.made_progress();
}

void receive_from_peer(Ring& ring, const OpDescriptor& op, void* buffer, int peer) {
  Transfer* transfers = ring.transfers(2);
  ring.begin();
  transfers[0].reset(peer, op, buffer, op.count * dtype_size(op.dtype));
  ring.transport().post_recv(transfers[0]);
  while (!transfers[0].complete) ring.wait(op, peer);
  ring.made_progress();
  transfers[1].reset(peer, receipt_of(op), nullptr, 0);
  ring.transport().post_send(transfers[1]);
  while (!transfers[1].complete) ring.wait(op, peer);
  ring.made_progress();
}

}  // namespace kolo
