// Open MPI's mpirun across hosts of the simulated cluster (scripts/cluster.sh), started as users
// start it: an sshd on every host, the job script examples/several-hosts/mpirun.sh exactly as
// docs/several-hosts.md prints it, run on host 1, and nothing of kolo's set by hand except the
// job secret's file. Rank 0's store address reaches the ranks through mpirun's PMIx server. The
// programs check their own results: all_reduce_perf -c 1 ("Out of bounds values : 0 OK"), the
// collectives checks, and a 2-epoch kolo.torch training whose parameters must end identical on
// every rank. Then a rank killed mid-job: the survivors name it. Needs root, network namespaces,
// mpirun and sshd; without them the program says why and exits 77 (skipped).
#define CATCH_CONFIG_RUNNER
#include <fmt/format.h>
#include <signal.h>
#include <sys/stat.h>
#include <unistd.h>

#include <catch2/catch.hpp>
#include <chrono>
#include <cstdlib>
#include <fstream>
#include <map>
#include <regex>
#include <set>
#include <sstream>
#include <string>
#include <vector>

#include "cluster.hpp"
#include "process.hpp"

using namespace kolo::test;

namespace {

// A name and subnets of this test's own, so that it may run beside the other cluster tests.
const char* kClusterName = "kolompi";
const std::map<std::string, std::string> kClusterEnv = {{"CLUSTER_SUBNET", "10.81.0"},
                                                        {"CLUSTER_SUBNET6", "fd81"}};

int run_script(const std::string& arguments) {
  return run_cluster_script(arguments, kClusterEnv.at("CLUSTER_SUBNET"),
                            kClusterEnv.at("CLUSTER_SUBNET6"));
}

// The hosts of one test with an sshd on each, taken down again whatever happens; a job secret in
// a file only its owner can read, on the file system every host shares.
struct Cluster {
  int hosts;
  std::string secret_file;
  explicit Cluster(int host_count) : hosts(host_count) {
    REQUIRE(run_script(fmt::format("up {} {}", kClusterName, hosts)) == 0);
    REQUIRE(run_script(fmt::format("sshd {}", kClusterName)) == 0);
    secret_file = fmt::format("/run/kolo-cluster/{}/job.secret", kClusterName);
    std::ofstream(secret_file) << "mpirun-test-secret-" << ::getpid() << "-0123456789abcdef\n";
    REQUIRE(::chmod(secret_file.c_str(), 0600) == 0);
  }
  ~Cluster() { run_script(fmt::format("down {}", kClusterName)); }
  Cluster(const Cluster&) = delete;
  Cluster& operator=(const Cluster&) = delete;

  // "kolompi1:2,kolompi2:2,..."
  std::string host_list(int per_host) const {
    std::string list;
    for (int host = 1; host <= hosts; ++host) {
      list += fmt::format("{}{}{}:{}", host > 1 ? "," : "", kClusterName, host, per_host);
    }
    return list;
  }

  // The job script on host 1, as a user runs it there. KOLO_DEBUG=INFO reaches the ranks on host
  // 1 only (mpirun forwards no variable to other hosts unless told): rank 0 says what it chose.
  Process start(int per_host, const std::vector<std::string>& program) const {
    // mpirun hands its own environment to the ranks on host 1 only: a setting of the test's
    // environment (meson's KOLO_TRANSPORT=tcp) would make those ranks differ from the others.
    std::vector<std::string> argv = {
        "/usr/bin/env",     "-u",
        "KOLO_TRANSPORT",   "/bin/sh",
        cluster_script(),   "exec",
        kClusterName,       "1",
        "/bin/sh",          source_dir() + "/examples/several-hosts/mpirun.sh",
        host_list(per_host)};
    argv.insert(argv.end(), program.begin(), program.end());
    std::map<std::string, std::string> env = kClusterEnv;
    env.insert({{"KOLO_SECRET_FILE", secret_file},
                {"KOLO_DEBUG", "INFO"},
                {"KOLO_TIMEOUT", "60"},
                // Only because the test runs as root; users are not.
                {"OMPI_ALLOW_RUN_AS_ROOT", "1"},
                {"OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1"}});
    return Process(argv, env);
  }
};

// What every job's rank 0 says: all ranks on every host, rendezvous through PMIx, a secret set,
// and no address asked for.
void expect_pmix_job(const ProcessResult& result, int hosts, int per_host) {
  CHECK_FALSE(result.timed_out);
  CHECK(result.exit_code == 0);
  CHECK(contains(result.output, fmt::format("{} rank(s) on {} node(s)", hosts * per_host, hosts)));
  CHECK(contains(result.output, "started by ompi, rendezvous through PMIx"));
  CHECK_FALSE(contains(result.output, "no job secret"));
  CHECK_FALSE(contains(result.output, "no rendezvous address"));
}

}  // namespace

TEST_CASE("mpirun over ssh with nothing of kolo's set", "[cluster][mpirun]") {
  const std::string build = build_dir();
  for (int hosts : {2, 4}) {
    const int per_host = 2;
    const int size = hosts * per_host;
    DYNAMIC_SECTION(hosts << " hosts x " << per_host << " ranks") {
      Cluster cluster(hosts);
      {
        INFO("all_reduce_perf -c 1");
        ProcessResult result = cluster
                                   .start(per_host, {build + "/bench/all_reduce_perf", "-b", "8",
                                                     "-e", "4M", "-f", "8", "-c", "1"})
                                   .wait(120);
        INFO(result.output);
        expect_pmix_job(result, hosts, per_host);
        CHECK(contains(result.output, "# Out of bounds values : 0 OK"));
        // all_reduce_perf's header names the host of every rank: block placement, per_host each.
        for (int rank = 0; rank < size; ++rank) {
          CHECK(std::regex_search(
              result.output, std::regex(fmt::format(R"(Rank +{} Group +0 Pid +\d+ on +{}{} )", rank,
                                                    kClusterName, rank / per_host + 1))));
        }
      }
      for (const char* scenario : {"allreduce", "broadcast", "barrier"}) {
        INFO("kolo_test_worker " << scenario);
        ProcessResult result =
            cluster.start(per_host, {build + "/tests/kolo_test_worker", scenario, "quick"})
                .wait(120);
        INFO(result.output);
        expect_pmix_job(result, hosts, per_host);
        CHECK(count(result.output, fmt::format("{} checks passed", scenario)) ==
              static_cast<size_t>(size));
      }
      {
        INFO("examples/pytorch_digits.py --epochs 2");
        ProcessResult result =
            cluster
                .start(per_host, {"/usr/bin/env", "PYTHONPATH=" + source_dir() + "/python",
                                  "KOLO_LIBRARY=" + build + "/capi/libkolo.so", "/usr/bin/python3",
                                  source_dir() + "/examples/pytorch_digits.py", "--epochs", "2"})
                .wait(180);
        INFO(result.output);
        expect_pmix_job(result, hosts, per_host);
        std::map<int, std::string> digests;
        const std::regex digest(R"(rank (\d+): parameters sha256 ([0-9a-f]{64}))");
        for (std::sregex_iterator match(result.output.begin(), result.output.end(), digest), end;
             match != end; ++match) {
          digests[std::stoi((*match)[1])] = (*match)[2];
        }
        REQUIRE(digests.size() == static_cast<size_t>(size));
        for (const auto& [rank, hex] : digests) {
          INFO("rank " << rank);
          CHECK(hex == digests.at(0));
        }
      }
    }
  }
}

TEST_CASE("mpirun over ssh: a rank killed mid-job is named by every survivor",
          "[cluster][mpirun]") {
  Cluster cluster(2);
  const int victim = 3;  // on host 2, which mpirun reaches over ssh
  Process job = cluster.start(2, {build_dir() + "/tests/kolo_test_worker", "loop", "60"});
  job.wait_for_output("looping", 4, std::chrono::seconds(30), std::chrono::milliseconds(50));
  REQUIRE(count(job.output_so_far(), "looping") == 4);
  // The victim's process on host 2: the worker whose environment says it is rank 3.
  Process finder({"/bin/sh", "-c",
                  fmt::format("for pid in $(ip netns pids {}2); do "
                              "tr '\\0' '\\n' </proc/$pid/environ 2>/dev/null | "
                              "grep -qx OMPI_COMM_WORLD_RANK={} && "
                              "grep -q kolo_test_worker /proc/$pid/cmdline && echo $pid; done",
                              kClusterName, victim)},
                 {});
  const std::string pid_text = finder.wait(30).output;
  INFO("the process of rank " << victim << ": " << pid_text);
  std::istringstream pids(pid_text);
  pid_t pid = 0;
  REQUIRE(pids >> pid);
  const auto killed_at = std::chrono::steady_clock::now();
  REQUIRE(::kill(pid, SIGKILL) == 0);
  ProcessResult result = job.wait(60);
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - killed_at).count();
  INFO(result.output);
  CHECK_FALSE(result.timed_out);
  CHECK(result.exit_code != 0);
  // A survivor learns of the loss from whichever of its connections to the victim notices first:
  // the control connection closed without a goodbye or reset, a data connection's send (EPIPE) or
  // receive (ECONNRESET). Whichever it is, the status is KOLO_ERR_PEER_LOST and the victim named.
  for (int survivor = 0; survivor < 4; ++survivor) {
    if (survivor == victim) continue;
    CHECK(std::regex_search(
        result.output,
        std::regex(fmt::format("rank {}: status KOLO_ERR_PEER_LOST: .* lost rank {}: (its "
                               "connection (closed without a goodbye|failed)|sending to it "
                               "failed|receiving failed)",
                               survivor, victim))));
  }
  // mpirun then ends the job and says why: the first process it saw end, either the victim
  // ("exited on signal 9") or a survivor that returned its error first ("non-zero status").
  CHECK((contains(result.output, fmt::format("process rank {} with PID {}", victim, pid)) ||
         contains(result.output,
                  "mpirun detected that one or more processes exited with "
                  "non-zero status")));
  CHECK(seconds < 20);
}

int main(int argc, char** argv) {
  if (kolo::test::cluster_unavailable(
          {{"command -v mpirun >/dev/null && test -x /usr/sbin/sshd",
            "mpirun (openmpi-bin) or /usr/sbin/sshd (openssh-server) is not installed"}}))
    return kolo::test::kSkipped;
  return Catch::Session().run(argc, argv);
}
