// What a shrink's coordinator or follower reads from a peer over the lifeline
// (src/comm/lifeline_wire.hpp): a header, then a payload read as the word says, a decision for a
// communicator of 1-64 ranks (the first byte), an abort or a build report. Whatever the bytes, the
// reader either refuses them with kMismatch or yields a message within the limits: a decision of
// increasing members inside the communicator that survives encoding again unchanged, and an abort
// that is a failure, never a success.
#include <cstring>

#include "comm/lifeline_wire.hpp"
#include "fuzz_input.hpp"

using namespace kolo;
using namespace kolo::lifeline_wire;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  FuzzInput input(data, size);
  const int ranks = 1 + input.take<uint8_t>() % 64;
  const Header header = input.take<Header>();
  Message message;
  try {
    check_header(header, 1);
  } catch (const Error& error) {
    FUZZ_REQUIRE(error.status() == Status::kMismatch);
    return 0;
  }
  FUZZ_REQUIRE(header.bytes <= kMaxPayloadBytes);
  message.word = static_cast<Word>(header.word);
  message.value = header.value;
  message.payload = input.take_bytes(std::min<size_t>(header.bytes, input.left()));
  switch (message.word) {
    case kDecision:
      try {
        const ShrinkDecision decision = decode(message.payload, ranks, 1);
        FUZZ_REQUIRE(!decision.members.empty() &&
                     decision.members.size() <= static_cast<size_t>(ranks));
        for (size_t i = 0; i < decision.members.size(); ++i) {
          FUZZ_REQUIRE(decision.members[i] >= 0 && decision.members[i] < ranks);
          FUZZ_REQUIRE(i == 0 || decision.members[i] > decision.members[i - 1]);
        }
        FUZZ_REQUIRE(encode(decision) == message.payload);
      } catch (const Error& error) {
        FUZZ_REQUIRE(error.status() == Status::kMismatch);
      }
      break;
    case kAbort:
      FUZZ_REQUIRE(abort_error(message, 1).status() != Status::kSuccess);
      break;
    case kBuilt:
      FUZZ_REQUIRE((built_result(message, 1).status() == Status::kSuccess) ==
                   (message.value == 0));
      break;
    case kCommit:
      break;
  }
  return 0;
}
