// Starting N ranks of a test worker (kolo_test_worker unless named) by hand (no launcher), as a
// user of mpirun-less start-up would: each process gets KOLO_RANK, KOLO_SIZE, KOLO_ADDR and the
// job secret. And the check that every rank of a job passed.
#pragma once

#include <catch2/catch.hpp>
#include <functional>
#include <map>
#include <string>
#include <vector>

#include "process.hpp"

namespace kolo::test {

inline const char* kTestSecret = "0123456789abcdef0123456789abcdef";

struct Job {
  std::vector<Process> ranks;
  int port = 0;

  // Waits for every rank; a rank that runs past timeout_s is killed and reported as timed out.
  std::vector<ProcessResult> wait(double timeout_s) {
    std::vector<ProcessResult> results;
    for (auto& rank : ranks) results.push_back(rank.wait(timeout_s));
    return results;
  }
};

// rank_env, where it has an entry for a rank, adds to (and overrides) extra_env for that rank.
inline Job start_job(int size, const std::vector<std::string>& worker_args,
                     const std::map<std::string, std::string>& extra_env = {},
                     const std::string& worker = "tests/kolo_test_worker",
                     const std::vector<std::map<std::string, std::string>>& rank_env = {}) {
  Job job;
  job.port = free_tcp_port();
  for (int rank = 0; rank < size; ++rank) {
    std::map<std::string, std::string> env = {
        {"KOLO_RANK", std::to_string(rank)},
        {"KOLO_SIZE", std::to_string(size)},
        {"KOLO_ADDR", "127.0.0.1:" + std::to_string(job.port)},
        {"KOLO_SECRET", kTestSecret},
        {"KOLO_TIMEOUT", "60"},
    };
    for (const auto& [key, value] : extra_env) env[key] = value;
    if (static_cast<size_t>(rank) < rank_env.size()) {
      for (const auto& [key, value] : rank_env[rank]) env[key] = value;
    }
    std::vector<std::string> argv = {built_program(worker)};
    argv.insert(argv.end(), worker_args.begin(), worker_args.end());
    job.ranks.emplace_back(argv, env);
  }
  return job;
}

// Every rank finished in time, exited 0 and printed `marker`, and its output passes `also` where
// given; a failed check shows the rank and its output.
inline void expect_all_pass(const std::vector<ProcessResult>& results, const std::string& marker,
                            const std::function<void(const std::string& output)>& also = {}) {
  for (size_t rank = 0; rank < results.size(); ++rank) {
    INFO("rank " << rank << " output:\n" << results[rank].output);
    CHECK_FALSE(results[rank].timed_out);
    CHECK(results[rank].exit_code == 0);
    CHECK(results[rank].output.find(marker) != std::string::npos);
    if (also) also(results[rank].output);
  }
}

}  // namespace kolo::test
