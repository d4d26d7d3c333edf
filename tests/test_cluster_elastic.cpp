// kolorun --elastic --host-discovery-script across hosts, on a simulated cluster (scripts/
// cluster.sh) with an sshd on every host. kolorun runs on host 4, as on a launch node, so that
// every rank - rank 0 too - starts through kolorun's agent over ssh. The discovery script reads a
// file the test rewrites: h1:2 (2 ranks) -> h1:2,h2:2 (4) -> a rank on h2 killed (3, then its
// slot restarted: 4) -> h2 gone, h3:2 there (h2's ranks leave, two newcomers on h3: 4). The C
// worker (tests/worker_elastic_driver.c) checks every allreduce against the sum it expects. Then
// the kolo.torch.elastic job of tests/python/test_torch_elastic_grow.py, 2 -> 4 -> 3 -> 4 across
// h1 and h2, ends with equal parameter digests on its 4 ranks, equal to a replay; and examples/several-hosts/
// kolorun-elastic.sh runs as docs/elastic.md prints it, growing from 2 to 4 ranks.
// Needs root and network namespaces; without them the program says why and exits 77 (skipped).
#define CATCH_CONFIG_RUNNER
#include <fmt/format.h>
#include <signal.h>
#include <stdlib.h>
#include <unistd.h>

#include <algorithm>
#include <catch2/catch.hpp>
#include <chrono>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <regex>
#include <set>
#include <string>
#include <vector>

#include "cluster.hpp"
#include "process.hpp"

using namespace kolo::test;
using Catch::Matchers::Contains;

namespace {

// A name and a subnet of this test's own, so that it can run beside the other cluster tests.
const ClusterId kCluster{"koloel", "10.49.0", "fd49", 4};
const char* kSecret = "cluster-elastic-test-secret-7a31c2";

// The discovery script's file and the worker's stop file, on the file system every host shares.
struct Scratch {
  std::filesystem::path dir;
  Scratch() {
    char name[] = "/tmp/kolo-cluster-elastic-XXXXXX";
    dir = ::mkdtemp(name);
  }
  ~Scratch() { std::filesystem::remove_all(dir); }
  std::string path(const std::string& name) const { return (dir / name).string(); }
  void hosts(const std::string& lines) const {
    std::string temporary = path("hosts.new");
    std::ofstream(temporary) << lines;
    std::filesystem::rename(temporary, path("hosts"));  // the script never reads half a file
  }
};

// Waits until `what` occurs `times` times in the output, up to timeout_s; the output then.
std::string wait_for_count(const Process& process, const std::string& what, size_t times,
                           int timeout_s = 90) {
  std::string output;
  if (!process.wait_for_output(what, times, std::chrono::seconds(timeout_s),
                               std::chrono::milliseconds(100), &output)) {
    FAIL("waited " << timeout_s << " s for " << times << " x '" << what << "'; the output:\n"
                   << output << "\nthe job's processes:\n"
                   << process_table({"kolo", "ssh", "cluster"}));
  }
  return output;
}

// The pid the worker in `slot` reported when it last started or joined (the hosts share one pid
// space, so the test can signal it).
pid_t pid_in_slot(const std::string& output, const std::string& slot) {
  std::regex pattern("slot " + slot +
                     R"(: rank \d+ of \d+ (?:started|joined) at step \d+, pid (\d+))");
  pid_t pid = -1;
  for (std::sregex_iterator it(output.begin(), output.end(), pattern), end; it != end; ++it) {
    pid = static_cast<pid_t>(std::stol((*it)[1]));
  }
  return pid;
}

}  // namespace

TEST_CASE("kolorun --elastic follows a discovery script across hosts", "[cluster][elastic]") {
  SshCluster cluster(kCluster);
  Scratch scratch;
  scratch.hosts(fmt::format("{}:2\n", kCluster.host(1)));
  std::string command = fmt::format(
      "cd '{}' && exec '{}' --verbose --elastic -np 2 --min-np 2 --max-np 4 --host-discovery-script "
      "'cat {}' '{}' '{}' 5 10",
      source_dir(), built_program("src/kolorun"), scratch.path("hosts"),
      built_program("tests/kolo_test_elastic_driver"), scratch.path("stop"));
  Process job(kCluster.exec(kCluster.hosts, command),
              {{"KOLO_SECRET", kSecret}, {"KOLO_TIMEOUT", "30"}});

  wait_for_count(job, "of 2 started", 2);
  CHECK(count(job.output_so_far(),
              fmt::format("slot {}:0: rank 0 of 2 started", kCluster.host(1))) == 1);

  // A host appears: two newcomers there.
  scratch.hosts(fmt::format("{}:2\n{}:2\n", kCluster.host(1), kCluster.host(2)));
  wait_for_count(job, "size 2 -> 4 (2 joined, 0 left)", 2);
  std::string output = wait_for_count(job, "of 4 joined", 2);
  for (int slot = 0; slot < 2; ++slot) {
    INFO(output);
    CHECK(std::regex_search(output, std::regex(fmt::format(R"(slot {}:{}: rank [23] of 4 joined)",
                                                           kCluster.host(2), slot))));
  }

  // A rank on the new host is killed: the others shrink to 3, its slot is restarted over ssh.
  pid_t victim = pid_in_slot(output, kCluster.host(2) + ":1");
  REQUIRE(victim > 0);
  ::kill(victim, SIGKILL);
  wait_for_count(job, "shrank to size 3", 3);
  output = wait_for_count(job, "size 3 -> 4 (1 joined, 0 left)", 3);
  CHECK_THAT(output, Contains(fmt::format("the rank in slot {}:1", kCluster.host(2))));
  CHECK_THAT(output, Contains("the others go on, and the slot is restarted at the next update"));
  wait_for_count(job, fmt::format("slot {}:1: rank 3 of 4 joined", kCluster.host(2)), 1);
  // The agent on h2 names the killed rank; the driver sees its agent's status.
  CHECK(
      count(output, fmt::format("the newcomer in slot {}:1 killed by signal SIGKILL (pid {} on {})",
                                kCluster.host(2), victim, kCluster.host(2))) == 1);
  CHECK_THAT(output, Contains("exited with status 137; the others go on"));

  // The new host goes, another comes: h2's ranks leave (exit 0), h3 gets two newcomers.
  scratch.hosts(fmt::format("{}:2\n{}:2\n", kCluster.host(1), kCluster.host(3)));
  wait_for_count(job, "leaving at step", 2);
  output = wait_for_count(job, "size 4 -> 4 (2 joined, 2 left)", 2);
  wait_for_count(job, "of 4 joined", 4);
  output = job.output_so_far();
  CHECK(count(output, "slot " + kCluster.host(3) + ":0: rank ") == 1);
  CHECK(count(output, "slot " + kCluster.host(3) + ":1: rank ") == 1);

  std::ofstream(scratch.path("stop")) << "stop\n";
  ProcessResult result = job.wait(120);
  INFO(result.output);
  CHECK(result.exit_code == 0);
  CHECK(count(result.output, "of 4 done") == 4);
  for (const char* slot : {"1:0", "1:1", "3:0", "3:1"}) {
    CHECK(count(result.output, fmt::format("slot {}{}: rank", kCluster.name, slot)) >= 1);
  }
  CHECK(count(result.output, "FAILED") == 0);
  // The secret travelled on ssh's stdin only; no line of kolorun's names it.
  CHECK(count(result.output, kSecret) == 0);
}

// The kolo.torch.elastic job of tests/python/test_torch_elastic_grow.py (run as a script: one
// rank), under the driver across hosts: the discovery file says h1:2; before step 4 rank 0 makes
// it h1:2,h2:2 and the ranks commit until there are 4; slot h2:1 kills itself at step 9, and the
// ranks wait for 4 again (its slot restarted over ssh) before step 12. Every rank that finishes
// prints its parameters' sha256: the 4 of the final world must be equal, and equal (within the
// float tolerance the Python test states) to a replay of the recorded schedule without kolo.
TEST_CASE("kolo.torch.elastic trains across hosts under the driver", "[cluster][elastic_torch]") {
  if (std::system("/usr/bin/python3 -c 'import torch' 2>/dev/null") != 0) {
    WARN("Debian's python3 cannot import torch (python3-torch): the training job is not run");
    return;
  }
  SshCluster cluster(kCluster);
  Scratch scratch;
  scratch.hosts(fmt::format("{}:2\n", kCluster.host(1)));
  std::string arguments = fmt::format(
      R"({{"control": "", "out_dir": "{}", "kill_name": "{}:1", "kill_step": 9, "waits": )"
      R"([[4, 4, "{}:2\n{}:2\n"], [12, 4, ""]]}})",
      scratch.dir.string(), kCluster.host(2), kCluster.host(1), kCluster.host(2));
  std::string command = fmt::format(
      "cd '{}' && exec '{}' --verbose --elastic -np 2 --min-np 2 --max-np 4 --timeout 240 --grace 3 "
      "--host-discovery-script 'cat {}' /usr/bin/python3 tests/python/test_torch_elastic_grow.py "
      "'{}'",
      source_dir(), built_program("src/kolorun"), scratch.path("hosts"), arguments);
  Process job(kCluster.exec(kCluster.hosts, command),
              {{"KOLO_SECRET", kSecret},
               {"KOLO_TIMEOUT", "20"},
               {"KOLO_LIBRARY", built_program("capi/libkolo.so")},
               {"PYTHONPATH", source_dir() + "/python"},
               {"OMP_NUM_THREADS", "1"}});
  ProcessResult result = job.wait(270);
  INFO(result.output);
  REQUIRE(result.exit_code == 0);
  CHECK(std::filesystem::exists(scratch.path("kill")));
  std::regex digest(R"(elastic grow: (\S+) rank (\d+) of (\d+): parameters sha256 ([0-9a-f]{64}))");
  std::map<int, std::string> by_rank;
  std::set<std::string> slots;
  for (std::sregex_iterator it(result.output.begin(), result.output.end(), digest), end; it != end;
       ++it) {
    CHECK((*it)[3] == "4");
    by_rank[std::stoi((*it)[2])] = (*it)[4];
    slots.insert((*it)[1]);
  }
  CHECK(by_rank.size() == 4);
  CHECK(slots == std::set<std::string>{kCluster.host(1) + ":0", kCluster.host(1) + ":1",
                                       kCluster.host(2) + ":0", kCluster.host(2) + ":1"});
  for (const auto& [rank, hex] : by_rank) CHECK(hex == by_rank.begin()->second);
  CHECK(count(result.output, "Traceback") == 0);

  // The same parameters as a replay of the recorded schedule of world sizes, without kolo.
  std::string names =
      fmt::format(R"(["{0}:0", "{0}:1", "{1}:0", "{1}:1"])", kCluster.host(1), kCluster.host(2));
  Process replay({"/usr/bin/python3", source_dir() + "/tests/python/test_torch_elastic_grow.py",
                  fmt::format(R"({{"replay": "{}", "names": {}}})", scratch.dir.string(), names)},
                 {{"OMP_NUM_THREADS", "1"}});
  ProcessResult replayed = replay.wait(120);
  INFO(replayed.output);
  CHECK(replayed.exit_code == 0);
  CHECK_THAT(replayed.output, Contains("max |job - replay| = "));
}

// examples/several-hosts/kolorun-elastic.sh exactly as docs/elastic.md prints it, run on host 4
// with a hosts file naming h1:2; once the first epoch has run on 2 ranks the test adds h2:2, and a
// later epoch runs on 4 ranks; the job ends with its test accuracy, exit status 0.
TEST_CASE("the example job script grows across hosts", "[cluster][elastic_example]") {
  if (std::system("/usr/bin/python3 -c 'import torch' 2>/dev/null") != 0) {
    WARN("Debian's python3 cannot import torch (python3-torch): the example is not run");
    return;
  }
  SshCluster cluster(kCluster);
  Scratch scratch;
  scratch.hosts(fmt::format("{}:2\n", kCluster.host(1)));
  Process job(
      kCluster.exec(kCluster.hosts,
                    fmt::format("cd '{}' && exec sh examples/several-hosts/kolorun-elastic.sh '{}'",
                                source_dir(), scratch.path("hosts"))),
      {{"OMP_NUM_THREADS", "1"}});
  wait_for_count(job, "epoch 0: 2 ranks", 1, 120);
  scratch.hosts(fmt::format("{}:2\n{}:2\n", kCluster.host(1), kCluster.host(2)));
  ProcessResult result = job.wait(240);
  INFO(result.output);
  CHECK(result.exit_code == 0);
  std::regex epoch(R"(epoch \d+: (\d+) ranks)");
  std::vector<int> sizes;
  for (std::sregex_iterator it(result.output.begin(), result.output.end(), epoch), end; it != end;
       ++it) {
    sizes.push_back(std::stoi((*it)[1]));
  }
  REQUIRE(!sizes.empty());
  CHECK(sizes.front() == 2);
  CHECK(sizes.back() == 4);
  CHECK(std::is_sorted(sizes.begin(), sizes.end()));
  CHECK_THAT(result.output, Contains("Test set: Average loss"));
}

int main(int argc, char** argv) {
  if (kolo::test::cluster_unavailable({kolo::test::kNeedsSshd})) return kolo::test::kSkipped;
  return Catch::Session().run(argc, argv);
}
