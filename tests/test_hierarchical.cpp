// The hierarchical allreduce and what "the same host" means (KOLO_HOST_ID), across real processes
// on one machine: KOLO_HOST_ID splits the ranks into hosts of uneven sizes, and the workers check
// every result against their own reference (tests/worker.cpp).
#include <fmt/format.h>

#include <algorithm>
#include <catch2/catch.hpp>
#include <string>
#include <vector>

#include "faults.hpp"
#include "flavour.hpp"
#include "job.hpp"
#include "kolo_build_config.h"

using kolo::test::contains;
using kolo::test::expect_all_pass;
using kolo::test::start_job;

namespace {

using Env = std::map<std::string, std::string>;

// KOLO_HOST_ID for each rank, from a list of host names such as {"a", "a", "a", "b", "b"}.
std::vector<Env> hosts(const std::vector<std::string>& host_of_rank) {
  std::vector<Env> env;
  for (const std::string& host : host_of_rank) env.push_back({{"KOLO_HOST_ID", "host-" + host}});
  return env;
}

struct Layout {
  const char* name;
  std::vector<std::string> host_of_rank;
  const char* placement;  // what rank 0 logs at INFO about the hosts
  const char* choice;     // and about the schedules
};

// Uneven hosts run through the leaders at every size; even ones by shards above recursive
// doubling's limit (the 4 MiB buffers of the worker's checks).
const char kLeadersOnly[] = "KOLO_ALLREDUCE=hierarchical: hierarchical;";
const Layout kLayouts[] = {
    {"N = 5, hosts of 3 + 2", {"a", "a", "a", "b", "b"}, "2 hosts (leaders 0,3)", kLeadersOnly},
    {"N = 4, hosts of 2 + 2",
     {"a", "a", "b", "b"},
     "2 hosts (leaders 0,2)",
     "KOLO_ALLREDUCE=hierarchical: hierarchical up to 131072 bytes, hierarchical by shards above;"},
    {"N = 6, hosts of 2 + 2 + 2, interleaved",
     {"a", "b", "c", "a", "b", "c"},
     "3 hosts (leaders 0,1,2)",
     "KOLO_ALLREDUCE=hierarchical: hierarchical up to 196608 bytes, hierarchical by shards above;"},
    {"N = 4, hosts of 1 + 3", {"a", "b", "b", "b"}, "2 hosts (leaders 0,1)", kLeadersOnly},
    {"N = 5, hosts of 2 + 1 + 2, interleaved",
     {"a", "b", "a", "c", "c"},
     "3 hosts (leaders 0,1,3)",
     kLeadersOnly},
};

}  // namespace

TEST_CASE("hierarchical allreduce: every dtype, op and size, uneven hosts",
          "[hierarchical][hierarchical_allreduce]") {
  for (const Layout& layout : kLayouts) {
    DYNAMIC_SECTION(layout.name) {
      const int n = static_cast<int>(layout.host_of_rank.size());
      auto job =
          start_job(n, {"allreduce"}, {{"KOLO_ALLREDUCE", "hierarchical"}, {"KOLO_DEBUG", "INFO"}},
                    "tests/kolo_test_worker", hosts(layout.host_of_rank));
      auto results = job.wait(900);
      expect_all_pass(results, "allreduce checks passed");
      INFO("rank 0 output:\n" << results[0].output);
      CHECK(contains(results[0].output, layout.placement));
      CHECK(contains(results[0].output, layout.choice));
      CHECK_FALSE(contains(results[0].output, "WARN"));
    }
  }
}

TEST_CASE("hierarchical allreduce on sub-communicators: splits take their members' hosts",
          "[hierarchical][hierarchical_split]") {
  // The split scenario's odd/even halves, singletons, nested splits and threads, each allreduce
  // through the leaders of the hosts its members are on.
  auto job = start_job(5, {"split"}, {{"KOLO_ALLREDUCE", "hierarchical"}},
                       "tests/kolo_test_collectives", hosts({"a", "a", "a", "b", "b"}));
  expect_all_pass(job.wait(300), "split checks passed");
}

TEST_CASE("hierarchical allreduce: inexact floats give the same bits on every rank",
          "[hierarchical][hierarchical_identical]") {
  // 3 + 2 through the leaders; 2 + 2 + 2 by shards for the largest counts.
  for (const char* mode : {"hierarchical", "auto"}) {
    DYNAMIC_SECTION("KOLO_ALLREDUCE=" << mode << ", N = 5, hosts of 3 + 2") {
      auto job = start_job(5, {"identical"}, {{"KOLO_ALLREDUCE", mode}}, "tests/kolo_test_worker",
                           hosts({"a", "a", "a", "b", "b"}));
      expect_all_pass(job.wait(300), "identical checks passed");
    }
    DYNAMIC_SECTION("KOLO_ALLREDUCE=" << mode << ", N = 6, hosts of 2 + 2 + 2") {
      auto job = start_job(6, {"identical"}, {{"KOLO_ALLREDUCE", mode}}, "tests/kolo_test_worker",
                           hosts({"a", "a", "b", "b", "c", "c"}));
      expect_all_pass(job.wait(300), "identical checks passed");
    }
  }
}

TEST_CASE("KOLO_HOST_ID: one machine counts as two hosts", "[hierarchical][host_id]") {
  // Without KOLO_HOST_ID the ranks share this machine; with two values they are two hosts: the
  // node count, local ranks and the allreduce's hosts follow (placement logged by rank 0). Auto
  // goes hierarchical up to recursive doubling's limit where some host has several ranks (2 + 2:
  // as many steps between hosts, half the bytes on each host's link; 3 + 3: four steps between
  // hosts against one) and by shards above it, and keeps the flat schedules with one rank per
  // host.
  struct Case {
    std::vector<std::string> host_of_rank;
    const char* placement;
    const char* choice;
  };
  for (const Case& c :
       {Case{{"a", "b"}, "2 hosts (leaders 0,1)", "KOLO_ALLREDUCE=auto: flat;"},
        Case{{"a", "a", "b", "b"},
             "2 hosts (leaders 0,2)",
             "KOLO_ALLREDUCE=auto: hierarchical up to 131072 bytes, hierarchical by shards above;"},
        Case{{"a", "a", "a", "b", "b", "b"},
             "2 hosts (leaders 0,3)",
             "KOLO_ALLREDUCE=auto: hierarchical up to 196608 bytes, hierarchical by shards above;"},
        Case{{"a", "a", "a", "b", "b"},
             "2 hosts (leaders 0,3)",
             "KOLO_ALLREDUCE=auto: hierarchical up to 163840 bytes, flat above;"}}) {
    const int n = static_cast<int>(c.host_of_rank.size());
    DYNAMIC_SECTION("N = " << n) {
      auto job = start_job(n, {"barrier"}, {{"KOLO_DEBUG", "INFO"}}, "tests/kolo_test_worker",
                           hosts(c.host_of_rank));
      auto results = job.wait(120);
      expect_all_pass(results, "barrier checks passed");
      for (int rank = 0; rank < n; ++rank) {
        INFO("rank " << rank << " output:\n" << results[rank].output);
        CHECK(contains(results[rank].output, "2 node(s)"));
        const auto& hosts_of = c.host_of_rank;
        const auto mine = hosts_of[rank];
        CHECK(contains(results[rank].output,
                       fmt::format("local rank {} of {}",
                                   std::count(hosts_of.begin(), hosts_of.begin() + rank, mine),
                                   std::count(hosts_of.begin(), hosts_of.end(), mine))));
      }
      INFO("rank 0 output:\n" << results[0].output);
      CHECK(contains(results[0].output, c.placement));
      CHECK(contains(results[0].output, c.choice));
    }
  }
}

#ifdef KOLO_HAVE_UCX
TEST_CASE("KOLO_HOST_ID: no shared-memory ring between two hosts of one machine (UCX)",
          "[hierarchical][host_id]") {
  // kolo's rings join the ranks of one host; UCX, kept to TCP on loopback, the two hosts.
  auto job = start_job(4, {"allreduce", "quick"},
                       {{"KOLO_TRANSPORT", "ucx"},
                        {"KOLO_ALLREDUCE", "hierarchical"},
                        {"KOLO_DEBUG", "INFO"},
                        {"UCX_TLS", "tcp"},
                        {"UCX_NET_DEVICES", "lo"}},
                       "tests/kolo_test_worker", hosts({"a", "a", "b", "b"}));
  auto results = job.wait(600);
  expect_all_pass(results, "allreduce checks passed");
  for (int rank = 0; rank < 4; ++rank) {
    INFO("rank " << rank << " output:\n" << results[rank].output);
    for (int peer = 0; peer < 4; ++peer) {
      if (peer == rank) continue;
      const std::string path = fmt::format("ucx: rank {} reaches rank {} through ", rank, peer);
      if (peer / 2 == rank / 2) {
        CHECK(contains(results[rank].output, path + "kolo's shared-memory ring"));
      } else {
        CHECK(contains(results[rank].output, path + "UCX (another host)"));
      }
    }
  }
}
#endif

TEST_CASE("KOLO_ALLREDUCE differs between ranks: KOLO_ERR_CONFIG on every rank at start-up",
          "[hierarchical][allreduce_mode_mismatch]") {
  std::vector<Env> env = hosts({"a", "a", "b", "b"});
  for (size_t rank = 0; rank < env.size(); ++rank) {
    env[rank]["KOLO_ALLREDUCE"] = rank == 2 ? "ring" : "hierarchical";
  }
  auto job = start_job(4, {"barrier"}, {}, "tests/kolo_test_worker", env);
  auto results = job.wait(60);
  for (size_t rank = 0; rank < results.size(); ++rank) {
    INFO("rank " << rank << " output:\n" << results[rank].output);
    CHECK_FALSE(results[rank].timed_out);
    CHECK(results[rank].exit_code == 4);  // kolo_comm_init failed
    CHECK(contains(results[rank].output, "KOLO_ERR_CONFIG"));
    CHECK(contains(results[rank].output,
                   "KOLO_ALLREDUCE is hierarchical on rank 0 but ring on rank 2"));
  }
}

TEST_CASE("hierarchical allreduce: ranks whose calls differ get KOLO_ERR_MISMATCH",
          "[hierarchical][hierarchical_mismatch]") {
  // The last rank (a member of the second host) calls differently; "collective": it broadcasts,
  // and its messages go to ranks that the hierarchical schedule does not receive from.
  for (const char* kind : {"count", "dtype", "op", "scale", "collective"}) {
    DYNAMIC_SECTION(kind << " differs, N = 5, hosts of 3 + 2") {
      auto job = start_job(5, {"mismatch", kind},
                           kolo::test::with_flavour_logging({{"KOLO_ALLREDUCE", "hierarchical"}}),
                           "tests/kolo_test_worker", hosts({"a", "a", "a", "b", "b"}));
      auto results = job.wait(60);
      kolo::test::expect_every_rank_reports_mismatch(results, "hierarchical");
      for (const auto& result : results) kolo::test::check_flavour(result.output, results.size());
    }
  }
}

TEST_CASE(
    "hierarchical allreduce: a rank killed with SIGKILL is KOLO_ERR_PEER_LOST on every "
    "survivor",
    "[hierarchical][hierarchical_sigkill]") {
  struct Case {
    int victim;
    const char* what;
  };
  for (Case c : {Case{3, "a leader"}, Case{1, "a member"}}) {
    DYNAMIC_SECTION("N = 5, hosts of 3 + 2, " << c.what << " (rank " << c.victim << ") killed") {
      auto job = start_job(5, {"loop", "120"}, {{"KOLO_ALLREDUCE", "hierarchical"}},
                           "tests/kolo_test_worker", hosts({"a", "a", "a", "b", "b"}));
      kolo::test::kill_and_expect_peer_lost(job, c.victim);
    }
  }
}
