// The rendezvous store's request parser (src/bootstrap/store_protocol.hpp) on what an
// authenticated client sends: requests are taken from the front of the input the way the server
// takes them from a connection's buffer (measure, decode, consume), and both passes must agree
// on every request, within the protocol's limits, and one byte short of it is still incomplete.
#include "bootstrap/store_protocol.hpp"
#include "fuzz_input.hpp"

using namespace kolo;
using namespace kolo::store_protocol;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  size_t offset = 0;
  while (offset < size) {
    const uint8_t* front = data + offset;
    const size_t left = size - offset;
    RequestParser check(front, left, nullptr);
    const Parse result = check.parse();
    FUZZ_REQUIRE(result != Parse::kMalformed || !check.reason().empty());
    if (result != Parse::kComplete) return 0;
    const size_t consumed = check.consumed();
    FUZZ_REQUIRE(consumed >= 1 && consumed <= left && consumed <= kMaxRequestBytes);

    Request request;
    RequestParser decode(front, left, &request);
    FUZZ_REQUIRE(decode.parse() == Parse::kComplete && decode.consumed() == consumed);
    FUZZ_REQUIRE(request.op == Op::kWait || request.op == Op::kDelete || request.op == Op::kGetMany
                     ? request.keys.size() <= kMaxWaitKeys
                     : request.keys.size() == 1);
    for (const std::string& key : request.keys) {
      FUZZ_REQUIRE(!key.empty() && key.size() <= kStoreMaxKeyBytes);
    }
    FUZZ_REQUIRE(request.value.size() <= kStoreMaxValueBytes);

    FUZZ_REQUIRE(RequestParser(front, consumed - 1, nullptr).parse() == Parse::kIncomplete);
    offset += consumed;
  }
  return 0;
}
