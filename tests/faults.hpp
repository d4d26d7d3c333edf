// What the fault tests share: waiting for a job's ranks to reach their loop, reading how long a
// survivor took to fail, and the SIGKILL check that every transport must pass.
#pragma once

#include <signal.h>

#include <catch2/catch.hpp>
#include <chrono>
#include <regex>
#include <string>
#include <thread>

#include "job.hpp"

namespace kolo::test {

inline bool contains(const std::string& text, const std::string& part) {
  return text.find(part) != std::string::npos;
}

// Waits (up to 30 s) until every rank has printed "looping".
inline void wait_until_looping(Job& job) {
  for (int attempt = 0; attempt < 600; ++attempt) {
    bool all = true;
    for (auto& rank : job.ranks) all = all && contains(rank.output_so_far(), "looping");
    if (all) return;
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  FAIL("the ranks did not start looping within 30 s");
}

// Seconds the worker reports between its last successful collective and its failure.
inline double seconds_to_failure(const std::string& output) {
  std::smatch match;
  REQUIRE(std::regex_search(output, match, std::regex(R"(after ([0-9.]+) s since last success)")));
  return std::stod(match[1]);
}

// Every rank of a job whose ranks disagree ("mismatch" worker mode) reported KOLO_ERR_MISMATCH
// saying that ranks disagree, and `also` where given, and exited as the mode expects (0).
inline void expect_every_rank_reports_mismatch(const std::vector<ProcessResult>& results,
                                               const std::string& also = "") {
  for (size_t rank = 0; rank < results.size(); ++rank) {
    INFO("rank " << rank << " output:\n" << results[rank].output);
    CHECK_FALSE(results[rank].timed_out);
    CHECK(results[rank].exit_code == 0);
    CHECK(contains(results[rank].output, "status KOLO_ERR_MISMATCH"));
    CHECK(contains(results[rank].output, "disagree"));
    if (!also.empty()) CHECK(contains(results[rank].output, also));
  }
}

// Every rank of the job but `victim` fails with KOLO_ERR_PEER_LOST naming it, within `bound_s`
// of `since` by this clock and by the rank's own report.
inline void expect_survivors_report_lost(Job& job, int victim,
                                         std::chrono::steady_clock::time_point since,
                                         double bound_s) {
  for (int rank = 0; rank < static_cast<int>(job.ranks.size()); ++rank) {
    if (rank == victim) continue;
    auto result = job.ranks[rank].wait(30 + bound_s);
    double elapsed =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - since).count();
    INFO("rank " << rank << " output:\n" << result.output);
    CHECK_FALSE(result.timed_out);
    CHECK(result.exit_code == 3);
    CHECK(contains(result.output, "KOLO_ERR_PEER_LOST"));
    CHECK(contains(result.output, "rank " + std::to_string(victim)));
    CHECK(elapsed < bound_s);
    CHECK(seconds_to_failure(result.output) < bound_s);
  }
}

// Kills rank `victim` of a job whose ranks loop on collectives ("loop" worker mode) once they all
// loop, and checks that every survivor fails with KOLO_ERR_PEER_LOST naming it within 10 s.
inline void kill_and_expect_peer_lost(Job& job, int victim) {
  wait_until_looping(job);
  std::this_thread::sleep_for(std::chrono::milliseconds(500));
  auto killed_at = std::chrono::steady_clock::now();
  job.ranks[victim].kill(SIGKILL);
  expect_survivors_report_lost(job, victim, killed_at, 10.0);
  CHECK(job.ranks[victim].wait(30).signal == SIGKILL);
}

}  // namespace kolo::test
