// kolo's shared-memory rings between two ranks of one host: set-up, the copies in and out, and
// the doorbells (shm_channel.hpp says how and why).
#include "transport/shm/shm_channel.hpp"

#include <fcntl.h>
#include <fmt/format.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cctype>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <random>

#include "core/log.hpp"
#include "net/socket.hpp"
#include "transport/control_channel.hpp"
#include "transport/framing.hpp"
#include "transport/shm/shm_segment.hpp"

#if defined(__SSE2__)
#include <emmintrin.h>
#endif

namespace kolo {
namespace {

constexpr uint64_t kSegmentMagic = 0x6b6f6c6f73686d31;  // "kolosh m1"
constexpr uint32_t kHelloMagic = 0x4f4c4548;            // "HELO"
constexpr size_t kAlign = shm::kCacheLine;              // messages are padded to whole cache lines
using shm::kCapacity;
using shm::kSegmentBytes;
using shm::RingCounters;
using shm::SegmentHeader;

static_assert(sizeof(FrameHeader) == kAlign, "a frame header lies whole within the ring");

// Set-up frames on the control socket.
struct Hello {
  uint32_t magic = kHelloMagic;
  uint32_t enabled = 0;
  char host[192] = {};  // host identity (core/host.hpp), at most kMaxHostIdBytes
};
struct Offer {
  char name[64] = {};  // empty: the lower rank could not make a segment
  uint64_t cookie = 0;
};

uint64_t random_u64() {
  std::random_device device;
  return (static_cast<uint64_t>(device()) << 32) ^ device();
}

// Segment names are "/kolo-<creator's pid>-<16 hex digits>".
std::string segment_name() {
  return fmt::format("/kolo-{}-{:016x}", ::getpid(), random_u64());
}

// A segment's name lives in /dev/shm only from its creation until the peer has opened it, but a
// creator killed (SIGKILL) inside that window leaves it there for good. Before making segments,
// each rank removes the names whose creator no longer exists (kill(pid, 0) fails with ESRCH).
// A creator in another PID namespace that shares this /dev/shm looks dead too; its peer then
// fails to open the segment and that pair keeps the network, which costs speed, not correctness.
void remove_stale_segments(const char* transport, int rank) {
  std::error_code error;
  for (const auto& entry : std::filesystem::directory_iterator("/dev/shm", error)) {
    const std::string file = entry.path().filename().string();
    unsigned pid = 0;
    char hex[17] = {};
    int end = 0;
    if (std::sscanf(file.c_str(), "kolo-%u-%16[0-9a-f]%n", &pid, hex, &end) != 2 ||
        static_cast<size_t>(end) != file.size() || std::strlen(hex) != 16 || pid == 0 ||
        pid == static_cast<unsigned>(::getpid())) {
      continue;
    }
    if (::kill(static_cast<pid_t>(pid), 0) == 0 || errno != ESRCH) continue;
    if (::shm_unlink(("/" + file).c_str()) == 0) {
      log::info("{}: rank {} removed /dev/shm/{}, left by process {} that no longer exists",
                transport, rank, file, pid);
    }
  }
}

// Copies a piece into a ring, with plain stores while the consumer's core shares a cache with
// this one, and from kStreamBytes on with non-temporal stores while it does not: with a shared
// cache, plain copies leave the piece where the consumer reads it; without one, every line a
// plain copy wrote is fetched out of the other cache, and streamed stores, which go to memory,
// win (docs/tuning.md, "Shared-memory rings"). Which case holds is read off the ring
// itself (Link::far, below). The fence orders
// the streamed stores before the store of `head` that publishes them.
constexpr size_t kStreamBytes = size_t{16} << 10;
// A load of the consumer's counter that finds a new value fetches its cache line from the
// consumer's core, in about half a cache_pingpong round trip (40-50 ns within a core complex,
// 170-190 across) plus the clock's own cost; a slower one is a vote for far.
constexpr double kFarNanoseconds = 120.0;

void copy_into_ring(char* ring, const char* from, size_t bytes, bool stream) {
#if defined(__SSE2__)
  if (stream && bytes >= kStreamBytes && reinterpret_cast<uintptr_t>(ring) % 16 == 0) {
    size_t done = 0;
    for (; done + 64 <= bytes; done += 64) {
      const auto* source = reinterpret_cast<const __m128i*>(from + done);
      auto* target = reinterpret_cast<__m128i*>(ring + done);
      __m128i a = _mm_loadu_si128(source);
      __m128i b = _mm_loadu_si128(source + 1);
      __m128i c = _mm_loadu_si128(source + 2);
      __m128i d = _mm_loadu_si128(source + 3);
      _mm_stream_si128(target, a);
      _mm_stream_si128(target + 1, b);
      _mm_stream_si128(target + 2, c);
      _mm_stream_si128(target + 3, d);
    }
    std::memcpy(ring + done, from + done, bytes - done);
    _mm_sfence();
    return;
  }
#else
  (void)stream;
#endif
  std::memcpy(ring, from, bytes);
}

// Loads a byte of the line at `line` and throws it away, to bring the line into this core's
// caches. The producer may be storing into the line meanwhile, so the load is an assembler
// statement, which is no access in the C++ memory model (a plain or atomic load would race with
// the producer's plain stores there); what it reads does not matter. Elsewhere a prefetch, which
// measured no better than nothing on x86-64.
inline void touch_line(const char* line) {
#if defined(__x86_64__)
  unsigned char ignored;
  asm volatile("movb (%1), %0" : "=q"(ignored) : "r"(line));
#elif defined(__aarch64__)
  unsigned ignored;
  asm volatile("ldrb %w0, [%1]" : "=r"(ignored) : "r"(line));
#else
  __builtin_prefetch(line, 0, 3);
#endif
}

uint64_t round_up(uint64_t value) {
  return (value + kAlign - 1) & ~uint64_t{kAlign - 1};
}

}  // namespace

// One peer's segment as this rank sees it: the ring it writes, the ring it reads, and the
// transfers queued on each.
struct ShmChannel::Link {
  void* mapping = nullptr;
  int peer = -1;
  RingCounters* out = nullptr;  // this rank produces
  RingCounters* in = nullptr;   // this rank consumes
  char* out_data = nullptr;
  char* in_data = nullptr;
  uint64_t head = 0;  // out: what this rank published
  uint64_t tail = 0;  // in: what this rank consumed
  // Whether the consumer's core is far (shares no cache with this one), by a vote of the last
  // loads of out->tail that found a new value, each of which fetched the counter's cache line
  // from the consumer's core: +1 when that took longer than kFarNanoseconds, -1 otherwise, kept
  // within +-32 so that a change of placement shows within a few dozen pieces and one slow load
  // (an interrupt) changes nothing.
  uint64_t seen_tail = 0;  // out->tail as last loaded
  bool out_warm = false;   // warm_out() has run
  bool in_warm = false;    // warm_in() has run
  int far_votes = 0;
  bool far() const { return far_votes > 0; }
  void vote_far(bool slow) { far_votes = std::clamp(far_votes + (slow ? 1 : -1), -32, 32); }

  // Which lines of the out ring hold payload in their first word (one bit a line): before a
  // message that ends at such a line is published, the line's word is cleared, so that the
  // consumer, which reads the next message's word there, never takes stale payload for it.
  std::vector<uint64_t> payload_lines = std::vector<uint64_t>(shm::kLines / 64, 0);

  IntrusiveFifo<Transfer> sends;
  bool header_sent = false;  // for the first of sends
  uint64_t header_at = 0;    // where its header line lies
  IntrusiveFifo<Transfer> recvs;
  bool header_checked = false;  // for the first of recvs
  uint64_t announced = 0;       // in: where its payload is known to be published up to
  size_t pending = 0;

  bool consumer_flag = false;  // this rank set in->consumer_waiting
  bool producer_flag = false;  // this rank set out->producer_waiting

  ~Link() {
    if (mapping) ::munmap(mapping, kSegmentBytes);
  }

  // Marks the lines that begin within [from, to) of the out ring's stream as holding payload.
  void mark_payload(uint64_t from, uint64_t to) {
    for (uint64_t line = (from + kAlign - 1) / kAlign; line * kAlign < to;) {
      const uint64_t index = line % shm::kLines, bit = index % 64;
      const uint64_t count =
          std::min<uint64_t>(64 - bit, (to - line * kAlign + kAlign - 1) / kAlign);
      payload_lines[index / 64] |=
          (count == 64 ? ~uint64_t{0} : ((uint64_t{1} << count) - 1) << bit);
      line += count;
    }
  }
  // Before the line at `at` is published as the next message's place: no stale payload in its
  // word. Lines that held a message's first line keep their stamp, which the consumer knows for
  // an earlier lap's.
  void clear_line(uint64_t at) {
    const uint64_t index = at / kAlign % shm::kLines;
    uint64_t& bits = payload_lines[index / 64];
    const uint64_t bit = uint64_t{1} << (index % 64);
    if ((bits & bit) == 0) return;
    bits &= ~bit;
    shm::line_word_at(out_data, at).store(0, std::memory_order_relaxed);
  }

  // A fresh ring's lines are in memory, in no cache. On the AMD EPYC machines measured the shared
  // L3 takes a line only when a core's L2 evicts it, so every line of a ring's first lap (2 MiB)
  // came from memory as a message was written to it: 4 KiB and 32 KiB allreduces ran 1.2-1.4x
  // slower for a job's first few hundred to few thousand calls than after it (bench/warmup.sh).
  // Called before the first send on the link, this writes every line of the out ring once (an
  // atomic OR of zero: no value changes, whatever the consumer reads meanwhile), 0.1-0.2 ms that
  // the first send on the link pays instead of the first lap.
  void warm_out() {
    out_warm = true;
    for (uint64_t at = 0; at < kCapacity; at += kAlign) {
      shm::line_word_at(out_data, at).fetch_or(0, std::memory_order_relaxed);
    }
  }
  // The consumer's side of the same: with only the producer's lines warm, a fresh job's first lap
  // still ran slower than the laps after it (32 KiB allreduce, N = 2: calls 11-100 a median 1.36x
  // the job's calls 1,001-6,000). Loading every line of the in ring once before the first receive
  // on the link brought that to 1.04-1.06x; touching one word a page (the page walks alone) did
  // not help (docs/performance.md, "The consumer's lines").
  void warm_in() {
    in_warm = true;
    for (uint64_t at = 0; at < kCapacity; at += kAlign) touch_line(in_data + at);
  }

  void attach(void* memory, bool lower) {
    mapping = memory;
    auto* header = static_cast<SegmentHeader*>(memory);
    out = &header->rings[lower ? 0 : 1];
    in = &header->rings[lower ? 1 : 0];
    out_data = shm::ring_data(memory, lower ? 0 : 1);
    in_data = shm::ring_data(memory, lower ? 1 : 0);
  }
};

ShmChannel::ShmChannel(int rank, int size, ControlChannel& control, const char* transport)
    : rank_(rank), size_(size), transport_(transport), control_(control), links_(size) {
  for (char c : std::string(transport)) network_ += static_cast<char>(std::toupper(c));
}

ShmChannel::~ShmChannel() = default;

size_t ShmChannel::pending(int peer) const {
  return links_[peer] ? links_[peer]->pending : 0;
}

// ---- set-up -------------------------------------------------------------------------------------

void ShmChannel::connect(const std::vector<PeerSockets>& sockets, const std::string& host,
                         bool enabled, Copy copy, const Deadline& deadline) {
  copy_ = copy;
  // 1. Every rank tells every peer its host and whether it wants rings; small frames, so sending
  // to all before receiving from any cannot block.
  Hello mine;
  mine.enabled = enabled ? 1 : 0;
  std::memcpy(mine.host, host.data(), std::min(host.size(), sizeof(mine.host) - 1));
  for (int peer = 0; peer < size_; ++peer) {
    if (peer != rank_) net::send_all(sockets[peer].control, &mine, sizeof(mine), deadline);
  }
  std::vector<std::string> why(size_);
  std::vector<bool> candidate(size_, false);
  for (int peer = 0; peer < size_; ++peer) {
    if (peer == rank_) continue;
    Hello theirs;
    net::recv_all(sockets[peer].control, &theirs, sizeof(theirs), deadline);
    if (theirs.magic != kHelloMagic) {
      throw control_.lost(peer, "it sent a malformed start-up message");
    }
    theirs.host[sizeof(theirs.host) - 1] = '\0';
    const bool other_host = host != theirs.host;
    other_hosts_ += other_host ? 1 : 0;
    if (!enabled || !theirs.enabled) {
      why[peer] = "KOLO_SHM=0";
    } else if (other_host) {
      why[peer] = "another host";
    } else {
      candidate[peer] = true;
    }
  }

  // 2. The lower rank of each same-host pair makes the segment and offers it; the higher one
  // opens it, checks the cookie and answers. Offers go out before any answer is awaited.
  if (std::count(candidate.begin(), candidate.end(), true) > 0)
    remove_stale_segments(transport_, rank_);
  std::vector<std::string> names(size_);
  std::vector<uint64_t> cookies(size_, 0);
  try {
    for (int peer = rank_ + 1; peer < size_; ++peer) {
      if (!candidate[peer]) continue;
      Offer offer;
      std::string name = segment_name();
      int fd = ::shm_open(name.c_str(), O_RDWR | O_CREAT | O_EXCL | O_CLOEXEC, 0600);
      void* memory = MAP_FAILED;
      int error = 0;
      if (fd < 0) {
        error = errno;
      } else {
        // posix_fallocate returns the error instead of setting errno.
        error = ::posix_fallocate(fd, 0, kSegmentBytes);
        if (error == 0) {
          memory = ::mmap(nullptr, kSegmentBytes, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE,
                          fd, 0);
          if (memory == MAP_FAILED) error = errno;
        }
        ::close(fd);
      }
      if (memory == MAP_FAILED) {
        if (fd >= 0) ::shm_unlink(name.c_str());
        why[peer] = fmt::format("cannot make a shared segment of {} bytes: {}", kSegmentBytes,
                                std::strerror(error));
        log::warn("{}: rank {}: {}; rank {} keeps {}", transport_, rank_, why[peer], peer,
                  network_);
      } else {
        auto* header = new (memory) SegmentHeader{};
        header->magic = kSegmentMagic;
        header->cookie = cookies[peer] = random_u64();
        header->slot_bytes = kSlotBytes;
        header->slots = kSlots;
        adopt_segment(peer, memory);
        names[peer] = name;
        std::memcpy(offer.name, name.data(), name.size());
        offer.cookie = cookies[peer];
      }
      net::send_all(sockets[peer].control, &offer, sizeof(offer), deadline);
    }
    for (int peer = 0; peer < rank_; ++peer) {
      if (!candidate[peer]) continue;
      Offer offer;
      net::recv_all(sockets[peer].control, &offer, sizeof(offer), deadline);
      offer.name[sizeof(offer.name) - 1] = '\0';
      uint8_t answer = 0;
      if (offer.name[0] == '\0') {
        why[peer] = "it could not make a shared segment";
      } else if (offer.name[0] != '/' || std::strncmp(offer.name, "/kolo-", 6) != 0) {
        throw control_.lost(peer, "it sent a malformed start-up message");
      } else {
        int fd = ::shm_open(offer.name, O_RDWR | O_CLOEXEC, 0);
        int error = fd < 0 ? errno : 0;
        ::shm_unlink(offer.name);  // mapped or not, the name has done its work
        void* memory = MAP_FAILED;
        struct stat status {};
        if (fd >= 0) {
          if (::fstat(fd, &status) != 0) {
            error = errno;
          } else if (static_cast<size_t>(status.st_size) != kSegmentBytes) {
            error = EINVAL;
          } else {
            memory = ::mmap(nullptr, kSegmentBytes, PROT_READ | PROT_WRITE,
                            MAP_SHARED | MAP_POPULATE, fd, 0);
            if (memory == MAP_FAILED) error = errno;
          }
          ::close(fd);
        }
        if (memory != MAP_FAILED) {
          const auto* header = static_cast<const SegmentHeader*>(memory);
          if (header->magic != kSegmentMagic || header->cookie != offer.cookie ||
              header->slot_bytes != kSlotBytes || header->slots != kSlots) {
            ::munmap(memory, kSegmentBytes);
            memory = MAP_FAILED;
            error = EINVAL;
          }
        }
        if (memory == MAP_FAILED) {
          why[peer] = fmt::format("cannot open its shared segment: {}", std::strerror(error));
          log::warn("{}: rank {}: {}; rank {} keeps {}", transport_, rank_, why[peer], peer,
                    network_);
        } else {
          adopt_segment(peer, memory);
          answer = 1;
        }
      }
      net::send_all(sockets[peer].control, &answer, 1, deadline);
    }
    for (int peer = rank_ + 1; peer < size_; ++peer) {
      if (!candidate[peer] || names[peer].empty()) continue;
      uint8_t answer = 0;
      net::recv_all(sockets[peer].control, &answer, 1, deadline);
      ::shm_unlink(names[peer].c_str());  // the peer unlinked it already when it could open it
      if (answer != 1) {
        links_[peer].reset();
        why[peer] = "it could not open the shared segment";
      }
    }
  } catch (...) {
    // A peer failed during set-up: leave nothing behind in /dev/shm.
    for (const auto& name : names) {
      if (!name.empty()) ::shm_unlink(name.c_str());
    }
    throw;
  }

  // 3. Whether rings link every pair: each rank tells every peer whether it has a ring to each of
  // its own peers. One byte each way, sent to all before any is awaited, as in step 1.
  connected_count_ = 0;
  for (int peer = 0; peer < size_; ++peer) connected_count_ += links_[peer] ? 1 : 0;
  const uint8_t all_mine = connected_count_ == size_ - 1 ? 1 : 0;
  for (int peer = 0; peer < size_; ++peer) {
    if (peer != rank_) net::send_all(sockets[peer].control, &all_mine, 1, deadline);
  }
  everywhere_ = all_mine == 1;
  for (int peer = 0; peer < size_; ++peer) {
    if (peer == rank_) continue;
    uint8_t all_theirs = 0;
    net::recv_all(sockets[peer].control, &all_theirs, 1, deadline);
    if (all_theirs > 1) throw control_.lost(peer, "it sent a malformed start-up message");
    everywhere_ = everywhere_ && all_theirs == 1;
  }

  for (int peer = 0; peer < size_; ++peer) {
    if (peer == rank_) continue;
    if (links_[peer]) {
      log::info(
          "{}: rank {} reaches rank {} through kolo's shared-memory ring ({} slots of {} "
          "KiB each way, {} copies)",
          transport_, rank_, peer, kSlots, kSlotBytes >> 10,
          copy_ == Copy::kPlain    ? "plain"
          : copy_ == Copy::kStream ? "streamed"
                                   : "adaptive");
    } else {
      log::info("{}: rank {} reaches rank {} through {} ({})", transport_, rank_, peer, network_,
                why[peer]);
    }
  }
}

void ShmChannel::adopt_segment(int peer, void* mapping) {
  auto link = std::make_unique<Link>();
  link->attach(mapping, rank_ < peer);
  link->peer = peer;
  links_[peer] = std::move(link);
}

size_t ShmChannel::segment_bytes() {
  return kSegmentBytes;
}

// ---- transfers ----------------------------------------------------------------------------------

// A caller may post and then sleep on the transport's readiness fd at once, trusting the last
// progress() to have asked for doorbells; that request did not cover the new transfer, so while
// prepared to sleep the flags are raised again before the first look.
bool ShmChannel::post_send(Transfer& transfer) {
  Link& link = *links_[transfer.peer];
  link.sends.push(&transfer);
  ++link.pending;
  if (sleeping_) prepare_sleep();
  bool completed = false;
  if (send_piece(transfer.peer, link, completed) && sleeping_) {
    end_sleep();
    return true;
  }
  return false;
}

bool ShmChannel::post_recv(Transfer& transfer) {
  Link& link = *links_[transfer.peer];
  link.recvs.push(&transfer);
  ++link.pending;
  if (sleeping_) prepare_sleep();
  bool completed = false;
  if (receive_piece(transfer.peer, link, completed) && sleeping_) {
    end_sleep();
    return true;
  }
  return false;
}

bool ShmChannel::pump(bool& moved) {
  bool completed = false;
  for (;;) {
    bool any = false;
    for (int peer = 0; peer < size_; ++peer) {
      Link* link = links_[peer].get();
      if (!link || link->pending == 0) continue;
      if (!link->sends.empty()) any = send_piece(peer, *link, completed) || any;
      if (!link->recvs.empty()) any = receive_piece(peer, *link, completed) || any;
    }
    if (any) moved = true;
    if (!any || completed) return completed;
  }
}

// How many bytes the producer may still write after `head` while the consumer has read up to
// `tail`. Two lines stay free: a message's padding and the line after it, where the next message
// begins and which is cleared before the message is published (Link::clear_line).
uint64_t room(uint64_t head, uint64_t tail) {
  const uint64_t in_flight = head - tail;
  return in_flight + 2 * kAlign >= kCapacity ? 0 : kCapacity - 2 * kAlign - in_flight;
}

// Sends the first queued transfer, or one piece of it. A small one (shm::fits_small) goes whole
// in one line; a large one opens with its header line and then moves at most a slot at a time.
// True when anything moved.
bool ShmChannel::send_piece(int peer, Link& link, bool& completed) {
  Transfer* transfer = link.sends.front();
  if (!transfer) return false;
  if (!link.out_warm) link.warm_out();
  const bool small = !link.header_sent && transfer->bytes <= shm::kSmallBytes &&
                     shm::fits_small(transfer->descriptor);
  // A small piece (never streamed, so it needs no vote) loads the consumer's counter, a cache
  // line fetched from the consumer's core, only when the value loaded last leaves too little room
  // for it: a message fewer lines to move between the cores.
  const uint64_t wanted =
      small ? kAlign
            : (link.header_sent ? 0 : kAlign) +
                  std::min<uint64_t>(transfer->bytes - transfer->done, kSlotBytes);
  uint64_t tail = link.seen_tail;
  if (wanted >= kStreamBytes || room(link.head, tail) < wanted) {
    const bool sample = copy_ == Copy::kAuto;
    const auto before =
        sample ? std::chrono::steady_clock::now() : std::chrono::steady_clock::time_point{};
    tail = link.out->tail.load(std::memory_order_seq_cst);
    if (sample && tail != link.seen_tail) {
      const std::chrono::duration<double, std::nano> took =
          std::chrono::steady_clock::now() - before;
      link.vote_far(took.count() > kFarNanoseconds);
    }
    link.seen_tail = tail;
  }
  if (tail > link.head || link.head - tail > kCapacity) {
    throw control_.lost(peer, "its shared-memory ring is corrupt (a read counter out of range)");
  }
  uint64_t space = room(link.head, tail);
  uint64_t head = link.head;
  if (space < kAlign) return false;

  if (small) {
    // The line after it cleared, then the body, then the word that publishes both: the consumer
    // that sees the word sees the rest (release), and reads nothing else of this message.
    link.clear_line(head + kAlign);
    shm::SmallBody body = shm::small_body(transfer->descriptor);
    if (transfer->bytes > 0) std::memcpy(body.payload, transfer->data, transfer->bytes);
    std::memcpy(link.out_data + head % kCapacity + sizeof(uint64_t), &body, sizeof(body));
    shm::line_word_at(link.out_data, head)
        .store(shm::line_word(head, shm::LineKind::kSmall, transfer->bytes),
               std::memory_order_seq_cst);
    link.head = head + kAlign;
    transfer->done = transfer->bytes;
    link.sends.pop();
    --link.pending;
    transfer->complete = true;
    completed = true;
  } else {
    const bool opens = !link.header_sent;
    if (opens) {
      const shm::LargeBody body{transfer->bytes, transfer->descriptor};
      std::memcpy(link.out_data + head % kCapacity + sizeof(uint64_t), &body, sizeof(body));
      link.header_at = head;
      head += kAlign;
      space -= kAlign;
      link.header_sent = true;
    }
    const uint64_t remaining = transfer->bytes - transfer->done;
    const uint64_t to_end = kCapacity - head % kCapacity;
    const uint64_t piece = std::min({remaining, space, to_end, uint64_t{kSlotBytes}});
    const bool whole = piece == remaining;
    // The line after the message cleared first, so that fetching it overlaps the copy.
    if (whole) link.clear_line(round_up(head + piece));
    if (piece > 0) {
      copy_into_ring(link.out_data + head % kCapacity,
                     static_cast<const char*>(transfer->data) + transfer->done, piece,
                     copy_ == Copy::kStream || (copy_ == Copy::kAuto && link.far()));
      link.mark_payload(head, head + piece);
      head += piece;
      transfer->done += piece;
    }
    if (head == link.head) return false;
    if (whole) {
      head = round_up(head);
      link.sends.pop();
      link.header_sent = false;
      --link.pending;
      transfer->complete = true;
      completed = true;
    }
    link.head = head;
    // The header's word says how much payload came with it, so a message sent in one piece needs
    // no store of `head` (nor the consumer a load of it). A piece that leaves more to come stores
    // `head` (before the word, for the first piece), where the consumer looks for the rest.
    if (!opens || !whole) link.out->head.store(head, std::memory_order_seq_cst);
    if (opens) {
      shm::line_word_at(link.out_data, link.header_at)
          .store(shm::line_word(link.header_at, shm::LineKind::kLarge, piece),
                 std::memory_order_seq_cst);
    }
  }
  // The store above is sequentially consistent and so is this load; prepare_sleep() stores the
  // flag and then reads the word or the counter the same way (Dekker).
  if (link.out->consumer_waiting.load(std::memory_order_seq_cst) != 0 &&
      link.out->consumer_waiting.exchange(0, std::memory_order_seq_cst) != 0) {
    control_.ring_doorbell(peer);
  }
  return true;
}

// What the line at the consumer's position says. For a message that is there: its frame header
// in `header`, and for a small one where its payload lies, for a large one how much of its payload
// came with the header (`announced`).
shm::Arrival ShmChannel::arrival(const Link& link, FrameHeader& header, const char*& payload,
                                 uint64_t& announced) {
  const uint64_t word = shm::line_word_at(link.in_data, link.tail).load(std::memory_order_seq_cst);
  uint64_t length = 0;
  shm::Arrival kind = shm::classify(word, link.tail, length);
  const char* line = link.in_data + link.tail % kCapacity;
  if (kind == shm::Arrival::kSmall) {
    shm::SmallBody body;  // copied out first: the peer cannot change it after the check
    std::memcpy(&body, line + sizeof(uint64_t), sizeof(body));
    header.bytes = length;
    header.descriptor = shm::descriptor_of(body);
    payload = line + sizeof(uint64_t) + offsetof(shm::SmallBody, payload);
  } else if (kind == shm::Arrival::kLarge) {
    shm::LargeBody body;
    std::memcpy(&body, line + sizeof(uint64_t), sizeof(body));
    header.bytes = body.bytes;
    header.descriptor = body.descriptor;
    announced = length;
    if (length > body.bytes) kind = shm::Arrival::kCorrupt;
  }
  if (kind == shm::Arrival::kCorrupt) {
    log::warn("{}: rank {} wrote a malformed message line (first word {:#x}) into its ring",
              transport_, link.peer, word);
  }
  return kind;
}

void ShmChannel::check_unexpected(const OpDescriptor& current) const {
  for (int peer = 0; peer < size_; ++peer) {
    const Link* link = links_[peer].get();
    if (!link || !link->recvs.empty() || link->header_checked) continue;
    const uint64_t word =
        shm::line_word_at(link->in_data, link->tail).load(std::memory_order_seq_cst);
    uint64_t small_bytes = 0;
    const shm::Arrival kind = shm::classify(word, link->tail, small_bytes);
    const char* line = link->in_data + link->tail % kCapacity + sizeof(uint64_t);
    FrameHeader header;
    if (kind == shm::Arrival::kSmall) {
      shm::SmallBody body;
      std::memcpy(&body, line, sizeof(body));
      header.descriptor = shm::descriptor_of(body);
    } else if (kind == shm::Arrival::kLarge) {
      shm::LargeBody body;
      std::memcpy(&body, line, sizeof(body));
      header.descriptor = body.descriptor;
    } else {
      continue;  // nothing there, or judged when a receive is posted
    }
    check_unexpected_frame(rank_, peer, current, header);
  }
}

// Takes the next message for the first posted receive: a small one whole, a large one's header
// (checked before a byte of payload moves) and then one piece of its payload at a time, at most
// a slot long. True when anything moved.
bool ShmChannel::receive_piece(int peer, Link& link, bool& completed) {
  Transfer* transfer = link.recvs.front();
  if (!transfer) return false;
  if (!link.in_warm) link.warm_in();
  uint64_t tail = link.tail;
  if (!link.header_checked) {
    FrameHeader header;
    const char* payload = nullptr;
    uint64_t announced = 0;
    const shm::Arrival kind = arrival(link, header, payload, announced);
    if (kind == shm::Arrival::kNone) return false;
    if (kind == shm::Arrival::kCorrupt) {
      throw Error(Status::kPeerLost,
                  fmt::format("rank {} sent a malformed message (its line's first word is wrong) "
                              "to rank {}",
                              peer, rank_));
    }
    check_frame(rank_, *transfer, header);
    tail += kAlign;
    if (kind == shm::Arrival::kSmall) {
      if (transfer->bytes > 0) {
        if (transfer->sink) {
          transfer->sink(transfer->sink_context, 0, payload, transfer->bytes);
          transfer->sunk = true;
        } else {
          std::memcpy(transfer->data, payload, transfer->bytes);
        }
      }
      transfer->done = transfer->bytes;
      link.recvs.pop();
      --link.pending;
      transfer->complete = true;
      completed = true;
      consumed(peer, link, tail);
      return true;
    }
    link.header_checked = true;
    link.announced = tail + announced;
  }
  // What came with the header needs no counter; the rest is published by `head`.
  const uint64_t remaining = transfer->bytes - transfer->done;
  uint64_t head = link.announced;
  if (head <= tail && remaining > 0) {
    head = link.in->head.load(std::memory_order_seq_cst);
    if (head < tail || head - tail > kCapacity) {
      throw control_.lost(peer, "its shared-memory ring is corrupt (a write counter out of range)");
    }
    link.announced = head;
  }
  uint64_t available = head > tail ? head - tail : 0;
  const uint64_t to_end = kCapacity - tail % kCapacity;
  uint64_t piece = std::min({remaining, available, to_end, uint64_t{kSlotBytes}});
  if (transfer->sink && piece < remaining) {
    piece -= piece % transfer->sink_grain;  // whole elements only; the rest comes with the next
  }
  if (piece > 0) {
    const char* from = link.in_data + tail % kCapacity;
    if (transfer->sink) {
      transfer->sink(transfer->sink_context, transfer->done, from, piece);
      transfer->sunk = true;
    } else {
      std::memcpy(static_cast<char*>(transfer->data) + transfer->done, from, piece);
    }
    tail += piece;
    transfer->done += piece;
  }
  if (tail == link.tail) return false;
  if (transfer->done == transfer->bytes) {
    tail = round_up(tail);
    link.recvs.pop();
    link.header_checked = false;
    --link.pending;
    transfer->complete = true;
    completed = true;
  }
  consumed(peer, link, tail);
  return true;
}

// Publishes that this rank has read `peer`'s ring up to `tail`, and rings the peer's doorbell if
// it sleeps waiting for room (the store and the flag's load are sequentially consistent: Dekker
// with prepare_sleep()).
void ShmChannel::consumed(int peer, Link& link, uint64_t tail) {
  link.tail = tail;
  link.in->tail.store(tail, std::memory_order_seq_cst);
  if (link.in->producer_waiting.load(std::memory_order_seq_cst) != 0 &&
      link.in->producer_waiting.exchange(0, std::memory_order_seq_cst) != 0) {
    control_.ring_doorbell(peer);
  }
}

// ---- sleeping -----------------------------------------------------------------------------------

void ShmChannel::prepare_sleep() {
  sleeping_ = true;
  for (auto& link : links_) {
    if (!link || link->pending == 0) continue;
    if (!link->recvs.empty()) {
      link->in->consumer_waiting.store(1, std::memory_order_seq_cst);
      link->consumer_flag = true;
    }
    if (!link->sends.empty()) {
      link->out->producer_waiting.store(1, std::memory_order_seq_cst);
      link->producer_flag = true;
    }
  }
}

void ShmChannel::end_sleep() {
  if (!sleeping_) return;
  sleeping_ = false;
  for (auto& link : links_) {
    if (!link) continue;
    if (link->consumer_flag) link->in->consumer_waiting.store(0, std::memory_order_relaxed);
    if (link->producer_flag) link->out->producer_waiting.store(0, std::memory_order_relaxed);
    link->consumer_flag = link->producer_flag = false;
  }
}

void ShmChannel::forget() {
  for (auto& link : links_) {
    if (!link) continue;
    link->sends.clear();
    link->recvs.clear();
    link->pending = 0;
  }
}

}  // namespace kolo
