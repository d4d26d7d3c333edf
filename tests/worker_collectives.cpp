// One rank of the multi-process tests of allgather(v), reduce-scatter(v), alltoall(v), reduce,
// send/recv and sub-communicators (tests/test_more_collectives.cpp). Uses kolo only through the
// C ABI and checks every element against a reference computed here from every rank's input
// (tests/reference.hpp), never with the library's code.
//
//   kolo_test_collectives allgather [quick]     every dtype x size, in and out of place; allgatherv
//   kolo_test_collectives reduce_scatter [quick] every dtype x op x size; reduce-scatterv
//   kolo_test_collectives alltoall [quick]      dtypes x sizes, in place; alltoallv with gaps
//   kolo_test_collectives reduce [quick]        every root x dtype x op x size, in place
//   kolo_test_collectives sendrecv              every pair of ranks, both ways, tags, sizes
//   kolo_test_collectives split                 odd/even, singletons, opt-out, nested, threads,
//                                               the parent destroyed first
//   kolo_test_collectives mismatch KIND         the last rank (or a pair) disagrees: MISMATCH
//   kolo_test_collectives split_mismatch        a mismatch inside one half of a split
//   kolo_test_collectives badargs               invalid vectors and arguments, then a working call
//   kolo_test_collectives recv_timeout SECONDS  rank 1 receives what rank 0 sends SECONDS late
//   kolo_test_collectives lost SECONDS          loops on an odd/even split; reports how it ends
//   kolo_test_collectives threads               two threads racing with the same allreduce
//   kolo_test_collectives stuck SECONDS         rank 0 comes SECONDS late (for SIGUSR1 reports)
//
// Exit status 0 means every check passed; a failing check prints what it expected and got.
#include <fmt/format.h>
#include <kolo.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <latch>
#include <limits>
#include <numeric>
#include <string>
#include <thread>
#include <vector>

#include "reference.hpp"
#include "worker_common.hpp"

namespace {

using namespace kolo::test::reference;
using namespace kolo::test::worker;

const TypeInfo& type_of(kolo_dtype_t dtype) {
  for (const TypeInfo& type : kTypes) {
    if (type.dtype == dtype) return type;
  }
  fail("unknown dtype");
}

// Element i of the data that `source` moves (to `target`, for alltoall and send/recv): exact in
// every dtype and varied enough that a block in the wrong place shows.
double moved_value(const TypeInfo& type, int source, int target, uint64_t i) {
  const uint64_t mix = (static_cast<uint64_t>(source) * 7919u +
                        static_cast<uint64_t>(target) * 15485863u + i * 104729u + 17) %
                       1000003u;
  switch (type.dtype) {
    case KOLO_BFLOAT16:
    case KOLO_INT8:
      return static_cast<double>(static_cast<int64_t>(mix % 256) - 128);
    case KOLO_UINT8:
      return static_cast<double>(mix % 256);
    case KOLO_FLOAT16:
      return static_cast<double>(static_cast<int64_t>(mix % 4096) - 2048);
    default:
      return static_cast<double>(static_cast<int64_t>(mix) - 500001);
  }
}

// Test buffers, grown to the largest size once: first touch of fresh memory is slow.
struct Arena {
  std::vector<unsigned char> send, recv, expected, copy;
  void reserve(size_t bytes) {
    if (send.size() >= bytes) return;
    send.resize(bytes);
    recv.resize(bytes);
    expected.resize(bytes);
    copy.resize(bytes);
  }
};
Arena g_arena;

// Elements of the large cases: at least 4 MiB in all (quick: 256 KiB).
uint64_t big_bytes(bool quick) {
  return (quick ? 256u : 4096u) * 1024;
}

void compare(const TypeInfo& type, const void* got, const void* expected, uint64_t count,
             const std::string& what) {
  const size_t bad = first_difference(got, expected, count, type.size);
  if (bad != count) {
    fail(fmt::format("{}: element {} expected {} got {}", what, bad,
                     element_text(type, expected, bad), element_text(type, got, bad)));
  }
}

std::vector<uint64_t> offsets_of(const std::vector<uint64_t>& counts) {
  std::vector<uint64_t> offsets(counts.size(), 0);
  for (size_t r = 1; r < counts.size(); ++r) offsets[r] = offsets[r - 1] + counts[r - 1];
  return offsets;
}

uint64_t sum_of(const std::vector<uint64_t>& counts) {
  return std::accumulate(counts.begin(), counts.end(), uint64_t{0});
}

// Per-rank counts of the v-collectives: uneven, with zeros, the same on every rank.
std::vector<std::vector<uint64_t>> uneven_patterns(int size, uint64_t big) {
  std::vector<std::vector<uint64_t>> patterns;
  std::vector<uint64_t> counts(static_cast<size_t>(size));
  for (int r = 0; r < size; ++r) counts[r] = (r % 3 == 1) ? 0 : static_cast<uint64_t>(r) * 37 + 5;
  patterns.push_back(counts);  // small, uneven, zeros (and rank 0 contributes 5)
  for (int r = 0; r < size; ++r) counts[r] = r == size - 1 ? 7919 : 0;
  patterns.push_back(counts);  // only the last rank
  for (int r = 0; r < size; ++r) counts[r] = 0;
  patterns.push_back(counts);  // nothing at all
  for (int r = 0; r < size; ++r) counts[r] = r == 0 ? 1 : (r % 2 ? big / size * 2 : 3);
  patterns.push_back(counts);  // one rank much larger, pipelined over several segments
  return patterns;
}

// ---- allgather ----------------------------------------------------------------------------------

void check_allgather(const Comm& comm, const TypeInfo& type, const std::vector<uint64_t>& counts,
                     bool variable, bool in_place) {
  const std::vector<uint64_t> offsets = offsets_of(counts);
  const uint64_t total = sum_of(counts);
  const size_t size = type.size;
  unsigned char* recv = g_arena.recv.data();
  unsigned char* expected = g_arena.expected.data();
  for (int r = 0; r < comm.size; ++r) {
    fill_periodic(type, expected + offsets[r] * size, counts[r],
                  [&](uint64_t i) { return moved_value(type, r, 0, i); });
  }
  std::memset(recv, 0xAB, total * size);
  const uint64_t mine = counts[comm.rank];
  unsigned char* send = in_place ? recv + offsets[comm.rank] * size : g_arena.send.data();
  std::memcpy(send, expected + offsets[comm.rank] * size, mine * size);
  std::memcpy(g_arena.copy.data(), send, mine * size);
  const std::string what =
      fmt::format("{} {} counts {}{} {}", variable ? "allgatherv" : "allgather", type.name,
                  counts.size() > 6 ? "..." : fmt::format("{}", fmt::join(counts, ",")),
                  counts.size() > 6 ? fmt::format(" (total {})", total) : "",
                  in_place ? "in place" : "out of place");
  const kolo_status_t status =
      variable ? kolo_allgatherv(comm.handle, send, recv, counts.data(), type.dtype)
               : kolo_allgather(comm.handle, send, recv, counts[0], type.dtype);
  check_status(comm.handle, status, what);
  compare(type, recv, expected, total, what);
  if (!in_place && std::memcmp(send, g_arena.copy.data(), mine * size) != 0) {
    fail(what + ": sendbuf was modified");
  }
}

int run_allgather(const Comm& comm, bool quick) {
  g_arena.reserve(big_bytes(quick) + (1u << 20));
  int checks = 0;
  for (const TypeInfo& type : kTypes) {
    const uint64_t sizes[] = {0, 1, 7919, big_bytes(quick) / comm.size / type.size + 3};
    for (uint64_t count : sizes) {
      for (bool in_place : {false, true}) {
        check_allgather(comm, type, std::vector<uint64_t>(comm.size, count), false, in_place);
        ++checks;
      }
    }
  }
  for (kolo_dtype_t dtype : {KOLO_FLOAT32, KOLO_FLOAT16, KOLO_INT8, KOLO_INT64}) {
    const TypeInfo& type = type_of(dtype);
    for (const auto& counts : uneven_patterns(comm.size, big_bytes(quick) / type.size)) {
      for (bool in_place : {false, true}) {
        check_allgather(comm, type, counts, true, in_place);
        ++checks;
      }
    }
  }
  fmt::print("rank {}: {} allgather checks passed\n", comm.rank, checks);
  return 0;
}

// ---- reduce-scatter -----------------------------------------------------------------------------

void check_reduce_scatter(const Comm& comm, const TypeInfo& type, kolo_op_t op,
                          const std::vector<uint64_t>& counts, bool variable, bool in_place) {
  const std::vector<uint64_t> offsets = offsets_of(counts);
  const uint64_t total = sum_of(counts);
  const size_t size = type.size;
  unsigned char* send = g_arena.send.data();
  unsigned char* expected = g_arena.expected.data();
  fill_periodic(type, send, total, [&](uint64_t i) {
    return static_cast<double>(input_value(type, op, comm.rank, i));
  });
  fill_periodic(type, expected, total,
                [&](uint64_t i) { return expected_value(type, op, i, 1.0, 1.0, comm.size); });
  std::memcpy(g_arena.copy.data(), send, total * size);
  const uint64_t mine = counts[comm.rank];
  unsigned char* recv = in_place ? send + offsets[comm.rank] * size : g_arena.recv.data();
  if (!in_place) std::memset(recv, 0xAB, mine * size);
  const std::string what = fmt::format(
      "{} {} {} counts {} {}", variable ? "reduce_scatterv" : "reduce_scatter", type.name,
      op_name(op), fmt::join(counts, ","), in_place ? "in place" : "out of place");
  const kolo_status_t status =
      variable ? kolo_reduce_scatterv(comm.handle, send, recv, counts.data(), type.dtype, op)
               : kolo_reduce_scatter(comm.handle, send, recv, counts[0], type.dtype, op);
  check_status(comm.handle, status, what);
  compare(type, recv, expected + offsets[comm.rank] * size, mine, what);
  // sendbuf is only read, except (in place) this rank's block.
  const uint64_t before = in_place ? offsets[comm.rank] : total;
  if (std::memcmp(send, g_arena.copy.data(), before * size) != 0 ||
      (in_place && std::memcmp(send + (offsets[comm.rank] + mine) * size,
                               g_arena.copy.data() + (offsets[comm.rank] + mine) * size,
                               (total - offsets[comm.rank] - mine) * size) != 0)) {
    fail(what + ": sendbuf outside this rank's block was modified");
  }
}

int run_reduce_scatter(const Comm& comm, bool quick) {
  g_arena.reserve(big_bytes(quick) + (1u << 20));
  int checks = 0;
  for (const TypeInfo& type : kTypes) {
    const uint64_t big = big_bytes(quick) / comm.size / type.size + 3;
    for (kolo_op_t op : kOps) {
      for (uint64_t count : {uint64_t{0}, uint64_t{1}, uint64_t{7919}, big}) {
        for (bool in_place : {false, true}) {
          // The large case in place only for SUM: placement does not depend on the op.
          if (count == big && in_place && op != KOLO_SUM) continue;
          check_reduce_scatter(comm, type, op, std::vector<uint64_t>(comm.size, count), false,
                               in_place);
          ++checks;
        }
      }
    }
  }
  for (kolo_dtype_t dtype : {KOLO_FLOAT32, KOLO_BFLOAT16, KOLO_UINT8, KOLO_INT32}) {
    const TypeInfo& type = type_of(dtype);
    for (kolo_op_t op : {KOLO_SUM, KOLO_MAX, KOLO_AVG}) {
      for (const auto& counts : uneven_patterns(comm.size, big_bytes(quick) / type.size)) {
        for (bool in_place : {false, true}) {
          check_reduce_scatter(comm, type, op, counts, true, in_place);
          ++checks;
        }
      }
    }
  }
  fmt::print("rank {}: {} reduce_scatter checks passed\n", comm.rank, checks);
  return 0;
}

// ---- alltoall -----------------------------------------------------------------------------------

// What this rank sends to and receives from each peer, in elements.
struct Layout {
  std::vector<uint64_t> send_counts, recv_counts;
  std::vector<int64_t> send_displacements, recv_displacements;
  uint64_t send_extent = 0, recv_extent = 0;
};

// count(source, target): elements source sends target. Blocks in peer order, back to back, as
// alltoall has them; with `shuffled` (for alltoallv), gaps of (peer mod 3) elements between
// blocks and receive blocks in reverse peer order.
Layout make_layout(const Comm& comm, const std::function<uint64_t(int, int)>& count,
                   bool shuffled) {
  const bool gaps = shuffled;
  Layout layout;
  uint64_t at = 0;
  for (int peer = 0; peer < comm.size; ++peer) {
    at += gaps ? peer % 3 : 0;
    layout.send_counts.push_back(count(comm.rank, peer));
    layout.send_displacements.push_back(static_cast<int64_t>(at));
    at += layout.send_counts.back();
  }
  layout.send_extent = at;
  layout.recv_counts.resize(comm.size);
  layout.recv_displacements.resize(comm.size);
  at = 0;
  for (int step = 0; step < comm.size; ++step) {
    const int peer = shuffled ? comm.size - 1 - step : step;
    at += gaps ? (peer + 1) % 3 : 0;
    layout.recv_counts[peer] = count(peer, comm.rank);
    layout.recv_displacements[peer] = static_cast<int64_t>(at);
    at += layout.recv_counts[peer];
  }
  layout.recv_extent = at;
  return layout;
}

void check_alltoall(const Comm& comm, const TypeInfo& type, const Layout& layout, bool variable,
                    bool in_place) {
  const size_t size = type.size;
  unsigned char* recv = g_arena.recv.data();
  unsigned char* send = in_place ? recv : g_arena.send.data();
  unsigned char* expected = g_arena.expected.data();
  const uint64_t extent = std::max(layout.send_extent, layout.recv_extent);
  std::memset(recv, 0xAB, extent * size);
  if (!in_place) std::memset(send, 0xCD, layout.send_extent * size);
  for (int peer = 0; peer < comm.size; ++peer) {
    fill_periodic(type, send + layout.send_displacements[peer] * size, layout.send_counts[peer],
                  [&](uint64_t i) { return moved_value(type, comm.rank, peer, i); });
  }
  // Afterwards recvbuf is what it was, with every received block in its place.
  std::memcpy(expected, recv, extent * size);
  for (int peer = 0; peer < comm.size; ++peer) {
    fill_periodic(type, expected + layout.recv_displacements[peer] * size, layout.recv_counts[peer],
                  [&](uint64_t i) { return moved_value(type, peer, comm.rank, i); });
  }
  std::memcpy(g_arena.copy.data(), send, layout.send_extent * size);
  const std::string what =
      fmt::format("{} {} sendcounts {} recvcounts {} {}", variable ? "alltoallv" : "alltoall",
                  type.name, fmt::join(layout.send_counts, ","), fmt::join(layout.recv_counts, ","),
                  in_place ? "in place" : "out of place");
  const kolo_status_t status =
      variable ? kolo_alltoallv(comm.handle, send, layout.send_counts.data(),
                                layout.send_displacements.data(), recv, layout.recv_counts.data(),
                                layout.recv_displacements.data(), type.dtype)
               : kolo_alltoall(comm.handle, send, recv, layout.send_counts[0], type.dtype);
  check_status(comm.handle, status, what);
  compare(type, recv, expected, extent, what);
  if (!in_place && std::memcmp(send, g_arena.copy.data(), layout.send_extent * size) != 0) {
    fail(what + ": sendbuf was modified");
  }
}

int run_alltoall(const Comm& comm, bool quick) {
  g_arena.reserve(big_bytes(quick) + (1u << 20));
  int checks = 0;
  for (kolo_dtype_t dtype : {KOLO_FLOAT32, KOLO_FLOAT64, KOLO_FLOAT16, KOLO_INT8, KOLO_INT64}) {
    const TypeInfo& type = type_of(dtype);
    const uint64_t big = big_bytes(quick) / comm.size / type.size + 3;
    for (uint64_t count : {uint64_t{0}, uint64_t{1}, uint64_t{7919}, big}) {
      for (bool in_place : {false, true}) {
        check_alltoall(comm, type,
                       make_layout(
                           comm, [&](int, int) { return count; }, false),
                       false, in_place);
        ++checks;
      }
    }
  }
  // The largest unit makes the busiest rank send about big_bytes (4N^2 units at most).
  const uint64_t units[] = {1, 97, 0};
  for (kolo_dtype_t dtype : {KOLO_FLOAT32, KOLO_BFLOAT16, KOLO_UINT8}) {
    const TypeInfo& type = type_of(dtype);
    for (uint64_t unit : units) {
      if (unit == 0) unit = big_bytes(quick) / (type.size * 4 * comm.size * comm.size);
      const std::function<uint64_t(int, int)> patterns[] = {
          // Uneven, zeros where (source + 2 target) % 4 == 1, and a self block.
          [&](int s, int t) {
            return (s + 2 * t) % 4 == 1 ? uint64_t{0} : static_cast<uint64_t>(s * 3 + t + 1) * unit;
          },
          // Only to the right-hand neighbour.
          [&](int s, int t) { return t == (s + 1) % comm.size ? unit : uint64_t{0}; },
          // Nothing at all.
          [](int, int) { return uint64_t{0}; },
      };
      for (const auto& pattern : patterns) {
        for (bool in_place : {false, true}) {
          check_alltoall(comm, type, make_layout(comm, pattern, true), true, in_place);
          ++checks;
        }
      }
    }
  }
  fmt::print("rank {}: {} alltoall checks passed\n", comm.rank, checks);
  return 0;
}

// ---- reduce -------------------------------------------------------------------------------------

int run_reduce(const Comm& comm, bool quick) {
  g_arena.reserve(big_bytes(quick) + (1u << 20));
  int checks = 0;
  for (int root = 0; root < comm.size; ++root) {
    for (const TypeInfo& type : kTypes) {
      const uint64_t big = big_bytes(quick) / type.size + 3;
      for (kolo_op_t op : kOps) {
        for (uint64_t count : {uint64_t{0}, uint64_t{1}, uint64_t{7919}, big}) {
          // One large case per root and dtype, the op taking turns.
          if (count == big && op != kOps[(root + type.size) % 5]) continue;
          for (bool in_place : {false, true}) {
            const size_t size = type.size;
            unsigned char* send = g_arena.send.data();
            fill_periodic(type, send, count, [&](uint64_t i) {
              return static_cast<double>(input_value(type, op, comm.rank, i));
            });
            std::memcpy(g_arena.copy.data(), send, count * size);
            const bool is_root = comm.rank == root;
            // In place on the root; elsewhere, in place means passing no recvbuf at all.
            unsigned char* recv = in_place ? (is_root ? send : nullptr) : g_arena.recv.data();
            if (!in_place) std::memset(recv, 0xAB, count * size);
            const std::string what =
                fmt::format("reduce {} {} count {} root {} {}", type.name, op_name(op), count, root,
                            in_place ? "in place" : "out of place");
            check_status(comm.handle,
                         kolo_reduce(comm.handle, send, recv, count, type.dtype, op, root), what);
            if (is_root) {
              fill_periodic(type, g_arena.expected.data(), count, [&](uint64_t i) {
                return expected_value(type, op, i, 1.0, 1.0, comm.size);
              });
              compare(type, recv, g_arena.expected.data(), count, what);
            } else if (recv != nullptr) {
              std::memset(g_arena.expected.data(), 0xAB, count * size);
              compare(type, recv, g_arena.expected.data(), count, what + " (recvbuf off the root)");
            }
            if (!(in_place && is_root) &&
                std::memcmp(send, g_arena.copy.data(), count * size) != 0) {
              fail(what + ": sendbuf was modified");
            }
            ++checks;
          }
        }
      }
    }
  }
  fmt::print("rank {}: {} reduce checks passed\n", comm.rank, checks);
  return 0;
}

// ---- send/recv ----------------------------------------------------------------------------------

int run_sendrecv(const Comm& comm) {
  g_arena.reserve((4u << 20) + (1u << 20));
  struct Message {
    kolo_dtype_t dtype;
    uint64_t count;
  };
  const Message messages[] = {{KOLO_FLOAT32, 0},
                              {KOLO_INT8, 1},
                              {KOLO_FLOAT16, 7919},
                              {KOLO_FLOAT32, (4u << 20) / 4 + 1},
                              {KOLO_INT64, 1009}};
  int checks = 0;
  // Pairs in one order that every rank follows; within a pair the lower rank sends first. Each
  // call blocks until its partner has matched it, and the order has no cycle.
  for (int a = 0; a < comm.size; ++a) {
    for (int b = a + 1; b < comm.size; ++b) {
      if (comm.rank != a && comm.rank != b) continue;
      const int peer = comm.rank == a ? b : a;
      int tag = 0;
      for (const Message& message : messages) {
        const TypeInfo& type = type_of(message.dtype);
        for (int direction = 0; direction < 2; ++direction, ++tag) {
          const int sender = direction == 0 ? a : b;
          auto value = [&](uint64_t i) { return moved_value(type, sender, tag, i); };
          const std::string what = fmt::format(
              "{} of {} {} elements, tag {}, {} rank {}", comm.rank == sender ? "send" : "recv",
              message.count, type.name, tag, comm.rank == sender ? "to" : "from", peer);
          if (comm.rank == sender) {
            fill_periodic(type, g_arena.send.data(), message.count, value);
            check_status(
                comm.handle,
                kolo_send(comm.handle, g_arena.send.data(), message.count, type.dtype, peer, tag),
                what);
          } else {
            std::memset(g_arena.recv.data(), 0xAB, message.count * type.size + 16);
            fill_periodic(type, g_arena.expected.data(), message.count, value);
            check_status(
                comm.handle,
                kolo_recv(comm.handle, g_arena.recv.data(), message.count, type.dtype, peer, tag),
                what);
            compare(type, g_arena.recv.data(), g_arena.expected.data(), message.count, what);
            for (int i = 0; i < 16; ++i) {
              if (g_arena.recv[message.count * type.size + i] != 0xAB) {
                fail(what + ": wrote past the end of the buffer");
              }
            }
          }
          ++checks;
        }
      }
    }
    // The same connections carry the collectives: a barrier between the rounds of pairs.
    check_status(comm.handle, kolo_barrier(comm.handle), "barrier between send/recv rounds");
  }
  if (comm.size > 1) {
    // NULL buffers are fine for empty messages.
    if (comm.rank == 0) {
      check_status(comm.handle, kolo_send(comm.handle, nullptr, 0, KOLO_INT32, 1, 7),
                   "send of nothing");
    } else if (comm.rank == 1) {
      check_status(comm.handle, kolo_recv(comm.handle, nullptr, 0, KOLO_INT32, 0, 7),
                   "recv of nothing");
    }
  }
  check_status(comm.handle, kolo_barrier(comm.handle), "final barrier");
  fmt::print("rank {}: {} sendrecv checks passed\n", comm.rank, checks);
  return 0;
}

// ---- sub-communicators --------------------------------------------------------------------------

// A few allreduce and allgather checks on comm, with references for its size and ranks.
void check_communicator(const Comm& comm, const std::vector<int>& world_ranks,
                        const std::string& name, bool with_big) {
  if (comm.size != static_cast<int>(world_ranks.size())) {
    fail(fmt::format("{}: size {} expected {}", name, comm.size, world_ranks.size()));
  }
  if (world_ranks[comm.rank] != g_rank) {
    fail(fmt::format("{}: rank {} is world rank {}, expected world rank {} there", name, comm.rank,
                     g_rank, world_ranks[comm.rank]));
  }
  // Who is who: every member's world rank, in the new order.
  std::vector<int32_t> gathered(comm.size, -1);
  const int32_t mine = g_rank;
  check_status(comm.handle, kolo_allgather(comm.handle, &mine, gathered.data(), 1, KOLO_INT32),
               name + ": allgather of world ranks");
  for (int r = 0; r < comm.size; ++r) {
    if (gathered[r] != world_ranks[r]) {
      fail(fmt::format("{}: rank {} is world rank {}, expected {}", name, r, gathered[r],
                       world_ranks[r]));
    }
  }
  for (kolo_dtype_t dtype : {KOLO_FLOAT32, KOLO_BFLOAT16, KOLO_INT64}) {
    const TypeInfo& type = type_of(dtype);
    for (kolo_op_t op : {KOLO_SUM, KOLO_AVG, KOLO_MAX}) {
      for (uint64_t count : {uint64_t{1}, uint64_t{7919}, uint64_t{(1u << 20) / type.size + 1}}) {
        if (count > 7919 && !with_big) continue;
        std::vector<unsigned char> send(count * type.size), recv(count * type.size),
            expected(count * type.size);
        fill_periodic(type, send.data(), count, [&](uint64_t i) {
          return static_cast<double>(input_value(type, op, comm.rank, i));
        });
        fill_periodic(type, expected.data(), count,
                      [&](uint64_t i) { return expected_value(type, op, i, 1.0, 1.0, comm.size); });
        const std::string what =
            fmt::format("{}: allreduce {} {} count {}", name, type.name, op_name(op), count);
        check_status(comm.handle,
                     kolo_allreduce(comm.handle, send.data(), recv.data(), count, dtype, op), what);
        compare(type, recv.data(), expected.data(), count, what);
      }
    }
  }
}

std::vector<int> members_of(int color_of_me, const std::function<int(int)>& color,
                            const std::function<int(int)>& key) {
  std::vector<int> members;
  for (int r = 0; r < g_size; ++r) {
    if (color(r) == color_of_me) members.push_back(r);
  }
  std::stable_sort(members.begin(), members.end(), [&](int a, int b) { return key(a) < key(b); });
  return members;
}

Comm split(const Comm& parent, int color, int key, const std::string& name) {
  kolo_comm_t child = nullptr;
  check_status(parent.handle, kolo_comm_split(parent.handle, color, key, &child), name);
  if (color < 0) {
    if (child != nullptr) fail(name + ": a negative colour got a communicator");
    return Comm{};
  }
  if (child == nullptr) fail(name + ": no communicator");
  return describe_comm(child);
}

// Runs `body` `times` times in a thread, recording a failure instead of exiting from the thread.
struct Worker {
  std::thread thread;
  std::string failure;
};

int run_split(Comm& world) {
  int checks = 0;
  // Odd and even world ranks, in reverse order (key = -rank).
  auto parity = [](int r) { return r % 2; };
  auto reverse = [](int r) { return -r; };
  Comm halves = split(world, parity(g_rank), reverse(g_rank), "split into odd and even");
  const std::vector<int> half_members = members_of(parity(g_rank), parity, reverse);
  // Both halves at once (each half's ranks run their collectives at the same time as the other's).
  check_communicator(halves, half_members, "odd/even half", true);
  ++checks;

  // Singletons.
  Comm alone = split(world, g_rank, 0, "split into singletons");
  check_communicator(alone, {g_rank}, "singleton", true);
  ++checks;

  // Rank 0 opts out; the others form one communicator ordered by key = rank.
  auto without_zero = [](int r) { return r == 0 ? KOLO_COLOR_NONE : 5; };
  Comm rest = split(world, without_zero(g_rank), g_rank, "split with rank 0 opting out");
  if (g_rank != 0) {
    check_communicator(rest, members_of(5, without_zero, [](int r) { return r; }), "all but rank 0",
                       false);
    check_status(rest.handle, kolo_comm_destroy(rest.handle), "destroy all-but-rank-0");
  }
  ++checks;

  // Nested: each half splits again by its own rank's parity, keyed by world rank.
  Comm quarter = split(halves, halves.rank % 2, g_rank, "nested split");
  {
    std::vector<int> members;
    for (int r = 0; r < halves.size; ++r) {
      if (r % 2 == halves.rank % 2) members.push_back(half_members[r]);
    }
    std::sort(members.begin(), members.end());
    check_communicator(quarter, members, "quarter", false);
  }
  ++checks;

  // Three communicators used at the same time from three threads: the halves, the lower/upper
  // halves of the world (a sibling of the odd/even halves), and the world itself.
  auto lower = [&](int r) { return r < (g_size + 1) / 2 ? 0 : 1; };
  Comm block = split(world, lower(g_rank), g_rank, "split into lower and upper");
  const std::vector<int> block_members = members_of(lower(g_rank), lower, [](int r) { return r; });
  std::vector<Worker> workers(2);
  auto loop = [](Worker* worker, Comm comm, std::vector<int> members, std::string name) {
    worker->thread = std::thread([worker, comm, members, name] {
      for (int iteration = 0; iteration < 20; ++iteration) {
        std::vector<int32_t> values(3 * members.size() + 1, -1);
        const int32_t mine[3] = {g_rank, iteration, comm.rank};
        kolo_status_t status = kolo_allgather(comm.handle, mine, values.data(), 3, KOLO_INT32);
        if (status != KOLO_SUCCESS) {
          worker->failure =
              fmt::format("{}: allgather #{} returned {}: {}", name, iteration,
                          kolo_status_string(status), kolo_comm_last_error(comm.handle));
          return;
        }
        for (size_t r = 0; r < members.size(); ++r) {
          if (values[3 * r] != members[r] || values[3 * r + 1] != iteration ||
              values[3 * r + 2] != static_cast<int32_t>(r)) {
            worker->failure =
                fmt::format("{}: allgather #{} gave ({}, {}, {}) for rank {}", name, iteration,
                            values[3 * r], values[3 * r + 1], values[3 * r + 2], r);
            return;
          }
        }
        std::vector<int64_t> sums(5000, 0);
        for (size_t i = 0; i < sums.size(); ++i) sums[i] = static_cast<int64_t>(i) + g_rank;
        status = kolo_allreduce(comm.handle, sums.data(), sums.data(), sums.size(), KOLO_INT64,
                                KOLO_SUM);
        int64_t ranks_sum = 0;
        for (int member : members) ranks_sum += member;
        if (status != KOLO_SUCCESS ||
            sums[4999] != 4999 * static_cast<int64_t>(members.size()) + ranks_sum) {
          worker->failure = fmt::format("{}: allreduce #{} returned {} ({})", name, iteration,
                                        kolo_status_string(status), sums[4999]);
          return;
        }
      }
    });
  };
  loop(&workers[0], halves, half_members, "odd/even half (thread)");
  loop(&workers[1], block, block_members, "lower/upper half (thread)");
  std::vector<int> everyone(g_size);
  std::iota(everyone.begin(), everyone.end(), 0);
  for (int iteration = 0; iteration < 5; ++iteration) {
    check_communicator(world, everyone, "world, while threads use its children", false);
  }
  for (Worker& worker : workers) {
    worker.thread.join();
    if (!worker.failure.empty()) fail(worker.failure);
  }
  ++checks;

  // Destroying one communicator leaves the others working: the quarter and the singleton go,
  // then the world itself; the halves and the lower/upper blocks go on, and split again. A copy
  // of the world (a split with one colour) keeps every process, rank 0's with the rendezvous
  // store included, until everyone has finished splitting, and says goodbye last.
  Comm copy = split(world, 0, g_rank, "split into a copy of the world");
  check_status(quarter.handle, kolo_comm_destroy(quarter.handle), "destroy quarter");
  check_status(alone.handle, kolo_comm_destroy(alone.handle), "destroy singleton");
  check_status(world.handle, kolo_comm_destroy(world.handle), "destroy world");
  world.handle = nullptr;
  check_communicator(halves, half_members, "odd/even half after the world was destroyed", true);
  check_communicator(block, block_members, "lower/upper half after the world was destroyed", false);
  Comm again = split(halves, 0, -halves.rank, "split of a half after the world was destroyed");
  {
    std::vector<int> members(half_members.rbegin(), half_members.rend());
    check_communicator(again, members, "reversed half", false);
  }
  check_status(again.handle, kolo_comm_destroy(again.handle), "destroy reversed half");
  check_status(block.handle, kolo_comm_destroy(block.handle), "destroy lower/upper half");
  check_status(halves.handle, kolo_comm_destroy(halves.handle), "destroy odd/even half");
  check_communicator(copy, everyone, "copy of the world, after the others were destroyed", false);
  check_status(copy.handle, kolo_comm_destroy(copy.handle), "destroy the copy of the world");
  checks += 2;
  fmt::print("rank {}: {} split checks passed\n", g_rank, checks);
  return 0;
}

// ---- faults -------------------------------------------------------------------------------------

// The last rank (or, for point to point, rank 1) calls differently; every rank must end with
// KOLO_ERR_MISMATCH, and a later call must say so again.
int run_mismatch(const Comm& comm, const std::string& kind) {
  const int n = comm.size;
  const bool odd = comm.rank == n - 1;
  std::vector<float> a(4096 * n, 1.0f), b(4096 * n, 0.0f);
  std::vector<uint64_t> counts(n, 3);
  kolo_status_t status = KOLO_SUCCESS;
  if (kind == "allgather_count") {
    status = kolo_allgather(comm.handle, a.data(), b.data(), odd ? 999 : 1000, KOLO_FLOAT32);
  } else if (kind == "allgather_dtype") {
    status = kolo_allgather(comm.handle, a.data(), b.data(), 1000, odd ? KOLO_INT32 : KOLO_FLOAT32);
  } else if (kind == "allgatherv_counts") {
    if (odd) counts[0] = 4;  // this rank's own block is still 3 elements
    status = kolo_allgatherv(comm.handle, a.data(), b.data(), counts.data(), KOLO_FLOAT32);
  } else if (kind == "reduce_scatter_op") {
    status = kolo_reduce_scatter(comm.handle, a.data(), b.data(), 1000, KOLO_FLOAT32,
                                 odd ? KOLO_MAX : KOLO_SUM);
  } else if (kind == "reduce_scatterv_counts") {
    if (odd) counts[0] = 2;
    status = kolo_reduce_scatterv(comm.handle, a.data(), b.data(), counts.data(), KOLO_FLOAT32,
                                  KOLO_SUM);
  } else if (kind == "alltoall_count") {
    status = kolo_alltoall(comm.handle, a.data(), b.data(), odd ? 100 : 101, KOLO_FLOAT32);
  } else if (kind == "alltoallv_pair") {
    // The last rank sends rank 0 one element more than rank 0 expects; every other pair agrees.
    std::vector<uint64_t> send_counts(n, 2), recv_counts(n, 2);
    std::vector<int64_t> displacements(n);
    for (int p = 0; p < n; ++p) displacements[p] = 4 * p;
    if (odd) send_counts[0] = 3;
    status = kolo_alltoallv(comm.handle, a.data(), send_counts.data(), displacements.data(),
                            b.data(), recv_counts.data(), displacements.data(), KOLO_FLOAT32);
  } else if (kind == "reduce_root") {
    status =
        kolo_reduce(comm.handle, a.data(), b.data(), 1000, KOLO_FLOAT32, KOLO_SUM, odd ? 1 % n : 0);
  } else if (kind == "reduce_count") {
    status =
        kolo_reduce(comm.handle, a.data(), b.data(), odd ? 1001 : 1000, KOLO_FLOAT32, KOLO_SUM, 0);
  } else if (kind == "reduce_op") {
    status = kolo_reduce(comm.handle, a.data(), b.data(), 1000, KOLO_FLOAT32,
                         odd ? KOLO_MIN : KOLO_SUM, n - 1);
  } else if (kind == "collective") {
    status = odd ? kolo_alltoall(comm.handle, a.data(), b.data(), 10, KOLO_FLOAT32)
                 : kolo_allgather(comm.handle, a.data(), b.data(), 10, KOLO_FLOAT32);
  } else if (kind == "sendrecv_tag" || kind == "sendrecv_count" || kind == "sendrecv_both_send") {
    const bool tag = kind == "sendrecv_tag";
    const bool count = kind == "sendrecv_count";
    if (comm.rank == 0) {
      status = kolo_send(comm.handle, a.data(), 100, KOLO_FLOAT32, 1, 5);
    } else if (comm.rank == 1) {
      status =
          kind == "sendrecv_both_send"
              ? kolo_send(comm.handle, a.data(), 100, KOLO_FLOAT32, 0, 5)
              : kolo_recv(comm.handle, b.data(), count ? 99 : 100, KOLO_FLOAT32, 0, tag ? 6 : 5);
    }
    // The other ranks learn of it in their next call.
    if (status == KOLO_SUCCESS) status = kolo_barrier(comm.handle);
  } else {
    fail("unknown mismatch kind " + kind);
  }
  fmt::print("rank {}: status {} message: {}\n", comm.rank, kolo_status_string(status),
             kolo_comm_last_error(comm.handle));
  if (status != KOLO_ERR_MISMATCH) fail("expected KOLO_ERR_MISMATCH");
  const kolo_status_t again = kolo_barrier(comm.handle);
  if (again != KOLO_ERR_MISMATCH) {
    fail(fmt::format("a later call returned {} instead of the same KOLO_ERR_MISMATCH",
                     kolo_status_string(again)));
  }
  fmt::print("rank {}: mismatch checks passed\n", comm.rank);
  return 0;
}

// The odd and even halves of the world; in the half of the last rank, the last member calls a
// different count. That half fails with KOLO_ERR_MISMATCH on every member, the other half and the
// world keep working.
int run_split_mismatch(const Comm& world) {
  Comm half = split(world, g_rank % 2, g_rank, "split into odd and even");
  const bool troubled = g_rank % 2 == (g_size - 1) % 2;
  std::vector<float> a(1000, 1.0f), b(1000 * g_size, 0.0f);
  const bool odd = troubled && half.rank == half.size - 1;
  const kolo_status_t status =
      kolo_allgather(half.handle, a.data(), b.data(), odd ? 999 : 1000, KOLO_FLOAT32);
  fmt::print("rank {}: half status {} message: {}\n", g_rank, kolo_status_string(status),
             kolo_comm_last_error(half.handle));
  if (troubled && half.size > 1 && status != KOLO_ERR_MISMATCH) fail("expected KOLO_ERR_MISMATCH");
  if ((!troubled || half.size == 1) && status != KOLO_SUCCESS) {
    fail("the half without a disagreement failed");
  }
  std::vector<int> everyone(g_size);
  std::iota(everyone.begin(), everyone.end(), 0);
  check_communicator(world, everyone, "the world after a mismatch in a half", false);
  check_status(half.handle, kolo_comm_destroy(half.handle), "destroy half");
  fmt::print("rank {}: split mismatch checks passed\n", g_rank);
  return 0;
}

int run_badargs(const Comm& comm) {
  const int n = comm.size;
  std::vector<float> data(64 * n, 1.0f), out(64 * n, 0.0f);
  std::vector<uint64_t> counts(n, 4), huge(n, uint64_t{1} << 62);
  std::vector<uint64_t> zeros(n, 0);
  std::vector<int64_t> displacements(n), negative(n), overflowing(n), same(n, 0);
  for (int p = 0; p < n; ++p) displacements[p] = 4 * p;
  negative = displacements;
  negative[n - 1] = -4;
  overflowing = displacements;
  overflowing[0] = std::numeric_limits<int64_t>::max() - 2;
  std::vector<uint64_t> self_differs = counts;
  std::vector<uint64_t> self_differs_recv = counts;
  self_differs_recv[comm.rank] = 3;
  kolo_comm_t ignored = nullptr;
  const uint64_t too_many = ~uint64_t{0} / 2;
  // Each case is refused and its message names the problem.
  auto expect_message = [&](const char* what, kolo_status_t status, const char* part) {
    if (status != KOLO_ERR_INVALID_ARGUMENT) {
      fail(fmt::format("{}: expected KOLO_ERR_INVALID_ARGUMENT, got {}", what,
                       kolo_status_string(status)));
    }
    if (part && !std::strstr(kolo_comm_last_error(comm.handle), part)) {
      fail(fmt::format("{}: the message '{}' does not mention '{}'", what,
                       kolo_comm_last_error(comm.handle), part));
    }
  };
  expect_message("allgather NULL sendbuf",
                 kolo_allgather(comm.handle, nullptr, out.data(), 4, KOLO_FLOAT32), "sendbuf");
  expect_message("allgather NULL recvbuf",
                 kolo_allgather(comm.handle, data.data(), nullptr, 4, KOLO_FLOAT32), "recvbuf");
  expect_message("allgather overlap",
                 kolo_allgather(comm.handle, out.data() + 1, out.data(), 4, KOLO_FLOAT32),
                 "overlap");
  expect_message("allgather count too large",
                 kolo_allgather(comm.handle, data.data(), out.data(), too_many, KOLO_FLOAT32),
                 "large");
  expect_message(
      "allgather unknown dtype",
      kolo_allgather(comm.handle, data.data(), out.data(), 4, static_cast<kolo_dtype_t>(9)),
      "dtype");
  expect_message("allgatherv NULL counts",
                 kolo_allgatherv(comm.handle, data.data(), out.data(), nullptr, KOLO_FLOAT32),
                 "counts");
  expect_message("allgatherv counts overflow",
                 kolo_allgatherv(comm.handle, data.data(), out.data(), huge.data(), KOLO_FLOAT32),
                 "counts");
  expect_message("reduce_scatter unknown op",
                 kolo_reduce_scatter(comm.handle, data.data(), out.data(), 4, KOLO_FLOAT32,
                                     static_cast<kolo_op_t>(5)),
                 "op");
  expect_message(
      "reduce_scatter overlap",
      kolo_reduce_scatter(comm.handle, data.data(), data.data() + 1, 4, KOLO_FLOAT32, KOLO_SUM),
      "overlap");
  expect_message(
      "reduce_scatterv NULL counts",
      kolo_reduce_scatterv(comm.handle, data.data(), out.data(), nullptr, KOLO_FLOAT32, KOLO_SUM),
      "counts");
  expect_message(
      "reduce_scatterv NULL sendbuf",
      kolo_reduce_scatterv(comm.handle, nullptr, out.data(), counts.data(), KOLO_FLOAT32, KOLO_SUM),
      "sendbuf");
  expect_message("alltoall NULL recvbuf",
                 kolo_alltoall(comm.handle, data.data(), nullptr, 4, KOLO_FLOAT32), "recvbuf");
  expect_message("alltoallv NULL sendcounts",
                 kolo_alltoallv(comm.handle, data.data(), nullptr, displacements.data(), out.data(),
                                counts.data(), displacements.data(), KOLO_FLOAT32),
                 "sendcounts");
  expect_message("alltoallv NULL rdispls",
                 kolo_alltoallv(comm.handle, data.data(), counts.data(), displacements.data(),
                                out.data(), counts.data(), nullptr, KOLO_FLOAT32),
                 "rdispls");
  expect_message("alltoallv negative displacement",
                 kolo_alltoallv(comm.handle, data.data(), counts.data(), negative.data(),
                                out.data(), counts.data(), displacements.data(), KOLO_FLOAT32),
                 "negative");
  expect_message("alltoallv overflowing displacement",
                 kolo_alltoallv(comm.handle, data.data(), counts.data(), displacements.data(),
                                out.data(), counts.data(), overflowing.data(), KOLO_FLOAT32),
                 "overflow");
  expect_message("alltoallv NULL sendbuf",
                 kolo_alltoallv(comm.handle, nullptr, counts.data(), displacements.data(),
                                out.data(), counts.data(), displacements.data(), KOLO_FLOAT32),
                 "sendbuf");
  expect_message(
      "alltoallv self counts differ",
      kolo_alltoallv(comm.handle, data.data(), self_differs.data(), displacements.data(),
                     out.data(), self_differs_recv.data(), displacements.data(), KOLO_FLOAT32),
      "itself");
  expect_message("reduce root out of range",
                 kolo_reduce(comm.handle, data.data(), out.data(), 4, KOLO_FLOAT32, KOLO_SUM, n),
                 "root");
  expect_message("reduce negative root",
                 kolo_reduce(comm.handle, data.data(), out.data(), 4, KOLO_FLOAT32, KOLO_SUM, -1),
                 "root");
  expect_message("reduce unknown op",
                 kolo_reduce(comm.handle, data.data(), out.data(), 4, KOLO_FLOAT32,
                             static_cast<kolo_op_t>(7), 0),
                 "op");
  // The root's recvbuf is NULL; elsewhere (where recvbuf is not used) sendbuf is NULL, so
  // that no rank starts the call.
  expect_message("reduce NULL recvbuf on the root",
                 kolo_reduce(comm.handle, comm.rank == 0 ? data.data() : nullptr, nullptr, 4,
                             KOLO_FLOAT32, KOLO_SUM, 0),
                 comm.rank == 0 ? "recvbuf" : "sendbuf");
  expect_message("send to itself",
                 kolo_send(comm.handle, data.data(), 4, KOLO_FLOAT32, comm.rank, 0), "itself");
  expect_message("send to a rank outside",
                 kolo_send(comm.handle, data.data(), 4, KOLO_FLOAT32, n, 0), "peer");
  expect_message("recv negative tag",
                 kolo_recv(comm.handle, out.data(), 4, KOLO_FLOAT32, (comm.rank + 1) % n, -3),
                 n == 1 ? "itself" : "tag");
  expect_message("recv NULL buf",
                 kolo_recv(comm.handle, nullptr, 4, KOLO_FLOAT32, (comm.rank + 1) % n, 0),
                 n == 1 ? "itself" : "NULL");
  expect_message("split NULL newcomm", kolo_comm_split(comm.handle, 0, 0, nullptr), "newcomm");
  expect_message("split NULL comm", kolo_comm_split(nullptr, 0, 0, &ignored), nullptr);
  expect_message("allgather NULL comm",
                 kolo_allgather(nullptr, data.data(), out.data(), 4, KOLO_FLOAT32), nullptr);
  if (n > 1) {
    expect_message("alltoallv overlapping receive blocks",
                   kolo_alltoallv(comm.handle, data.data(), counts.data(), displacements.data(),
                                  out.data(), counts.data(), same.data(), KOLO_FLOAT32),
                   "overlap");
    expect_message("send negative tag",
                   kolo_send(comm.handle, data.data(), 4, KOLO_FLOAT32, (comm.rank + 1) % n, -1),
                   "tag");
  }
  // Count 0 with NULL buffers and zero vectors is fine.
  check_status(comm.handle,
               kolo_allgatherv(comm.handle, nullptr, nullptr, zeros.data(), KOLO_FLOAT32),
               "allgatherv of nothing with NULL buffers");
  check_status(comm.handle,
               kolo_alltoallv(comm.handle, nullptr, zeros.data(), same.data(), nullptr,
                              zeros.data(), same.data(), KOLO_INT8),
               "alltoallv of nothing with NULL buffers");
  // And the communicator still works.
  check_status(comm.handle, kolo_allgather(comm.handle, data.data(), out.data(), 64, KOLO_FLOAT32),
               "allgather after invalid arguments");
  check_status(comm.handle,
               kolo_alltoallv(comm.handle, data.data(), counts.data(), displacements.data(),
                              out.data(), counts.data(), displacements.data(), KOLO_FLOAT32),
               "alltoallv after invalid arguments");
  fmt::print("rank {}: bad-argument checks passed\n", comm.rank);
  return 0;
}

// Rank 1 waits for a message that rank 0 sends only after `seconds`: with a shorter KOLO_TIMEOUT
// the receive must end with KOLO_ERR_TIMEOUT in about that time. Reports "recv status <NAME>
// after <t> s" and "send status <NAME>".
int run_recv_timeout(const Comm& comm, double seconds) {
  std::vector<float> data(100, 1.0f);
  if (comm.rank == 1) {
    const auto start = std::chrono::steady_clock::now();
    const kolo_status_t status = kolo_recv(comm.handle, data.data(), 100, KOLO_FLOAT32, 0, 0);
    const double waited =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    fmt::print("rank {}: recv status {} after {:.3f} s: {}\n", comm.rank,
               kolo_status_string(status), waited, kolo_comm_last_error(comm.handle));
  } else if (comm.rank == 0) {
    std::this_thread::sleep_for(std::chrono::duration<double>(seconds));
    const kolo_status_t status = kolo_send(comm.handle, data.data(), 100, KOLO_FLOAT32, 1, 0);
    fmt::print("rank {}: send status {}: {}\n", comm.rank, kolo_status_string(status),
               kolo_comm_last_error(comm.handle));
  }
  std::fflush(stdout);
  return 3;
}

// Splits into odd and even halves and allreduces 4 MiB on the half in a loop for `seconds`
// (the half's rank 0 decides when to stop), then meets the others in a world barrier. Reports
// how each ended: "half status <NAME> ..." and "world status <NAME> ...".
// Rank 0 comes late (SECONDS) to a named allreduce 'late' and to an ordered allreduce, which the
// others have entered; the test asks ranks for their report (SIGUSR1) meanwhile. Every result is
// checked once rank 0 has come.
int run_stuck(const Comm& world, double seconds) {
  const int64_t expected = int64_t{g_size} * (g_size + 1) / 2;
  int64_t early = g_rank + 1;
  kolo_request_t request = nullptr;
  check_status(world.handle,
               kolo_allreduce_async(world.handle, "early", &early, &early, 1, KOLO_INT64, KOLO_SUM,
                                    nullptr, &request),
               "allreduce_async 'early'");
  check_status(world.handle, kolo_request_wait(request), "waiting for 'early'");
  kolo_request_free(request);
  if (g_rank == 0) {
    fmt::print("rank 0: stuck: sleeping {} s\n", seconds);
    std::fflush(stdout);
    std::this_thread::sleep_for(std::chrono::duration<double>(seconds));
  }
  int64_t late = g_rank + 1;
  check_status(world.handle,
               kolo_allreduce_async(world.handle, "late", &late, &late, 1, KOLO_INT64, KOLO_SUM,
                                    nullptr, &request),
               "allreduce_async 'late'");
  if (g_rank != 0) {
    fmt::print("rank {}: stuck: in the ordered allreduce\n", g_rank);
    std::fflush(stdout);
  }
  int64_t ordered = g_rank + 1;
  check_status(world.handle,
               kolo_allreduce(world.handle, &ordered, &ordered, 1, KOLO_INT64, KOLO_SUM),
               "ordered allreduce");
  check_status(world.handle, kolo_request_wait(request), "waiting for 'late'");
  kolo_request_free(request);
  if (early != expected || late != expected || ordered != expected) {
    fail(fmt::format("sums {} {} {}, expected {}", early, late, ordered, expected));
  }
  fmt::print("rank {}: stuck: all sums right\n", g_rank);
  return 0;
}

// Two threads make the same allreduce at once on one communicator, 300 times each. Every rank
// contributes the same value from both threads, so a pairing that differs between ranks still
// gives the right sum; the library must warn that it saw the race (tests/test_more_collectives).
// The race is made certain on rank 0: its threads start their loops together while the other
// ranks start theirs 200 ms later, so rank 0's first allreduce waits for them, holding the
// communicator, while its other thread makes its first call.
int run_threads(const Comm& world) {
  constexpr int kCalls = 300;
  const int64_t expected = int64_t{g_size} * (g_size + 1) / 2;
  std::atomic<int> checked{0};
  std::latch start(2);
  auto loop = [&] {
    start.arrive_and_wait();
    if (g_rank != 0) std::this_thread::sleep_for(std::chrono::milliseconds(200));
    for (int call = 0; call < kCalls; ++call) {
      int64_t value = g_rank + 1;
      check_status(world.handle,
                   kolo_allreduce(world.handle, &value, &value, 1, KOLO_INT64, KOLO_SUM),
                   "allreduce from two threads");
      if (value != expected) fail(fmt::format("sum {}, expected {}", value, expected));
      ++checked;
    }
  };
  std::thread other(loop);
  loop();
  other.join();
  fmt::print("rank {}: threads: {} calls checked\n", g_rank, checked.load());
  return 0;
}

int run_lost(Comm& world, double seconds) {
  Comm half = split(world, g_rank % 2, g_rank, "split into odd and even");
  std::vector<float> data(1u << 20, 1.0f);
  fmt::print("rank {}: looping\n", g_rank);
  std::fflush(stdout);
  const auto start = std::chrono::steady_clock::now();
  auto last_success = start;
  kolo_status_t status = KOLO_SUCCESS;
  int32_t keep_going = 1;
  long iterations = 0;
  while (keep_going) {
    status =
        kolo_allreduce(half.handle, data.data(), data.data(), data.size(), KOLO_FLOAT32, KOLO_AVG);
    if (status != KOLO_SUCCESS) break;
    keep_going =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count() < seconds;
    status = kolo_broadcast(half.handle, &keep_going, 1, KOLO_INT32, 0);
    if (status != KOLO_SUCCESS) break;
    last_success = std::chrono::steady_clock::now();
    ++iterations;
  }
  const double since =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - last_success).count();
  fmt::print("rank {}: half status {} after {:.3f} s since last success ({} iterations): {}\n",
             g_rank, kolo_status_string(status), since, iterations,
             kolo_comm_last_error(half.handle));
  std::fflush(stdout);
  const kolo_status_t world_status = kolo_barrier(world.handle);
  fmt::print("rank {}: world status {}: {}\n", g_rank, kolo_status_string(world_status),
             kolo_comm_last_error(world.handle));
  kolo_comm_destroy(half.handle);
  return 3;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 2) {
    std::fprintf(stderr, "usage: kolo_test_collectives SCENARIO [ARG]\n");
    return 2;
  }
  const std::string scenario = argv[1];
  const std::string argument = argc > 2 ? argv[2] : "";
  kolo_comm_t handle = nullptr;
  const kolo_status_t status = kolo_comm_init(nullptr, &handle);
  if (status != KOLO_SUCCESS) {
    fmt::print(stderr, "init failed: {}: {}\n", kolo_status_string(status),
               kolo_comm_last_error(nullptr));
    return 4;
  }
  Comm world = describe_comm(handle);
  g_rank = world.rank;
  g_size = world.size;
  const bool quick = argument == "quick";
  int result = 0;
  if (scenario == "allgather") {
    result = run_allgather(world, quick);
  } else if (scenario == "reduce_scatter") {
    result = run_reduce_scatter(world, quick);
  } else if (scenario == "alltoall") {
    result = run_alltoall(world, quick);
  } else if (scenario == "reduce") {
    result = run_reduce(world, quick);
  } else if (scenario == "sendrecv") {
    result = run_sendrecv(world);
  } else if (scenario == "split") {
    result = run_split(world);
  } else if (scenario == "mismatch") {
    result = run_mismatch(world, argument);
  } else if (scenario == "split_mismatch") {
    result = run_split_mismatch(world);
  } else if (scenario == "badargs") {
    result = run_badargs(world);
  } else if (scenario == "recv_timeout") {
    result = run_recv_timeout(world, argument.empty() ? 5.0 : std::atof(argument.c_str()));
  } else if (scenario == "stuck") {
    result = run_stuck(world, argument.empty() ? 6.0 : std::atof(argument.c_str()));
  } else if (scenario == "threads") {
    result = run_threads(world);
  } else if (scenario == "lost") {
    result = run_lost(world, argument.empty() ? 4.0 : std::atof(argument.c_str()));
  } else {
    fail("unknown scenario " + scenario);
  }
  if (world.handle != nullptr && kolo_comm_destroy(world.handle) != KOLO_SUCCESS) {
    fail("destroy failed");
  }
  return result;
}
