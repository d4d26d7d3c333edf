#include "ring/ring.hpp"

#include <fmt/format.h>

namespace kolo {

std::byte* Ring::buffer(Buffer which, size_t bytes) {
  if (bytes > buffer_bytes_[which]) {
    buffers_[which].reset();  // free first: the old and new buffer need not coexist
    buffers_[which].reset(new std::byte[bytes]);
    buffer_bytes_[which] = bytes;
  }
  return buffers_[which].get();
}

Transfer* Ring::transfers(size_t count) {
  if (transfers_.size() < count) transfers_.resize(count);
  for (size_t i = 0; i < count; ++i) transfers_[i] = Transfer{};
  return transfers_.data();
}

void Ring::wait(const OpDescriptor& op, int waiting_for) {
  if (deadline_.expired()) {
    Error error(Status::kTimeout,
                fmt::format("{} timed out on rank {}: nothing arrived from or went to rank {} for "
                            "{} s (KOLO_TIMEOUT)",
                            describe(op), rank_, waiting_for, timeout_s_));
    transport_.abort(error);
    throw error;
  }
  transport_.progress(deadline_);
}

}  // namespace kolo
