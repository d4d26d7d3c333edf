// The worker of test_elastic: one rank of a job in which some ranks die (SIGKILL, by their own
// hand, at a moment set by the test) in the middle of an operation, and the survivors shrink the
// communicator (kolo_comm_shrink) and go on.
//
//   kolo_test_elastic PHASE VICTIMS [DURING]
//   kolo_test_elastic slow RANK SECONDS kept|left-out
//
// PHASE is what every rank runs in a loop when the victims die: "allreduce" (4 MiB calls),
// "fused" (batches of named allreduces) or "split" (split, an allreduce in the child, destroy).
// VICTIMS is a comma-separated list of world ranks that kill themselves together, a few
// milliseconds into the phase, once every rank is past the barrier before it: each rank leaves a
// file in the directory that ELASTIC_PAST_BARRIER_DIR names, and a victim waits for all of them (a
// barrier returns on one rank before it has on the others, and a victim killed in between would
// fail the others' barrier instead of their phase, as under AddressSanitizer it did). DURING,
// where given, is a rank that kills itself a few milliseconds after it has called
// kolo_comm_shrink (a death during the agreement).
// "cold": the survivors submit a batch of named allreduces, the first, and the victims, which
// submit nothing, die: the survivors' fusion engines still connect (they connect on the first
// submission, and wait for the dead until KOLO_TIMEOUT). The survivors notice through an ordered
// allreduce and shrink, which must fail the requests still pending with KOLO_ERR_PEER_LOST.
// "slow" kills nobody: RANK sleeps SECONDS before its first allreduce, so that the others time
// out waiting for it and shrink. With "kept" it must be a member of the new communicator (it came
// within the timeout); with "left-out" the others go on without it, and it must get an error or,
// the others' old communicator being gone by then, a communicator of itself alone.
//
// A survivor prints how its loop failed, shrinks (calling again if the call fails, as the
// contract allows, at most three times), and checks on the new communicator, element by element
// against values computed here: its size and its rank (the survivors in their old order), an
// allreduce, a batch of named allreduces, and a split with an allreduce in each half. It prints
// "elastic passed" and, for the test's timing, the wall-clock time of its first allreduce on the
// new communicator; a victim prints the time it dies.
#include <fmt/format.h>
#include <kolo.h>
#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "worker_common.hpp"

using namespace kolo::test::worker;

namespace {

double wall_seconds() {
  return std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
}

// Kills this process with SIGKILL after `delay_ms`, from a thread of its own, so that the main
// thread is inside whatever it was doing.
void die_after(int delay_ms) {
  std::thread([delay_ms] {
    std::this_thread::sleep_for(std::chrono::milliseconds(delay_ms));
    fmt::print(stderr, "rank {}: dying at {:.6f}\n", g_rank, wall_seconds());
    std::fflush(stderr);
    if (const char* dir = std::getenv("ELASTIC_PAST_BARRIER_DIR")) {
      std::ofstream(fmt::format("{}/dying.{}", dir, g_rank)).put('\n');
    }
    ::raise(SIGKILL);
  }).detach();
}

// Says that this rank is past the barrier before the deaths, and for a victim waits (up to a
// minute) until every rank has said so; see the file's comment.
void pass_barrier(bool victim) {
  const char* dir = std::getenv("ELASTIC_PAST_BARRIER_DIR");
  if (dir == nullptr) return;
  std::ofstream(fmt::format("{}/{}", dir, g_rank)).put('\n');
  const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(60);
  while (victim && std::chrono::steady_clock::now() < until) {
    int past = 0;
    for (int r = 0; r < g_size; ++r) past += std::filesystem::exists(fmt::format("{}/{}", dir, r));
    if (past == g_size) return;
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
}

// For a survivor: waits (up to a minute) until every victim is about to die, so that what the
// survivors agree on does not depend on how fast a victim's own timer fires on a busy machine
// (a shrink takes milliseconds; a victim that notices the others' deaths first would take part).
void wait_for_victims(const std::vector<int>& victims) {
  const char* dir = std::getenv("ELASTIC_PAST_BARRIER_DIR");
  if (dir == nullptr) return;
  const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(60);
  for (int victim : victims) {
    while (!std::filesystem::exists(fmt::format("{}/dying.{}", dir, victim)) &&
           std::chrono::steady_clock::now() < until) {
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
  }
}

std::vector<int> parse_ranks(const std::string& text) {
  std::vector<int> ranks;
  std::stringstream stream(text);
  for (std::string item; std::getline(stream, item, ',');) {
    if (!item.empty()) ranks.push_back(std::stoi(item));
  }
  return ranks;
}

// The value rank `world_rank` contributes at element i: small integers, so float sums are exact.
float contribution(int world_rank, uint64_t i, int salt) {
  return static_cast<float>((world_rank + 1) * 3 + static_cast<int>(i % 97) + salt);
}

// Runs the phase until a call fails; returns that call's status and message.
std::pair<kolo_status_t, std::string> run_until_failure(kolo_comm_t comm, const std::string& phase) {
  const uint64_t count = uint64_t{1} << 20;  // 4 MiB of float32
  std::vector<float> send(count, 1.0f), recv(count);
  for (int round = 0; round < 100000; ++round) {
    kolo_status_t status = KOLO_SUCCESS;
    if (phase == "allreduce") {
      status = kolo_allreduce(comm, send.data(), recv.data(), count, KOLO_FLOAT32, KOLO_SUM);
    } else if (phase == "fused") {
      constexpr int kTensors = 16;
      std::vector<std::vector<float>> tensors(kTensors, std::vector<float>(4096, 1.0f));
      std::vector<kolo_request_t> requests(kTensors, nullptr);
      for (int t = 0; t < kTensors && status == KOLO_SUCCESS; ++t) {
        const std::string name = fmt::format("grad.{}", t);
        status = kolo_allreduce_async(comm, name.c_str(), tensors[t].data(), tensors[t].data(),
                                      tensors[t].size(), KOLO_FLOAT32, KOLO_SUM, nullptr,
                                      &requests[t]);
      }
      std::string message;
      for (kolo_request_t request : requests) {
        if (!request) continue;
        const kolo_status_t waited = kolo_request_wait(request);
        if (waited != KOLO_SUCCESS && status == KOLO_SUCCESS) {
          status = waited;
          message = kolo_request_last_error(request);
        }
        kolo_request_free(request);
      }
      if (status != KOLO_SUCCESS) {
        if (message.empty()) message = kolo_comm_last_error(comm);
        return {status, message};
      }
    } else if (phase == "split") {
      kolo_comm_t child = nullptr;
      status = kolo_comm_split(comm, g_rank % 2, g_rank, &child);
      if (status == KOLO_SUCCESS) {
        status = kolo_allreduce(child, send.data(), recv.data(), 1024, KOLO_FLOAT32, KOLO_SUM);
        if (status != KOLO_SUCCESS) {
          const std::string message = kolo_comm_last_error(child);
          kolo_comm_destroy(child);
          return {status, message};
        }
        kolo_comm_destroy(child);
      }
    } else {
      fail("unknown phase " + phase);
    }
    if (status != KOLO_SUCCESS) return {status, kolo_comm_last_error(comm)};
  }
  fail("no call failed although ranks died");
}

void check_allreduce(const Comm& comm, const std::vector<int>& survivors, int salt) {
  const uint64_t count = 100003;  // not a multiple of anything the ring cuts by
  std::vector<float> send(count), recv(count, -1.0f);
  for (uint64_t i = 0; i < count; ++i) send[i] = contribution(g_rank, i, salt);
  check_status(comm.handle,
               kolo_allreduce(comm.handle, send.data(), recv.data(), count, KOLO_FLOAT32, KOLO_SUM),
               fmt::format("allreduce (salt {}) on a communicator of {} ranks", salt, comm.size));
  for (uint64_t i = 0; i < count; ++i) {
    float expected = 0;
    for (int r : survivors) expected += contribution(r, i, salt);
    if (recv[i] != expected) {
      fail(fmt::format("allreduce (salt {}): element {} is {}, expected {}", salt, i, recv[i],
                       expected));
    }
  }
}

void check_named(const Comm& comm, const std::vector<int>& survivors) {
  constexpr int kTensors = 12;
  std::vector<std::vector<float>> tensors(kTensors);
  std::vector<kolo_request_t> requests(kTensors);
  for (int t = 0; t < kTensors; ++t) {
    tensors[t].resize(1000 + 37 * t);
    for (uint64_t i = 0; i < tensors[t].size(); ++i) tensors[t][i] = contribution(g_rank, i, t);
    const std::string name = fmt::format("after-shrink.{}", t);
    check_status(comm.handle,
                 kolo_allreduce_async(comm.handle, name.c_str(), tensors[t].data(),
                                      tensors[t].data(), tensors[t].size(), KOLO_FLOAT32, KOLO_SUM,
                                      nullptr, &requests[t]),
                 "kolo_allreduce_async on the shrunken communicator");
  }
  for (int t = 0; t < kTensors; ++t) {
    if (kolo_request_wait(requests[t]) != KOLO_SUCCESS) {
      fail(fmt::format("named allreduce {} after shrink: {}", t,
                       kolo_request_last_error(requests[t])));
    }
    kolo_request_free(requests[t]);
    for (uint64_t i = 0; i < tensors[t].size(); ++i) {
      float expected = 0;
      for (int r : survivors) expected += contribution(r, i, t);
      if (tensors[t][i] != expected) {
        fail(fmt::format("named allreduce {} after shrink: element {} is {}, expected {}", t, i,
                         tensors[t][i], expected));
      }
    }
  }
}

void check_split(const Comm& comm, const std::vector<int>& survivors) {
  kolo_comm_t child = nullptr;
  check_status(comm.handle, kolo_comm_split(comm.handle, comm.rank % 2, comm.rank, &child),
               "kolo_comm_split of the shrunken communicator");
  std::vector<int> half;  // the world ranks of this rank's half, by new rank
  for (size_t position = 0; position < survivors.size(); ++position) {
    if (static_cast<int>(position) % 2 == comm.rank % 2) half.push_back(survivors[position]);
  }
  const Comm described = describe_comm(child);
  if (described.size != static_cast<int>(half.size())) {
    fail(fmt::format("split after shrink: size {}, expected {}", described.size, half.size()));
  }
  check_allreduce(described, half, 7);
  check_status(child, kolo_comm_destroy(child), "kolo_comm_destroy");
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 3) {
    std::fprintf(stderr, "usage: kolo_test_elastic PHASE VICTIMS [DURING]\n");
    return 2;
  }
  const std::string phase = argv[1];
  const bool slow_phase = phase == "slow";
  const std::vector<int> victims = slow_phase ? std::vector<int>{} : parse_ranks(argv[2]);
  const int during = argc > 3 && !slow_phase ? std::stoi(argv[3]) : -1;
  const int slow = slow_phase ? std::stoi(argv[2]) : -1;
  const double slow_seconds = slow_phase && argc > 3 ? std::atof(argv[3]) : 0;
  const bool slow_kept = slow_phase && argc > 4 && std::string(argv[4]) == "kept";

  // For tests/strangers.hpp: a rank given ELASTIC_LATE_MS joins that late, so that the others'
  // listeners stay open while they wait for it, and victims die ELASTIC_STEADY_MS later than
  // usual, so that the survivors' calls run that long with strangers at their ports.
  const auto env_ms = [](const char* name) {
    const char* value = std::getenv(name);
    return value ? std::atoi(value) : 0;
  };
  const int steady_ms = env_ms("ELASTIC_STEADY_MS");
  std::this_thread::sleep_for(std::chrono::milliseconds(env_ms("ELASTIC_LATE_MS")));

  kolo_comm_t world = nullptr;
  if (kolo_comm_init(nullptr, &world) != KOLO_SUCCESS) {
    fmt::print(stderr, "init failed: {}\n", kolo_comm_last_error(nullptr));
    return 4;
  }
  const Comm described = describe_comm(world);
  g_rank = described.rank;
  g_size = described.size;
  std::vector<int> everyone(static_cast<size_t>(g_size));
  for (int r = 0; r < g_size; ++r) everyone[r] = r;
  check_allreduce(described, everyone, 0);  // everyone is connected before anyone dies

  if (phase == "fused") {
    // The engine connects on its first submission: a death before it has connected is one
    // during set-up, found at the timeout; the phase is about a death in a running batch.
    check_named(described, everyone);
  }
  // Every rank is past its checks before anyone dies (a death within the checks is no test).
  check_status(world, kolo_barrier(world), "kolo_barrier before the kill");
  const bool victim = std::find(victims.begin(), victims.end(), g_rank) != victims.end();
  pass_barrier(victim);
  std::vector<std::vector<float>> cold_tensors;
  std::vector<kolo_request_t> cold_requests;
  if (phase == "cold") {
    // A victim submits nothing, so its engine never connects: the others' engines wait for it.
    for (int t = 0; t < 8 && !victim; ++t) {
      cold_tensors.emplace_back(1024, 1.0f);
      const std::string name = fmt::format("cold.{}", t);
      cold_requests.push_back(nullptr);
      check_status(world,
                   kolo_allreduce_async(world, name.c_str(), cold_tensors[t].data(),
                                        cold_tensors[t].data(), 1024, KOLO_FLOAT32, KOLO_SUM,
                                        nullptr, &cold_requests[t]),
                   "kolo_allreduce_async before the kill");
    }
    if (victim) die_after(30 + steady_ms);
    // The ordered allreduce notices the death at once; the requests are left pending.
    const auto [status, message] = run_until_failure(world, "allreduce");
    fmt::print("rank {}: the cold phase's allreduce failed: {}: {}\n", g_rank,
               kolo_status_string(status), message);
  } else {
    if (victim) die_after(30 + steady_ms);
    if (g_rank == slow) {
      std::this_thread::sleep_for(std::chrono::duration<double>(slow_seconds));
    }
    const auto [status, message] = run_until_failure(world, slow_phase ? "allreduce" : phase);
    fmt::print("rank {}: the {} loop failed: {}: {}\n", g_rank, phase,
               kolo_status_string(status), message);
  }

  std::vector<int> survivors;
  for (int r = 0; r < g_size; ++r) {
    if (std::find(victims.begin(), victims.end(), r) == victims.end() && r != during &&
        (r != slow || slow_kept)) {
      survivors.push_back(r);
    }
  }
  if (g_rank == slow && !slow_kept) {
    kolo_comm_t alone = nullptr;
    const kolo_status_t left = kolo_comm_shrink(world, &alone);
    int size = 0;
    if (left == KOLO_SUCCESS) kolo_comm_size(alone, &size);
    if (left == KOLO_SUCCESS && size != 1) {
      fail(fmt::format("a rank left out joined a communicator of {} ranks", size));
    }
    fmt::print("rank {}: left out: {}: {}\n", g_rank, kolo_status_string(left),
               left == KOLO_SUCCESS ? "a communicator of itself alone" : kolo_comm_last_error(world));
    if (alone) kolo_comm_destroy(alone);
    kolo_comm_destroy(world);
    return 0;
  }
  if (!victim) wait_for_victims(victims);
  // The rank that dies during the agreement calls first and dies 5 ms later; the others call
  // 100 ms later, so that it is in the midst of the agreement (a shrink takes milliseconds).
  if (g_rank == during) die_after(5);
  if (during >= 0 && g_rank != during) std::this_thread::sleep_for(std::chrono::milliseconds(100));
  kolo_comm_t shrunk = nullptr;
  for (int attempt = 1;; ++attempt) {
    const double started = wall_seconds();
    const kolo_status_t shrink_status = kolo_comm_shrink(world, &shrunk);
    if (shrink_status == KOLO_SUCCESS) {
      fmt::print("rank {}: kolo_comm_shrink took {:.3f} s (attempt {})\n", g_rank,
                 wall_seconds() - started, attempt);
      break;
    }
    fmt::print("rank {}: kolo_comm_shrink attempt {}: {}: {}\n", g_rank, attempt,
               kolo_status_string(shrink_status), kolo_comm_last_error(world));
    if (attempt == 3) fail("kolo_comm_shrink failed three times");
  }
  // Requests still pending on the old communicator have failed with PEER_LOST.
  for (kolo_request_t request : cold_requests) {
    const kolo_status_t waited = kolo_request_wait(request);
    if (waited != KOLO_ERR_PEER_LOST) {
      fail(fmt::format("a request pending on the shrunken-from communicator ended with {}: {}",
                       kolo_status_string(waited), kolo_request_last_error(request)));
    }
    kolo_request_free(request);
  }
  // The old communicator is broken for good.
  float probe = 1;
  if (kolo_allreduce(world, &probe, &probe, 1, KOLO_FLOAT32, KOLO_SUM) == KOLO_SUCCESS) {
    fail("an allreduce on the shrunken-from communicator succeeded");
  }

  const Comm comm = describe_comm(shrunk);
  const auto position = std::find(survivors.begin(), survivors.end(), g_rank) - survivors.begin();
  if (comm.size != static_cast<int>(survivors.size()) || comm.rank != position) {
    fail(fmt::format("shrunken communicator: rank {} of {}, expected rank {} of {}", comm.rank,
                     comm.size, position, survivors.size()));
  }
  check_allreduce(comm, survivors, 1);
  fmt::print("rank {}: first allreduce after shrink at {:.6f}\n", g_rank, wall_seconds());
  check_named(comm, survivors);
  check_split(comm, survivors);
  check_allreduce(comm, survivors, 2);
  check_status(shrunk, kolo_comm_destroy(shrunk), "kolo_comm_destroy (shrunken)");
  check_status(world, kolo_comm_destroy(world), "kolo_comm_destroy (world)");
  fmt::print("rank {}: elastic passed, rank {} of {} after shrink\n", g_rank, comm.rank, comm.size);
  return 0;
}
