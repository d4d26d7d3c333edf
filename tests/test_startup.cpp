// What a job says when it starts: the line rank 0 logs with kolo's version, commit, transport and
// schedules, and the error when a rank never joins (comm/communicator.cpp).
#include <catch2/catch.hpp>
#include <cstdio>
#include <cstdlib>
#include <map>
#include <regex>
#include <string>
#include <vector>

#include "job.hpp"
#include "kolo.h"

using kolo::test::start_job;

namespace {

int count_matches(const std::string& text, const std::regex& pattern) {
  return static_cast<int>(std::distance(std::sregex_iterator(text.begin(), text.end(), pattern),
                                        std::sregex_iterator()));
}

// `git rev-parse --short=12 HEAD` of the source tree, "" outside git.
std::string source_commit() {
  const char* source = std::getenv("TESTS_SOURCE_DIR");
  if (source == nullptr) return "";
  std::string command = std::string("git -C '") + source + "' rev-parse --short=12 HEAD 2>/dev/null";
  FILE* pipe = ::popen(command.c_str(), "r");
  if (pipe == nullptr) return "";
  char line[64] = {};
  const bool read = std::fgets(line, sizeof line, pipe) != nullptr;
  ::pclose(pipe);
  std::string commit = read ? line : "";
  while (!commit.empty() && (commit.back() == '\n' || commit.back() == '\r')) commit.pop_back();
  return commit;
}

}  // namespace

TEST_CASE("a rank that never joins is named, with the store it was awaited at", "[startup]") {
  // Rank 0 of 2 alone: rank 1 is never started.
  const int port = kolo::test::free_tcp_port();
  kolo::test::Process rank0({kolo::test::built_program("tests/kolo_test_worker"), "loop", "1"},
                            {{"KOLO_RANK", "0"},
                             {"KOLO_SIZE", "2"},
                             {"KOLO_ADDR", "127.0.0.1:" + std::to_string(port)},
                             {"KOLO_SECRET", kolo::test::kTestSecret},
                             {"KOLO_TIMEOUT", "3"}});
  auto result = rank0.wait(30);
  INFO("rank 0 output:\n" << result.output);
  CHECK_FALSE(result.timed_out);
  CHECK(result.exit_code == 4);  // the worker's "init failed"
  CHECK(result.output.find("KOLO_ERR_TIMEOUT") != std::string::npos);
  const std::string expected = "rank 1 of 2 never joined: rank 0 waited 3 s (KOLO_TIMEOUT) for it "
                               "at the rendezvous store at 127.0.0.1:" +
                               std::to_string(port) +
                               "; was it started, with the same KOLO_ADDR and KOLO_SIZE=2?";
  CHECK(result.output.find(expected) != std::string::npos);
  CHECK(result.output.find("waiting for key") == std::string::npos);
}

TEST_CASE("ranks that make a communicator again while rank 0 still serves the old store join the "
          "new one",
          "[startup]") {
  // Rank 0 destroys each communicator 0.5 s after the others, which meanwhile make the next one
  // at the same address: they must wait for rank 0's next store, not register in the old one
  // (which vanished under them: "rank 1 of 3 never joined").
  auto job = kolo::test::start_job(3, {"reinit", "0.5"}, {{"KOLO_TIMEOUT", "10"}});
  kolo::test::expect_all_pass(job.wait(60), "made 3 communicators one after the other");
}

TEST_CASE("a rank that waits with rank 0 for a rank that never joins names it too", "[startup]") {
  // Ranks 0 and 2 of 3: rank 1 is never started. Rank 0 times out and its store closes; rank 2,
  // whose own timeout has not yet come, says which rank it was waiting for when the store went.
  const int port = kolo::test::free_tcp_port();
  const std::string address = "127.0.0.1:" + std::to_string(port);
  std::vector<kolo::test::Process> ranks;
  for (const char* rank : {"0", "2"}) {
    ranks.emplace_back(
        std::vector<std::string>{kolo::test::built_program("tests/kolo_test_worker"), "loop", "1"},
        std::map<std::string, std::string>{{"KOLO_RANK", rank},
                                           {"KOLO_SIZE", "3"},
                                           {"KOLO_ADDR", address},
                                           {"KOLO_SECRET", kolo::test::kTestSecret},
                                           {"KOLO_TIMEOUT", rank == std::string("0") ? "3" : "30"}});
  }
  auto rank0 = ranks[0].wait(30);
  auto rank2 = ranks[1].wait(30);
  INFO("rank 0 output:\n" << rank0.output << "\nrank 2 output:\n" << rank2.output);
  CHECK(rank0.exit_code == 4);
  CHECK(rank0.output.find("rank 1 of 3 never joined: rank 0 waited 3 s (KOLO_TIMEOUT) for it at "
                          "the rendezvous store at " + address) != std::string::npos);
  CHECK(rank2.exit_code == 4);
  CHECK(rank2.output.find("KOLO_ERR_PEER_LOST") != std::string::npos);
  CHECK(rank2.output.find("rank 1 of 3 had not joined when the rendezvous store at " + address +
                          " closed (rank 2 waited for it; rank 0, which serves the store, gave "
                          "up waiting for it or was lost)") != std::string::npos);
}

TEST_CASE("rank 0 logs one start-up line with the version, commit, transport and schedules",
          "[startup]") {
  auto job = start_job(2, {"loop", "1"}, {{"KOLO_DEBUG", "INFO"}, {"KOLO_ALLREDUCE", "ring"}});
  auto results = job.wait(60);
  const std::string version = std::to_string(KOLO_VERSION_MAJOR) + "\\." +
                              std::to_string(KOLO_VERSION_MINOR) + "\\." +
                              std::to_string(KOLO_VERSION_PATCH);
  const std::regex line("kolo " + version +
                        " \\(commit ([0-9a-f]{12}(-dirty)?|unknown)\\): 2 rank\\(s\\) on 1 "
                        "node\\(s\\), transport tcp, allreduce flat \\(KOLO_ALLREDUCE=ring; flat: "
                        "recursive doubling up to [0-9]+ bytes, ring above\\), "
                        "segments of [0-9]+ bytes, KOLO_SHM=[a-z0-9]+, 1 TCP stream\\(s\\), "
                        "started by [a-z]+");
  for (size_t rank = 0; rank < results.size(); ++rank) {
    INFO("rank " << rank << " output:\n" << results[rank].output);
    CHECK(results[rank].exit_code == 0);
    CHECK(count_matches(results[rank].output, line) == (rank == 0 ? 1 : 0));
  }
  // The commit is the source tree's (when the tests run from a git checkout).
  const std::string commit = source_commit();
  if (!commit.empty()) {
    INFO("rank 0 output:\n" << results[0].output);
    CHECK(results[0].output.find("(commit " + commit) != std::string::npos);
  }
}

TEST_CASE("through the store, the world's start-up is one SET and one GET_MANY per rank",
          "[startup]") {
  // The host record, the transport's and the lifeline's addresses and KOLO_TRANSPORT=auto's facts
  // go in one record per rank (comm/communicator.cpp, start_through_store).
  for (const char* transport : {"tcp", "auto"}) {
    auto job = start_job(3, {"loop", "1"}, {{"KOLO_DEBUG", "INFO"}, {"KOLO_TRANSPORT", transport}});
    auto results = job.wait(60);
    const std::regex line("start-up took [0-9.]+ s and ([0-9]+) store request\\(s\\)");
    for (size_t rank = 0; rank < results.size(); ++rank) {
      INFO("KOLO_TRANSPORT=" << transport << ", rank " << rank << " output:\n"
                             << results[rank].output);
      CHECK(results[rank].exit_code == 0);
      std::smatch match;
      REQUIRE(std::regex_search(results[rank].output, match, line));
      CHECK(match[1] == "2");
    }
  }
}
