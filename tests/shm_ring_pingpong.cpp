// shm_ring_pingpong: the round trip of one message through kolo's shared-memory rings
// (src/transport/shm/), between two threads pinned to two CPUs, each spinning on its channel as a
// rank does while it may spin. Beside bench/cache_pingpong (one cache line handed back and forth)
// it says how many lines' worth of latency a message costs: docs/performance.md, "Small
// messages", has the model. It uses only ShmChannel's interface (post_send, post_recv, pump,
// adopt_segment), so the same source builds against any version of the rings and compares them.
//
//   shm_ring_pingpong [BYTES [BATCHES [ROUND_TRIPS] [CPU_A CPU_B]]]
//       defaults: 8 bytes, 31 batches of 2000 round trips, CPUs 0 and 1
//
// Prints the median and the lowest of the batches' mean round trips, in ns. On a loaded machine
// a thread may lose its CPU in the middle of a batch, which the median of many batches discounts.
// Not a test: the Meson test test_shm_ring checks the rings.
#include <pthread.h>
#include <sched.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <thread>
#include <vector>

#include "transport/control_channel.hpp"
#include "transport/shm/shm_channel.hpp"

namespace {

using kolo::ShmChannel;
using kolo::Transfer;

void pin(int cpu) {
  cpu_set_t set;
  CPU_ZERO(&set);
  CPU_SET(cpu, &set);
  pthread_setaffinity_np(pthread_self(), sizeof(set), &set);
}

void wait(ShmChannel& channel, const Transfer& transfer) {
  bool moved = false;
  while (!transfer.complete) channel.pump(moved);
}

// One side: `rounds` times, rank 0 sends and then receives, rank 1 receives and then sends.
void side(ShmChannel& channel, int rank, size_t bytes, uint64_t rounds, uint64_t first) {
  std::vector<char> out(bytes, static_cast<char>(rank)), in(bytes);
  kolo::OpDescriptor descriptor;
  descriptor.count = bytes;
  descriptor.dtype = kolo::DataType::kUInt8;
  for (uint64_t i = 0; i < rounds; ++i) {
    descriptor.sequence = first + i;
    Transfer send, recv;
    send.reset(1 - rank, descriptor, out.data(), bytes);
    recv.reset(1 - rank, descriptor, in.data(), bytes);
    if (rank == 0) {
      channel.post_send(send);
      wait(channel, send);
      channel.post_recv(recv);
      wait(channel, recv);
    } else {
      channel.post_recv(recv);
      wait(channel, recv);
      channel.post_send(send);
      wait(channel, send);
    }
  }
}

}  // namespace

int main(int argc, char** argv) {
  const size_t bytes = argc > 1 ? std::strtoull(argv[1], nullptr, 10) : 8;
  const int batches = argc > 2 ? std::atoi(argv[2]) : 31;
  const uint64_t rounds = argc > 3 ? std::strtoull(argv[3], nullptr, 10) : 2000;
  const int cpu_a = argc > 5 ? std::atoi(argv[4]) : 0, cpu_b = argc > 5 ? std::atoi(argv[5]) : 1;
  if (batches < 1 || rounds < 1) {
    std::fprintf(stderr,
                 "usage: shm_ring_pingpong [BYTES [BATCHES [ROUND_TRIPS] [CPU_A CPU_B]]]\n");
    return 2;
  }
  const size_t segment_bytes = ShmChannel::segment_bytes();
  const int fd = ::memfd_create("kolo-shm-ring-pingpong", MFD_CLOEXEC);
  if (fd < 0 || ::ftruncate(fd, static_cast<off_t>(segment_bytes)) != 0) {
    std::perror("shm_ring_pingpong: memfd");
    return 1;
  }
  void* mappings[2];
  for (void*& mapping : mappings) {
    mapping =
        ::mmap(nullptr, segment_bytes, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE, fd, 0);
    if (mapping == MAP_FAILED) {
      std::perror("shm_ring_pingpong: mmap");
      return 1;
    }
  }
  ::close(fd);
  kolo::ControlChannel control0(0, 2), control1(1, 2);
  ShmChannel channel0(0, 2, control0, "bench"), channel1(1, 2, control1, "bench");
  channel0.adopt_segment(1, mappings[0]);
  channel1.adopt_segment(0, mappings[1]);

  // Both threads run every batch; the main thread times them between two barriers.
  std::atomic<int> started{0}, finished{0};
  std::vector<double> means;
  std::thread answerer([&] {
    pin(cpu_b);
    for (int batch = 0; batch <= batches; ++batch) {  // batch 0 warms up
      while (started.load() <= batch) {
      }
      side(channel1, 1, bytes, rounds, 1 + batch * rounds);
      finished.fetch_add(1);
    }
  });
  pin(cpu_a);
  for (int batch = 0; batch <= batches; ++batch) {
    const auto begin = std::chrono::steady_clock::now();
    started.fetch_add(1);
    side(channel0, 0, bytes, rounds, 1 + batch * rounds);
    while (finished.load() <= batch) {
    }
    const std::chrono::duration<double, std::nano> took = std::chrono::steady_clock::now() - begin;
    if (batch > 0) means.push_back(took.count() / static_cast<double>(rounds));
  }
  answerer.join();
  std::sort(means.begin(), means.end());
  std::printf(
      "shm ring, %zu B, CPU %d <-> CPU %d: %.0f ns per round trip (median of %d batches of %llu; "
      "lowest %.0f)\n",
      bytes, cpu_a, cpu_b, means[means.size() / 2], batches,
      static_cast<unsigned long long>(rounds), means.front());
  return 0;
}
