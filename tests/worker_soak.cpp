// One rank of the soak (meson test soak; docs/contributing.md, "The soak"): for a fixed time,
// threads of every rank issue random collectives, sub-communicator calls and named operations
// through the C ABI and check every result against tests/reference.hpp, never the library's code.
// At the end every rank learns the calls made, the wrong results and every rank's memory,
// descriptors and shared memory at the start and at the end, and rank 0 prints them.
//
//   kolo_soak_worker SECONDS [SEED]
//
// Every rank draws the same sequence (each thread its own generator, seeded from SEED), so that
// ordered calls agree; only the order in which named operations are submitted differs from rank to
// rank. Three threads, each on communicators of its own:
//   ordered  the world: allreduce (scaled too), broadcast, allgather, reduce-scatter, alltoall,
//            reduce and barrier, with random dtypes, ops, sizes (0 to 256 Ki elements), roots,
//            in place or not;
//   split    the same on an odd/even split of the world and on the world reversed (key -rank);
//            every 64th round it splits the reversed communicator, checks an allreduce on the new
//            one and destroys it;
//   named    batches of 1 to 8 named allreduces and broadcasts on the world's fusion engine, each
//            rank submitting them in its own order.
// The threads stop together: every 16 rounds each one asks its communicator whether any rank's time
// is up (an allreduce of MAX), which is one more checked call.
//
// The figures of the start are taken after a warm-up (a tenth of the time, 5 to 60 s, in which the
// library's buffers and caches and the allocator's arenas reach the sizes they then keep; the
// test's own buffers are allocated at their largest before it) while every thread is idle, and
// those of the end likewise.
// Memory is the resident set (/proc/self/statm) and the bytes malloc has handed out and not got
// back (mallinfo2: what the process and the library hold, whatever the allocator keeps mapped
// besides), descriptors the entries of /proc/self/fd, shared memory the mappings of /dev/shm files
// in /proc/self/maps plus this process's entries left in /dev/shm (named /kolo-<pid>-...). Exit
// status 0: no call failed, no result was wrong, and on every rank descriptors and shared memory
// are as at the start, the resident set grew by less than kMaxResidentGrowthKiB and malloc's bytes
// in use by less than kMaxInUseGrowthKiB. SOAK_MEMORY_DETAIL=1 also prints where each rank's
// resident set lies at the start and at the end (heap, anonymous mappings, files, /dev/shm).
#include <fmt/format.h>
#include <kolo.h>
#include <malloc.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cctype>
#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <numeric>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "reference.hpp"
#include "worker_common.hpp"

namespace {

using namespace kolo::test::reference;
using namespace kolo::test::worker;
using Clock = std::chrono::steady_clock;

constexpr int kRoundsPerCheck = 16;  // rounds between agreements on whether to stop
constexpr uint64_t kLargestCount = 256 * 1024;
constexpr uint64_t kLargestNamedCount = 64 * 1024;
constexpr size_t kMaxNamedBatch = 8;
constexpr size_t kLargestElement = 8;
// Bounds on growth from the warm-up's end to the end. The library's working buffers grow to the
// largest message seen and then stay (a few MiB in the first minutes); bytes in use stay within
// a few hundred KiB.
constexpr int64_t kMaxResidentGrowthKiB = 16 * 1024;
constexpr int64_t kMaxInUseGrowthKiB = 4 * 1024;
constexpr int kShownWrong = 10;  // wrong results described in full; the rest only counted

std::atomic<int> g_wrong_shown{0};

Comm split(const Comm& parent, int color, int key) {
  kolo_comm_t child = nullptr;
  check_status(parent.handle, kolo_comm_split(parent.handle, color, key, &child), "kolo_comm_split");
  return describe_comm(child);
}

// The draws every rank makes alike. mt19937_64 is specified to the bit, and `below` uses no
// library distribution (those may differ between implementations).
struct Draw {
  std::mt19937_64 generator;
  explicit Draw(uint64_t seed) : generator(seed) {}
  uint64_t below(uint64_t n) { return n == 0 ? 0 : generator() % n; }
  // Mostly small counts (the latency-bound calls of a training step), some medium, a few large.
  uint64_t count() {
    uint64_t kind = below(100);
    if (kind < 60) return below(65);
    if (kind < 95) return 65 + below(16320);
    return 16385 + below(kLargestCount - 16385);
  }
};

// One call's data: element i of rank r's input is the reference input at (i + salt) mod kPeriod,
// so that every call moves different values and the reference stays a table of kPeriod elements.
struct Call {
  const TypeInfo* type;
  kolo_op_t op;
  uint64_t count;
  uint64_t salt;
  int root = 0;
  double prescale = 1.0;
  double postscale = 1.0;
  std::string what;  // for messages

  double input(int rank, uint64_t i) const {
    return static_cast<double>(input_value(*type, op, rank, (i + salt) % kPeriod));
  }
  double reduced(uint64_t i, int ranks) const {
    return expected_value(*type, op, (i + salt) % kPeriod, prescale, postscale, ranks);
  }
};

Call draw_call(Draw& draw, const std::string& what) {
  Call call{&kTypes[draw.below(std::size(kTypes))], kOps[draw.below(std::size(kOps))],
            draw.count(), draw.below(kPeriod), 0, 1.0, 1.0, {}};
  call.what = fmt::format("{} ({} x {}, {})", what, call.count, call.type->name, op_name(call.op));
  return call;
}

// A thread's buffers, allocated (and touched) at the largest size before the warm-up.
struct Buffers {
  std::vector<unsigned char> send, recv, expected;
  explicit Buffers(uint64_t bytes) : send(bytes), recv(bytes), expected(bytes) {}
};

struct Tally {
  uint64_t calls = 0;
  uint64_t wrong = 0;
};

void compare(Tally& tally, const Call& call, const void* got, const void* expected,
             uint64_t count) {
  const size_t bad = first_difference(got, expected, count, call.type->size);
  if (bad == count) return;
  ++tally.wrong;
  if (g_wrong_shown.fetch_add(1) < kShownWrong) {
    fmt::print(stderr, "rank {}: WRONG: {}: element {} expected {} got {}\n", g_rank, call.what,
               bad, element_text(*call.type, expected, bad), element_text(*call.type, got, bad));
  }
}

template <typename Value>
void fill(const Call& call, void* buffer, uint64_t count, Value&& value) {
  fill_periodic(*call.type, buffer, count, std::forward<Value>(value));
}

// One random ordered collective on comm, checked.
void ordered_call(Draw& draw, const Comm& comm, Buffers& buffers, Tally& tally,
                  const std::string& where) {
  static const char* kNames[] = {"allreduce", "broadcast", "allgather", "reduce_scatter",
                                 "alltoall",  "reduce",    "barrier"};
  const int kind = static_cast<int>(draw.below(std::size(kNames)));
  Call call = draw_call(draw, where + " " + kNames[kind]);
  const int n = comm.size;
  const int me = comm.rank;
  const size_t element = call.type->size;
  const uint64_t count = call.count;
  unsigned char* send = buffers.send.data();
  unsigned char* recv = buffers.recv.data();
  unsigned char* expected = buffers.expected.data();
  kolo_dtype_t dtype = call.type->dtype;
  ++tally.calls;
  switch (kind) {
    case 0: {  // allreduce, scaled by powers of two for floating types, in place or not
      if (call.type->is_float && draw.below(3) == 0) {
        call.prescale = draw.below(2) ? 0.5 : 2.0;
        call.postscale = draw.below(2) ? 0.25 : 1.0;
      }
      const bool in_place = draw.below(2) == 0;
      fill(call, send, count, [&](uint64_t i) { return call.input(me, i); });
      if (in_place) std::memcpy(recv, send, count * element);
      check_status(comm.handle,
                   kolo_allreduce_scaled(comm.handle, in_place ? recv : send, recv, count, dtype,
                                         call.op, call.prescale, call.postscale),
                   call.what);
      fill(call, expected, count, [&](uint64_t i) { return call.reduced(i, n); });
      return compare(tally, call, recv, expected, count);
    }
    case 1: {  // broadcast
      call.root = static_cast<int>(draw.below(static_cast<uint64_t>(n)));
      if (me == call.root) {
        fill(call, recv, count, [&](uint64_t i) { return call.input(call.root, i); });
      } else {
        std::memset(recv, 0xa5, count * element);
      }
      check_status(comm.handle, kolo_broadcast(comm.handle, recv, count, dtype, call.root),
                   call.what);
      fill(call, expected, count, [&](uint64_t i) { return call.input(call.root, i); });
      return compare(tally, call, recv, expected, count);
    }
    case 2: {  // allgather
      fill(call, send, count, [&](uint64_t i) { return call.input(me, i); });
      check_status(comm.handle, kolo_allgather(comm.handle, send, recv, count, dtype), call.what);
      for (int q = 0; q < n; ++q) {
        fill(call, expected + q * count * element, count, [&](uint64_t i) { return call.input(q, i); });
      }
      return compare(tally, call, recv, expected, count * n);
    }
    case 3: {  // reduce-scatter: this rank gets block `me` of the reduction
      fill(call, send, count * n, [&](uint64_t i) { return call.input(me, i); });
      check_status(comm.handle,
                   kolo_reduce_scatter(comm.handle, send, recv, count, dtype, call.op), call.what);
      fill(call, expected, count, [&](uint64_t i) { return call.reduced(me * count + i, n); });
      return compare(tally, call, recv, expected, count);
    }
    case 4: {  // alltoall: block p of rank r's input goes to rank p
      fill(call, send, count * n, [&](uint64_t i) { return call.input(me, i); });
      check_status(comm.handle, kolo_alltoall(comm.handle, send, recv, count, dtype), call.what);
      for (int q = 0; q < n; ++q) {
        fill(call, expected + q * count * element, count,
             [&](uint64_t i) { return call.input(q, me * count + i); });
      }
      return compare(tally, call, recv, expected, count * n);
    }
    case 5: {  // reduce to a root
      call.root = static_cast<int>(draw.below(static_cast<uint64_t>(n)));
      fill(call, send, count, [&](uint64_t i) { return call.input(me, i); });
      check_status(comm.handle,
                   kolo_reduce(comm.handle, send, recv, count, dtype, call.op, call.root),
                   call.what);
      if (me != call.root) return;
      fill(call, expected, count, [&](uint64_t i) { return call.reduced(i, n); });
      return compare(tally, call, recv, expected, count);
    }
    default:
      check_status(comm.handle, kolo_barrier(comm.handle), call.what);
  }
}

// Whether any rank of comm wants to stop: an allreduce of MAX, itself checked.
bool agree_to_stop(const Comm& comm, bool stop_here, Tally& tally) {
  int32_t flag = stop_here ? 1 : 0;
  int32_t any = -1;
  ++tally.calls;
  check_status(comm.handle, kolo_allreduce(comm.handle, &flag, &any, 1, KOLO_INT32, KOLO_MAX),
               "the allreduce that agrees on stopping");
  if (any != 0 && any != 1) {
    ++tally.wrong;
    fmt::print(stderr, "rank {}: WRONG: the stop agreement gave {}\n", g_rank, any);
    return true;
  }
  return any == 1;
}

// Runs rounds in blocks of kRoundsPerCheck until the ranks agree to stop, once a rank's deadline
// has passed.
template <typename Round>
void run_blocks(const Comm& agreement, Clock::time_point deadline, Tally& tally, Round&& round) {
  for (;;) {
    for (int i = 0; i < kRoundsPerCheck; ++i) round();
    if (agree_to_stop(agreement, Clock::now() >= deadline, tally)) return;
  }
}

// Room for a call of the largest count on every rank of the world.
uint64_t largest_bytes(int ranks) {
  return kLargestCount * static_cast<uint64_t>(ranks) * kLargestElement;
}

struct OrderedThread {
  Comm world;
  Draw draw;
  Buffers buffers{largest_bytes(g_size)};
  Tally tally{};
  void run(Clock::time_point deadline) {
    run_blocks(world, deadline, tally,
               [&] { ordered_call(draw, world, buffers, tally, "world"); });
  }
};

struct SplitThread {
  Comm halves;    // odd and even ranks
  Comm reversed;  // every rank, in reverse order
  Draw draw;
  Buffers buffers{largest_bytes(g_size)};
  Tally tally{};
  uint64_t rounds = 0;
  void run(Clock::time_point deadline) {
    run_blocks(reversed, deadline, tally, [&] {
      if (++rounds % 64 == 0) return split_use_destroy();
      if (draw.below(2) == 0) return ordered_call(draw, halves, buffers, tally, "odd/even");
      ordered_call(draw, reversed, buffers, tally, "reversed");
    });
  }
  // A communicator of a random colouring of the reversed one, one checked allreduce on it, gone.
  void split_use_destroy() {
    const uint64_t colouring = draw.below(3);
    const int color = colouring == 0 ? 0 : (colouring == 1 ? reversed.rank % 2 : reversed.rank / 2);
    ++tally.calls;
    Comm child = split(reversed, color, static_cast<int>(draw.below(4)));
    ordered_call(draw, child, buffers, tally, "a fresh split");
    check_status(child.handle, kolo_comm_destroy(child.handle), "kolo_comm_destroy");
  }
};

struct NamedThread {
  Comm world;
  Draw draw;
  std::mt19937_64 own_order;  // this rank's alone: the order of submission
  Tally tally{};
  uint64_t batch = 0;

  struct Named {
    Call call;
    bool broadcast = false;
    Buffers buffers{kLargestNamedCount * kLargestElement};
    kolo_request_t request = nullptr;
  };
  std::vector<Named> slots = std::vector<Named>(kMaxNamedBatch);
  // The stop agreement is an ordered call beside the ordered thread's on the world: it goes
  // through a communicator of its own so that the two threads' sequences cannot interleave.
  Comm stop_comm{};

  void run(Clock::time_point deadline) {
    run_blocks(stop_comm, deadline, tally, [&] { one_batch(); });
  }

  void one_batch() {
    ++batch;
    const int n = world.size;
    const int me = world.rank;
    const size_t batch_size = 1 + draw.below(kMaxNamedBatch);
    for (size_t k = 0; k < batch_size; ++k) {
      Named& op = slots[k];
      op.broadcast = draw.below(5) == 0;
      op.call = draw_call(draw, fmt::format("named {} soak.{}.{}",
                                            op.broadcast ? "broadcast" : "allreduce", batch, k));
      op.call.count = std::clamp<uint64_t>(op.call.count, 1, kLargestNamedCount);
      op.call.root = static_cast<int>(draw.below(static_cast<uint64_t>(n)));
      const Call& call = op.call;
      unsigned char* send = op.buffers.send.data();
      unsigned char* recv = op.buffers.recv.data();
      unsigned char* expected = op.buffers.expected.data();
      if (op.broadcast) {
        if (me == call.root) {
          fill(call, recv, call.count, [&](uint64_t i) { return call.input(call.root, i); });
        } else {
          std::memset(recv, 0x5a, call.count * call.type->size);
        }
        fill(call, expected, call.count, [&](uint64_t i) { return call.input(call.root, i); });
      } else {
        fill(call, send, call.count, [&](uint64_t i) { return call.input(me, i); });
        fill(call, expected, call.count, [&](uint64_t i) { return call.reduced(i, n); });
      }
    }
    std::vector<size_t> order(batch_size);
    std::iota(order.begin(), order.end(), size_t{0});
    std::shuffle(order.begin(), order.end(), own_order);
    for (size_t k : order) {
      Named& op = slots[k];
      const std::string name = fmt::format("soak.{}.{}", batch, k);
      kolo_status_t status =
          op.broadcast
              ? kolo_broadcast_async(world.handle, name.c_str(), op.buffers.recv.data(),
                                     op.call.count, op.call.type->dtype, op.call.root, nullptr,
                                     &op.request)
              : kolo_allreduce_async(world.handle, name.c_str(), op.buffers.send.data(),
                                     op.buffers.recv.data(),
                                     op.call.count, op.call.type->dtype, op.call.op, nullptr,
                                     &op.request);
      check_status(world.handle, status, op.call.what);
    }
    for (size_t k = 0; k < batch_size; ++k) {
      Named& op = slots[k];
      ++tally.calls;
      if (kolo_request_wait(op.request) != KOLO_SUCCESS) {
        fail(fmt::format("{}: {}", op.call.what, kolo_request_last_error(op.request)));
      }
      kolo_request_free(op.request);
      compare(tally, op.call, op.buffers.recv.data(), op.buffers.expected.data(), op.call.count);
    }
  }
};

// ---- what the process holds ----------------------------------------------------------------

struct Figures {
  int64_t rss_kib = 0;
  int64_t in_use_kib = 0;  // malloc's bytes handed out (mallinfo2: uordblks + hblkhd)
  int64_t descriptors = 0;
  int64_t shared_memory = 0;  // /dev/shm mappings plus this process's /dev/shm entries
};

// Where the resident set lies (/proc/self/smaps) and what the allocator holds (mallinfo2), for
// finding what grows: printed per rank when SOAK_MEMORY_DETAIL is set.
std::string memory_detail() {
  int64_t heap = 0, anonymous = 0, files = 0, shared = 0, stack = 0;
  int64_t* category = &anonymous;
  std::ifstream smaps("/proc/self/smaps");
  for (std::string line; std::getline(smaps, line);) {
    if (line.empty()) continue;
    if (std::isxdigit(static_cast<unsigned char>(line[0])) && line.find('-') < 16 &&
        line.find(':') > 16) {
      const size_t slash = line.find('/');
      const size_t bracket = line.find('[');
      if (line.find("/dev/shm/") != std::string::npos)
        category = &shared;
      else if (slash != std::string::npos)
        category = &files;
      else if (line.find("[heap]") != std::string::npos)
        category = &heap;
      else if (bracket != std::string::npos)
        category = &stack;
      else
        category = &anonymous;
      continue;
    }
    if (line.rfind("Rss:", 0) == 0) *category += std::strtoll(line.c_str() + 4, nullptr, 10);
  }
  const struct mallinfo2 info = mallinfo2();
  int threads = 0;
  std::ifstream status("/proc/self/status");
  for (std::string line; std::getline(status, line);) {
    if (line.rfind("Threads:", 0) == 0) threads = std::atoi(line.c_str() + 8);
  }
  return fmt::format(
      "rss heap {:.1f} anon {:.1f} files {:.1f} shm {:.1f} other {:.1f} MiB; "
      "malloc in use {:.1f} held {:.1f} (mmapped {:.1f}) MiB; threads {}",
      heap / 1024.0, anonymous / 1024.0, files / 1024.0, shared / 1024.0, stack / 1024.0,
      (info.uordblks + info.hblkhd) / 1048576.0, (info.arena + info.hblkhd) / 1048576.0,
      info.hblkhd / 1048576.0, threads);
}

Figures measure() {
  if (std::getenv("SOAK_MEMORY_DETAIL") != nullptr) {
    fmt::print(stderr, "soak: rank {}: {}\n", g_rank, memory_detail());
  }
  Figures figures;
  std::ifstream statm("/proc/self/statm");
  int64_t size_pages = 0, resident_pages = 0;
  statm >> size_pages >> resident_pages;
  figures.rss_kib = resident_pages * (sysconf(_SC_PAGESIZE) / 1024);
  const struct mallinfo2 info = mallinfo2();
  figures.in_use_kib = static_cast<int64_t>((info.uordblks + info.hblkhd) / 1024);
  for ([[maybe_unused]] const auto& entry : std::filesystem::directory_iterator("/proc/self/fd")) {
    ++figures.descriptors;
  }
  std::ifstream maps("/proc/self/maps");
  for (std::string line; std::getline(maps, line);) {
    if (line.find("/dev/shm/") != std::string::npos) ++figures.shared_memory;
  }
  const std::string own_prefix = fmt::format("kolo-{}-", getpid());
  std::error_code error;
  for (const auto& entry : std::filesystem::directory_iterator("/dev/shm", error)) {
    if (entry.path().filename().string().rfind(own_prefix, 0) == 0) ++figures.shared_memory;
  }
  return figures;
}

template <typename Thread>
std::thread start(Thread& thread, Clock::time_point deadline) {
  return std::thread([&thread, deadline] { thread.run(deadline); });
}

Clock::time_point after(double seconds) {
  return Clock::now() +
         std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(seconds));
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 2) {
    fmt::print(stderr, "usage: kolo_soak_worker SECONDS [SEED]\n");
    return 2;
  }
  const double seconds = std::atof(argv[1]);
  const uint64_t seed = argc > 2 ? std::strtoull(argv[2], nullptr, 10) : 1;
  const auto started = Clock::now();

  kolo_comm_t world_handle = nullptr;
  if (kolo_comm_init(nullptr, &world_handle) != KOLO_SUCCESS) fail(kolo_comm_last_error(nullptr));
  Comm world = describe_comm(world_handle);
  g_rank = world.rank;
  g_size = world.size;
  Figures at_init = measure();

  OrderedThread ordered{world, Draw(seed * 3 + 0)};
  SplitThread splits{split(world, world.rank % 2, world.rank), split(world, 0, -world.rank),
                     Draw(seed * 3 + 1)};
  NamedThread named{world, Draw(seed * 3 + 2),
                    std::mt19937_64(seed * 1000003 + static_cast<uint64_t>(world.rank))};
  named.stop_comm = split(world, 0, world.rank);

  auto run_phase = [&](Clock::time_point deadline) {
    std::thread a = start(ordered, deadline);
    std::thread b = start(splits, deadline);
    std::thread c = start(named, deadline);
    a.join();
    b.join();
    c.join();
    check_status(world.handle, kolo_barrier(world.handle), "kolo_barrier");
  };
  const double warm_up_s = std::clamp(seconds / 10, 5.0, 60.0);
  run_phase(after(warm_up_s));
  Figures at_start = measure();
  const auto timed_from = Clock::now();
  run_phase(after(seconds));
  const double ran_s = std::chrono::duration<double>(Clock::now() - timed_from).count();
  Figures at_end = measure();

  // Every rank's tallies and figures to every rank, so that each judges alike.
  const uint64_t calls = ordered.tally.calls + splits.tally.calls + named.tally.calls;
  const uint64_t wrong = ordered.tally.wrong + splits.tally.wrong + named.tally.wrong;
  constexpr int kFields = 15;
  int64_t mine[kFields] = {static_cast<int64_t>(calls),
                           static_cast<int64_t>(wrong),
                           static_cast<int64_t>(ordered.tally.calls),
                           static_cast<int64_t>(splits.tally.calls),
                           static_cast<int64_t>(named.tally.calls),
                           at_init.rss_kib,
                           at_start.rss_kib,
                           at_end.rss_kib,
                           at_init.descriptors,
                           at_start.descriptors,
                           at_end.descriptors,
                           at_start.shared_memory,
                           at_end.shared_memory,
                           at_start.in_use_kib,
                           at_end.in_use_kib};
  std::vector<int64_t> all(static_cast<size_t>(kFields) * g_size);
  check_status(world.handle, kolo_allgather(world.handle, mine, all.data(), kFields, KOLO_INT64),
               "the allgather of the figures");

  bool flat = true;
  int64_t total_calls = 0, total_wrong = 0;
  std::string lines;
  for (int r = 0; r < g_size; ++r) {
    const int64_t* f = all.data() + static_cast<size_t>(r) * kFields;
    total_calls += f[0];
    total_wrong += f[1];
    const bool rank_flat = f[10] == f[9] && f[12] == f[11] && f[7] - f[6] < kMaxResidentGrowthKiB &&
                           f[14] - f[13] < kMaxInUseGrowthKiB;
    flat = flat && rank_flat;
    lines += fmt::format(
        "soak: rank {}: {} calls (ordered {}, split {}, named {}), {} wrong; memory {:.1f} MiB "
        "at init, {:.1f} at start, {:.1f} at end (malloc in use {:.1f} -> {:.1f}); descriptors {} "
        "at init, {} at start, {} at end; /dev/shm {} at start, {} at end{}\n",
        r, f[0], f[2], f[3], f[4], f[1], f[5] / 1024.0, f[6] / 1024.0, f[7] / 1024.0,
        f[13] / 1024.0, f[14] / 1024.0, f[8], f[9], f[10], f[11], f[12],
        rank_flat ? "" : "  <- NOT FLAT");
  }
  if (g_rank == 0) {
    fmt::print("{}soak: {} ranks, {:.0f} s after a warm-up of {:.0f} s ({:.0f} s in all), seed {}: "
               "{} calls checked (the warm-up's too), {} wrong; memory, descriptors and /dev/shm {}\n",
               lines, g_size, ran_s, warm_up_s,
               std::chrono::duration<double>(Clock::now() - started).count(), seed, total_calls,
               total_wrong, flat ? "flat" : "NOT FLAT");
    std::fflush(stdout);
  }
  kolo_comm_destroy(named.stop_comm.handle);
  kolo_comm_destroy(splits.halves.handle);
  kolo_comm_destroy(splits.reversed.handle);
  kolo_comm_destroy(world.handle);
  return total_wrong == 0 && flat && total_calls > 0 ? 0 : 1;
}
