// comm/lifeline_wire.hpp.
#include "comm/lifeline_wire.hpp"

#include <fmt/format.h>

#include <cstring>

namespace kolo::lifeline_wire {

void check_header(const Header& header, int peer) {
  if (header.magic != kMagic || header.bytes > kMaxPayloadBytes || header.word < kDecision ||
      header.word > kBuilt) {
    throw Error(Status::kMismatch,
                fmt::format("kolo_comm_shrink: rank {} sent a malformed message", peer));
  }
}

std::vector<uint8_t> encode(const ShrinkDecision& decision) {
  std::vector<uint8_t> bytes(12 + 4 * decision.members.size());
  const auto count = static_cast<uint32_t>(decision.members.size());
  std::memcpy(bytes.data(), &decision.context, 8);
  std::memcpy(bytes.data() + 8, &count, 4);
  std::memcpy(bytes.data() + 12, decision.members.data(), 4 * decision.members.size());
  bytes.insert(bytes.end(), decision.store.begin(), decision.store.end());
  return bytes;
}

ShrinkDecision decode(const std::vector<uint8_t>& bytes, int size, int coordinator) {
  ShrinkDecision decision;
  uint32_t count = 0;
  bool good = bytes.size() >= 12;
  if (good) {
    std::memcpy(&decision.context, bytes.data(), 8);
    std::memcpy(&count, bytes.data() + 8, 4);
    good = count >= 1 && count <= static_cast<uint32_t>(size) &&
           bytes.size() >= 12 + 4 * static_cast<size_t>(count);
  }
  if (good) {
    decision.members.resize(count);
    std::memcpy(decision.members.data(), bytes.data() + 12, 4 * static_cast<size_t>(count));
    decision.store.assign(bytes.begin() + 12 + 4 * static_cast<ptrdiff_t>(count), bytes.end());
    for (uint32_t i = 0; i < count; ++i) {
      const int member = decision.members[i];
      good = good && member >= 0 && member < size && (i == 0 || member > decision.members[i - 1]);
    }
  }
  if (!good) {
    throw Error(Status::kMismatch,
                fmt::format("kolo_comm_shrink: the decision of rank {} is malformed", coordinator));
  }
  return decision;
}

namespace {

std::string text_of(const Message& message) {
  return std::string(message.payload.begin(), message.payload.end());
}

}  // namespace

Error abort_error(const Message& message, int peer) {
  Status status = Status::kSuccess;
  if (!status_from_wire(message.value, status) || status == Status::kSuccess) {
    return Error(Status::kMismatch,
                 fmt::format("kolo_comm_shrink: rank {} aborted with status {}, which is no "
                             "failure kolo knows (message: '{}')",
                             peer, message.value, text_of(message)));
  }
  return Error(status, text_of(message));
}

Error built_result(const Message& message, int peer) {
  if (message.value == 0) return Error(Status::kSuccess, "");
  Status status = Status::kSuccess;
  if (!status_from_wire(message.value, status)) status = Status::kMismatch;
  return Error(status, fmt::format("kolo_comm_shrink: rank {} could not connect the new "
                                   "communicator: {}",
                                   peer, text_of(message)));
}

std::vector<uint8_t> text_bytes(const std::string& text) {
  return std::vector<uint8_t>(text.begin(), text.end());
}

}  // namespace kolo::lifeline_wire
