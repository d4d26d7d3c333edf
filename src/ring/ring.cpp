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

void IncomingReduction::attach(Transfer& transfer) {
  transfer.sink = [](void* context, size_t offset, const void* piece, size_t length) {
    static_cast<const IncomingReduction*>(context)->apply(offset, piece, length);
  };
  transfer.sink_context = this;
  transfer.sink_grain = accumulator_size(spec->dtype);
}

void IncomingReduction::apply(size_t offset, const void* incoming, size_t bytes) const {
  const size_t accumulator = accumulator_size(spec->dtype);
  const size_t element = dtype_size(spec->dtype);
  const size_t first = offset / accumulator;
  const size_t count = bytes / accumulator;
  if (finish) {
    reduce_finish(result + first * element, incoming, own + first * element, count, *spec);
  } else {
    reduce_combine(result + first * accumulator, incoming, own + first * element, count, *spec);
  }
}

Transfer* Ring::transfers(size_t count) {
  if (transfers_.size() < count) transfers_.resize(count);
  for (size_t i = 0; i < count; ++i) transfers_[i] = Transfer{};
  return transfers_.data();
}

void Ring::wait(const OpDescriptor& op, int waiting_for) {
  waiting_for_.store(waiting_for, std::memory_order_relaxed);
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
