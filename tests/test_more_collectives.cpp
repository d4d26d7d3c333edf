// Multi-process tests of allgather(v), reduce-scatter(v), alltoall(v), reduce, send/recv and
// sub-communicators, and of their faults: N real processes over loopback, each checking every
// result element by element against its own reference (tests/worker_collectives.cpp).
#include <signal.h>

#include <catch2/catch.hpp>
#include <chrono>
#include <regex>
#include <thread>

#include "faults.hpp"
#include "flavour.hpp"
#include "job.hpp"

using kolo::test::contains;
using kolo::test::expect_all_pass_on_transport;

namespace {

const char* kWorker = "tests/kolo_test_collectives";

// Under a transport flavour the ranks log at INFO, for expect_all_pass_on_transport to check the
// path; the fault tests that kill or starve a rank run as before, without it (`log_flavour` false).
kolo::test::Job start(int size, const std::vector<std::string>& args,
                      const std::map<std::string, std::string>& env = {}, bool log_flavour = true) {
  return kolo::test::start_job(size, args,
                               log_flavour ? kolo::test::with_flavour_logging(env) : env, kWorker);
}

}  // namespace

TEST_CASE("allgather and allgatherv: every dtype and size, uneven counts, N = 1..5",
          "[collectives][allgather]") {
  for (int n = 1; n <= 5; ++n) {
    DYNAMIC_SECTION("N = " << n) {
      auto job = start(n, {"allgather"});
      expect_all_pass_on_transport(job.wait(600), "allgather checks passed");
    }
  }
  SECTION("small segments and several streams, N = 3") {
    auto job =
        start(3, {"allgather", "quick"}, {{"KOLO_SEGMENT_BYTES", "4K"}, {"KOLO_TCP_STREAMS", "3"}});
    expect_all_pass_on_transport(job.wait(600), "allgather checks passed");
  }
}

TEST_CASE("reduce-scatter and reduce-scatterv: every dtype, op and size, N = 1..5",
          "[collectives][reduce_scatter]") {
  for (int n = 1; n <= 5; ++n) {
    DYNAMIC_SECTION("N = " << n) {
      auto job = start(n, {"reduce_scatter"});
      expect_all_pass_on_transport(job.wait(600), "reduce_scatter checks passed");
    }
  }
  SECTION("small segments and several streams, N = 4") {
    auto job = start(4, {"reduce_scatter", "quick"},
                     {{"KOLO_SEGMENT_BYTES", "4K"}, {"KOLO_TCP_STREAMS", "2"}});
    expect_all_pass_on_transport(job.wait(600), "reduce_scatter checks passed");
  }
}

TEST_CASE("alltoall and alltoallv: dtypes, sizes, gaps and zeros, in place, N = 1..5",
          "[collectives][alltoall]") {
  for (int n = 1; n <= 5; ++n) {
    DYNAMIC_SECTION("N = " << n) {
      auto job = start(n, {"alltoall"});
      expect_all_pass_on_transport(job.wait(600), "alltoall checks passed");
    }
  }
}

TEST_CASE("reduce: every root, dtype, op and size, in place, N = 1..5", "[collectives][reduce]") {
  for (int n = 1; n <= 5; ++n) {
    DYNAMIC_SECTION("N = " << n) {
      auto job = start(n, {"reduce", n >= 4 ? "quick" : ""});
      expect_all_pass_on_transport(job.wait(600), "reduce checks passed");
    }
  }
  SECTION("small segments, N = 3") {
    auto job = start(3, {"reduce", "quick"}, {{"KOLO_SEGMENT_BYTES", "4K"}});
    expect_all_pass_on_transport(job.wait(600), "reduce checks passed");
  }
}

TEST_CASE("send/recv: every pair both ways, tags and sizes, between collectives",
          "[collectives][sendrecv]") {
  for (int n = 1; n <= 4; ++n) {
    DYNAMIC_SECTION("N = " << n) {
      auto job = start(n, {"sendrecv"}, {{"KOLO_TCP_STREAMS", n == 3 ? "2" : "1"}});
      expect_all_pass_on_transport(job.wait(300), "sendrecv checks passed");
    }
  }
}

TEST_CASE("split: odd/even, singletons, opting out, nested, threads, parent destroyed first",
          "[collectives][split]") {
  for (int n = 1; n <= 5; ++n) {
    DYNAMIC_SECTION("N = " << n) {
      auto job = start(n, {"split"});
      expect_all_pass_on_transport(job.wait(300), "split checks passed");
    }
  }
  SECTION("each member of a new communicator erases the store keys it wrote to connect, N = 3") {
    auto job = start(3, {"split"}, {{"KOLO_DEBUG", "INFO"}});
    auto results = job.wait(300);
    expect_all_pass_on_transport(results, "split checks passed");
    const std::regex erased(
        "split: erased the ([0-9]+) store key\\(s\\) rank [0-9]+ wrote to connect communicator");
    size_t erasures = 0;
    for (const auto& result : results) {
      INFO(result.output);
      CHECK_FALSE(contains(result.output, "could not erase"));
      for (auto it = std::sregex_iterator(result.output.begin(), result.output.end(), erased);
           it != std::sregex_iterator(); ++it) {
        ++erasures;
        CHECK(std::stoul((*it)[1].str()) > 0);  // at least the member's addresses
      }
    }
    CHECK(erasures > 0);
  }
}

TEST_CASE("SIGUSR1: each rank reports the call it is in, the peer it waits for and its names",
          "[collectives][report]") {
  const int n = 3;
  auto job = start(n, {"stuck", "8"});
  auto wait_for_output = [&](int rank, const std::string& text) {
    for (int attempt = 0; attempt < 400; ++attempt) {
      if (contains(job.ranks[rank].output_so_far(), text)) return true;
      std::this_thread::sleep_for(std::chrono::milliseconds(25));
    }
    return false;
  };
  REQUIRE(wait_for_output(0, "stuck: sleeping"));
  for (int rank = 1; rank < n; ++rank) REQUIRE(wait_for_output(rank, "in the ordered allreduce"));
  // Let rank 0's coordinator see 'late' from ranks 1 and 2 (it refreshes once a second).
  std::this_thread::sleep_for(std::chrono::milliseconds(2500));
  for (int rank = 0; rank < n; ++rank) job.ranks[rank].kill(SIGUSR1);
  REQUIRE(wait_for_output(0, "SIGUSR1: rank 0 of 3"));
  REQUIRE(wait_for_output(1, "SIGUSR1: rank 1 of 3"));
  REQUIRE(wait_for_output(2, "SIGUSR1: rank 2 of 3"));
  auto results = job.wait(60);
  for (int rank = 0; rank < n; ++rank) {
    INFO("rank " << rank << " output:\n" << results[rank].output);
    CHECK(results[rank].exit_code == 0);
    CHECK(contains(results[rank].output, "stuck: all sums right"));
  }
  // Rank 0 sleeps before its first ordered call; as rank 0 of the engine it knows who has not
  // submitted 'late'.
  CHECK(std::regex_search(results[0].output,
                          std::regex("SIGUSR1: rank 0 of 3 .*: no collective yet; .*"
                                     "'late' for [0-9.]+ s, missing rank 0")));
  // Ranks 1 and 2 are inside the ordered allreduce: rank 1 waits for rank 0, its left
  // neighbour; both have 'late' in flight.
  CHECK(std::regex_search(results[1].output,
                          std::regex("SIGUSR1: rank 1 of 3 .*: in allreduce #[0-9]+ .* for "
                                     "[0-9.]+ s, waiting for rank 0; fusion engine: 1 named "
                                     "operation\\(s\\) in flight on this rank: 'late'")));
  CHECK(std::regex_search(results[2].output,
                          std::regex("SIGUSR1: rank 2 of 3 .*: in allreduce #[0-9]+ .*'late'")));
}

TEST_CASE("collectives from two threads at once on one communicator are warned about",
          "[collectives][threads]") {
  for (int n : {2, 3}) {
    DYNAMIC_SECTION("N = " << n) {
      auto job = start(n, {"threads"});
      auto results = job.wait(120);
      const std::string warning = "waited for another thread's collective";
      for (size_t rank = 0; rank < results.size(); ++rank) {
        INFO("rank " << rank << " output:\n" << results[rank].output);
        CHECK_FALSE(results[rank].timed_out);
        CHECK(results[rank].exit_code == 0);
        CHECK(contains(results[rank].output, "threads: 600 calls checked"));
        // Once per communicator at most.
        const std::string& output = results[rank].output;
        const size_t first = output.find(warning);
        if (first != std::string::npos) {
          CHECK(output.find(warning, first + 1) == std::string::npos);
          CHECK(contains(output, "kolo_comm_split"));
        }
      }
      // Rank 0's threads race for certain (its first call waits 200 ms for the other ranks while
      // its other thread calls: worker_collectives.cpp, run_threads); the others' may.
      INFO("rank 0 output:\n" << results[0].output);
      CHECK(contains(results[0].output, warning));
    }
  }
}

TEST_CASE("the new collectives: ranks that disagree get KOLO_ERR_MISMATCH on every rank",
          "[faults][mismatch_collectives]") {
  const char* kinds[] = {
      "allgather_count",        "allgather_dtype",   "allgatherv_counts", "reduce_scatter_op",
      "reduce_scatterv_counts", "alltoall_count",    "alltoallv_pair",    "reduce_root",
      "reduce_count",           "reduce_op",         "collective",        "sendrecv_tag",
      "sendrecv_count",         "sendrecv_both_send"};
  for (const char* kind : kinds) {
    for (int n : {2, 3, 5}) {
      // Point to point involves ranks 0 and 1 only; the others learn of it from them.
      DYNAMIC_SECTION(kind << ", N = " << n) {
        auto job = start(n, {"mismatch", kind});
        kolo::test::expect_every_rank_reports_mismatch(job.wait(60));
      }
    }
  }
  for (int n : {3, 4, 5}) {
    DYNAMIC_SECTION("inside one half of a split, N = " << n) {
      auto job = start(n, {"split_mismatch"});
      auto results = job.wait(60);
      for (size_t rank = 0; rank < results.size(); ++rank) {
        INFO("rank " << rank << " output:\n" << results[rank].output);
        CHECK(results[rank].exit_code == 0);
        const bool troubled = rank % 2 == static_cast<size_t>(n - 1) % 2;
        CHECK(contains(results[rank].output,
                       troubled ? "half status KOLO_ERR_MISMATCH" : "half status KOLO_SUCCESS"));
        CHECK(contains(results[rank].output, "split mismatch checks passed"));
      }
    }
  }
}

TEST_CASE("the new collectives: invalid vectors and arguments are refused before anything moves",
          "[faults][arguments_collectives]") {
  for (int n : {1, 2, 3}) {
    DYNAMIC_SECTION("N = " << n) {
      auto job = start(n, {"badargs"});
      expect_all_pass_on_transport(job.wait(60), "bad-argument checks passed");
    }
  }
}

TEST_CASE("a rank killed while a split communicator runs: KOLO_ERR_PEER_LOST on its survivors",
          "[faults][sigkill_split]") {
  struct Case {
    int size;
    int victim;
  };
  for (Case c : {Case{4, 1}, Case{5, 2}, Case{3, 0}}) {
    DYNAMIC_SECTION("N = " << c.size << ", rank " << c.victim << " killed") {
      auto job = start(c.size, {"lost", "4"}, {}, false);
      for (int attempt = 0; attempt < 600; ++attempt) {
        bool all = true;
        for (auto& rank : job.ranks) all = all && contains(rank.output_so_far(), "looping");
        if (all) break;
        std::this_thread::sleep_for(std::chrono::milliseconds(50));
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(500));
      job.ranks[c.victim].kill(SIGKILL);
      for (int rank = 0; rank < c.size; ++rank) {
        auto result = job.ranks[rank].wait(30);
        if (rank == c.victim) {
          CHECK(result.signal == SIGKILL);
          continue;
        }
        INFO("rank " << rank << " output:\n" << result.output);
        CHECK_FALSE(result.timed_out);
        CHECK(result.exit_code == 3);
        if (rank % 2 == c.victim % 2) {
          // The victim's half notices at once, in the middle of its loop.
          CHECK(contains(result.output, "half status KOLO_ERR_PEER_LOST"));
          CHECK(kolo::test::seconds_to_failure(result.output) < 10.0);
        } else {
          // The other half goes on undisturbed to the end of its loop.
          CHECK(contains(result.output, "half status KOLO_SUCCESS"));
        }
        // The world contains the victim.
        CHECK(contains(result.output, "world status KOLO_ERR_PEER_LOST"));
      }
    }
  }
}

TEST_CASE("a receive whose send never comes ends with KOLO_ERR_TIMEOUT within KOLO_TIMEOUT",
          "[faults][timeout_sendrecv]") {
  auto job = start(2, {"recv_timeout", "4"}, {{"KOLO_TIMEOUT", "2"}}, false);
  auto receiver = job.ranks[1].wait(30);
  INFO("rank 1 output:\n" << receiver.output);
  CHECK(receiver.exit_code == 3);
  CHECK(contains(receiver.output, "recv status KOLO_ERR_TIMEOUT"));
  std::smatch match;
  REQUIRE(std::regex_search(receiver.output, match, std::regex(R"(after ([0-9.]+) s)")));
  CHECK(std::stod(match[1]) >= 1.5);
  CHECK(std::stod(match[1]) < 5.0);
  // The sender, late, finds the communicator broken by the receiver's timeout.
  auto sender = job.ranks[0].wait(30);
  INFO("rank 0 output:\n" << sender.output);
  CHECK(contains(sender.output, "send status KOLO_ERR_TIMEOUT"));
}
