// What a shrink's coordinator and its followers say to each other over the lifeline, after the
// handshake (comm/lifeline.hpp): a 16-byte header (magic, word, value, payload bytes), then the
// payload. Everything read here comes from a peer and is checked before it is used; a message that
// fails a check is a kolo::Error(kMismatch) naming the peer. tests/fuzz/lifeline_message.cpp feeds
// these functions arbitrary bytes.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "kolo/status.hpp"

namespace kolo {

// What a coordinator decided: the members (ranks of the old communicator, in order), the new
// communicator's context, and the address of its rendezvous store.
struct ShrinkDecision {
  std::vector<int> members;
  uint64_t context = 0;
  std::string store;  // "host:port"
};

namespace lifeline_wire {

enum Word : uint32_t {
  kDecision = 1,  // coordinator to follower; payload: encode(ShrinkDecision)
  kCommit = 2,    // coordinator to follower: every member built its communicator
  kAbort = 3,     // either way; value: the status (a failure); payload: the message
  kBuilt = 4,     // follower to coordinator; value: 0, or the status it failed with; payload: why
};
inline constexpr uint32_t kMagic = 0x6b6c6966;  // "kolo lifeline"
inline constexpr uint32_t kMaxPayloadBytes = 1u << 20;

struct Header {
  uint32_t magic = kMagic;
  uint32_t word = 0;
  int32_t value = 0;
  uint32_t bytes = 0;
};
static_assert(sizeof(Header) == 16);

struct Message {
  Word word{};
  int32_t value = 0;
  std::vector<uint8_t> payload;
};

// Checks a header read from `peer`: the magic, a known word, a bounded payload.
void check_header(const Header& header, int peer);

std::vector<uint8_t> encode(const ShrinkDecision& decision);
// A decision from coordinator `coordinator` of a communicator of `size` ranks: the members must be
// increasing ranks of it, at least one.
ShrinkDecision decode(const std::vector<uint8_t>& bytes, int size, int coordinator);

// The error an ABORT from `peer` carries. Its status must be a failure: an ABORT that says
// "success", or a status kolo does not know, is itself the error (kMismatch), so that a shrink can
// never end in success without a communicator.
Error abort_error(const Message& message, int peer);
// The failure a BUILT from `peer` reports; kSuccess when it built its communicator. A status kolo
// does not know is reported as kMismatch.
Error built_result(const Message& message, int peer);

std::vector<uint8_t> text_bytes(const std::string& text);

}  // namespace lifeline_wire
}  // namespace kolo
