// The control channel's frame reader (src/transport/control_frame.hpp) on what a peer's control
// socket delivers. The first byte gives the communicator's size and how the stream is cut into
// reads; the rest is the stream. It is read twice, in whole wanted() pieces and in pieces of at
// most that cut, as a socket may deliver it: both must yield the same frames, each within the
// limits, up to the first malformed header, after which the channel closes the connection.
#include "transport/control_frame.hpp"

#include <string>

#include "fuzz_input.hpp"

using namespace kolo;

namespace {

// Every step of reading `stream` with reads of at most `cut` bytes, frames described in full.
std::vector<std::string> read_all(const std::vector<uint8_t>& stream, int ranks, size_t cut) {
  ControlFrameReader reader(ranks);
  std::vector<std::string> steps;
  size_t at = 0;
  while (at < stream.size()) {
    const size_t bytes = std::min({reader.wanted(), cut, stream.size() - at});
    FUZZ_REQUIRE(bytes > 0);
    std::memcpy(reader.space(), stream.data() + at, bytes);
    at += bytes;
    const ControlFrameReader::Step step = reader.advance(bytes);
    if (step == ControlFrameReader::Step::kMore) continue;
    std::string described = std::to_string(static_cast<int>(step));
    if (step == ControlFrameReader::Step::kFrame) {
      FUZZ_REQUIRE(reader.text().size() <= kControlMaxText);
      if (reader.kind() == ControlKind::kAbort) {
        FUZZ_REQUIRE(reader.status() != Status::kSuccess);
        FUZZ_REQUIRE(reader.origin() >= 0 && reader.origin() < ranks);
        described += " abort " + std::to_string(static_cast<int>(reader.status())) + " " +
                     std::to_string(reader.origin()) + " " + std::string(reader.text());
      } else {
        described += " kind " + std::to_string(static_cast<uint32_t>(reader.kind()));
      }
    }
    steps.push_back(std::move(described));
    if (step == ControlFrameReader::Step::kMalformedHeader) break;
  }
  return steps;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  FuzzInput input(data, size);
  const uint8_t shape = input.take<uint8_t>();
  const int ranks = 1 + shape % 8;
  const size_t cut = 1 + shape / 8;
  const std::vector<uint8_t> stream = input.take_bytes(input.left());
  FUZZ_REQUIRE(read_all(stream, ranks, kControlMaxText + sizeof(ControlFrameHeader)) ==
               read_all(stream, ranks, cut));
  return 0;
}
