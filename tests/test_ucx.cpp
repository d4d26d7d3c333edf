// The collective suite and the fault tests over the UCX transport (KOLO_TRANSPORT=ucx), in three
// flavours: kolo's own shared-memory rings between ranks of one host (the default), UCX's default
// transports with those rings off (KOLO_SHM=0), which on one machine are shared memory and
// CMA, and UCX's TCP on loopback (UCX_TLS=tcp, UCX_NET_DEVICES=lo), the path two hosts without
// RDMA would take.
// The scenarios are those of the TCP tests (tests/worker.cpp); every rank checks every result
// against its own reference. KOLO_DEBUG=INFO makes each rank log the UCX transports it uses, and
// the tests check that each flavour really runs on the path it names.
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <catch2/catch.hpp>
#include <chrono>
#include <filesystem>
#include <fstream>
#include <map>
#include <regex>
#include <string>
#include <thread>
#include <vector>

#include "faults.hpp"
#include "job.hpp"

using kolo::test::contains;
using kolo::test::start_job;

namespace {

using Environment = std::map<std::string, std::string>;

struct Flavour {
  const char* name;
  Environment env;
  const char* path;  // a regular expression: the log line that shows this flavour's path
};

const std::vector<Flavour>& flavours() {
  static const std::vector<Flavour> all = {
      // UCX_TLS=all is UCX's default, spelled out so that a UCX_TLS in the environment of the
      // tests cannot move this flavour off shared memory.
      {"kolo shared memory",
       {{"KOLO_TRANSPORT", "ucx"}, {"KOLO_DEBUG", "INFO"}, {"UCX_TLS", "all"}},
       "reaches rank [0-9]+ through kolo's shared-memory ring"},
      // Whether the rings stream their copies depends on where the scheduler puts the ranks;
      // this flavour streams every piece, so that path is always tested.
      {"kolo shared memory, streamed copies",
       {{"KOLO_TRANSPORT", "ucx"},
        {"KOLO_DEBUG", "INFO"},
        {"KOLO_SHM_COPY", "stream"},
        {"UCX_TLS", "all"}},
       "through kolo's shared-memory ring .*streamed copies"},
      {"UCX shared memory",
       {{"KOLO_TRANSPORT", "ucx"}, {"KOLO_DEBUG", "INFO"}, {"KOLO_SHM", "0"}, {"UCX_TLS", "all"}},
       "reaches its peers through .*/memory"},
      {"tcp",
       {{"KOLO_TRANSPORT", "ucx"},
        {"KOLO_DEBUG", "INFO"},
        {"KOLO_SHM", "0"},
        {"UCX_TLS", "tcp"},
        {"UCX_NET_DEVICES", "lo"}},
       "reaches its peers through .*tcp/lo"},
  };
  return all;
}

Environment with(Environment env, const Environment& more) {
  for (const auto& [key, value] : more) env[key] = value;
  return env;
}

// Every rank passed, printed `marker`, used the flavour's path when it has peers, and UCX printed
// nothing (a clean run has no "UCX  WARN" or "UCX  ERROR" lines).
void expect_all_pass(const std::vector<kolo::test::ProcessResult>& results, const char* marker,
                     const Flavour& flavour) {
  for (size_t rank = 0; rank < results.size(); ++rank) {
    const std::string& output = results[rank].output;
    INFO("rank " << rank << " output:\n" << output);
    CHECK_FALSE(results[rank].timed_out);
    CHECK(results[rank].exit_code == 0);
    CHECK(contains(output, marker));
    CHECK(contains(output, "transport ucx"));
    if (results.size() > 1) {
      CHECK(std::regex_search(output, std::regex(flavour.path)));
    }
    CHECK_FALSE(contains(output, "UCX  WARN"));
    CHECK_FALSE(contains(output, "UCX  ERROR"));
  }
}

}  // namespace

TEST_CASE("ucx: allreduce, every dtype, op and size, N = 1..5", "[ucx][allreduce]") {
  for (const Flavour& flavour : flavours()) {
    for (int n = 1; n <= 5; ++n) {
      DYNAMIC_SECTION(flavour.name << ", N = " << n) {
        auto job = start_job(n, {"allreduce"}, flavour.env);
        expect_all_pass(job.wait(600), "allreduce checks passed", flavour);
      }
    }
  }
}

TEST_CASE("ucx: allreduce with small segments keeps many messages in flight", "[ucx][allreduce]") {
  for (const Flavour& flavour : flavours()) {
    for (int n : {2, 3, 4}) {
      DYNAMIC_SECTION(flavour.name << ", N = " << n) {
        auto job =
            start_job(n, {"allreduce", "quick"}, with(flavour.env, {{"KOLO_SEGMENT_BYTES", "4K"}}));
        expect_all_pass(job.wait(600), "allreduce checks passed", flavour);
      }
    }
  }
}

TEST_CASE("ucx: broadcast from every root, N = 1..5", "[ucx][broadcast]") {
  for (const Flavour& flavour : flavours()) {
    for (int n = 1; n <= 5; ++n) {
      DYNAMIC_SECTION(flavour.name << ", N = " << n) {
        auto job = start_job(n, {"broadcast"}, with(flavour.env, {{"KOLO_SEGMENT_BYTES", "256K"}}));
        expect_all_pass(job.wait(600), "broadcast checks passed", flavour);
      }
    }
  }
}

TEST_CASE("ucx: barrier, nobody leaves before the last rank enters", "[ucx][barrier]") {
  for (const Flavour& flavour : flavours()) {
    for (int n : {1, 2, 3, 5}) {
      DYNAMIC_SECTION(flavour.name << ", N = " << n) {
        auto job = start_job(n, {"barrier"}, flavour.env);
        expect_all_pass(job.wait(120), "barrier checks passed", flavour);
      }
    }
  }
}

TEST_CASE("ucx: a rank killed with SIGKILL becomes KOLO_ERR_PEER_LOST on every survivor",
          "[ucx][faults]") {
  struct Case {
    int size;
    int victim;
  };
  for (const Flavour& flavour : flavours()) {
    for (Case c : {Case{4, 2}, Case{3, 0}, Case{2, 1}}) {
      DYNAMIC_SECTION(flavour.name << ", N = " << c.size << ", rank " << c.victim << " killed") {
        auto job = start_job(c.size, {"loop", "120"}, flavour.env);
        kolo::test::kill_and_expect_peer_lost(job, c.victim);
      }
    }
  }
}

TEST_CASE("ucx: a segment name left in /dev/shm by a killed creator is removed by the next job",
          "[ucx][shm_leftover]") {
  // The pid of a process that has exited names no process (until the kernel reuses it).
  const pid_t gone = ::fork();
  if (gone == 0) ::_exit(0);
  REQUIRE(gone > 0);
  ::waitpid(gone, nullptr, 0);
  const std::string stale = "/dev/shm/kolo-" + std::to_string(gone) + "-0123456789abcdef";
  // One whose creator is alive (this process) stays, as does a name of another shape.
  const std::string alive = "/dev/shm/kolo-" + std::to_string(::getpid()) + "-fedcba9876543210";
  const std::string other = "/dev/shm/kolo-" + std::to_string(gone) + "-not-a-segment";
  for (const std::string& path : {stale, alive, other}) std::ofstream(path) << "left over";
  auto job = start_job(2, {"barrier"},
                       {{"KOLO_TRANSPORT", "ucx"}, {"KOLO_DEBUG", "INFO"}, {"UCX_TLS", "all"}});
  auto results = job.wait(60);
  int removed = 0;
  for (size_t rank = 0; rank < results.size(); ++rank) {
    INFO("rank " << rank << " output:\n" << results[rank].output);
    CHECK(results[rank].exit_code == 0);
    removed += contains(results[rank].output, "removed " + stale) ? 1 : 0;
  }
  CHECK(removed == 1);
  CHECK_FALSE(std::filesystem::exists(stale));
  CHECK(std::filesystem::exists(alive));
  CHECK(std::filesystem::exists(other));
  std::filesystem::remove(alive);
  std::filesystem::remove(other);
}

TEST_CASE("ucx: ranks that disagree get KOLO_ERR_MISMATCH on every rank", "[ucx][faults]") {
  for (const Flavour& flavour : flavours()) {
    for (const char* kind : {"count", "dtype", "op", "collective", "root", "scale"}) {
      for (int n : {2, 3}) {
        DYNAMIC_SECTION(flavour.name << ", " << kind << " differs, N = " << n) {
          auto job = start_job(n, {"mismatch", kind}, flavour.env);
          auto results = job.wait(60);
          for (size_t rank = 0; rank < results.size(); ++rank) {
            INFO("rank " << rank << " output:\n" << results[rank].output);
            CHECK_FALSE(results[rank].timed_out);
            CHECK(results[rank].exit_code == 0);
            CHECK(contains(results[rank].output, "KOLO_ERR_MISMATCH"));
            CHECK(contains(results[rank].output, "disagree"));
          }
        }
      }
    }
  }
}

TEST_CASE("ucx: invalid arguments are refused and the communicator goes on", "[ucx][faults]") {
  for (const Flavour& flavour : flavours()) {
    DYNAMIC_SECTION(flavour.name) {
      auto job = start_job(3, {"badargs"}, flavour.env);
      expect_all_pass(job.wait(60), "bad-argument checks passed", flavour);
    }
  }
}

TEST_CASE("ucx: a rank that never arrives gives KOLO_ERR_TIMEOUT", "[ucx][faults]") {
  for (const Flavour& flavour : flavours()) {
    DYNAMIC_SECTION(flavour.name) {
      auto job = start_job(3, {"stall", "30"}, with(flavour.env, {{"KOLO_TIMEOUT", "2"}}));
      auto started = std::chrono::steady_clock::now();
      for (int rank = 0; rank < 2; ++rank) {
        auto result = job.ranks[rank].wait(20);
        INFO("rank " << rank << " output:\n" << result.output);
        CHECK(result.exit_code == 3);
        CHECK(contains(result.output, "KOLO_ERR_TIMEOUT"));
      }
      double elapsed =
          std::chrono::duration<double>(std::chrono::steady_clock::now() - started).count();
      CHECK(elapsed < 15.0);
    }
  }
}

TEST_CASE("KOLO_TRANSPORT=auto, the default, picks UCX when every rank is on this host",
          "[ucx][auto]") {
  // "" stands for the default: an empty variable counts as unset (the suite's environment pins
  // tcp, so leaving it out would not do).
  for (const char* setting : {"auto", ""}) {
    for (int n : {1, 3}) {
      DYNAMIC_SECTION("KOLO_TRANSPORT='" << setting << "', N = " << n) {
        auto job = start_job(n, {"barrier"}, {{"KOLO_TRANSPORT", setting}, {"KOLO_DEBUG", "INFO"}});
        auto results = job.wait(60);
        for (size_t rank = 0; rank < results.size(); ++rank) {
          INFO("rank " << rank << " output:\n" << results[rank].output);
          CHECK(results[rank].exit_code == 0);
          // One rank alone has nothing to send: the TCP transport costs nothing to set up.
          CHECK(contains(results[rank].output, n == 1 ? "KOLO_TRANSPORT=auto chose tcp"
                                                      : "KOLO_TRANSPORT=auto chose ucx: all 3 "
                                                        "ranks are on one host"));
          CHECK(contains(results[rank].output, n == 1 ? "transport tcp" : "transport ucx"));
        }
      }
    }
  }
}
