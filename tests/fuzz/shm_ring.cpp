// kolo's shared-memory rings (src/transport/shm/shm_channel.hpp) with a hostile peer on the
// other side of the segment: it writes message lines (a small message whole, a large one's
// header) with their first word right, stamped for another lap or another line, or missing, any
// word anywhere, and any bytes into the ring this rank reads, publishes any write counter, and
// moves the read counter of the ring this rank writes at will.
// The input is a script of such moves and of this rank's posts, pumps and sleeps. Whatever the
// peer does, this rank copies only within its posted buffers (AddressSanitizer) and within the
// segment (inaccessible pages around it), hands a sink only whole grains within the message, and
// reports a corrupt ring as an error, never a crash.
#include <sys/mman.h>
#include <unistd.h>

#include <list>

#include "fuzz_input.hpp"
#include "transport/control_channel.hpp"
#include "transport/framing.hpp"
#include "transport/shm/shm_segment.hpp"

using namespace kolo;

namespace {

constexpr int kMaxSteps = 64;
// Messages up to 8 KiB: larger ones take no other path through the consumer (a piece ends at the
// message, the slot or the ring's end, whichever comes first, and the script cannot fill a 2 MiB
// ring), and their copies and fresh pages would make each execution many times slower.
constexpr size_t kMaxMessage = 8192;

struct Posted {
  Transfer transfer;
  std::vector<uint8_t> buffer;
};

void check_sink(void* context, size_t offset, const void*, size_t length) {
  const auto* transfer = static_cast<const Transfer*>(context);
  FUZZ_REQUIRE(offset % transfer->sink_grain == 0 && length > 0);
  FUZZ_REQUIRE(offset + length <= transfer->bytes);
}

// A segment with an inaccessible page on either side, which the channel unmaps itself.
char* map_guarded_segment() {
  const size_t page = static_cast<size_t>(::sysconf(_SC_PAGESIZE));
  void* region =
      ::mmap(nullptr, shm::kSegmentBytes + 2 * page, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  FUZZ_REQUIRE(region != MAP_FAILED);
  char* segment = static_cast<char*>(region) + page;
  FUZZ_REQUIRE(::mprotect(segment, shm::kSegmentBytes, PROT_READ | PROT_WRITE) == 0);
  return segment;
}

void unmap_guards(char* segment) {
  const size_t page = static_cast<size_t>(::sysconf(_SC_PAGESIZE));
  ::munmap(segment - page, page);
  ::munmap(segment + shm::kSegmentBytes, page);
}

// Writes bytes into a ring at byte position `at` of its stream, wrapping at the end.
void write_ring(char* ring, uint64_t at, const uint8_t* bytes, size_t size) {
  for (size_t done = 0; done < size;) {
    const size_t offset = (at + done) % shm::kCapacity;
    const size_t piece = std::min(size - done, shm::kCapacity - offset);
    std::memcpy(ring + offset, bytes + done, piece);
    done += piece;
  }
}

void run(FuzzInput& input, char* segment) {
  const int rank = input.take<uint8_t>() % 2, peer = 1 - rank;
  std::list<Posted> posted;  // outlives the channel, which points into it
  ControlChannel control(rank, 2);
  ShmChannel channel(rank, 2, control, "ucx");
  channel.adopt_segment(peer, segment);
  auto* header = reinterpret_cast<shm::SegmentHeader*>(segment);
  const int theirs = rank < peer ? 1 : 0;  // the ring the peer writes and this rank reads
  shm::RingCounters& in = header->rings[theirs];
  shm::RingCounters& out = header->rings[1 - theirs];
  char* in_data = shm::ring_data(segment, theirs);
  uint64_t written = 0;  // how far the peer has written into its ring
  auto line_start = [&] { return written = (written + 63) / 64 * 64; };
  // The first word of the line at `at`: right (0), another lap's (1), another line's (2), none
  // (3), or any value.
  auto store_word = [&](uint64_t at, shm::LineKind kind, uint64_t length) {
    const uint8_t choice = input.take<uint8_t>() % 5;
    uint64_t word = shm::line_word(at, kind, length);
    if (choice == 1) word = shm::line_word(at + shm::kCapacity, kind, length);
    if (choice == 2) word = shm::line_word(at + 64, kind, length);
    if (choice == 4) word = input.take<uint64_t>();
    if (choice != 3) shm::line_word_at(in_data, at).store(word, std::memory_order_release);
  };

  auto post = [&](bool send) {
    Posted& entry = posted.emplace_back();
    const size_t bytes = input.take<uint16_t>() % kMaxMessage;
    OpDescriptor descriptor;
    descriptor.sequence = input.take<uint8_t>();
    entry.buffer.assign(bytes, 0x5a);
    entry.transfer.reset(peer, descriptor, entry.buffer.data(), bytes);
    const uint8_t sink = input.take<uint8_t>();
    if (send) return channel.post_send(entry.transfer);
    if (sink % 2 == 1) {
      entry.transfer.sink = check_sink;
      entry.transfer.sink_context = &entry.transfer;
      entry.transfer.sink_grain = 1 + sink / 2 % 8;
    }
    return channel.post_recv(entry.transfer);
  };
  try {
    for (int step = 0; step < kMaxSteps && input.left() > 0; ++step) {
      switch (input.take<uint8_t>() % 12) {
        case 0:
          post(false);
          break;
        case 1:
          post(true);
          break;
        case 2: {  // the peer writes a large message's first line, of a message of any length
          shm::LargeBody body{};
          body.bytes = input.take<uint16_t>() % kMaxMessage;
          body.descriptor.sequence = input.take<uint8_t>();
          const uint64_t at = line_start();
          write_ring(in_data, at + 8, reinterpret_cast<const uint8_t*>(&body), sizeof body);
          // How much payload came with it: none, any amount (the peer writes it later or not at
          // all), or more than the message.
          store_word(at, shm::LineKind::kLarge, input.take<uint16_t>());
          written += 64;
          break;
        }
        case 3: {  // the peer writes any bytes
          const std::vector<uint8_t> bytes = input.take_bytes(input.take<uint16_t>() % kMaxMessage);
          write_ring(in_data, written, bytes.data(), bytes.size());
          written += bytes.size();
          break;
        }
        case 4:  // the peer publishes what it wrote, padded as a whole message is
          written = (written + 63) / 64 * 64;
          in.head.store(written);
          break;
        case 5:
          in.head.store(input.take<uint64_t>());
          break;
        case 6: {  // the peer reads: up to what `head` says, some lines on, or anywhere
          const uint8_t choice = input.take<uint8_t>() % 3;
          out.tail.store(choice == 0   ? out.head.load()
                         : choice == 1 ? out.tail.load() + 64 * (input.take<uint8_t>() % 8)
                                       : input.take<uint64_t>());
          break;
        }
        case 7: {
          bool moved = false;
          channel.pump(moved);
          break;
        }
        case 8:
          channel.prepare_sleep();
          break;
        case 9:
          channel.end_sleep();
          break;
        case 10: {  // the peer writes a small message, its length up to a line's
          const uint64_t bytes = input.take<uint8_t>() % 64;
          OpDescriptor descriptor;
          descriptor.sequence = input.take<uint8_t>();
          descriptor.count = input.take<uint8_t>() % 2 ? bytes : input.take<uint16_t>();
          shm::SmallBody body = shm::small_body(descriptor);
          const std::vector<uint8_t> payload = input.take_bytes(std::min(bytes, shm::kSmallBytes));
          if (!payload.empty()) std::memcpy(body.payload, payload.data(), payload.size());
          const uint64_t at = line_start();
          write_ring(in_data, at + 8, reinterpret_cast<const uint8_t*>(&body), sizeof body);
          store_word(at, shm::LineKind::kSmall, bytes);
          written += 64;
          break;
        }
        case 11: {  // the peer stores a word at any line of its ring
          const uint64_t at = input.take<uint16_t>() * uint64_t{64};
          const uint64_t word =
              input.take<uint8_t>() % 2
                  ? shm::line_word(at, shm::LineKind::kSmall, input.take<uint8_t>() % 64)
                  : input.take<uint64_t>();
          shm::line_word_at(in_data, at).store(word, std::memory_order_release);
          break;
        }
      }
      for (const Posted& entry : posted) {
        FUZZ_REQUIRE(entry.transfer.done <= entry.transfer.bytes);
        FUZZ_REQUIRE(!entry.transfer.complete || entry.transfer.done == entry.transfer.bytes);
      }
    }
  } catch (const Error&) {
    // A mismatch or a corrupt ring: the transport fails, as it must.
  }
  channel.forget();
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  FuzzInput input(data, size);
  char* segment = map_guarded_segment();
  run(input, segment);
  unmap_guards(segment);
  return 0;
}
