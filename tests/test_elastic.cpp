// kolo_comm_shrink: ranks die (SIGKILL) in the middle of an allreduce, a batch of named
// allreduces or a split; the survivors shrink and go on, every later result checked element by
// element by the worker (tests/worker_elastic.cpp). Here: every survivor passed, every victim died
// by SIGKILL, no survivor took long, nothing is left in /dev/shm, and the time from the first
// death to the last survivor's first allreduce on the new communicator, for docs/performance.md ("A
// lost rank: from the kill to the next step").
#include <dirent.h>
#include <signal.h>
#include <stdlib.h>

#include <algorithm>
#include <catch2/catch.hpp>
#include <chrono>
#include <filesystem>
#include <map>
#include <optional>
#include <regex>
#include <set>
#include <sstream>
#include <string>

#include "faults.hpp"
#include "flavour.hpp"
#include "job.hpp"
#include "strangers.hpp"

using kolo::test::contains;

namespace {

std::set<std::string> kolo_shm_entries() {
  std::set<std::string> names;
  if (DIR* dir = ::opendir("/dev/shm")) {
    while (dirent* entry = ::readdir(dir)) {
      if (std::string(entry->d_name).rfind("kolo", 0) == 0) names.insert(entry->d_name);
    }
    ::closedir(dir);
  }
  return names;
}

std::vector<double> times_in(const std::string& output, const std::string& pattern) {
  std::vector<double> times;
  const std::regex line(pattern + " ([0-9]+\\.[0-9]+)");
  for (auto it = std::sregex_iterator(output.begin(), output.end(), line);
       it != std::sregex_iterator(); ++it) {
    times.push_back(std::stod((*it)[1]));
  }
  return times;
}

struct Scenario {
  int size;
  std::string victims;  // comma-separated world ranks
  int during = -1;      // a rank that dies during kolo_comm_shrink
};

// Runs one scenario; returns the milliseconds from the first death to the last survivor's first
// allreduce on the shrunken communicator.
// With `strangers`, tests/strangers.hpp crowds every port the ranks listen on from the start to the
// end, and the ports it found are checked: the store's, and every rank's lifeline and meshes.
double run_scenario(const std::string& phase, const Scenario& scenario,
                    const std::map<std::string, std::string>& env = {}, bool strangers = false,
                    const std::map<std::string, std::string>& last_rank_env = {}) {
  const std::set<std::string> shm_before = kolo_shm_entries();
  std::vector<std::string> args = {phase, scenario.victims};
  if (scenario.during >= 0) args.push_back(std::to_string(scenario.during));
  // Where the ranks say they are past the barrier before the deaths (worker_elastic.cpp); removed
  // however the scenario ends.
  struct TemporaryDirectory {
    std::string path = std::filesystem::temp_directory_path() / "kolo-elastic-XXXXXX";
    TemporaryDirectory() { REQUIRE(::mkdtemp(path.data()) != nullptr); }
    ~TemporaryDirectory() { std::filesystem::remove_all(path); }
  } past_barrier;
  std::map<std::string, std::string> ranks_env = {{"KOLO_TIMEOUT", "10"},
                                                  {"ELASTIC_PAST_BARRIER_DIR", past_barrier.path}};
  for (const auto& [key, value] : env) ranks_env[key] = value;
  std::vector<std::map<std::string, std::string>> rank_env(static_cast<size_t>(scenario.size));
  rank_env.back() = last_rank_env;
  auto job = kolo::test::start_job(scenario.size, args, kolo::test::with_flavour_logging(ranks_env),
                                   "tests/kolo_test_elastic", rank_env);
  std::optional<kolo::test::Strangers> crowd;
  if (strangers) {
    std::vector<kolo::test::Target> targets;
    for (const auto& rank : job.ranks) targets.push_back({rank.pid()});
    crowd.emplace(targets);
  }
  std::set<int> dead;
  std::stringstream list(scenario.victims);
  for (std::string item; std::getline(list, item, ',');) dead.insert(std::stoi(item));
  if (scenario.during >= 0) dead.insert(scenario.during);

  double first_death = 1e300;
  double last_first_step = 0;
  const auto started = std::chrono::steady_clock::now();
  for (int rank = 0; rank < scenario.size; ++rank) {
    const kolo::test::ProcessResult result = job.ranks[rank].wait(90);
    INFO("phase " << phase << ", N = " << scenario.size << ", victims " << scenario.victims
                  << ", during " << scenario.during << "; rank " << rank << " output:\n"
                  << result.output);
    REQUIRE_FALSE(result.timed_out);
    if (dead.count(rank)) {
      CHECK(result.signal == SIGKILL);
      for (double t : times_in(result.output, "dying at")) first_death = std::min(first_death, t);
    } else {
      CHECK(result.exit_code == 0);
      CHECK(contains(result.output, "elastic passed"));
      // The calls and named requests in flight when the ranks died failed with PEER_LOST (a split
      // may also fail while it connects its new communicator, with a timeout).
      if (phase == "allreduce" || phase == "fused") {
        CHECK(contains(result.output, "loop failed: KOLO_ERR_PEER_LOST"));
      }
      if (rank == 0 || !dead.count(0)) kolo::test::check_flavour(result.output, 2);
      for (double t : times_in(result.output, "first allreduce after shrink at")) {
        last_first_step = std::max(last_first_step, t);
      }
    }
  }
  // Bounded: 10 s timeout, one shrink a few seconds at most even with a death during it.
  CHECK(std::chrono::steady_clock::now() - started < std::chrono::seconds(60));
  if (crowd) {
    // Nobody waited past KOLO_TIMEOUT (10 s) beyond the late start and the steady calls.
    CHECK(std::chrono::steady_clock::now() - started < std::chrono::milliseconds(13500));
    const std::set<kolo::test::ListeningPort> ports = crowd->ports();
    INFO(crowd->connections() << " stranger connections to " << ports.size() << " ports");
    // At least the store and every rank's lifeline (a mesh listens for milliseconds only, and is
    // crowded when the flood finds it in time; tests/test_mesh.cpp crowds one for sure).
    CHECK(std::any_of(ports.begin(), ports.end(),
                      [&](const auto& port) { return port.port == job.port; }));
    CHECK(ports.size() >= 1 + static_cast<size_t>(scenario.size));
    std::string listed;
    for (const auto& port : ports) listed += " " + std::to_string(port.port);
    WARN(crowd->connections() << " stranger connections to " << ports.size() << " ports:"
                              << listed << " (store " << job.port << ")");
  }
  CHECK(kolo_shm_entries() == shm_before);
  REQUIRE(first_death < 1e300);
  REQUIRE(last_first_step > 0);
  return (last_first_step - first_death) * 1000;
}

void run_phase(const std::string& phase) {
  const Scenario scenarios[] = {
      {4, "2"}, {4, "1,3"}, {4, "0"}, {5, "3"}, {5, "0,4"}, {5, "0"},
  };
  for (const Scenario& scenario : scenarios) {
    DYNAMIC_SECTION("N = " << scenario.size << ", rank(s) " << scenario.victims << " killed") {
      const double ms = run_scenario(phase, scenario);
      WARN("elastic " << phase << ": N = " << scenario.size << ", killed " << scenario.victims
                      << ": first death -> first allreduce after shrink: " << ms << " ms");
    }
  }
}

}  // namespace

TEST_CASE("shrink after ranks die in an allreduce", "[elastic][shrink_allreduce]") {
  run_phase("allreduce");
}

TEST_CASE("shrink after ranks die in a batch of named allreduces", "[elastic][shrink_fused]") {
  run_phase("fused");
}

TEST_CASE("shrink after ranks die in a split", "[elastic][shrink_split]") { run_phase("split"); }

TEST_CASE("strangers on every port change nothing the ranks agree on", "[elastic][strangers]") {
  // While N = 4 ranks start, run ordered and named allreduces, lose a rank and shrink, strangers
  // hold 200 silent and 20 garbage connections to every port any rank listens on, renewed every
  // second. Every survivor must shrink to the same members (the worker checks its rank and size,
  // then the sums of ordered, named and split collectives on the new communicator), within the
  // usual bounds. Rank 0 lost: the coordinator is rank 1; rank 2 lost: a follower. The last rank
  // starts 1.5 s late (the others wait for it at the crowded store) and the calls run 2 s before
  // the death.
  const Scenario scenarios[] = {{4, "0"}, {4, "2"}};
  for (const std::string phase : {"allreduce", "fused"}) {
    for (const Scenario& scenario : scenarios) {
      DYNAMIC_SECTION(phase << ", rank " << scenario.victims << " killed") {
        run_scenario(phase, scenario, {{"ELASTIC_STEADY_MS", "2000"}}, true,
                     {{"ELASTIC_LATE_MS", "1500"}});
      }
    }
  }
}

TEST_CASE("shrink fails the requests pending while the engines still connected",
          "[elastic][shrink_cold]") {
  // The engines' connect waits for the dead rank until KOLO_TIMEOUT (20 s here); the shrink
  // comes long before and must fail the requests still pending with KOLO_ERR_PEER_LOST (the
  // worker checks), so the survivors are done well within the timeout.
  for (const Scenario& scenario : {Scenario{4, "2"}, Scenario{4, "0"}}) {
    DYNAMIC_SECTION("N = 4, rank " << scenario.victims << " killed") {
      const auto started = std::chrono::steady_clock::now();
      run_scenario("cold", scenario, {{"KOLO_TIMEOUT", "20"}});
      CHECK(std::chrono::steady_clock::now() - started < std::chrono::seconds(15));
    }
  }
}

TEST_CASE("shrink when a rank, the coordinator too, dies during the agreement",
          "[elastic][shrink_during]") {
  // Rank 2 dies in the allreduce; then a survivor dies just after calling kolo_comm_shrink: a
  // follower (3), and the coordinator itself (0). The others shrink to the rest, calling again
  // if the first call fails, as the contract allows.
  for (int during : {3, 0}) {
    DYNAMIC_SECTION("rank " << during << " dies during the agreement") {
      run_scenario("allreduce", Scenario{5, "2", during});
    }
  }
}

TEST_CASE("a slow rank that others gave up on is kept if it comes within the timeout",
          "[elastic][shrink_slow]") {
  // KOLO_TIMEOUT 3 s: rank 2 sleeps before the first allreduce; the others time out waiting for
  // it (reporting it lost), and shrink. Coming 4 s in, it is within the coordinator's wait (3 s
  // from its own call) and is a member; coming 12 s in, it is left out.
  const std::map<std::string, std::string> env = {{"KOLO_TIMEOUT", "3"}};
  for (const bool kept : {true, false}) {
    DYNAMIC_SECTION((kept ? "kept" : "left out")) {
      auto job = kolo::test::start_job(
          4, {"slow", "2", kept ? "4" : "12", kept ? "kept" : "left-out"}, env,
          "tests/kolo_test_elastic");
      for (int rank = 0; rank < 4; ++rank) {
        const kolo::test::ProcessResult result = job.ranks[rank].wait(90);
        INFO("rank " << rank << " output:\n" << result.output);
        REQUIRE_FALSE(result.timed_out);
        CHECK(result.exit_code == 0);
        if (rank == 2 && !kept) {
          CHECK(contains(result.output, "left out"));
        } else {
          CHECK(contains(result.output, kept ? " of 4 after shrink" : " of 3 after shrink"));
          CHECK(contains(result.output, "elastic passed"));
        }
      }
    }
  }
}
