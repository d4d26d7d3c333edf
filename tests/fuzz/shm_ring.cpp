// kolo's shared-memory rings (src/transport/shm/shm_channel.hpp) with a hostile peer on the
// other side of the segment: it writes any header and bytes into the ring this rank reads,
// publishes any write counter, and moves the read counter of the ring this rank writes at will.
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
      switch (input.take<uint8_t>() % 10) {
        case 0:
          post(false);
          break;
        case 1:
          post(true);
          break;
        case 2: {  // the peer writes a well-formed header, of a message of any length
          FrameHeader frame;
          frame.bytes = input.take<uint16_t>() % kMaxMessage;
          frame.descriptor.sequence = input.take<uint8_t>();
          write_ring(in_data, written, reinterpret_cast<const uint8_t*>(&frame), sizeof frame);
          written += sizeof frame;
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
        case 6:
          out.tail.store(input.take<uint8_t>() % 2 ? out.head.load() : input.take<uint64_t>());
          break;
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
