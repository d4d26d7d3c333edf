// The receiver's check of a frame header (transport/framing.hpp), in the words every transport
// reports a disagreement with.
#include "transport/framing.hpp"

#include <fmt/format.h>

namespace kolo {

void check_frame(int rank, const Transfer& transfer, const FrameHeader& header) {
  if (!(header.descriptor == transfer.descriptor)) {
    throw Error(
        Status::kMismatch,
        fmt::format("ranks disagree: rank {} called {} but rank {} called {}", rank,
                    describe(transfer.descriptor), transfer.peer, describe(header.descriptor)));
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
