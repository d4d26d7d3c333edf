// torchrun across hosts, as its users start it: on a simulated cluster (scripts/cluster.sh) every
// host runs examples/several-hosts/torchrun-node.sh, the script docs/several-hosts.md prints,
// which starts Debian's torchrun (torch 1.13) with the c10d rendezvous. Nothing of kolo's is set:
// the job secret comes from a KOLO_SECRET_FILE on the file system the hosts share, and kolo finds
// its rank, its peers and its store from what torchrun exports (MASTER_ADDR is the host of the
// agent that got group rank 0, where rank 0 runs; nothing serves MASTER_PORT under c10d).
//
// Each job is judged from what the programs print, not from kolo's logs: the two training
// examples print a digest of their final parameters on every rank (all must agree, and every host
// must have run its ranks), all_reduce_perf checks every element itself. A node whose torchrun
// dies mid-job (its agent and ranks killed at once, or its agent stopped with SIGTERM) must be
// reported by every rank on the other hosts, naming a lost rank of that node, within seconds.
// Needs root and network namespaces; without them the program says why and exits 77 (skipped).
#define CATCH_CONFIG_RUNNER
#include <fmt/format.h>
#include <signal.h>
#include <sys/stat.h>
#include <unistd.h>

#include <catch2/catch.hpp>
#include <chrono>
#include <cstdlib>
#include <ctime>
#include <filesystem>
#include <fstream>
#include <map>
#include <regex>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "cluster.hpp"
#include "process.hpp"

extern char** environ;

using namespace kolo::test;

namespace {

// A name and a subnet of this test's own, so that it can run beside the other cluster tests.
const char* kClusterName = "kolotr";
const char* kSubnet = "10.46.0";
const char* kRendezvousPort = "29400";
// A survivor's report, and its exit, seen by its agent (which polls every 5 s).
constexpr std::chrono::seconds kReportWithin{15};

int run_script(const std::string& arguments) {
  return run_cluster_script(arguments, kSubnet);
}

// The hosts of one test, taken down again whatever happens.
struct Cluster {
  int hosts;
  explicit Cluster(int host_count) : hosts(host_count) {
    REQUIRE(run_script(fmt::format("up {} {}", kClusterName, hosts)) == 0);
  }
  ~Cluster() { run_script(fmt::format("down {}", kClusterName)); }
  Cluster(const Cluster&) = delete;
  Cluster& operator=(const Cluster&) = delete;
};

// The job secret as a user keeps it: a file readable by its owner only, on the shared file system.
struct SecretFile {
  std::filesystem::path folder;
  std::string path;
  SecretFile() {
    char name[] = "/tmp/kolo-torchrun-XXXXXX";
    REQUIRE(::mkdtemp(name) != nullptr);
    folder = name;
    path = (folder / "secret").string();
    std::ofstream(path) << "torchrun-hosts-" << ::getpid() << "-" << std::time(nullptr) << "\n";
    REQUIRE(::chmod(path.c_str(), 0600) == 0);
  }
  ~SecretFile() {
    std::error_code ignored;
    std::filesystem::remove_all(folder, ignored);
  }
};

struct Shape {
  int hosts;
  int per_host;
  int rendezvous_host;  // the host named in --rdzv_endpoint
};

// Starts torchrun-node.sh on every host, with what the page tells the user to set, and `program`
// (the script's arguments). The environment is the test's with every KOLO_* variable emptied
// (kolo reads an empty one as unset), so that nothing of kolo's but the secret file is given.
std::vector<Process> start_nodes(const Cluster& cluster, const Shape& shape,
                                 const std::string& job_id, const SecretFile& secret,
                                 const std::vector<std::string>& program) {
  std::map<std::string, std::string> env = {
      {"NNODES", std::to_string(cluster.hosts)},
      {"NPROC_PER_NODE", std::to_string(shape.per_host)},
      {"RDZV_HOST", fmt::format("{}{}", kClusterName, shape.rendezvous_host)},
      {"RDZV_PORT", kRendezvousPort},
      {"JOB_ID", job_id},
      {"KOLO_SECRET_FILE", secret.path},
      {"PYTHONPATH", source_dir() + "/python"},  // the checkout's kolo package, not installed
  };
  for (char** entry = environ; *entry != nullptr; ++entry) {
    std::string text = *entry;
    if (text.rfind("KOLO_", 0) == 0 && text.rfind("KOLO_SECRET_FILE=", 0) != 0) {
      env[text.substr(0, text.find('='))] = "";
    }
  }
  const std::string script = source_dir() + "/examples/several-hosts/torchrun-node.sh";
  std::vector<Process> nodes;
  for (int host = 1; host <= cluster.hosts; ++host) {
    std::vector<std::string> argv = {
        "/bin/sh", cluster_script(), "exec", kClusterName, std::to_string(host), "/bin/sh", script};
    argv.insert(argv.end(), program.begin(), program.end());
    nodes.emplace_back(argv, env);
  }
  return nodes;
}

// Every node's torchrun, waited for; each must end well.
std::vector<std::string> expect_nodes_succeed(std::vector<Process>& nodes, double timeout_s) {
  std::vector<std::string> outputs;
  for (size_t node = 0; node < nodes.size(); ++node) {
    ProcessResult result = nodes[node].wait(timeout_s);
    INFO("host " << node + 1 << " output:\n" << result.output);
    CHECK_FALSE(result.timed_out);
    CHECK(result.exit_code == 0);
    outputs.push_back(result.output);
  }
  return outputs;
}

// Lines "rank R: ..." that torchrun relays ("[default0]:rank 3: ..."), in a host's output: for
// each rank, what the one group of `pattern` matched.
std::map<int, std::string> rank_lines(const std::string& output, const std::string& pattern) {
  const std::regex line_pattern("rank (\\d+): " + pattern);
  std::map<int, std::string> found;
  for (auto it = std::sregex_iterator(output.begin(), output.end(), line_pattern);
       it != std::sregex_iterator(); ++it) {
    found[std::stoi((*it)[1])] = (*it)[2].str();
  }
  return found;
}

// A training example: every rank of every host printed the same parameters' digest. Returns the
// host (1-based) on which rank 0 ran.
int expect_same_parameters(const Shape& shape, const std::vector<std::string>& outputs) {
  const int size = shape.hosts * shape.per_host;
  std::map<int, std::string> digests;
  int rank0_host = 0;
  for (size_t host = 0; host < outputs.size(); ++host) {
    auto here = rank_lines(outputs[host], "parameters sha256 ([0-9a-f]{64})");
    INFO("host " << host + 1 << " output:\n" << outputs[host]);
    CHECK(static_cast<int>(here.size()) == shape.per_host);  // its own ranks ran on every host
    for (const auto& [rank, digest] : here) {
      CHECK(digests.count(rank) == 0);  // and each rank ran once
      digests[rank] = digest;
      if (rank == 0) rank0_host = static_cast<int>(host) + 1;
    }
  }
  REQUIRE(static_cast<int>(digests.size()) == size);
  CHECK(digests.begin()->first == 0);
  CHECK(digests.rbegin()->first == size - 1);
  for (const auto& [rank, digest] : digests) {
    INFO("rank " << rank);
    CHECK(digest == digests.at(0));
  }
  return rank0_host;
}

// all_reduce_perf: rank 0's table says every element was right, and lists every rank on its
// host, per_host ranks on each.
void expect_all_reduce_perf_passed(const Shape& shape, const std::vector<std::string>& outputs) {
  std::string all;
  for (const auto& output : outputs) all += output;
  INFO("output of every host:\n" << all);
  CHECK(contains(all, "# Out of bounds values : 0 OK"));
  const std::regex device(R"(#\s+Rank\s+(\d+) Group\s+\d+ Pid\s+\d+ on\s+(\S+) device)");
  std::map<int, std::string> host_of;
  for (auto it = std::sregex_iterator(all.begin(), all.end(), device); it != std::sregex_iterator();
       ++it) {
    host_of[std::stoi((*it)[1])] = (*it)[2];
  }
  CHECK(static_cast<int>(host_of.size()) == shape.hosts * shape.per_host);
  std::map<std::string, int> ranks_on;
  for (const auto& [rank, host] : host_of) ++ranks_on[host];
  for (int host = 1; host <= shape.hosts; ++host) {
    CHECK(ranks_on[fmt::format("{}{}", kClusterName, host)] == shape.per_host);
  }
}

std::string job_id(const std::string& what) {
  return fmt::format("{}-{}-{}", what, ::getpid(), std::time(nullptr));
}

}  // namespace

TEST_CASE("torchrun on every host: DDP on kolo, kolo.torch and all_reduce_perf", "[torchrun]") {
  // 4 x 2 names the third host as the rendezvous: rank 0 lands elsewhere (on the host whose name
  // sorts first), where kolo's store must then be.
  for (const Shape& shape : {Shape{2, 2, 1}, Shape{4, 2, 3}}) {
    DYNAMIC_SECTION(shape.hosts << " hosts x " << shape.per_host << " ranks, rendezvous on host "
                                << shape.rendezvous_host) {
      Cluster cluster(shape.hosts);
      SecretFile secret;
      const std::string examples = source_dir() + "/examples/";
      {
        INFO("examples/ddp_digits.py (DistributedDataParallel on the \"kolo\" backend)");
        auto nodes = start_nodes(cluster, shape, job_id("ddp"), secret,
                                 {examples + "ddp_digits.py", "--epochs", "2"});
        const int rank0_host = expect_same_parameters(shape, expect_nodes_succeed(nodes, 180));
        if (shape.rendezvous_host != 1) CHECK(rank0_host != shape.rendezvous_host);
      }
      {
        INFO("examples/pytorch_digits.py (kolo.torch)");
        auto nodes = start_nodes(cluster, shape, job_id("hvd"), secret,
                                 {examples + "pytorch_digits.py", "--epochs", "2"});
        expect_same_parameters(shape, expect_nodes_succeed(nodes, 180));
      }
      {
        INFO("all_reduce_perf -c 1 (torchrun --no_python)");
        auto nodes = start_nodes(cluster, shape, job_id("perf"), secret,
                                 {"--no_python", built_program("bench/all_reduce_perf"), "-c", "1",
                                  "-b", "8", "-e", "1M", "-f", "4"});
        expect_all_reduce_perf_passed(shape, expect_nodes_succeed(nodes, 120));
      }
    }
  }
}

TEST_CASE("a node whose torchrun dies is reported by every rank on the other hosts", "[torchrun]") {
  struct Case {
    const char* what;
    int victim_host;
    bool whole_node;  // SIGKILL to the agent and its ranks, else SIGTERM to the agent alone
  };
  const Shape shape{3, 2, 1};
  for (const Case& c :
       {Case{"the last host's agent and ranks killed", 3, true},
        Case{"the rendezvous host's agent (rank 0's) stopped with SIGTERM", 1, false}}) {
    DYNAMIC_SECTION(c.what) {
      Cluster cluster(shape.hosts);
      SecretFile secret;
      auto nodes =
          start_nodes(cluster, shape, job_id("lost"), secret,
                      {"--no_python", built_program("tests/kolo_test_worker"), "loop", "60"});
      // Which ranks each host runs, from their "rank R: looping" (up to 60 s: the ranks start
      // only once every node has joined the rendezvous).
      std::vector<std::map<int, std::string>> looping(nodes.size());
      for (int attempt = 0; attempt < 600; ++attempt) {
        bool all = true;
        for (size_t host = 0; host < nodes.size(); ++host) {
          looping[host] = rank_lines(nodes[host].output_so_far(), "(looping)");
          all = all && static_cast<int>(looping[host].size()) == shape.per_host;
        }
        if (all) break;
        std::this_thread::sleep_for(std::chrono::milliseconds(100));
      }
      for (size_t host = 0; host < nodes.size(); ++host) {
        INFO("host " << host + 1 << " output so far:\n" << nodes[host].output_so_far());
        REQUIRE(static_cast<int>(looping[host].size()) == shape.per_host);
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(500));
      Process& victim = nodes[c.victim_host - 1];
      const auto killed_at = std::chrono::steady_clock::now();
      if (c.whole_node) {
        victim.kill(SIGKILL);  // the process group: the agent and the ranks it started
      } else {
        REQUIRE(::kill(victim.pid(), SIGTERM) == 0);  // cluster.sh execs into torchrun
      }
      std::set<int> lost;
      for (const auto& [rank, text] : looping[c.victim_host - 1]) lost.insert(rank);
      // Every rank on the other hosts reports the loss and ends, which its agent logs. The agents
      // themselves then wait in torch's exit barrier for the lost one (torch 1.13: up to 300 s,
      // not settable from torchrun's command line), which is torch's: the test stops them then.
      auto reported = [&](int host) {
        const std::string output = nodes[host - 1].output_so_far();
        auto reports = rank_lines(output, "status (KOLO_ERR_PEER_LOST.*)");
        for (const auto& [rank, text] : looping[host - 1]) {
          if (reports.count(rank) == 0) return false;
        }
        return contains(output, "(exitcode: 3)");
      };
      bool all_reported = false;
      while (!all_reported && std::chrono::steady_clock::now() - killed_at < kReportWithin) {
        std::this_thread::sleep_for(std::chrono::milliseconds(100));
        all_reported = true;
        for (int host = 1; host <= shape.hosts; ++host) {
          all_reported = all_reported && (host == c.victim_host || reported(host));
        }
      }
      for (int host = 1; host <= shape.hosts; ++host) {
        if (host == c.victim_host) continue;
        const std::string output = nodes[host - 1].output_so_far();
        INFO("host " << host << " output:\n" << output);
        CHECK(reported(host));
        auto reports = rank_lines(output, "status (KOLO_ERR_PEER_LOST.*)");
        for (const auto& [rank, text] : looping[host - 1]) {
          INFO("rank " << rank);
          REQUIRE(reports.count(rank) == 1);
          std::smatch named;
          REQUIRE(std::regex_search(reports[rank], named, std::regex(R"(lost rank (\d+))")));
          CHECK(lost.count(std::stoi(named[1])) == 1);
          std::smatch after;
          REQUIRE(std::regex_search(reports[rank], after,
                                    std::regex(R"(after ([0-9.]+) s since last success)")));
          CHECK(std::stod(after[1]) < 10.0);
        }
      }
    }
  }
}

int main(int argc, char** argv) {
  if (kolo::test::cluster_unavailable(
          {{"test -x /usr/bin/torchrun", "Debian's torchrun (python3-torch) is not installed"},
           {"/usr/bin/python3 -c 'import sklearn' >/dev/null 2>&1",
            "the examples need python3-sklearn, which is not installed"}}))
    return kolo::test::kSkipped;
  return Catch::Session().run(argc, argv);
}
