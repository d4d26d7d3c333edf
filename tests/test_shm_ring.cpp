// kolo's shared-memory rings (transport/shm/shm_channel.hpp) between two channels of this
// process, each with its own mapping of one segment as two ranks have: small messages (one line,
// their arrival seen on that line's first word) and large ones (a header line, then the payload
// published by `head`) interleaved over many laps of the ring; a message taken only when its
// line's word says it is there; and a line that held payload in an earlier lap never taken for a
// message, whatever the payload was.
#include <sys/mman.h>
#include <unistd.h>

#include <catch2/catch.hpp>
#include <chrono>
#include <cstring>
#include <deque>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "kolo/status.hpp"
#include "transport/control_channel.hpp"
#include "transport/framing.hpp"
#include "transport/shm/shm_channel.hpp"
#include "transport/shm/shm_segment.hpp"

namespace {

using kolo::Error;
using kolo::OpDescriptor;
using kolo::ShmChannel;
using kolo::Status;
using kolo::Transfer;
namespace shm = kolo::shm;

// One segment (a memfd), zeroed as a fresh one is, mapped twice as two ranks map it; each
// channel unmaps its own. With `one_address`, both channels use one mapping, so that
// ThreadSanitizer, which knows memory by its address, sees the two sides' accesses to the same
// bytes and checks their order (the second unmapping of the address then finds nothing there).
struct Segment {
  void* mappings[2] = {};
  explicit Segment(bool one_address = false) {
    const int fd = ::memfd_create("kolo-test-shm-ring", MFD_CLOEXEC);
    REQUIRE(fd >= 0);
    REQUIRE(::ftruncate(fd, static_cast<off_t>(shm::kSegmentBytes)) == 0);
    for (void*& mapping : mappings) {
      mapping = ::mmap(nullptr, shm::kSegmentBytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
      REQUIRE(mapping != MAP_FAILED);
    }
    if (one_address) {
      ::munmap(mappings[1], shm::kSegmentBytes);
      mappings[1] = mappings[0];
    }
    ::close(fd);
  }
};

// A rank's end: its control channel (never connected: doorbells go nowhere) and its channel.
struct End {
  kolo::ControlChannel control;
  ShmChannel channel;
  End(int rank, void* mapping) : control(rank, 2), channel(rank, 2, control, "ucx") {
    channel.adopt_segment(1 - rank, mapping);
  }
  bool pump() {
    bool moved = false;
    return channel.pump(moved);
  }
  // A wait's step: pump, and let the other thread run when nothing moved (the machine may have
  // fewer free cores than threads).
  void step() {
    bool moved = false;
    channel.pump(moved);
    if (!moved) std::this_thread::yield();
  }
};

// Byte j of message i: what the receiver compares with, computed the same way on both sides.
uint8_t pattern(uint64_t i, uint64_t j) {
  return static_cast<uint8_t>(i * 131 + j * 7 + 1);
}

OpDescriptor descriptor_for(uint64_t i, size_t bytes, int kind) {
  OpDescriptor descriptor;
  descriptor.sequence = i + 1;
  descriptor.count = bytes;
  descriptor.dtype = kolo::DataType::kUInt8;
  if (kind == 1) descriptor.postscale = 0.5;                     // no compact form: a large message
  if (kind == 2) descriptor.detail = i;                          // the same
  if (kind == 3) descriptor.sequence = (uint64_t{1} << 32) + i;  // the same
  return descriptor;
}

struct Message {
  size_t bytes;
  int kind;  // 0: compact descriptor; 1-3: one that has no compact form
};

// Messages of every shape: small ones (up to shm::kSmallBytes), small payloads whose descriptor
// has no compact form, a little over a line, and large ones of up to 300 KiB (more than a slot).
std::vector<Message> script(size_t count, uint64_t seed) {
  std::mt19937_64 random(seed);
  std::vector<Message> messages;
  for (size_t i = 0; i < count; ++i) {
    const uint64_t choice = random() % 100;
    if (choice < 55) {
      messages.push_back({random() % (shm::kSmallBytes + 1), 0});
    } else if (choice < 70) {
      messages.push_back({random() % (shm::kSmallBytes + 1), 1 + static_cast<int>(random() % 3)});
    } else if (choice < 90) {
      messages.push_back({shm::kSmallBytes + 1 + random() % 200, 0});
    } else {
      messages.push_back({1024 + random() % (300 << 10), 0});
    }
  }
  return messages;
}

struct Received {
  std::vector<uint8_t> buffer;
  Transfer transfer;
  size_t sunk_bytes = 0;
  bool bad_sink = false;
};

void sink_into(void* context, size_t offset, const void* piece, size_t length) {
  auto* received = static_cast<Received*>(context);
  if (offset != received->sunk_bytes || offset % received->transfer.sink_grain != 0 ||
      offset + length > received->buffer.size()) {
    received->bad_sink = true;
    return;
  }
  std::memcpy(received->buffer.data() + offset, piece, length);
  received->sunk_bytes += length;
}

// Where the sender's and the receiver's threads report what went wrong (Catch2 is not
// thread-safe).
struct Outcome {
  std::string error;
  void fail(const std::string& what) {
    if (error.empty()) error = what;
  }
};

void send_all(End& end, const std::vector<Message>& messages, Outcome& outcome) {
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(120);
  std::deque<std::pair<std::vector<uint8_t>, Transfer>> window;
  size_t next = 0;
  try {
    while (next < messages.size() || !window.empty()) {
      while (next < messages.size() && window.size() < 8) {
        const Message& message = messages[next];
        auto& [buffer, transfer] = window.emplace_back();
        buffer.resize(message.bytes);
        for (size_t j = 0; j < message.bytes; ++j) buffer[j] = pattern(next, j);
        transfer.reset(1, descriptor_for(next, message.bytes, message.kind), buffer.data(),
                       message.bytes);
        end.channel.post_send(transfer);
        ++next;
      }
      end.step();
      while (!window.empty() && window.front().second.complete) window.pop_front();
      if (std::chrono::steady_clock::now() > deadline) {
        return outcome.fail("the sender timed out at message " + std::to_string(next));
      }
    }
  } catch (const Error& error) {
    outcome.fail(std::string("the sender failed: ") + error.what());
  }
}

void receive_all(End& end, const std::vector<Message>& messages, Outcome& outcome) {
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(120);
  try {
    for (size_t i = 0; i < messages.size(); ++i) {
      Received received;
      received.buffer.assign(messages[i].bytes, 0);
      received.transfer.reset(0, descriptor_for(i, messages[i].bytes, messages[i].kind),
                              received.buffer.data(), messages[i].bytes);
      if (i % 3 == 1) {
        received.transfer.sink = sink_into;
        received.transfer.sink_context = &received;
        received.transfer.sink_grain = size_t{1} << (i / 3 % 4);  // an element: 1, 2, 4, 8
      }
      end.channel.post_recv(received.transfer);
      while (!received.transfer.complete) {
        end.step();
        if (std::chrono::steady_clock::now() > deadline) {
          return outcome.fail("the receiver timed out at message " + std::to_string(i));
        }
      }
      if (received.bad_sink ||
          (received.transfer.sink && received.sunk_bytes != messages[i].bytes)) {
        return outcome.fail("message " + std::to_string(i) + " was handed to the sink wrongly");
      }
      for (size_t j = 0; j < messages[i].bytes; ++j) {
        if (received.buffer[j] != pattern(i, j)) {
          return outcome.fail("message " + std::to_string(i) + " (" +
                              std::to_string(messages[i].bytes) + " bytes) differs at byte " +
                              std::to_string(j));
        }
      }
    }
  } catch (const Error& error) {
    outcome.fail(std::string("the receiver failed: ") + error.what());
  }
}

// The error a receive posted for `posted` meets when `header` arrives, as check_frame words it.
std::string mismatch_words(const Transfer& posted, const kolo::FrameHeader& header) {
  try {
    kolo::check_frame(0, posted, header);
  } catch (const Error& error) {
    return error.what();
  }
  return "";
}

// Writes a small message line as a peer would, the word last (or not at all when word is 0).
void write_small(char* ring, uint64_t at, const OpDescriptor& descriptor, const void* payload,
                 size_t bytes, uint64_t word) {
  shm::SmallBody body = shm::small_body(descriptor);
  std::memcpy(body.payload, payload, bytes);
  std::memcpy(ring + at % shm::kCapacity + 8, &body, sizeof body);
  if (word != 0) shm::line_word_at(ring, at).store(word, std::memory_order_release);
}

}  // namespace

TEST_CASE("shm ring: small and large messages interleaved over many laps, two threads",
          "[shm_ring]") {
  const std::vector<Message> messages = script(3000, 48);
  uint64_t total = 0;
  for (const Message& message : messages) total += (message.bytes + 64 + 63) / 64 * 64;
  REQUIRE(total > 5 * shm::kCapacity);  // the ring laps several times
  Segment segment(true);
  End sender(0, segment.mappings[0]), receiver(1, segment.mappings[1]);
  Outcome sent, received;
  std::thread producer([&] { send_all(sender, messages, sent); });
  receive_all(receiver, messages, received);
  producer.join();
  CHECK(sent.error == "");
  CHECK(received.error == "");
}

// Rank `rank` of a ping-pong of small messages: rank 0 sends message i and waits for rank 1's
// answer, which carries the same bytes plus one. Only line words and `tail` pass between the
// threads (no large message stores `head`), so ThreadSanitizer checks that a line's word orders
// its body.
void ping_pong(End& end, int rank, uint64_t rounds, Outcome& outcome) {
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(120);
  try {
    for (uint64_t i = 0; i < rounds; ++i) {
      const size_t bytes = 1 + i % shm::kSmallBytes;
      uint8_t mine[shm::kSmallBytes], theirs[shm::kSmallBytes] = {};
      Transfer send, recv;
      recv.reset(1 - rank, descriptor_for(i, bytes, 0), theirs, bytes);
      if (rank == 1) {
        end.channel.post_recv(recv);
        while (!recv.complete) {
          end.step();
          if (std::chrono::steady_clock::now() > deadline) return outcome.fail("rank 1 timed out");
        }
        for (size_t j = 0; j < bytes; ++j) {
          if (theirs[j] != pattern(i, j)) return outcome.fail("rank 1 got a wrong byte");
          mine[j] = static_cast<uint8_t>(theirs[j] + 1);
        }
        send.reset(0, descriptor_for(i, bytes, 0), mine, bytes);
        end.channel.post_send(send);
        while (!send.complete) end.step();
      } else {
        for (size_t j = 0; j < bytes; ++j) mine[j] = pattern(i, j);
        send.reset(1, descriptor_for(i, bytes, 0), mine, bytes);
        end.channel.post_send(send);
        while (!send.complete) end.step();
        end.channel.post_recv(recv);
        while (!recv.complete) {
          end.step();
          if (std::chrono::steady_clock::now() > deadline) return outcome.fail("rank 0 timed out");
        }
        for (size_t j = 0; j < bytes; ++j) {
          if (theirs[j] != static_cast<uint8_t>(pattern(i, j) + 1)) {
            return outcome.fail("rank 0 got a wrong answer in round " + std::to_string(i));
          }
        }
      }
    }
  } catch (const Error& error) {
    outcome.fail(std::string("rank ") + std::to_string(rank) + " failed: " + error.what());
  }
}

TEST_CASE("shm ring: small messages back and forth, two threads", "[shm_ring][ping_pong]") {
  const uint64_t rounds = 5000;
  Segment segment(true);
  End first(0, segment.mappings[0]), second(1, segment.mappings[1]);
  Outcome one, two;
  std::thread answerer([&] { ping_pong(second, 1, rounds, two); });
  ping_pong(first, 0, rounds, one);
  answerer.join();
  CHECK(one.error == "");
  CHECK(two.error == "");
}

TEST_CASE("shm ring: a small message is taken only when its line's word says it is there",
          "[shm_ring]") {
  Segment segment;
  End receiver(0, segment.mappings[0]);
  char* ring = shm::ring_data(segment.mappings[1], 1);  // what rank 1 writes, rank 0 reads
  const uint8_t payload[8] = {1, 2, 3, 4, 5, 6, 7, 8};
  OpDescriptor descriptor = descriptor_for(0, sizeof payload, 0);
  uint8_t buffer[8] = {};
  Transfer transfer;
  transfer.reset(1, descriptor, buffer, sizeof buffer);
  receiver.channel.post_recv(transfer);

  SECTION("the line written but no word") {
    write_small(ring, 0, descriptor, payload, sizeof payload, 0);
    for (int i = 0; i < 10; ++i) receiver.pump();
    CHECK(!transfer.complete);
    // The word arrives: the message is taken, whole.
    shm::line_word_at(ring, 0).store(shm::line_word(0, shm::LineKind::kSmall, 8));
    CHECK(receiver.pump());
    CHECK(transfer.complete);
    CHECK(std::memcmp(buffer, payload, sizeof payload) == 0);
  }
  SECTION("the word of this line in another lap") {
    write_small(ring, 0, descriptor, payload, sizeof payload,
                shm::line_word(shm::kCapacity, shm::LineKind::kSmall, 8));
    for (int i = 0; i < 10; ++i) receiver.pump();
    CHECK(!transfer.complete);
    CHECK(buffer[0] == 0);
  }
  SECTION("the word of another line: a corrupt ring, the peer is lost") {
    write_small(ring, 0, descriptor, payload, sizeof payload,
                shm::line_word(64, shm::LineKind::kSmall, 8));
    try {
      receiver.pump();
      FAIL("a word stamped for another line was taken");
    } catch (const Error& error) {
      CHECK(error.status() == Status::kPeerLost);
      CHECK_THAT(error.what(), Catch::Contains("rank 1 sent a malformed message"));
    }
    CHECK(!transfer.complete);
  }
  SECTION("a length over a small message's: corrupt") {
    write_small(ring, 0, descriptor, payload, sizeof payload,
                shm::line_word(0, shm::LineKind::kSmall, shm::kSmallBytes + 1));
    CHECK_THROWS_AS(receiver.pump(), Error);
    CHECK(!transfer.complete);
  }
  SECTION("another call: the mismatch in check_frame's words, nothing copied") {
    OpDescriptor other = descriptor;
    other.sequence = 7;
    write_small(ring, 0, other, payload, sizeof payload,
                shm::line_word(0, shm::LineKind::kSmall, 8));
    kolo::FrameHeader header;
    header.bytes = 8;
    header.descriptor = other;
    const std::string expected = mismatch_words(transfer, header);
    REQUIRE(expected != "");
    try {
      receiver.pump();
      FAIL("a message of another call was taken");
    } catch (const Error& error) {
      CHECK(error.status() == Status::kMismatch);
      CHECK(std::string(error.what()) == expected);
    }
    CHECK(buffer[0] == 0);
  }
  SECTION("another length: the mismatch") {
    write_small(ring, 0, descriptor, payload, 4, shm::line_word(0, shm::LineKind::kSmall, 4));
    try {
      receiver.pump();
      FAIL("a message of another length was taken");
    } catch (const Error& error) {
      CHECK(error.status() == Status::kMismatch);
      CHECK_THAT(error.what(), Catch::Contains("a message of 4 bytes"));
    }
  }
  receiver.channel.forget();
}

TEST_CASE("shm ring: a line that held payload a lap earlier is never taken for a message",
          "[shm_ring]") {
  Segment segment;
  End sender(0, segment.mappings[0]), receiver(1, segment.mappings[1]);
  // A large message whose every line is forged as the small message the receiver will wait for
  // at that line one lap later: its word, stamp and all, and a matching descriptor.
  const size_t bytes = 64 << 10;
  std::vector<uint8_t> forged(bytes);
  for (size_t line = 0; line < bytes / 64; ++line) {
    const uint64_t at = 64 + line * 64 + shm::kCapacity;
    const uint64_t word = shm::line_word(at, shm::LineKind::kSmall, 8);
    const shm::SmallBody body = shm::small_body(descriptor_for(0, 8, 0));
    std::memcpy(forged.data() + line * 64, &word, 8);
    std::memcpy(forged.data() + line * 64 + 8, &body, sizeof body);
  }
  OpDescriptor large;
  large.count = bytes;
  Transfer send, recv;
  std::vector<uint8_t> into(bytes);
  send.reset(1, large, forged.data(), bytes);
  recv.reset(0, large, into.data(), bytes);
  sender.channel.post_send(send);
  receiver.channel.post_recv(recv);
  for (int i = 0; i < 100 && !recv.complete; ++i) sender.pump(), receiver.pump();
  REQUIRE(recv.complete);
  REQUIRE(into == forged);

  // Small messages, in lockstep, until the stream has passed over the forged lines again: before
  // each is sent, the receiver's posted receive must stay incomplete.
  const uint64_t count = shm::kCapacity / 64 + 16;
  for (uint64_t i = 1; i <= count; ++i) {
    uint8_t payload[8], buffer[8] = {};
    for (size_t j = 0; j < 8; ++j) payload[j] = pattern(i, j);
    const OpDescriptor descriptor = descriptor_for(0, 8, 0);
    Transfer small_send, small_recv;
    small_recv.reset(0, descriptor, buffer, 8);
    receiver.channel.post_recv(small_recv);
    receiver.pump();
    if (small_recv.complete) FAIL("message " << i << " was taken before it was sent");
    small_send.reset(1, descriptor, payload, 8);
    sender.channel.post_send(small_send);
    REQUIRE(small_send.complete);
    receiver.pump();
    REQUIRE(small_recv.complete);
    REQUIRE(std::memcmp(buffer, payload, 8) == 0);
  }
}

// The first send on a link writes every line of the ring it fills (to bring the lines into the
// caches, ShmChannel::Link::warm_out) and changes no byte there: whatever the lines hold, the
// consumer may be reading them.
TEST_CASE("shm ring: the first send warms the ring without changing what it holds", "[shm_ring]") {
  Segment segment;
  char* ring = shm::ring_data(segment.mappings[0], 0);  // what rank 0 writes, rank 1 reads
  // Every line but the first (where the message goes) holds bytes no fresh ring has: words of
  // this line stamped a lap later, which the consumer takes for "nothing yet", and a pattern.
  std::vector<uint8_t> before(shm::kCapacity);
  for (uint64_t at = shm::kCacheLine; at < shm::kCapacity; at += shm::kCacheLine) {
    const uint64_t word = shm::line_word(at + shm::kCapacity, shm::LineKind::kSmall, 8);
    std::memcpy(before.data() + at, &word, sizeof word);
    for (size_t j = sizeof word; j < shm::kCacheLine; ++j) before[at + j] = pattern(at, j);
  }
  std::memcpy(ring, before.data(), shm::kCapacity);
  End sender(0, segment.mappings[0]), receiver(1, segment.mappings[1]);
  uint8_t payload[8] = {9, 8, 7, 6, 5, 4, 3, 2};
  uint8_t buffer[8] = {};
  const OpDescriptor descriptor = descriptor_for(0, sizeof payload, 0);
  Transfer send, recv;
  send.reset(1, descriptor, payload, sizeof payload);
  recv.reset(0, descriptor, buffer, sizeof buffer);
  receiver.channel.post_recv(recv);
  sender.channel.post_send(send);
  REQUIRE(send.complete);
  receiver.pump();
  REQUIRE(recv.complete);
  CHECK(std::memcmp(buffer, payload, sizeof payload) == 0);
  size_t changed = 0;
  for (uint64_t at = shm::kCacheLine; at < shm::kCapacity; ++at) {
    if (static_cast<uint8_t>(ring[at]) != before[at]) ++changed;
  }
  CHECK(changed == 0);
}
