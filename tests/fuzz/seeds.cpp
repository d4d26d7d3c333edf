// Writes the seed corpus of every fuzz target (tests/fuzz/corpus/<target>/) from kolo's own
// encoders, so that each target starts from inputs that get past its first checks:
//   build-fuzz/tests/fuzz/fuzz_seeds tests/fuzz/corpus
// The layouts of the targets' own framing (a leading choice byte, length prefixes, the scripts of
// shm_ring) are described at the top of each target.
#include <filesystem>
#include <fstream>
#include <string>

#include "bootstrap/store_protocol.hpp"
#include "fusion/wire.hpp"
#include "comm/lifeline_wire.hpp"
#include "transport/control_frame.hpp"

using namespace kolo;
using Bytes = std::vector<uint8_t>;

namespace {

std::filesystem::path root;

void seed(const std::string& target, const std::string& name, const Bytes& bytes) {
  std::filesystem::create_directories(root / target);
  std::ofstream(root / target / name, std::ios::binary)
      .write(reinterpret_cast<const char*>(bytes.data()),
             static_cast<std::streamsize>(bytes.size()));
}

template <typename T>
void put(Bytes& out, const T& value) {
  store_protocol::append_bytes(out, &value, sizeof value);
}

void store_seeds() {
  using namespace store_protocol;
  Bytes requests{static_cast<uint8_t>(Op::kSet)};
  append_key(requests, "rank/0/address");
  append_u32(requests, 15);
  append_bytes(requests, "127.0.0.1:29500", 15);
  requests.push_back(static_cast<uint8_t>(Op::kGet));
  append_key(requests, "rank/0/address");
  requests.push_back(static_cast<uint8_t>(Op::kWait));
  append_u32(requests, 2);
  append_key(requests, "a");
  append_key(requests, "b");
  requests.push_back(static_cast<uint8_t>(Op::kAdd));
  append_key(requests, "counter");
  append_u64(requests, 3);
  seed("store_request", "set_get_wait_add", requests);
  Bytes erase{static_cast<uint8_t>(Op::kErase)};
  append_key(erase, "kolo/2a/");
  seed("store_request", "erase", erase);
  Bytes erase_keys{static_cast<uint8_t>(Op::kDelete)};
  append_u32(erase_keys, 2);
  append_key(erase_keys, "kolo/2a/tcp/0");
  append_key(erase_keys, "kolo/2a/lifeline/0");
  seed("store_request", "delete", erase_keys);
  Bytes get_many{static_cast<uint8_t>(Op::kGetMany)};
  append_u32(get_many, 1000);  // wait_ms
  append_u32(get_many, 3);
  append_key(get_many, "kolo/1/startup/0");
  append_key(get_many, "kolo/1/startup/1");
  append_key(get_many, "kolo/1/startup/2");
  seed("store_request", "get_many", get_many);
}

fusion::UnitSpec allreduce(const std::string& name, uint64_t count, DataType dtype) {
  fusion::UnitSpec spec;
  spec.dtype = dtype;
  spec.members.push_back({name, count});
  return spec;
}

void fusion_seeds() {
  using namespace fusion;
  // Rank 0: 3 ranks (1), a cache of 64 (3), a threshold of 4096 (2); two cycles, in which every
  // rank announces two fusable allreduces and a broadcast, then sets the bits of slots 0 and 1.
  UnitSpec broadcast = allreduce("w", 9, DataType::kInt32);
  broadcast.kind = Kind::kBroadcast;
  broadcast.root = 2;
  RequestList announce;
  announce.announcements = {allreduce("a", 10, DataType::kFloat32),
                            allreduce("b", 3, DataType::kFloat32), broadcast};
  RequestList ready;
  ready.ready_words = {0x3};
  Bytes rank_zero{0, 1, 3, 2}, payload;
  for (const RequestList* list : {&announce, &ready}) {
    encode(*list, payload);
    for (int rank = 0; rank < 3; ++rank) {
      put(rank_zero, static_cast<uint16_t>(payload.size()));
      store_protocol::append_bytes(rank_zero, payload.data(), payload.size());
    }
  }
  seed("fusion_negotiation", "rank_zero_two_cycles", rank_zero);
  // A member: an error, a fused batch of the cached float32 unit (slot 0) and a new one, the
  // cached broadcast (slot 3) alone, and an allgather.
  ResponseList response;
  response.errors.push_back({"x", Status::kMismatch, "ranks disagree about tensor 'x'"});
  response.batches.push_back(
      {true, {{true, 0, {}}, {false, 5, allreduce("n", 4, DataType::kFloat32)}}});
  response.batches.push_back({false, {{true, 3, {}}}});
  UnitSpec gather;
  gather.kind = Kind::kAllgather;
  gather.members.push_back({"g", 0});
  gather.gather_counts = {1, 2, 3};
  response.batches.push_back({false, {{false, -1, gather}}});
  encode(response, payload);
  Bytes member{1};
  store_protocol::append_bytes(member, payload.data(), payload.size());
  seed("fusion_negotiation", "member_response", member);
  // The same with the autotuner's settings after the batches.
  response.settings = EngineSettings{uint64_t{16} << 20, 2.0, uint64_t{4} << 20, false};
  encode(response, payload);
  Bytes tuned{1};
  store_protocol::append_bytes(tuned, payload.data(), payload.size());
  seed("fusion_negotiation", "member_response_with_settings", tuned);
}

void control_seeds() {
  // 3 ranks, reads of at most 3 bytes (shape 2 + 8 * 2); an ABORT, a WAKE, a GOODBYE.
  Bytes stream{2 + 8 * 2};
  const std::string text = "rank 1 failed: out of memory";
  ControlFrameHeader abort;
  abort.kind = static_cast<uint32_t>(ControlKind::kAbort);
  abort.status = static_cast<int32_t>(Status::kPeerLost);
  abort.origin = 1;
  abort.length = static_cast<uint32_t>(text.size());
  put(stream, abort);
  store_protocol::append_bytes(stream, text.data(), text.size());
  ControlFrameHeader wake, goodbye;
  wake.kind = static_cast<uint32_t>(ControlKind::kWake);
  goodbye.kind = static_cast<uint32_t>(ControlKind::kGoodbye);
  put(stream, wake);
  put(stream, goodbye);
  seed("control_frame", "abort_wake_goodbye", stream);
}

void shm_seeds() {
  // Rank 0; post a 100-byte receive (sequence 1) and a 50-byte send; the peer writes a header (its
  // word right, no payload with it) and 100 bytes and publishes them with `head`; pump; the peer
  // reads what was sent; sleep, pump, wake.
  Bytes script{0};
  auto step = [&](uint8_t op) { script.push_back(op); };
  step(0), put(script, uint16_t{100}), script.push_back(1), script.push_back(0);
  step(1), put(script, uint16_t{50}), script.push_back(1), script.push_back(0);
  step(2), put(script, uint16_t{100}), script.push_back(1), put(script, uint16_t{0});
  script.push_back(0);
  step(3), put(script, uint16_t{100}), script.insert(script.end(), 100, 0x42);
  step(4), step(7), step(6), script.push_back(1), step(8), step(7), step(9);
  seed("shm_ring", "receive_and_send", script);

  // Rank 1; post an 8-byte receive and a 16-byte one (sequences 1 and 2); the peer writes a small
  // message of 8 bytes (its word right) and one of 16 whose word comes from another lap; pump;
  // post a 24-byte send (one line); pump; the peer reads a line.
  Bytes small{1};
  auto op = [&](uint8_t value) { small.push_back(value); };
  op(0), put(small, uint16_t{8}), op(1), op(0);
  op(0), put(small, uint16_t{16}), op(2), op(0);
  op(10), op(8), op(1), op(1), small.insert(small.end(), 8, 0x11), op(0);
  op(10), op(16), op(2), op(1), small.insert(small.end(), 16, 0x22), op(1);
  op(7);
  op(1), put(small, uint16_t{24}), op(3), op(0);
  op(7), op(6), op(1), op(1);
  seed("shm_ring", "small_lines", small);
}

void endpoint_seeds() {
  for (const std::string& text : {"127.0.0.1:29500", "[::1]:80", "node-7.cluster:1234"}) {
    Bytes bytes{0};
    store_protocol::append_bytes(bytes, text.data(), text.size());
    seed("endpoint_auth", "endpoint_" + std::to_string(text.size()), bytes);
  }
  // An answer with the magic and version right and a wrong tag.
  Bytes answer{1, 'K', 'O', 'L', 'O'};
  store_protocol::append_u32(answer, 1);
  answer.resize(1 + 64, 0);
  seed("endpoint_auth", "answer", answer);
}

void lifeline_seeds() {
  using namespace lifeline_wire;
  auto message = [](Word word, int32_t value, const Bytes& payload) {
    Bytes bytes{4};  // a communicator of 5 ranks
    Header header;
    header.word = word;
    header.value = value;
    header.bytes = static_cast<uint32_t>(payload.size());
    put(bytes, header);
    bytes.insert(bytes.end(), payload.begin(), payload.end());
    return bytes;
  };
  seed("lifeline_message", "decision",
       message(kDecision, 0, encode(ShrinkDecision{{1, 2, 4}, 0x1234, "10.0.0.2:4242"})));
  seed("lifeline_message", "commit", message(kCommit, 0, {}));
  const std::string why = "rank 1 could not connect";
  seed("lifeline_message", "abort",
       message(kAbort, static_cast<int32_t>(Status::kPeerLost), Bytes(why.begin(), why.end())));
  seed("lifeline_message", "built", message(kBuilt, 0, {}));
}

}  // namespace

int main(int argc, char** argv) {
  root = argc > 1 ? argv[1] : "tests/fuzz/corpus";
  store_seeds();
  fusion_seeds();
  control_seeds();
  shm_seeds();
  endpoint_seeds();
  lifeline_seeds();
  return 0;
}
