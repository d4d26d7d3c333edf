// Endpoint and authentication parsing (src/net/socket.hpp, auth.hpp) on text and bytes from
// outside: the first byte chooses.
//  - An endpoint (even): the rest as KOLO_ADDR text, or an address a peer published in the store.
//    One that parses must print as text that parses back to the same endpoint.
//  - An authentication answer (odd): the rest as the 64 bytes a connecting stranger sends, checked
//    against a fixed nonce and secret. It must be refused with kMismatch, unless it is a valid
//    answer, which only the secret can make.
#include "fuzz_input.hpp"
#include "kolo/status.hpp"
#include "net/auth.hpp"
#include "net/socket.hpp"

using namespace kolo;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  FuzzInput input(data, size);
  if (input.take<uint8_t>() % 2 == 0) {
    const std::vector<uint8_t> bytes = input.take_bytes(input.left());
    const std::string text(bytes.begin(), bytes.end());
    net::Endpoint endpoint;
    try {
      endpoint = net::parse_endpoint(text, "KOLO_ADDR");
    } catch (const Error& error) {
      FUZZ_REQUIRE(error.status() == Status::kConfig);
      return 0;
    }
    FUZZ_REQUIRE(!endpoint.host.empty());
    net::Endpoint again;
    try {
      again = net::parse_endpoint(endpoint.to_string(), "KOLO_ADDR");
    } catch (const Error& error) {
      std::fprintf(stderr, "%s\n", error.what());
      FUZZ_REQUIRE(!"a parsed endpoint prints as text that parses");
    }
    FUZZ_REQUIRE(again.host == endpoint.host && again.port == endpoint.port);
    return 0;
  }
  const net::AuthNonce nonce{};
  uint8_t answer[net::kAuthAnswerBytes] = {};
  const std::vector<uint8_t> bytes = input.take_bytes(sizeof answer);
  std::copy(bytes.begin(), bytes.end(), answer);
  try {
    net::check_auth_answer("fuzz-secret", nonce, answer, "a fuzzer");
  } catch (const Error& error) {
    FUZZ_REQUIRE(error.status() == Status::kMismatch);
  }
  return 0;
}
