// The receiver's check of a frame header (transport/framing.hpp), in the words every transport
// reports a disagreement with.
#include "transport/framing.hpp"

#include <fmt/format.h>

namespace kolo {

namespace {

[[noreturn]] void disagree(int rank, const OpDescriptor& mine, int peer,
                           const OpDescriptor& theirs) {
  throw Error(Status::kMismatch, fmt::format("ranks disagree: rank {} called {} but rank {} called {}",
                                             rank, describe(mine), peer, describe(theirs)));
}

}  // namespace

bool numbered_collective(Collective collective) {
  return collective != Collective::kSendRecv && collective != Collective::kSendRecvReceipt &&
         collective != Collective::kNegotiation;
}

bool enters_another_collective(const OpDescriptor& current, const OpDescriptor& posted) {
  return numbered_collective(posted.collective) &&
         (posted.sequence != current.sequence || posted.collective != current.collective);
}

void check_unexpected_frame(int rank, int peer, const OpDescriptor& current,
                            const FrameHeader& header) {
  const OpDescriptor& theirs = header.descriptor;
  if (numbered_collective(current.collective) && numbered_collective(theirs.collective) &&
      theirs.sequence == current.sequence && theirs.collective != current.collective) {
    disagree(rank, current, peer, theirs);
  }
}

void check_frame(int rank, const Transfer& transfer, const FrameHeader& header) {
  if (!(header.descriptor == transfer.descriptor)) {
    disagree(rank, transfer.descriptor, transfer.peer, header.descriptor);
  }
  if (header.bytes != transfer.bytes) {
    throw Error(Status::kMismatch,
                fmt::format("ranks disagree in {}: rank {} sent a message of {} bytes where rank "
                            "{} expected {} (is KOLO_SEGMENT_BYTES the same on every rank?)",
                            describe(transfer.descriptor), transfer.peer, header.bytes, rank,
                            transfer.bytes));
  }
}

}  // namespace kolo
