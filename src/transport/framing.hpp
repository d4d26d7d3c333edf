// The framing every transport shares, written once: the 64-byte header that opens each message,
// the receiver's check of it, and the FIFO of posted transfers.
//
// A message on any transport is a FrameHeader followed by `bytes` of payload. The header carries
// the OpDescriptor of the call the sender made; the receiver checks it, and the length, against
// the transfer it posted (check_frame) before a byte of payload is used, so ranks that disagree
// get KOLO_ERR_MISMATCH, in the same words on every transport, instead of corrupt data or a hang.
// A header whose magic is wrong is the transport's business to report (it knows the connection):
// it is a lost peer, never a mismatch.
//
// The header is sent as it lies in memory: every rank of a job runs the same build on the same
// kind of machine (the store's hello checks the secret, not the byte order), so no field is
// converted.
#pragma once

#include <cstdint>

#include "core/op_descriptor.hpp"
#include "transport/transport.hpp"

namespace kolo {

struct alignas(64) FrameHeader {
  static constexpr uint32_t kMagic = 0x464c4f4b;  // "KOLF"

  uint32_t magic = kMagic;
  uint32_t reserved = 0;
  uint64_t bytes = 0;  // of the payload that follows
  OpDescriptor descriptor;

  static FrameHeader for_transfer(const Transfer& transfer) {
    FrameHeader header;
    header.bytes = transfer.bytes;
    header.descriptor = transfer.descriptor;
    return header;
  }
  bool well_formed() const { return magic == kMagic; }
};
static_assert(sizeof(FrameHeader) == 64, "a frame header is one cache line on the wire");

// Checks a received header against the receive posted for it on this rank: the same descriptor
// and the same length, else kolo::Error(kMismatch) naming both ranks and both calls.
void check_frame(int rank, const Transfer& transfer, const FrameHeader& header);

// Checks a header that arrived from `peer` before any receive was posted for it, against the
// collective this rank is in (`current`: the descriptor of its latest posted transfer). A message
// numbered as that collective but of another kind of collective is a disagreement that no posted
// receive would ever catch where the ranks' schedules differ, so that some never talk to each
// other (a broadcast where the others run the hierarchical allreduce): kolo::Error(kMismatch) in
// check_frame's words. Only the kind is compared: the messages of one call may differ in the rest
// (the hierarchical allreduce's leaders exchange sums in float32, alltoallv's pairs have counts of
// their own), which posted receives check. Anything else waits for its receive: a later call's
// message, or one of point-to-point calls and negotiation messages, which are numbered their own
// way.
void check_unexpected_frame(int rank, int peer, const OpDescriptor& current,
                            const FrameHeader& header);

// Whether calls of this kind take the communicator's collective numbers (OpDescriptor::sequence).
bool numbered_collective(Collective collective);

// Whether a transfer of `posted` starts another collective than `current` (the collective a rank
// is in for check_unexpected_frame): a numbered collective of another number or kind.
bool enters_another_collective(const OpDescriptor& current, const OpDescriptor& posted);

// A FIFO of T linked through T::next (Transfer, or a transport's own records): pushing and
// popping never allocate. The queue does not own its elements.
template <typename T>
class IntrusiveFifo {
 public:
  bool empty() const { return head_ == nullptr; }
  T* front() const { return head_; }
  void push(T* item) {
    item->next = nullptr;
    if (tail_) {
      tail_->next = item;
    } else {
      head_ = item;
    }
    tail_ = item;
  }
  // Unlinks and returns the front; the queue must not be empty.
  T* pop() {
    T* item = head_;
    head_ = head_->next;
    if (!head_) tail_ = nullptr;
    item->next = nullptr;
    return item;
  }
  void clear() { head_ = tail_ = nullptr; }

 private:
  T* head_ = nullptr;
  T* tail_ = nullptr;
};

}  // namespace kolo
