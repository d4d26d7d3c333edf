// kolorun --elastic --host-discovery-script, run for real on this machine: the driver starts,
// grows, shrinks and restarts ranks of tests/worker_elastic_driver.c, which checks every
// allreduce against the sum it computes from the world size and its step. The discovery script
// reads a file the test rewrites; this machine's names (localhost, 127.0.0.1) stand for hosts.
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
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "bootstrap/store.hpp"
#include "comm/elastic.hpp"
#include "kolo/status.hpp"
#include "net/socket.hpp"
#include "process.hpp"

namespace {

using Catch::Matchers::Contains;
using kolo::test::Process;
using kolo::test::ProcessResult;
using kolo::test::count;

constexpr const char* kSecret = "elastic-test-secret-0123456789abcdef";

// A directory of the test's own: the hosts file, the script, the stop file.
struct Scratch {
  std::filesystem::path dir;
  Scratch() {
    char name[] = "/tmp/kolo-elastic-XXXXXX";
    dir = ::mkdtemp(name);
  }
  ~Scratch() { std::filesystem::remove_all(dir); }
  std::string path(const std::string& name) const { return (dir / name).string(); }
  void write(const std::string& name, const std::string& text) const {
    std::string temporary = path(name + ".new");
    std::ofstream(temporary) << text;
    std::filesystem::rename(temporary, path(name));  // the script never reads half a file
  }
};

// Waits until `what` occurs `times` times in the output, up to timeout_s; the output then.
std::string wait_for_count(const Process& process, const std::string& what, size_t times,
                           int timeout_s = 60) {
  std::string output;
  if (!process.wait_for_output(what, times, std::chrono::seconds(timeout_s),
                               std::chrono::milliseconds(100), &output)) {
    FAIL("waited " << timeout_s << " s for " << times << " x '" << what << "'; the output:\n"
                   << output);
  }
  return output;
}

// kolorun --elastic -np `np` `flags` with the discovery script `sh <scratch>/discover.sh`, the
// worker, `env` and the job secret the test knows.
Process launch_job(const Scratch& scratch, int np, const std::vector<std::string>& flags = {},
                   std::map<std::string, std::string> env = {}) {
  std::vector<std::string> argv = {kolo::test::built_program("src/kolorun"), "--elastic",
                                   "--host-discovery-script", "sh " + scratch.path("discover.sh")};
  argv.insert(argv.end(), {"-np", std::to_string(np)});
  argv.insert(argv.end(), flags.begin(), flags.end());
  argv.insert(argv.end(), {kolo::test::built_program("tests/kolo_test_elastic_driver"),
                           scratch.path("stop"), "5", "10"});
  env.emplace("KOLO_SECRET", kSecret);
  env.emplace("KOLO_TIMEOUT", "20");
  for (const char* name : {"KOLO_ADDR", "KOLO_SECRET_FILE", "KOLO_RANK", "KOLO_SIZE",
                           "KOLO_ELASTIC_ADDR", "KOLO_ELASTIC_SLOT", "KOLO_INVITATION"}) {
    ::unsetenv(name);
  }
  return Process(argv, env);
}

// launch_job, returned once its `np` ranks said they started (60 s at most).
Process start_job(const Scratch& scratch, int np, const std::vector<std::string>& flags = {},
                  std::map<std::string, std::string> env = {}) {
  Process job = launch_job(scratch, np, flags, std::move(env));
  wait_for_count(job, fmt::format("of {} started", np), np);
  return job;
}

void hosts(const Scratch& scratch, const std::string& lines) {
  scratch.write("discover.sh", "cat <<'EOF'\n" + lines + "EOF\n");
}

// The pid the worker in `slot` reported when it last started or joined.
pid_t pid_in_slot(const std::string& output, const std::string& slot) {
  std::regex pattern("slot " + slot +
                     R"(: rank \d+ of \d+ (?:started|joined) at step \d+, pid (\d+))");
  pid_t pid = -1;
  for (std::sregex_iterator it(output.begin(), output.end(), pattern), end; it != end; ++it) {
    pid = static_cast<pid_t>(std::stol((*it)[1]));
  }
  return pid;
}

// Stops the job through the worker's stop file and waits for it (60 s at most); it must end with
// status 0 and, where `done` > 0, with `done` ranks saying "of <done> done". Its output.
ProcessResult stop_job(const Scratch& scratch, Process& job, int done = 0) {
  std::ofstream(scratch.path("stop")) << "stop\n";
  ProcessResult result = job.wait(60);
  INFO(result.output);
  CHECK(result.exit_code == 0);
  if (done > 0) CHECK(count(result.output, fmt::format("of {} done", done)) == static_cast<size_t>(done));
  return result;
}

}  // namespace

TEST_CASE("2 -> 4 (a host grows) -> 3 (a rank killed) -> 4 (its slot restarted)",
          "[elastic_driver_grow]") {
  Scratch scratch;
  hosts(scratch, "localhost:2\n");
  Process job = start_job(scratch, 2, {"--min-np", "2", "--max-np", "4"});

  hosts(scratch, "localhost:4\n");
  wait_for_count(job, "size 2 -> 4 (2 joined, 0 left)", 2);
  // The newcomers' pids are in their "joined" lines, which may come after the others' report.
  std::string output = wait_for_count(job, "of 4 joined", 2);

  pid_t victim = pid_in_slot(output, "localhost:3");
  REQUIRE(victim > 0);
  ::kill(victim, SIGKILL);
  wait_for_count(job, "shrank to size 3", 3);
  output = wait_for_count(job, "size 3 -> 4 (1 joined, 0 left)", 3);
  CHECK_THAT(output, Contains("the rank in slot localhost:3"));
  CHECK_THAT(output, Contains("was killed by signal SIGKILL; the others go on, and the slot is "
                              "restarted at the next update"));
  wait_for_count(job, "slot localhost:3: rank 3 of 4 joined", 1);

  ProcessResult result = stop_job(scratch, job, 4);
  INFO(result.output);
  CHECK(count(result.output, "FAILED") == 0);
}

TEST_CASE("growth beyond --max-np is refused, said once", "[elastic_driver_max_np]") {
  Scratch scratch;
  hosts(scratch, "localhost:2\n");
  Process job = start_job(scratch, 2, {"--max-np", "3"});
  hosts(scratch, "localhost:5\n");
  wait_for_count(job, "size 2 -> 3 (1 joined, 0 left)", 2);
  std::this_thread::sleep_for(std::chrono::seconds(2));  // several more updates
  ProcessResult result = stop_job(scratch, job, 3);
  INFO(result.output);
  CHECK(count(result.output, "--max-np 3 allows") == 1);
  CHECK(count(result.output, "joined at step") == 1);
  CHECK(count(result.output, "failed at step") == 0);
}

TEST_CASE("the ranks of a host that vanishes leave with status 0", "[elastic_driver_remove]") {
  Scratch scratch;
  hosts(scratch, "localhost:2\n127.0.0.1:2\n");
  Process job = start_job(scratch, 4, {"--min-np", "2", "-v"});
  hosts(scratch, "localhost:2\n");
  wait_for_count(job, "size 4 -> 2 (0 joined, 2 left)", 2);
  ProcessResult result = stop_job(scratch, job, 2);
  INFO(result.output);
  CHECK(count(result.output, "slot 127.0.0.1:0: leaving") == 1);
  CHECK(count(result.output, "slot 127.0.0.1:1: leaving") == 1);
  CHECK(count(result.output, "exited 0: it left") == 2);
  CHECK(count(result.output, "killing it") == 0);
  CHECK(count(result.output, "failed at step") == 0);
}

TEST_CASE("rank 0's host vanishes: the others go on, grow and shrink again",
          "[elastic_driver_remove_rank0]") {
  Scratch scratch;
  hosts(scratch, "127.0.0.1:1\nlocalhost:3\n");
  Process job = start_job(scratch, 4, {"--min-np", "1"});
  // Rank 0 leaves; the three that stay need a store of their own (comm/elastic.cpp) for what
  // follows: a removal (a split of their communicator), then a growth.
  hosts(scratch, "localhost:3\n");
  wait_for_count(job, "size 4 -> 3 (0 joined, 1 left)", 3);
  CHECK(count(job.output_so_far(), "slot 127.0.0.1:0: leaving") == 1);
  hosts(scratch, "localhost:2\n");
  wait_for_count(job, "size 3 -> 2 (0 joined, 1 left)", 2);
  hosts(scratch, "localhost:2\n127.0.0.2:1\n");
  wait_for_count(job, "size 2 -> 3 (1 joined, 0 left)", 2);
  ProcessResult result = stop_job(scratch, job, 3);
  INFO(result.output);
  CHECK(count(result.output, "FAILED") == 0);
  CHECK(count(result.output, "failed at step") == 0);  // no call failed and was recovered
}

TEST_CASE("below --min-np with no slot to fill, the job stops", "[elastic_driver_min_np]") {
  Scratch scratch;
  hosts(scratch, "localhost:1\n127.0.0.1:1\n");
  Process job = start_job(scratch, 2, {"--min-np", "2"});
  hosts(scratch, "localhost:1\n");
  ProcessResult result = job.wait(60);
  INFO(result.output);
  CHECK(result.exit_code == 1);
  CHECK_THAT(result.output, Contains("kolorun: --elastic: 1 ranks run, fewer than --min-np 2, and "
                                     "sh " +
                                     scratch.path("discover.sh") +
                                     " names no free slot to start one; stopping the job"));
}

TEST_CASE("a discovery script that prints garbage, fails or hangs: the last good hosts are kept",
          "[elastic_driver_discovery]") {
  Scratch scratch;
  hosts(scratch, "localhost:2\n");
  Process job = start_job(scratch, 2);
  const std::string script = "--host-discovery-script sh " + scratch.path("discover.sh");

  scratch.write("discover.sh", "echo localhost:2\necho 'local host!'\n");
  wait_for_count(job,
                 script +
                     " printed line 2, 'local host!', which is not 'host' or "
                     "'host:slots'; the last good host set is kept",
                 1, 20);
  scratch.write("discover.sh", "echo localhost:4\nexit 3\n");
  wait_for_count(job, script + " exited with status 3; the last good host set is kept", 1, 20);
  scratch.write("discover.sh", "sleep 100\n");
  wait_for_count(job,
                 script +
                     " did not finish within 10 s and was killed; the last good host "
                     "set is kept",
                 1, 30);
  hosts(scratch, "localhost:2\n");
  std::string output = wait_for_count(job, script + " works again", 1, 20);
  CHECK(count(output, "joined") == 0);  // no failure changed the job
  CHECK(count(output, "leaving") == 0);

  ProcessResult result = stop_job(scratch, job, 2);
  INFO(result.output);
  // Each failure is said once, though the script ran about every second meanwhile.
  CHECK(count(result.output, "exited with status 3") == 1);
}

TEST_CASE("a discovery script that keeps failing stops the job", "[elastic_driver_discovery]") {
  Scratch scratch;
  scratch.write("discover.sh", "exit 4\n");
  Process job = launch_job(scratch, 2);
  ProcessResult result = job.wait(60);
  INFO(result.output);
  CHECK(result.exit_code == 1);
  CHECK_THAT(result.output,
             Contains("kolorun: --host-discovery-script sh " + scratch.path("discover.sh") +
                      " exited with status 4; no hosts known yet"));
  CHECK_THAT(result.output, Contains("failed 10 times in a row (last: exited with status 4); "
                                     "stopping the job"));
  CHECK(count(result.output, "started at step") == 0);
}

TEST_CASE("a newcomer that dies while joining fails the growth cleanly; its slot is restarted",
          "[elastic_driver_newcomer_dies]") {
  Scratch scratch;
  hosts(scratch, "localhost:2\n");
  std::ofstream(scratch.path("die")) << "die\n";
  Process job = start_job(
      scratch, 2, {"--max-np", "3"},
      {{"ELASTIC_DIE_FILE", scratch.path("die")}, {"ELASTIC_DIE_MS", "0"}, {"KOLO_TIMEOUT", "5"}});
  hosts(scratch, "localhost:3\n");
  std::string output = wait_for_count(job, "slot localhost:2: dying before joining", 1);
  // The members' growth fails (bounded by KOLO_TIMEOUT), they shrink and go on; the driver
  // restarts the slot at the next update, and that newcomer joins.
  output = wait_for_count(job, "kolo_elastic_update failed at step", 2);
  {
    INFO(output);
    std::regex timeout(
        R"(kolo_elastic_update failed at step \d+: KOLO_ERR_TIMEOUT: [^\n]*0 of the 1 newcomer\(s\) arrived within 5 s)");
    CHECK(std::distance(std::sregex_iterator(output.begin(), output.end(), timeout),
                        std::sregex_iterator()) == 2);
  }
  wait_for_count(job, "shrank to size 2", 2);
  output = wait_for_count(job, "size 2 -> 3 (1 joined, 0 left)", 2);
  CHECK_THAT(output, Contains("the rank in slot localhost:2"));
  ProcessResult result = stop_job(scratch, job, 3);
  INFO(result.output);
  CHECK(count(result.output, "FAILED") == 0);
}

TEST_CASE("a slot is restarted up to --reset-limit times", "[elastic_driver_reset_limit]") {
  Scratch scratch;
  hosts(scratch, "localhost:2\n");
  Process job = start_job(scratch, 2, {"--min-np", "1", "--reset-limit", "1"});
  std::string output = job.output_so_far();
  ::kill(pid_in_slot(output, "localhost:1"), SIGKILL);
  output = wait_for_count(job, "slot localhost:1: rank 1 of 2 joined", 1);  // restart 1 of 1
  ::kill(pid_in_slot(output, "localhost:1"), SIGKILL);
  output = wait_for_count(job, "shrank to size 1", 2);
  CHECK_THAT(output, Contains("the slot has failed 2 times, more than --reset-limit 1: it is "
                              "not restarted"));
  std::this_thread::sleep_for(std::chrono::seconds(2));  // updates that start nobody
  ProcessResult result = stop_job(scratch, job);
  INFO(result.output);
  CHECK(count(result.output, "joined at step") == 1);
  CHECK(count(result.output, "slot localhost:0: rank 0 of 1 done") == 1);
}

TEST_CASE("a host whose ranks keep failing is blacklisted", "[elastic_driver_blacklist]") {
  Scratch scratch;
  hosts(scratch, "localhost:1\n127.0.0.1:2\n");
  Process job = start_job(scratch, 3, {"--min-np", "1"});
  // Three failures on 127.0.0.1: two restarts of 127.0.0.1:0, then the host is blacklisted and
  // its other rank leaves.
  for (int failure = 1; failure <= 3; ++failure) {
    std::string output = job.output_so_far();
    ::kill(pid_in_slot(output, "127.0.0.1:0"), SIGKILL);
    if (failure < 3) {
      wait_for_count(job, "slot 127.0.0.1:0: rank 2 of 3 joined", failure);
    }
  }
  std::string output = wait_for_count(job, "slot 127.0.0.1:1: leaving", 1);
  CHECK_THAT(output, Contains("3 ranks have failed on 127.0.0.1: it is blacklisted, its ranks "
                              "leave at the next update and none start there again"));
  CHECK(count(output, "blacklisted") == 1);
  std::this_thread::sleep_for(std::chrono::seconds(1));
  ProcessResult result = stop_job(scratch, job);
  INFO(result.output);
  CHECK(count(result.output, "slot localhost:0: rank 0 of 1 done") == 1);
  CHECK(count(result.output, "joined at step") == 2);
}

TEST_CASE("the driver's store admits only the job secret", "[elastic_driver_secret]") {
  Scratch scratch;
  hosts(scratch, "localhost:1\n");
  Process job = start_job(scratch, 1, {"-v"}, {{"KOLO_DEBUG", "INFO"}});
  // The worker's environment holds the driver's address; kolorun -v does not say it, so the
  // test reads it from /proc.
  std::string output = job.output_so_far();
  pid_t rank = pid_in_slot(output, "localhost:0");
  REQUIRE(rank > 0);
  std::ifstream environ_file(fmt::format("/proc/{}/environ", rank));
  std::string environ_text((std::istreambuf_iterator<char>(environ_file)), {});
  std::smatch match;
  REQUIRE(std::regex_search(environ_text, match, std::regex("KOLO_ELASTIC_ADDR=([^\\0]+)")));
  kolo::net::Endpoint driver = kolo::net::parse_endpoint(match[1].str(), "KOLO_ELASTIC_ADDR");

  for (std::string secret : {std::string("wrong-secret-0123456789abcdef"), std::string()}) {
    INFO("secret '" << secret << "'");
    CHECK_THROWS_AS(kolo::StoreClient(driver, secret, 0, 2.0), kolo::Error);
  }
  kolo::StoreClient client(driver, kSecret, 0, 5.0);
  CHECK(client.add(kolo::kElasticRequestCounter, 0) >= 1);  // the worker has asked already

  stop_job(scratch, job);
}

TEST_CASE("kolorun --elastic's flags are checked", "[elastic_driver_args]") {
  Scratch scratch;
  hosts(scratch, "localhost:1\n");
  const std::string kolorun = kolo::test::built_program("src/kolorun");
  const std::string script = "sh " + scratch.path("discover.sh");
  struct Case {
    std::vector<std::string> args;
    std::string message;
  };
  std::vector<Case> cases = {
      {{"-np", "2", "--host-discovery-script", script, "true"},
       "--host-discovery-script needs --elastic"},
      {{"--elastic", "-np", "2", "--min-np", "1", "true"},
       "--reset-limit and --start-timeout go with"},
      {{"--elastic", "-np", "2", "--min-np", "3", "--host-discovery-script", script, "true"},
       "--elastic needs 1 <= --min-np <= -np <= --max-np, not 3 <= 2 <= "},
      {{"--elastic", "-np", "4", "--max-np", "3", "--host-discovery-script", script, "true"},
       "not 4 <= 4 <= 3"},
      {{"--elastic", "-np", "1", "-H", "localhost:2", "--host-discovery-script", script, "true"},
       "give no -H or --hostfile"},
      {{"--elastic", "-np", "1", "--reset-limit", "-1", "--host-discovery-script", script, "true"},
       "--reset-limit -1: expected 0 or more"},
      {{"--elastic", "-np", "1", "--slots-per-host", "0", "--host-discovery-script", script,
        "true"},
       "--slots-per-host 0: expected 1 to 100000"},
  };
  for (const Case& bad : cases) {
    std::vector<std::string> argv = {kolorun};
    argv.insert(argv.end(), bad.args.begin(), bad.args.end());
    Process process(argv, {});
    ProcessResult result = process.wait(10);
    INFO(result.output);
    CHECK(result.exit_code == 2);
    CHECK_THAT(result.output, Contains(bad.message));
  }
}

TEST_CASE("without the driver kolo_elastic_update changes nothing", "[elastic_driver_none]") {
  Scratch scratch;
  std::vector<std::string> argv = {kolo::test::built_program("src/kolorun"),
                                   "-np",
                                   "2",
                                   kolo::test::built_program("tests/kolo_test_elastic_driver"),
                                   scratch.path("stop"),
                                   "2",
                                   "10"};
  Process job(argv, {});
  wait_for_count(job, "of 2 started", 2);
  std::this_thread::sleep_for(std::chrono::milliseconds(500));  // a few dozen updates
  ProcessResult result = stop_job(scratch, job, 2);
  INFO(result.output);
  CHECK(count(result.output, "update at") == 0);
}

TEST_CASE("a driver that cannot be reached, a rank without a slot: every rank says so",
          "[elastic_driver_unreachable]") {
  Scratch scratch;
  const std::string worker = kolo::test::built_program("tests/kolo_test_elastic_driver");
  const std::string kolorun = kolo::test::built_program("src/kolorun");
  const std::string address = fmt::format("127.0.0.1:{}", kolo::test::free_tcp_port());
  {
    // Nothing listens at the address: every update fails on both ranks, naming it, bounded by
    // KOLO_TIMEOUT; the ranks go on.
    Process job({kolorun, "-np", "2", worker, scratch.path("stop"), "5", "10"},
                {{"KOLO_ELASTIC_ADDR", address},
                 {"KOLO_ELASTIC_SLOT", "somewhere:0"},
                 {"KOLO_TIMEOUT", "2"}});
    std::string message = "rank 0 got no plan from the driver at KOLO_ELASTIC_ADDR=" + address;
    std::string output = wait_for_count(job, message, 2, 30);
    CHECK(count(output, "kolo_elastic_update failed at step") >= 2);
    stop_job(scratch, job, 2);
  }
  std::filesystem::remove(scratch.path("stop"));
  {
    // No KOLO_ELASTIC_SLOT: KOLO_ERR_CONFIG on every rank, naming the rank without one.
    Process job({kolorun, "-np", "2", worker, scratch.path("stop"), "5", "10"},
                {{"KOLO_ELASTIC_ADDR", address}, {"KOLO_TIMEOUT", "2"}});
    ProcessResult result = job.wait(30);
    INFO(result.output);
    CHECK(result.exit_code == 1);
    CHECK(count(result.output, "FAILED: kolo_elastic_update: KOLO_ERR_CONFIG") >= 1);
    CHECK_THAT(result.output, Contains("rank 0 has no valid KOLO_ELASTIC_SLOT"));
  }
}
