// kolorun -H and --hostfile on a simulated cluster (scripts/cluster.sh) with an sshd on every host,
// started from host 1 as a user starts it: ranks on every host, the collectives and a training run
// correct, the example job script run as docs/several-hosts.md prints it, the job secret on no
// command line, signals ending every rank on every host, and a host that cannot be reached or a
// program that is missing reported by host and rank. Needs root and network namespaces; without
// them the program says why and exits 77 (skipped).
#define CATCH_CONFIG_RUNNER
#include <fmt/format.h>
#include <signal.h>
#include <unistd.h>

#include <catch2/catch.hpp>
#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>
#include <regex>
#include <set>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "cluster.hpp"
#include "process.hpp"

using namespace kolo::test;
using Catch::Matchers::Contains;
using Clock = std::chrono::steady_clock;

namespace {

// A name and a subnet of this test's own, so that it can run beside the other cluster tests.
const ClusterId kCluster{"kolokr", "10.48.0", "fd48", 4};
// The job secret, given to kolorun as a user may; it must reach every rank and no command line.
const char* kSecret = "kolorun-hosts-test-secret-5f1c0a9e";

// A shell command run on host 1 from the checkout's root, where a user runs kolorun.
Process on_host_one(const std::string& command, std::map<std::string, std::string> env = {}) {
  env.emplace("KOLO_SECRET", kSecret);
  env.emplace("PYTHONPATH", source_dir() + "/python");
  return Process(kCluster.exec(1, fmt::format("cd '{}' && exec {}", source_dir(), command)), env);
}

std::string kolorun() {
  return built_program("src/kolorun");
}

std::string host_list(int hosts, int per_host) {
  std::string list;
  for (int host = 1; host <= hosts; ++host) {
    list += fmt::format("{}{}:{}", list.empty() ? "" : ",", kCluster.host(host), per_host);
  }
  return list;
}

// A hostfile in mpirun's words ("host slots=N") with a comment, on the shared file system.
std::string write_hostfile(int hosts, int per_host) {
  std::string path = fmt::format("/tmp/kolorun-hosts-{}-{}x{}", ::getpid(), hosts, per_host);
  std::ofstream file(path);
  file << "# written by test_kolorun_hosts\n";
  for (int host = 1; host <= hosts; ++host) {
    file << kCluster.host(host) << " slots=" << per_host << "  # host " << host << "\n";
  }
  return path;
}

std::string read_file(const std::filesystem::path& path) {
  std::ifstream file(path, std::ios::binary);
  std::ostringstream text;
  text << file.rdbuf();
  return text.str();
}

// Command lines (NULs as spaces) of every process on the machine; the hosts share one pid space.
std::vector<std::pair<int, std::string>> command_lines() {
  std::vector<std::pair<int, std::string>> lines;
  std::error_code error;
  for (const auto& entry : std::filesystem::directory_iterator("/proc", error)) {
    std::string name = entry.path().filename().string();
    if (name.find_first_not_of("0123456789") != std::string::npos) continue;
    std::string line = read_file(entry.path() / "cmdline");
    std::replace(line.begin(), line.end(), '\0', ' ');
    lines.emplace_back(std::stoi(name), line);
  }
  return lines;
}

// The processes left on the hosts besides their sshd listeners ("pid comm" each), after waiting
// up to `seconds` for them to go.
std::vector<std::string> left_on_hosts(double seconds) {
  Clock::time_point give_up = Clock::now() + std::chrono::duration_cast<Clock::duration>(
                                                 std::chrono::duration<double>(seconds));
  for (;;) {
    std::vector<std::string> left;
    for (int host = 1; host <= kCluster.hosts; ++host) {
      FILE* pids =
          ::popen(fmt::format("ip netns pids {} 2>/dev/null", kCluster.host(host)).c_str(), "r");
      for (long pid; pids && std::fscanf(pids, "%ld", &pid) == 1;) {
        std::string comm = read_file(fmt::format("/proc/{}/comm", pid));
        std::string command = read_file(fmt::format("/proc/{}/cmdline", pid));
        if (comm.empty() || (comm == "sshd\n" && command.find("-f") != std::string::npos)) continue;
        left.push_back(fmt::format("{} on {}: {}", pid, kCluster.host(host), comm));
      }
      if (pids) ::pclose(pids);
    }
    if (left.empty() || Clock::now() > give_up) return left;
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
}

// Not gone and not a zombie.
bool still_running(pid_t pid) {
  std::string stat = read_file(fmt::format("/proc/{}/stat", pid));
  size_t state = stat.rfind(')');
  return state != std::string::npos && state + 2 < stat.size() && stat[state + 2] != 'Z';
}

// Waits for `count` lines holding `marker` in the output of a running process (30 s at most).
bool output_appears(const Process& process, size_t count, const std::string& marker) {
  return process.wait_for_output(marker, count, std::chrono::seconds(30),
                                 std::chrono::milliseconds(50));
}

// Every rank's "rank R: parameters sha256 HEX" line, tagged "[R@host] ", all equal, R on its host.
void expect_same_parameters(const std::string& output, int ranks, int per_host) {
  std::regex digest(R"(\[(\d+)@(\S+)\] rank (\d+): parameters sha256 ([0-9a-f]{64}))");
  std::set<std::string> digests;
  std::set<int> seen;
  for (std::sregex_iterator it(output.begin(), output.end(), digest), end; it != end; ++it) {
    int rank = std::stoi((*it)[1]);
    CHECK((*it)[1] == (*it)[3]);
    CHECK((*it)[2] == kCluster.host(rank / per_host + 1));
    seen.insert(rank);
    digests.insert((*it)[4]);
  }
  CHECK(static_cast<int>(seen.size()) == ranks);
  CHECK(digests.size() == 1);
}

}  // namespace

TEST_CASE("kolorun -H and --hostfile start ranks over ssh on every host", "[cluster][kolorun]") {
  SshCluster cluster(kCluster);

  // Block placement and the variables of every rank, each rank on its own host.
  {
    Process job = on_host_one(
        kolorun() + " -np 7 -H " + host_list(4, 2) +
        " --tag-output /bin/sh -c 'echo host=$(hostname) rank=$KOLO_RANK size=$KOLO_SIZE "
        "local=$KOLO_LOCAL_RANK/$KOLO_LOCAL_SIZE secret=$KOLO_SECRET pwd=$PWD'");
    ProcessResult result = job.wait(60);
    INFO("output:\n" << result.output);
    REQUIRE(result.exit_code == 0);
    for (int rank = 0; rank < 7; ++rank) {
      int host = rank / 2 + 1;
      CHECK_THAT(result.output,
                 Contains(fmt::format("[{}@{}] host={} rank={} size=7 local={}/{} secret={} pwd={}",
                                      rank, kCluster.host(host), kCluster.host(host), rank,
                                      rank % 2, host == 4 ? 1 : 2, kSecret,
                                      std::filesystem::canonical(source_dir()).string())));
    }
  }

  // The example job script exactly as the page prints it (all_reduce_perf, then two epochs of
  // training), on four hosts; meanwhile, no command line on any host holds the secret.
  {
    Process job = on_host_one(fmt::format("sh examples/several-hosts/kolorun.sh {} {} {} {}",
                                          kCluster.host(1), kCluster.host(2), kCluster.host(3),
                                          kCluster.host(4)));
    std::set<std::string> holders;
    int scans = 0;
    for (Clock::time_point start = Clock::now();
         still_running(job.pid()) && Clock::now() - start < std::chrono::seconds(240) &&
         job.output_so_far().find("parameters sha256") == std::string::npos;
         ++scans) {
      for (const auto& [pid, line] : command_lines()) {
        if (line.find(kSecret) != std::string::npos)
          holders.insert(fmt::format("{}: {}", pid, line));
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(100));
    }
    ProcessResult result = job.wait(240);
    INFO("output:\n" << result.output);
    CHECK(result.exit_code == 0);
    CHECK(count(result.output, "# Out of bounds values : 0 OK") == 1);
    expect_same_parameters(result.output, 8, 2);
    CHECK(scans > 5);
    CHECK(holders.empty());
    for (const std::string& holder : holders) UNSCOPED_INFO("secret on a command line: " << holder);
  }
}

TEST_CASE("kolorun runs the collectives checks, all_reduce_perf and training at 2x2 and 4x2",
          "[cluster][kolorun]") {
  SshCluster cluster(kCluster);
  struct Check {
    std::string program;
    std::string marker;
    int per_rank;  // lines with the marker: one per rank, or one for the job
  };
  const std::string worker = built_program("tests/kolo_test_worker");
  const std::vector<Check> checks = {
      {worker + " allreduce quick", "allreduce checks passed", 1},
      {worker + " broadcast", "broadcast checks passed", 1},
      {worker + " barrier", "barrier checks passed", 1},
      {built_program("bench/all_reduce_perf") + " -b 8 -e 64K -f 8 -c 1",
       "# Out of bounds values : 0 OK", 0}};
  for (int hosts : {2, 4}) {
    const std::string hostfile = write_hostfile(hosts, 2);
    for (const Check& check : checks) {
      // 2x2 from the hostfile, 4x2 from -H: both ways of naming hosts, both shapes.
      std::string where = hosts == 2 ? "--hostfile " + hostfile : "-H " + host_list(4, 2);
      Process job = on_host_one(fmt::format("{} {} {}", kolorun(), where, check.program),
                                {{"KOLO_DEBUG", "INFO"}});
      ProcessResult result = job.wait(120);
      INFO(hosts << " hosts x 2 ranks: " << check.program << "\noutput:\n" << result.output);
      CHECK(result.exit_code == 0);
      const size_t markers = check.per_rank ? 2 * hosts : 1;
      CHECK(count(result.output, check.marker) == markers);
      // every rank saw every host: kolo counted them from where the ranks really run
      CHECK(count(result.output, fmt::format("{} node(s)", hosts)) >= 2u * hosts);
    }
    if (hosts == 2) {  // training from the hostfile too (the example script trains at 4x2 from -H)
      Process job = on_host_one(fmt::format(
          "{} --hostfile {} --tag-output /usr/bin/python3 examples/pytorch_digits.py --epochs 2",
          kolorun(), hostfile));
      ProcessResult result = job.wait(180);
      INFO("2 hosts x 2 ranks: pytorch_digits\noutput:\n" << result.output);
      CHECK(result.exit_code == 0);
      expect_same_parameters(result.output, 4, 2);
    }
    std::filesystem::remove(hostfile);
  }
}

TEST_CASE("kolorun across hosts: a missing program, an unreachable host, signals",
          "[cluster][kolorun]") {
  SshCluster cluster(kCluster);
  const std::string marker = "sleep 3001";  // the ranks' command, to find what is left of them

  // A program missing on the remote hosts (rank 0 among them): each named with its host, 127.
  {
    Process job = on_host_one(kolorun() + " -H " + kCluster.host(2) + ":2," + kCluster.host(3) +
                              ":2 /nonexistent/kolo-program");
    ProcessResult result = job.wait(60);
    INFO("output:\n" << result.output);
    CHECK(result.exit_code == 127);
    // The first rank to fail names itself and its host; the others may be stopped before.
    CHECK(std::regex_search(
        result.output, std::regex(fmt::format(
                           "kolorun: rank [0-3] on {}[23]: cannot run /nonexistent/kolo-program",
                           kCluster.name))));
    CHECK(left_on_hosts(10).empty());
  }

  // SIGTERM and SIGINT to kolorun, and SIGKILL, whose ssh connections' end stops the remote ranks:
  // nothing of the job is left on any host. Rank 0 on this host, then on another.
  for (int signal : {SIGTERM, SIGINT, SIGKILL}) {
    std::string hosts =
        signal == SIGINT ? kCluster.host(2) + ":2," + kCluster.host(3) + ":2" : host_list(3, 2);
    Process job = on_host_one(
        fmt::format("{} -H {} /bin/sh -c 'echo started; exec {}'", kolorun(), hosts, marker));
    INFO("signal " << signal << ", hosts " << hosts);
    REQUIRE(output_appears(job, signal == SIGINT ? 4 : 6, "started"));
    std::this_thread::sleep_for(std::chrono::milliseconds(300));  // the ranks are sleeping now
    Clock::time_point sent = Clock::now();
    job.kill(signal);
    ProcessResult result = job.wait(30);
    INFO("output:\n" << result.output);
    CHECK_FALSE(result.timed_out);
    CHECK(Clock::now() - sent < std::chrono::seconds(10));
    std::vector<std::string> left = left_on_hosts(10);
    for (const std::string& process : left) UNSCOPED_INFO("left: " << process);
    CHECK(left.empty());
    int ranks_left = 0;
    for (const auto& [pid, line] : command_lines()) ranks_left += line.find(marker) == 0;
    CHECK(ranks_left == 0);
  }

  // An unreachable host: named with its ranks, ssh's status, the others stopped, within seconds.
  REQUIRE(kCluster.run_script(fmt::format("cut {} 3", kCluster.name)) == 0);
  {
    Clock::time_point start = Clock::now();
    Process job =
        on_host_one(fmt::format("{} -H {}:2,{}:2,{}:2 /bin/sh -c 'exec {}'", kolorun(),
                                kCluster.host(1), kCluster.host(2), kCluster.host(3), marker));
    ProcessResult result = job.wait(60);
    INFO("output:\n" << result.output);
    CHECK(result.exit_code == 255);
    CHECK_THAT(result.output,
               Contains(fmt::format("could not start ranks 4-5 on {}: ssh exited with status 255",
                                    kCluster.host(3))));
    CHECK(Clock::now() - start < std::chrono::seconds(25));
    CHECK(left_on_hosts(10).empty());
  }
}

int main(int argc, char** argv) {
  if (kolo::test::cluster_unavailable({kolo::test::kNeedsSshd})) return kolo::test::kSkipped;
  return Catch::Session().run(argc, argv);
}
