// kolo jobs started by a real Slurm on the simulated cluster: Debian's slurmctld, a slurmd per
// host and munge (scripts/slurm.sh), jobs submitted on host 1 with srun and sbatch as a user types
// them. Nothing of the launch is set by hand: every command starts from an empty environment
// (env -i) with Slurm's configuration, a job secret file, the Python paths and, for the workers,
// KOLO_DEBUG=INFO so that the test can read what kolo chose. Rank 0's address comes from the
// step (core/config.cpp), which every rank logs; the programs check their own results.
// Needs root and network namespaces; without them the program says why and exits 77 (skipped).
#define CATCH_CONFIG_RUNNER
#include <fmt/format.h>
#include <stdlib.h>
#include <sys/stat.h>
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
#include "faults.hpp"
#include "process.hpp"

using namespace kolo::test;
namespace fs = std::filesystem;

namespace {

// Unlike test_cluster's, so that both can run at once.
const char* kClusterName = "kolosl";

std::string script(const std::string& name) {
  return source_dir() + "/scripts/" + name;
}

std::string host_name(int host) {
  return fmt::format("{}{}", kClusterName, host);
}

// Runs a command, its output in `output`; returns its exit status.
int run_command(const std::string& command, std::string* output = nullptr) {
  std::string line = command + " 2>&1";
  FILE* pipe = ::popen(line.c_str(), "r");
  if (pipe == nullptr) return -1;
  std::string text;
  char buffer[4096];
  for (size_t n; (n = std::fread(buffer, 1, sizeof buffer, pipe)) > 0;) text.append(buffer, n);
  int status = ::pclose(pipe);
  if (output != nullptr) *output = text;
  return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
}

// H hosts with Slurm running on them, and a scratch folder on the shared file system that holds
// the job secret (mode 600, as a user keeps it); all taken down again whatever happens.
struct SlurmCluster {
  int hosts;
  std::string conf;
  std::string scratch;
  std::string secret_file;

  explicit SlurmCluster(int host_count) : hosts(host_count) {
    REQUIRE(run_command(
                fmt::format("sh '{}' up {} {}", script("cluster.sh"), kClusterName, hosts)) == 0);
    std::string output;
    int status =
        run_command(fmt::format("sh '{}' up {}", script("slurm.sh"), kClusterName), &output);
    INFO("slurm.sh up:\n" << output);
    REQUIRE(status == 0);
    std::istringstream lines(output);
    for (std::string line; std::getline(lines, line);) conf = line;  // the last line
    REQUIRE(fs::exists(conf));
    char folder[] = "/tmp/kolo-slurm-XXXXXX";
    REQUIRE(::mkdtemp(folder) != nullptr);
    scratch = folder;
    secret_file = scratch + "/secret";
    std::ofstream(secret_file) << "slurm-test-secret-" << ::getpid() << "-0123456789abcdef\n";
    ::chmod(secret_file.c_str(), 0600);
  }
  ~SlurmCluster() {
    // cluster.sh down kills every process of the hosts (the daemons, steps and tasks included)
    // and removes the state under /run/kolo-cluster.
    run_command(fmt::format("sh '{}' down {}", script("cluster.sh"), kClusterName));
    std::error_code error;
    if (!scratch.empty()) fs::remove_all(scratch, error);
  }
  SlurmCluster(const SlurmCluster&) = delete;
  SlurmCluster& operator=(const SlurmCluster&) = delete;

  // `command` as a user on host 1 types it, from an empty environment plus `env`.
  Process on_host1(const std::vector<std::string>& command,
                   const std::map<std::string, std::string>& env = {}) const {
    std::vector<std::string> argv = {"/usr/bin/env", "-i", "PATH=/usr/sbin:/usr/bin:/sbin:/bin",
                                     "HOME=" + scratch, "SLURM_CONF=" + conf};
    for (const auto& [key, value] : env) argv.push_back(key + "=" + value);
    argv.insert(argv.end(), {"/bin/sh", script("cluster.sh"), "exec", kClusterName, "1"});
    argv.insert(argv.end(), command.begin(), command.end());
    return Process(argv, {});
  }

  // srun --label -N hosts --ntasks-per-node per_host `program`, with the job secret.
  Process srun(int per_host, const std::vector<std::string>& program,
               std::map<std::string, std::string> env = {},
               const std::vector<std::string>& options = {}) const {
    std::vector<std::string> command = {"srun",
                                        "--label",
                                        "-N",
                                        std::to_string(hosts),
                                        "--ntasks-per-node",
                                        std::to_string(per_host)};
    command.insert(command.end(), options.begin(), options.end());
    command.insert(command.end(), program.begin(), program.end());
    env["KOLO_SECRET_FILE"] = secret_file;
    return on_host1(command, env);
  }
};

// srun --label's output, one text per task: the lines "N: ..." of task N without the label.
std::map<int, std::string> by_task(const std::string& output) {
  static const std::regex labelled(R"(^\s*(\d+): (.*)$)");
  std::map<int, std::string> tasks;
  std::istringstream lines(output);
  for (std::string line; std::getline(lines, line);) {
    std::smatch match;
    if (std::regex_match(line, match, labelled))
      tasks[std::stoi(match[1])] += match[2].str() + "\n";
  }
  return tasks;
}

// all_reduce_perf's table found no wrong element, and its header puts each rank on its host.
void expect_all_reduce_perf_passed(const std::string& output, int hosts, int per_host) {
  CHECK(contains(output, "# Out of bounds values : 0 OK"));
  for (int rank = 0; rank < hosts * per_host; ++rank) {
    std::regex placed(fmt::format(R"(#\s+Rank\s+{} Group\s+0 Pid\s+\d+ on\s+{} )", rank,
                                  host_name(rank / per_host + 1)));
    CHECK(std::regex_search(output, placed));
  }
}

struct Shape {
  int hosts;
  int per_host;
};

// Each task ran as its rank on its host, found rank 0's store on host 1 by itself, saw every host
// and printed `marker`.
void expect_workers_passed(const ProcessResult& result, Shape shape, const std::string& marker) {
  const int size = shape.hosts * shape.per_host;
  auto tasks = by_task(result.output);
  CHECK(static_cast<int>(tasks.size()) == size);
  for (int rank = 0; rank < size; ++rank) {
    const std::string& text = tasks[rank];
    INFO("task " << rank << " output:\n" << text);
    CHECK(std::regex_search(text, std::regex(fmt::format("rank {}: .*{}", rank, marker))));
    CHECK(contains(text, fmt::format("kolo {}:{} ", host_name(rank / shape.per_host + 1), rank)));
    CHECK(contains(text, fmt::format("rank 0's store at {}:", host_name(1))));
    CHECK(contains(text, fmt::format("ready: rank {} of {}", rank, size)));
    CHECK(contains(text, fmt::format("{} node(s)", shape.hosts)));
  }
}

double seconds_since(std::chrono::steady_clock::time_point start) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

}  // namespace

TEST_CASE("srun starts kolo jobs across hosts with no address set", "[slurm][srun]") {
  for (Shape shape : {Shape{2, 2}, Shape{4, 2}}) {
    DYNAMIC_SECTION(shape.hosts << " hosts x " << shape.per_host << " ranks") {
      SlurmCluster cluster(shape.hosts);
      const int size = shape.hosts * shape.per_host;
      {
        auto started = std::chrono::steady_clock::now();
        auto result = cluster
                          .srun(shape.per_host, {built_program("bench/all_reduce_perf"), "-b", "1K",
                                                 "-e", "4M", "-f", "4", "-c", "1"})
                          .wait(120);
        INFO("all_reduce_perf, " << seconds_since(started) << " s:\n" << result.output);
        CHECK(result.exit_code == 0);
        expect_all_reduce_perf_passed(by_task(result.output)[0], shape.hosts, shape.per_host);
      }
      for (const auto& [mode, marker] :
           std::vector<std::pair<std::vector<std::string>, std::string>>{
               {{"allreduce", "quick"}, "allreduce checks passed"},
               {{"broadcast"}, "broadcast checks passed"},
               {{"barrier"}, "barrier checks passed"}}) {
        std::vector<std::string> program = {built_program("tests/kolo_test_worker")};
        program.insert(program.end(), mode.begin(), mode.end());
        auto started = std::chrono::steady_clock::now();
        auto result = cluster.srun(shape.per_host, program, {{"KOLO_DEBUG", "INFO"}}).wait(120);
        INFO(marker << ", " << seconds_since(started) << " s:\n" << result.output);
        CHECK_FALSE(result.timed_out);
        CHECK(result.exit_code == 0);
        expect_workers_passed(result, shape, marker);
      }
      {
        auto started = std::chrono::steady_clock::now();
        auto result = cluster
                          .srun(shape.per_host,
                                {"/usr/bin/python3", source_dir() + "/examples/pytorch_digits.py",
                                 "--epochs", "2"},
                                {{"PYTHONPATH", source_dir() + "/python"},
                                 {"KOLO_LIBRARY", built_program("capi/libkolo.so")}})
                          .wait(180);
        INFO("pytorch_digits.py, " << seconds_since(started) << " s:\n" << result.output);
        CHECK_FALSE(result.timed_out);
        CHECK(result.exit_code == 0);
        expect_same_parameters(result.output, size);
      }
    }
  }
}

TEST_CASE("srun --mpi=pmix starts kolo jobs with no address set", "[slurm][pmix]") {
  // Each slurmd's PMIx server has a directory of its own (slurm.sh), else the step fails.
  SlurmCluster cluster(2);
  auto result = cluster
                    .srun(2, {built_program("tests/kolo_test_worker"), "allreduce", "quick"},
                          {{"KOLO_DEBUG", "INFO"}}, {"--mpi=pmix"})
                    .wait(120);
  INFO(result.output);
  CHECK(result.exit_code == 0);
  auto tasks = by_task(result.output);
  for (int rank = 0; rank < 4; ++rank) {
    INFO("task " << rank);
    CHECK(std::regex_search(tasks[rank],
                            std::regex(fmt::format("rank {}: .*allreduce checks passed", rank))));
    CHECK(contains(tasks[rank], "2 node(s)"));
  }
  // The address came through Slurm's PMIx server, not from the node list and the step's ids.
  CHECK(contains(tasks[0], "started by slurm, rendezvous through PMIx"));
  CHECK_FALSE(contains(result.output, "the first node of SLURM_STEP_NODELIST"));
}

TEST_CASE("sbatch runs the job script of docs/several-hosts.md as printed", "[slurm][sbatch]") {
  // The script runs in the folder it was submitted from, as the kolo checkout: a folder with the
  // checkout's python/ and examples/ and this build as build/.
  SlurmCluster cluster(2);
  const std::string job_script = "examples/several-hosts/slurm-job.sh";
  fs::create_directory_symlink(fs::absolute(build_dir()), cluster.scratch + "/build");
  fs::create_directory_symlink(fs::absolute(source_dir() + "/python"), cluster.scratch + "/python");
  fs::create_directory_symlink(fs::absolute(source_dir() + "/examples"),
                               cluster.scratch + "/examples");
  // --wait: sbatch returns when the job ends, with its exit status; --output keeps the test's
  // files in its scratch folder (an option given to sbatch overrides the script's #SBATCH line).
  const std::string output_file = cluster.scratch + "/job.out";
  auto started = std::chrono::steady_clock::now();
  auto submitted =
      cluster
          .on_host1({"/bin/sh", "-c", "cd \"$1\" && exec sbatch --wait --output=\"$2\" \"$3\"",
                     "sh", cluster.scratch, output_file, job_script})
          .wait(240);
  std::ifstream file(output_file);
  std::string job_output((std::istreambuf_iterator<char>(file)), std::istreambuf_iterator<char>());
  INFO("sbatch, " << seconds_since(started) << " s:\n"
                  << submitted.output << "\njob output:\n"
                  << job_output);
  CHECK_FALSE(submitted.timed_out);
  CHECK(submitted.exit_code == 0);
  CHECK(contains(submitted.output, "Submitted batch job"));
  expect_all_reduce_perf_passed(job_output, 2, 2);
  expect_same_parameters(job_output, 4);
  CHECK(contains(job_output, "done: 4 ranks"));
  CHECK_FALSE(contains(job_output, "no job secret"));
  // The script's secret file is gone with the job.
  for (const auto& entry : fs::directory_iterator(cluster.scratch)) {
    CHECK_FALSE(contains(entry.path().filename().string(), ".kolo-secret"));
  }
}

TEST_CASE("a node lost in an srun job is reported by number on every survivor", "[slurm][lost]") {
  SlurmCluster cluster(3);
  Process job = cluster.srun(1, {built_program("tests/kolo_test_worker"), "loop", "60"});
  auto wait_for = [&](const std::function<bool(const std::map<int, std::string>&)>& done,
                      double bound_s) {
    auto start = std::chrono::steady_clock::now();
    while (seconds_since(start) < bound_s) {
      if (done(by_task(job.output_so_far()))) return true;
      std::this_thread::sleep_for(std::chrono::milliseconds(100));
    }
    return false;
  };
  bool looping = wait_for(
      [](const std::map<int, std::string>& tasks) {
        for (int rank = 0; rank < 3; ++rank) {
          auto it = tasks.find(rank);
          if (it == tasks.end() || !contains(it->second, "looping")) return false;
        }
        return true;
      },
      60);
  INFO("srun output:\n" << job.output_so_far());
  REQUIRE(looping);
  std::this_thread::sleep_for(std::chrono::milliseconds(500));
  const int victim = 1;  // on host 2, between the survivors on hosts 1 and 3
  auto cut_at = std::chrono::steady_clock::now();
  REQUIRE(run_command(fmt::format("sh '{}' cut {} {}", script("cluster.sh"), kClusterName,
                                  victim + 1)) == 0);
  // TCP's keepalive and user timeout give up on the silent host after 10 s.
  const double bound_s = 15.0;
  wait_for(
      [](const std::map<int, std::string>& tasks) {
        for (int rank : {0, 2}) {
          auto it = tasks.find(rank);
          if (it == tasks.end() || !contains(it->second, "status KOLO_ERR_PEER_LOST")) return false;
        }
        return true;
      },
      bound_s + 5);
  const double elapsed = seconds_since(cut_at);
  auto tasks = by_task(job.output_so_far());
  for (int rank : {0, 2}) {
    INFO("task " << rank << " output:\n" << tasks[rank]);
    std::smatch status;
    REQUIRE(
        std::regex_search(tasks[rank], status,
                          std::regex(fmt::format("rank {}: status KOLO_ERR_PEER_LOST.*", rank))));
    CHECK(contains(status[0].str(), fmt::format("rank {}", victim)));
    CHECK(seconds_to_failure(status[0].str()) < bound_s);
  }
  CHECK(elapsed < bound_s);
  job.kill(SIGKILL);
}

int main(int argc, char** argv) {
  if (kolo::test::cluster_unavailable(
          {{"command -v slurmctld >/dev/null && command -v slurmd >/dev/null && "
            "command -v srun >/dev/null && command -v munged >/dev/null",
            "Slurm (slurmctld, slurmd, slurm-client) or munge is not installed "
            "(scripts/install-deps.sh installs them)"}}))
    return kolo::test::kSkipped;
  return Catch::Session().run(argc, argv);
}
