// The worker of test_grow: a member or a newcomer of a growing communicator (kolo_comm_invite,
// kolo_comm_grow, kolo_comm_init with KOLO_INVITATION).
//
//   kolo_test_grow SCENARIO
//
// A process with KOLO_INVITATION set is a newcomer: it joins (kolo_comm_init), checks the grown
// communicator as the members do, and, if it is not yet of the scenario's final size, takes part
// in the next growth as a member. Expected failures are printed as "refused: STATUS: message" and
// exit 0, so that the test reads the status and message.
// The members' scenarios (GROW_DIR names a directory shared with the test):
//   grow      2 -> 4 -> 5. Rank 0 submits a named allreduce that no other rank submits, then
//             invites (GROW_DIR/invitation1) and everyone grows to 4: the pending request and a
//             later call on the old communicator must fail with KOLO_ERR_CANCELLED. Then rank 0
//             of the 4 invites again (GROW_DIR/invitation2) and the 4 grow to 5.
//   again     4 ranks; rank 3 kills itself, the others shrink to 3, rank 0 invites
//             (GROW_DIR/invitation1) and the 3 grow back to 4; then the 4 split in two halves;
//             then the newcomer kills itself and the 3 members shrink the grown communicator.
//   mismatch  rank 0 invites twice (GROW_DIR/invitation0, replaced by GROW_DIR/invitation1); the
//             2 members wait for GROW_DIR/go (the test starts a newcomer), then rank 0 asks for
//             4 ranks, rank 1 for 5: both must get KOLO_ERR_MISMATCH, and the old communicator
//             must still work.
//   extra     2 members wait for GROW_DIR/go (the test starts two newcomers), then grow to 3: the
//             first newcomer to arrive joins, the second must be refused (the invitation is used
//             up).
//   killed    2 members wait for GROW_DIR/go (the test starts the newcomers: one of which kills
//             itself once it has arrived, or only one), then grow to 4: every member must fail,
//             then shrink the old communicator back to the 2 of them and find it working.
// Every check on a grown communicator compares against values computed here: its size, this
// rank's place (members keep theirs; newcomers after them in order of process id, all on one
// host), an allreduce of rank-dependent integers, the process ids of every rank (allgather), and
// a named allreduce on a fusion engine whose counters start at zero.
#include <fmt/format.h>
#include <kolo.h>
#include <signal.h>
#include <unistd.h>

#include <chrono>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <string>
#include <thread>
#include <vector>

#include "worker_common.hpp"

using namespace kolo::test::worker;

namespace {

std::string grow_dir() {
  const char* dir = std::getenv("GROW_DIR");
  if (dir == nullptr) fail("GROW_DIR is not set");
  return dir;
}

// Written whole under another name, then renamed, so the test never reads half of it.
void publish(const std::string& name, const std::string& text) {
  const std::string path = grow_dir() + "/" + name;
  {
    std::ofstream out(path + ".tmp");
    out << text;
  }
  std::filesystem::rename(path + ".tmp", path);
}

void wait_for_file(const std::string& name, double seconds) {
  const auto until = std::chrono::steady_clock::now() + std::chrono::duration<double>(seconds);
  while (!std::filesystem::exists(grow_dir() + "/" + name)) {
    if (std::chrono::steady_clock::now() > until) fail("no " + name + " from the test");
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
}

void refused(kolo_comm_t comm, kolo_status_t status) {
  fmt::print("rank {}: refused: {}: {}\n", g_rank, kolo_status_string(status),
             kolo_comm_last_error(comm));
  std::fflush(stdout);
}

// The checks of the file's comment on a communicator of `size` ranks whose first newcomer is
// rank `first_newcomer`; `old_rank` is this rank's rank before the growth (-1: a newcomer).
void check_grown(kolo_comm_t handle, int size, int first_newcomer, int old_rank) {
  const Comm comm = describe_comm(handle);
  if (comm.size != size)
    fail(fmt::format("grown communicator has {} ranks, expected {}", comm.size, size));
  if (old_rank >= 0 && comm.rank != old_rank) {
    fail(fmt::format("member rank {} became rank {}", old_rank, comm.rank));
  }
  if (old_rank < 0 && comm.rank < first_newcomer) {
    fail(fmt::format("newcomer got rank {}, which is a member's", comm.rank));
  }
  g_rank = comm.rank;

  kolo_fusion_stats_t stats{};
  stats.struct_size = sizeof stats;
  check_status(handle, kolo_comm_fusion_stats(handle, &stats), "kolo_comm_fusion_stats");
  if (stats.tensors_submitted != 0 || stats.cycles != 0) {
    fail(
        fmt::format("the new communicator's fusion engine did not start clean ({} tensors, {} "
                    "cycles)",
                    stats.tensors_submitted, stats.cycles));
  }

  constexpr int kCount = 1000;
  std::vector<int64_t> values(kCount), sums(kCount);
  for (int i = 0; i < kCount; ++i) values[i] = int64_t{comm.rank + 1} * 1000003 + i;
  check_status(handle,
               kolo_allreduce(handle, values.data(), sums.data(), kCount, KOLO_INT64, KOLO_SUM),
               "kolo_allreduce on the grown communicator");
  for (int i = 0; i < kCount; ++i) {
    const int64_t expected = int64_t{size} * (size + 1) / 2 * 1000003 + int64_t{size} * i;
    if (sums[i] != expected) {
      fail(fmt::format("allreduce element {}: got {}, expected {}", i, sums[i], expected));
    }
  }

  const int64_t pid = ::getpid();
  std::vector<int64_t> pids(static_cast<size_t>(size));
  check_status(handle, kolo_allgather(handle, &pid, pids.data(), 1, KOLO_INT64), "kolo_allgather");
  for (int r = first_newcomer + 1; r < size; ++r) {
    if (pids[r] <= pids[r - 1]) {
      fail(fmt::format("newcomers out of order: rank {} has pid {}, rank {} pid {}", r - 1,
                       pids[r - 1], r, pids[r]));
    }
  }

  std::vector<int64_t> named(kCount);
  kolo_request_t request = nullptr;
  check_status(handle,
               kolo_allreduce_async(handle, "grown.values", values.data(), named.data(), kCount,
                                    KOLO_INT64, KOLO_SUM, nullptr, &request),
               "kolo_allreduce_async");
  const kolo_status_t status = kolo_request_wait(request);
  if (status != KOLO_SUCCESS) {
    fail(fmt::format("named allreduce on the grown communicator: {}: {}",
                     kolo_status_string(status), kolo_request_last_error(request)));
  }
  kolo_request_free(request);
  if (named != sums) fail("the named allreduce differs from the ordered one");
  fmt::print("rank {}: checked a communicator of {} ranks\n", comm.rank, size);
}

// Rank 0 of `comm` invites and publishes the invitation as `name`.
void invite(kolo_comm_t comm, const std::string& name) {
  char invitation[KOLO_INVITATION_MAX];
  check_status(comm, kolo_comm_invite(comm, invitation, sizeof invitation), "kolo_comm_invite");
  publish(name, invitation);
}

// A member of `comm` (size n) grows it to `size`, checks it, and returns it.
kolo_comm_t grow(kolo_comm_t comm, int size) {
  const Comm before = describe_comm(comm);
  kolo_comm_t grown = nullptr;
  check_status(comm, kolo_comm_grow(comm, size, &grown), fmt::format("kolo_comm_grow to {}", size));
  check_grown(grown, size, before.size, before.rank);
  return grown;
}

// A barrier, after which one rank of comm dies, then allreduces until the death is seen. The
// barrier may return on the dying rank first, which then dies before it returns here: a lost
// peer in the barrier is the death seen early.
void see_loss(kolo_comm_t comm, const std::string& who) {
  kolo_status_t status = kolo_barrier(comm);
  if (status != KOLO_SUCCESS && status != KOLO_ERR_PEER_LOST) {
    check_status(comm, status, "the barrier before " + who + " dies");
  }
  int64_t value = 1, result = 0;
  for (int i = 0; i < 1000 && status == KOLO_SUCCESS; ++i) {
    status = kolo_allreduce(comm, &value, &result, 1, KOLO_INT64, KOLO_SUM);
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  if (status == KOLO_SUCCESS) fail(who + " died and every allreduce still succeeded");
}

// Splits a grown communicator of 4 into ranks {0, 2} and {1, 3}; each half sums its ranks.
kolo_comm_t split_halves(kolo_comm_t four) {
  kolo_comm_t half = nullptr;
  const int rank = describe_comm(four).rank;
  check_status(four, kolo_comm_split(four, rank % 2, rank, &half), "kolo_comm_split");
  int64_t mine = rank, sum = 0;
  check_status(half, kolo_allreduce(half, &mine, &sum, 1, KOLO_INT64, KOLO_SUM),
               "allreduce in a half");
  if (sum != (rank % 2 == 0 ? 2 : 4)) fail(fmt::format("half {} summed to {}", rank % 2, sum));
  return half;
}

int newcomer(const std::string& scenario) {
  kolo_comm_t comm = nullptr;
  const kolo_status_t status = kolo_comm_init(nullptr, &comm);
  if (status != KOLO_SUCCESS) {
    refused(nullptr, status);
    return 0;
  }
  Comm me = describe_comm(comm);
  g_rank = me.rank;
  const int first_newcomer = scenario == "grow" ? (me.size == 4 ? 2 : 4) : me.size - 1;
  check_grown(comm, me.size, first_newcomer, -1);
  kolo_comm_t last = comm;
  if (scenario == "grow" && me.size == 4) last = grow(comm, 5);
  if (scenario == "again") {
    last = split_halves(comm);
    check_status(comm, kolo_barrier(comm), "the barrier before the newcomer dies");
    fmt::print("rank {}: dying\n", g_rank);
    std::fflush(stdout);
    ::raise(SIGKILL);
  }
  check_status(last, kolo_barrier(last), "the final barrier");
  if (last != comm) kolo_comm_destroy(last);
  kolo_comm_destroy(comm);
  fmt::print("rank {}: grow passed\n", g_rank);
  return 0;
}

int member(const std::string& scenario) {
  kolo_comm_t world = nullptr;
  check_status(nullptr, kolo_comm_init(nullptr, &world), "kolo_comm_init");
  const Comm me = describe_comm(world);
  g_rank = me.rank;
  g_size = me.size;
  std::vector<kolo_comm_t> made;

  if (scenario == "grow") {
    int64_t value = 7, result = 0;
    kolo_request_t pending = nullptr;
    if (me.rank == 0) {
      check_status(world,
                   kolo_allreduce_async(world, "only.rank0", &value, &result, 1, KOLO_INT64,
                                        KOLO_SUM, nullptr, &pending),
                   "kolo_allreduce_async on the old communicator");
      invite(world, "invitation1");
    }
    kolo_comm_t four = grow(world, 4);
    if (pending != nullptr) {
      const kolo_status_t status = kolo_request_wait(pending);
      if (status != KOLO_ERR_CANCELLED) {
        fail(
            fmt::format("a named request pending on the old communicator ended with {}, expected "
                        "KOLO_ERR_CANCELLED",
                        kolo_status_string(status)));
      }
      kolo_request_free(pending);
    }
    const kolo_status_t old = kolo_allreduce(world, &value, &result, 1, KOLO_INT64, KOLO_SUM);
    if (old != KOLO_ERR_CANCELLED) {
      fail(
          fmt::format("an allreduce on the old communicator returned {}, expected "
                      "KOLO_ERR_CANCELLED",
                      kolo_status_string(old)));
    }
    fmt::print("rank {}: old communicator: {}\n", me.rank, kolo_comm_last_error(world));
    if (me.rank == 0) invite(four, "invitation2");
    made.push_back(four);
    made.push_back(grow(four, 5));
  } else if (scenario == "again") {
    if (me.rank == 3) {
      (void)kolo_barrier(world);
      ::raise(SIGKILL);
    }
    see_loss(world, "rank 3");
    kolo_comm_t three = nullptr;
    check_status(world, kolo_comm_shrink(world, &three), "kolo_comm_shrink");
    if (describe_comm(three).size != 3) fail("the shrunk communicator does not have 3 ranks");
    if (me.rank == 0) invite(three, "invitation1");
    made.push_back(three);
    kolo_comm_t four = grow(three, 4);
    made.push_back(four);
    made.push_back(split_halves(four));
    // The newcomer (rank 3) dies: the grown communicator shrinks like any other.
    see_loss(four, "the newcomer");
    kolo_comm_t shrunk = nullptr;
    check_status(four, kolo_comm_shrink(four, &shrunk),
                 "kolo_comm_shrink of the grown communicator");
    made.push_back(shrunk);
    const Comm after = describe_comm(shrunk);
    int64_t mine = after.rank + 1, sum = 0;
    check_status(shrunk, kolo_allreduce(shrunk, &mine, &sum, 1, KOLO_INT64, KOLO_SUM),
                 "allreduce after shrinking the grown communicator");
    if (after.size != 3 || after.rank != me.rank || sum != 6) {
      fail(fmt::format("after shrinking the grown communicator: rank {} of {}, sum {}", after.rank,
                       after.size, sum));
    }
  } else if (scenario == "mismatch") {
    if (me.rank == 0) {
      invite(world, "invitation0");  // replaced at once: the test checks it is refused
      invite(world, "invitation1");
    }
    wait_for_file("go", 60);
    kolo_comm_t grown = nullptr;
    const kolo_status_t status = kolo_comm_grow(world, me.rank == 0 ? 4 : 5, &grown);
    if (status != KOLO_ERR_MISMATCH || grown != nullptr) {
      fail(fmt::format("grow with different sizes returned {}, expected KOLO_ERR_MISMATCH",
                       kolo_status_string(status)));
    }
    refused(world, status);
    int64_t value = me.rank + 1, result = 0;
    check_status(world, kolo_allreduce(world, &value, &result, 1, KOLO_INT64, KOLO_SUM),
                 "allreduce on the communicator after the refused growth");
    if (result != 3) fail(fmt::format("allreduce after the refused growth: {}", result));
  } else if (scenario == "killed") {
    if (me.rank == 0) invite(world, "invitation1");
    wait_for_file("go", 60);
    const auto started = std::chrono::steady_clock::now();
    kolo_comm_t grown = nullptr;
    const kolo_status_t status = kolo_comm_grow(world, 4, &grown);
    if (status == KOLO_SUCCESS || grown != nullptr) fail("grow succeeded with a dead newcomer");
    refused(world, status);
    fmt::print("rank {}: failed after {:.1f} s\n", me.rank,
               std::chrono::duration<double>(std::chrono::steady_clock::now() - started).count());
    kolo_comm_t again = nullptr;
    check_status(world, kolo_comm_shrink(world, &again),
                 "kolo_comm_shrink after the failed growth");
    int64_t value = me.rank + 1, result = 0;
    check_status(again, kolo_allreduce(again, &value, &result, 1, KOLO_INT64, KOLO_SUM),
                 "allreduce after the shrink");
    if (result != 3) fail(fmt::format("allreduce after the shrink: {}", result));
    made.push_back(again);
  } else if (scenario == "extra") {
    if (me.rank == 0) invite(world, "invitation1");
    wait_for_file("go", 60);
    made.push_back(grow(world, 3));
  } else {
    fail("unknown scenario " + scenario);
  }
  if (!made.empty()) check_status(made.back(), kolo_barrier(made.back()), "the final barrier");
  for (auto it = made.rbegin(); it != made.rend(); ++it) kolo_comm_destroy(*it);
  kolo_comm_destroy(world);
  fmt::print("rank {}: grow passed\n", me.rank);
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 2) fail("usage: kolo_test_grow grow|again|mismatch|killed");
  const std::string scenario = argv[1];
  const char* invitation = std::getenv("KOLO_INVITATION");
  if (invitation != nullptr && *invitation != '\0') {
    if (const char* die = std::getenv("GROW_DIE_AFTER_MS")) {
      const int delay = std::atoi(die);
      std::thread([delay] {
        std::this_thread::sleep_for(std::chrono::milliseconds(delay));
        fmt::print(stderr, "newcomer: dying\n");
        std::fflush(stderr);
        ::raise(SIGKILL);
      }).detach();
    }
    return newcomer(scenario);
  }
  return member(scenario);
}
