// kolorun, run for real with small /bin/sh ranks, and the tests' own process helper under it.
#include <arpa/inet.h>
#include <fmt/format.h>
#include <fmt/ranges.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
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

#include "kolo.h"
#include "process.hpp"

namespace {

using Catch::Matchers::Contains;
using kolo::test::Process;
using kolo::test::ProcessResult;
using Clock = std::chrono::steady_clock;

std::string kolorun_path() {
  return kolo::test::built_program("src/kolorun");
}

double seconds_since(Clock::time_point start) {
  return std::chrono::duration<double>(Clock::now() - start).count();
}

// kolorun must pick the address and secret itself unless a test hands them over.
void clear_job_environment() {
  for (const char* name : {"KOLO_ADDR", "KOLO_SECRET", "KOLO_SECRET_FILE", "KOLO_RANK", "KOLO_SIZE",
                           "KOLO_LOCAL_RANK", "KOLO_LOCAL_SIZE"}) {
    ::unsetenv(name);
  }
}

struct Run {
  ProcessResult result;
  double seconds = 0;
};

// Runs kolorun with these arguments to the end (10 s at most) and times it.
Run run_kolorun(const std::vector<std::string>& args,
                const std::map<std::string, std::string>& extra_env = {}) {
  std::vector<std::string> argv = {kolorun_path()};
  argv.insert(argv.end(), args.begin(), args.end());
  Clock::time_point start = Clock::now();
  Process kolorun(argv, extra_env);
  Run run{kolorun.wait(10), 0};
  run.seconds = seconds_since(start);
  return run;
}

std::vector<std::string> lines_of(const std::string& text) {
  std::vector<std::string> lines;
  std::istringstream stream(text);
  for (std::string line; std::getline(stream, line);) lines.push_back(line);
  return lines;
}

// The numbers that follow "pid=" (or another label) in the output: the ranks report their own
// pids, and those of what they start.
std::vector<pid_t> reported_pids(const std::string& output, const std::string& label = "pid") {
  std::vector<pid_t> pids;
  std::regex pattern("\\b" + label + R"(=(\d+))");
  for (std::sregex_iterator it(output.begin(), output.end(), pattern), end; it != end; ++it) {
    pids.push_back(static_cast<pid_t>(std::stol((*it)[1])));
  }
  return pids;
}

// Gone, or a zombie waiting for whoever inherited it. The test process is a child subreaper
// (process.cpp), so ranks whose kolorun died are its children: they are reaped here.
bool process_gone(pid_t pid) {
  int status;
  ::waitpid(pid, &status, WNOHANG);
  std::ifstream stat("/proc/" + std::to_string(pid) + "/stat");
  std::string line;
  if (!stat || !std::getline(stat, line)) return true;
  size_t state = line.rfind(')') + 2;  // the command name in parentheses may contain spaces
  return state < line.size() && (line[state] == 'Z' || line[state] == 'X');
}

bool all_gone_within(const std::vector<pid_t>& pids, double seconds) {
  Clock::time_point start = Clock::now();
  for (;;) {
    if (std::all_of(pids.begin(), pids.end(), process_gone)) return true;
    if (seconds_since(start) > seconds) return false;
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
}

// Waits for `count` occurrences of `marker` in the output of a running process (5 s at most).
bool output_appears(const Process& process, size_t count, const std::string& marker) {
  return process.wait_for_output(marker, count, std::chrono::seconds(5),
                                 std::chrono::milliseconds(5));
}

std::string this_host() {
  char host[256] = {};
  ::gethostname(host, sizeof host - 1);
  return host;
}

// kolorun's own line when a rank has ended.
bool contains_exit(const std::string& output) {
  return output.find("kolorun: rank") != std::string::npos;
}

}  // namespace

TEST_CASE("Process captures both output streams and the exit code", "[process]") {
  Process shell({"/bin/sh", "-c", "echo to-stdout; echo to-stderr >&2; exit 7"}, {});
  ProcessResult result = shell.wait(5);
  INFO("output: " << result.output);
  CHECK(result.exit_code == 7);
  CHECK(result.signal == 0);
  CHECK_FALSE(result.timed_out);
  CHECK_THAT(result.output, Contains("to-stdout\n") && Contains("to-stderr\n"));
}

TEST_CASE("Process lays extra_env over the environment", "[process]") {
  ::setenv("KOLO_TEST_REPLACED", "old", 1);
  Process shell({"/bin/sh", "-c", "echo \"$KOLO_TEST_REPLACED $KOLO_TEST_ADDED\""},
                {{"KOLO_TEST_REPLACED", "new"}, {"KOLO_TEST_ADDED", "added"}});
  CHECK(shell.wait(5).output == "new added\n");
  ::unsetenv("KOLO_TEST_REPLACED");
}

TEST_CASE("Process::wait kills what outlives its timeout and reports a signal", "[process]") {
  Clock::time_point start = Clock::now();
  Process sleeper({"/bin/sh", "-c", "echo started; sleep 30 & echo pid=$!; wait"}, {});
  REQUIRE(output_appears(sleeper, 1, "pid="));
  ProcessResult result = sleeper.wait(0.2);
  INFO("output: " << result.output);
  CHECK(result.timed_out);
  CHECK(result.signal == SIGKILL);
  CHECK(result.exit_code == -1);
  CHECK_THAT(result.output, Contains("started\n"));
  CHECK(seconds_since(start) < 3);
  CHECK(all_gone_within(reported_pids(result.output), 2));  // the background sleep too

  Process terminated({"/bin/sh", "-c", "exec sleep 30"}, {});
  terminated.kill(SIGTERM);
  ProcessResult killed = terminated.wait(5);
  CHECK(killed.signal == SIGTERM);
  CHECK_FALSE(killed.timed_out);
}

TEST_CASE("free_tcp_port gives a port that can be bound on 127.0.0.1", "[process]") {
  int port = kolo::test::free_tcp_port();
  REQUIRE(port > 0);
  REQUIRE(port < 65536);
  int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in address{};
  address.sin_family = AF_INET;
  address.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  address.sin_port = htons(static_cast<uint16_t>(port));
  CHECK(::bind(fd, reinterpret_cast<sockaddr*>(&address), sizeof address) == 0);
  ::close(fd);
}

TEST_CASE("kolorun gives every rank its place in the job and one shared secret", "[kolorun]") {
  clear_job_environment();
  Run run = run_kolorun({"-np", "4", "--tag-output", "/bin/sh", "-c",
                         "echo rank=$KOLO_RANK size=$KOLO_SIZE local_rank=$KOLO_LOCAL_RANK "
                         "local_size=$KOLO_LOCAL_SIZE addr=$KOLO_ADDR secret=$KOLO_SECRET"});
  INFO("output: " << run.result.output);
  REQUIRE(run.result.exit_code == 0);
  std::regex line_pattern(
      R"(\[(\d)\] rank=(\d) size=4 local_rank=(\d) local_size=4 addr=127\.0\.0\.1:(\d+) )"
      R"(secret=([0-9a-f]{64}))");
  std::multiset<int> ranks;
  std::set<std::string> addresses, secrets;
  for (const std::string& line : lines_of(run.result.output)) {
    std::smatch match;
    INFO("line: " << line);
    REQUIRE(std::regex_match(line, match, line_pattern));
    CHECK(match[1] == match[2]);  // the prefix names the rank that wrote the line
    CHECK(match[2] == match[3]);  // one machine: the local rank is the rank
    ranks.insert(std::stoi(match[2]));
    addresses.insert(match[4]);
    secrets.insert(match[5]);
  }
  CHECK(ranks == std::multiset<int>{0, 1, 2, 3});
  CHECK(secrets.size() == 1);
  REQUIRE(addresses.size() == 1);
  int port = std::stoi(*addresses.begin());
  CHECK((port > 0 && port < 65536));
}

// Binds 127.0.0.1:port as kolo's store does (SO_REUSEADDR); returns errno, or 0 when it could.
int bind_error(int port) {
  int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  int one = 1;
  ::setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
  sockaddr_in address{};
  address.sin_family = AF_INET;
  address.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  address.sin_port = htons(static_cast<uint16_t>(port));
  int error = ::bind(fd, reinterpret_cast<sockaddr*>(&address), sizeof address) == 0 ? 0 : errno;
  ::close(fd);
  return error;
}

TEST_CASE("kolorun binds the store's port itself and hands it to rank 0 alone", "[kolorun]") {
  clear_job_environment();
  // The ranks never serve the store: while they run, the port stays kolorun's (then rank 0's), and
  // nothing else can take it.
  Process kolorun({kolorun_path(), "-np", "2", "/bin/sh", "-c",
                   "echo rank=$KOLO_RANK addr=$KOLO_ADDR fd=${KOLO_STORE_FD:-none}; sleep 1"},
                  {});
  REQUIRE(output_appears(kolorun, 2, "addr="));
  std::smatch match;
  std::string output = kolorun.output_so_far();
  REQUIRE(std::regex_search(output, match, std::regex(R"(addr=127\.0\.0\.1:(\d+))")));
  const int port = std::stoi(match[1]);
  CHECK(bind_error(port) == EADDRINUSE);
  ProcessResult result = kolorun.wait(10);
  INFO("output: " << result.output);
  CHECK(result.exit_code == 0);
  CHECK(std::regex_search(result.output, std::regex(R"((^|\n)rank=0 addr=\S+ fd=\d+\n)")));
  CHECK_THAT(result.output, Contains("rank=1 addr=127.0.0.1:" + std::to_string(port) + " fd=none"));
}

TEST_CASE("kolorun runs a kolo job whose rank 0 serves the store on kolorun's socket",
          "[kolorun]") {
  clear_job_environment();
  Run run =
      run_kolorun({"-np", "3", kolo::test::built_program("tests/kolo_test_worker"), "barrier"},
                  {{"KOLO_DEBUG", "INFO"}});
  INFO("output: " << run.result.output);
  CHECK(run.result.exit_code == 0);
  for (int rank = 0; rank < 3; ++rank) {
    CHECK_THAT(run.result.output,
               Contains("rank " + std::to_string(rank) + ": barrier checks passed"));
  }
  CHECK_THAT(run.result.output, Contains("on the socket its launcher bound (KOLO_STORE_FD)"));
}

TEST_CASE("kolorun keeps a KOLO_ADDR and KOLO_SECRET it was given", "[kolorun]") {
  clear_job_environment();
  std::string secret(64, 'a');
  std::map<std::string, std::string> env = {
      {"KOLO_ADDR", "10.1.2.3:4567"}, {"KOLO_SECRET", secret}, {"KOLO_RANK", "99"}};
  std::string script = "echo $KOLO_RANK/$KOLO_SIZE $KOLO_ADDR $KOLO_SECRET";
  std::string np_option = GENERATE("-np", "-n", "--np");
  Run run = run_kolorun({np_option, "2", "/bin/sh", "-c", script}, env);
  INFO("output: " << run.result.output);
  CHECK(run.result.exit_code == 0);
  std::vector<std::string> lines = lines_of(run.result.output);
  std::sort(lines.begin(), lines.end());
  CHECK(lines ==
        std::vector<std::string>{"0/2 10.1.2.3:4567 " + secret, "1/2 10.1.2.3:4567 " + secret});
}

TEST_CASE("kolorun --version says which kolo it belongs to and starts nothing", "[kolorun]") {
  Run run = run_kolorun({"--version", "-np", "2", "/bin/sh", "-c", "echo started"});
  INFO("output: " << run.result.output);
  CHECK(run.result.exit_code == 0);
  // The version kolo.h declares, which the build's version must match.
  CHECK(run.result.output == "kolorun (kolo) " + std::to_string(KOLO_VERSION_MAJOR) + "." +
                                 std::to_string(KOLO_VERSION_MINOR) + "." +
                                 std::to_string(KOLO_VERSION_PATCH) + "\n");
}

TEST_CASE("kolorun leaves the secret to a KOLO_SECRET_FILE it was given", "[kolorun]") {
  // kolorun must not generate KOLO_SECRET beside it: the ranks would refuse both.
  clear_job_environment();
  char path[] = "/tmp/kolo-secret-XXXXXX";
  const int fd = ::mkstemp(path);  // mode 600, as the file must be
  REQUIRE(fd >= 0);
  const std::string secret = "kolorun-secret-file-0123456789";
  REQUIRE(::write(fd, secret.data(), secret.size()) == static_cast<ssize_t>(secret.size()));
  ::close(fd);
  Run run =
      run_kolorun({"-np", "2", kolo::test::built_program("tests/kolo_test_worker"), "barrier"},
                  {{"KOLO_SECRET_FILE", path}});
  ::unlink(path);
  INFO("output: " << run.result.output);
  CHECK(run.result.exit_code == 0);
  CHECK_THAT(run.result.output, Contains("rank 1: barrier checks passed"));
  CHECK_THAT(run.result.output, !Contains("both set"));
}

// A shell around kolorun throws one of its streams away, to see what went to the other.
std::vector<std::string> kolorun_lines_on(const std::string& options, const std::string& script,
                                          const std::string& discard) {
  Process shell({"/bin/sh", "-c", "\"$0\" -np 2 " + options + " /bin/sh -c \"$1\" " + discard,
                 kolorun_path(), script},
                {});
  ProcessResult result = shell.wait(10);
  INFO("output: " << result.output);
  CHECK(result.exit_code == 0);
  return lines_of(result.output);
}

// The lines that end with "-<rank>", in the order they came.
std::vector<std::string> lines_of_rank(const std::vector<std::string>& lines, int rank) {
  std::vector<std::string> mine;
  const std::string suffix = "-" + std::to_string(rank);
  for (const std::string& line : lines) {
    if (line.ends_with(suffix)) mine.push_back(line);
  }
  return mine;
}

const char* const kTwoStreamScript =
    "echo out-$KOLO_RANK; echo err-$KOLO_RANK >&2; echo more-$KOLO_RANK; printf end-$KOLO_RANK";

TEST_CASE("kolorun passes lines on untagged by default and keeps stdout and stderr apart",
          "[kolorun]") {
  std::vector<std::string> out = kolorun_lines_on("", kTwoStreamScript, "2>/dev/null");
  CHECK(out.size() == 6);
  CHECK(lines_of_rank(out, 0) == std::vector<std::string>{"out-0", "more-0", "end-0"});
  CHECK(lines_of_rank(out, 1) == std::vector<std::string>{"out-1", "more-1", "end-1"});
  std::vector<std::string> err = kolorun_lines_on("", kTwoStreamScript, ">/dev/null");
  std::sort(err.begin(), err.end());
  CHECK(err == std::vector<std::string>{"err-0", "err-1"});
}

TEST_CASE("kolorun --tag-output prefixes each line with its rank, stdout and stderr apart",
          "[kolorun]") {
  std::vector<std::string> out = kolorun_lines_on("--tag-output", kTwoStreamScript, "2>/dev/null");
  std::vector<std::string> rank0_out, rank1_out;
  for (const std::string& line : out)
    (line.starts_with("[0] ") ? rank0_out : rank1_out).push_back(line);
  CHECK(rank0_out == std::vector<std::string>{"[0] out-0", "[0] more-0", "[0] end-0"});
  CHECK(rank1_out == std::vector<std::string>{"[1] out-1", "[1] more-1", "[1] end-1"});
  std::vector<std::string> err = kolorun_lines_on("--tag-output", kTwoStreamScript, ">/dev/null");
  std::sort(err.begin(), err.end());
  CHECK(err == std::vector<std::string>{"[0] err-0", "[1] err-1"});
}

TEST_CASE("kolorun never mixes lines of different ranks", "[kolorun]") {
  const int kLines = 400;
  std::string script = "i=0; while [ $i -lt " + std::to_string(kLines) +
                       " ]; do echo $KOLO_RANK-$i-" + std::string(200, 'x') + "; i=$((i+1)); done";
  const bool tagged = GENERATE(false, true);
  Run run = tagged ? run_kolorun({"-np", "4", "--tag-output", "/bin/sh", "-c", script})
                   : run_kolorun({"-np", "4", "/bin/sh", "-c", script});
  REQUIRE(run.result.exit_code == 0);
  // Tagged, the tag must name the rank that wrote the line.
  std::regex line_pattern(tagged ? R"(\[(\d)\] (\d)-(\d+)-x{200})" : R"(()(\d)-(\d+)-x{200})");
  std::vector<int> next_line(4, 0);
  int well_formed = 0;
  for (const std::string& line : lines_of(run.result.output)) {
    std::smatch match;
    if (!std::regex_match(line, match, line_pattern) || (tagged && match[1] != match[2])) {
      FAIL("a mangled line: " << line);
    }
    int rank = std::stoi(match[2]);
    CHECK(std::stoi(match[3]) == next_line[rank]++);  // each rank's lines in order
    ++well_formed;
  }
  CHECK(well_formed == 4 * kLines);
}

TEST_CASE("kolorun stops the job when a rank fails and exits with its status", "[kolorun]") {
  SECTION("a non-zero exit") {
    Run run = run_kolorun({"-np", "3", "/bin/sh", "-c",
                           "echo pid=$$; if [ $KOLO_RANK = 1 ]; then sleep 0.2; exit 3; fi; "
                           "exec sleep 30"});
    INFO("output: " << run.result.output);
    CHECK(run.result.exit_code == 3);
    CHECK(std::regex_search(run.result.output,
                            std::regex("kolorun: rank 1 exited with status 3 \\(pid \\d+ on " +
                                       this_host() + "\\)\n")));
    CHECK(run.seconds < 3);  // the other ranks were stopped, not waited for
    CHECK(reported_pids(run.result.output).size() == 3);
    CHECK(all_gone_within(reported_pids(run.result.output), 1));
  }
  SECTION("a signal") {
    Run run = run_kolorun({"-np", "2", "/bin/sh", "-c",
                           "if [ $KOLO_RANK = 1 ]; then kill -KILL $$; fi; exec sleep 30"});
    INFO("output: " << run.result.output);
    CHECK(run.result.exit_code == 128 + SIGKILL);
    CHECK(std::regex_search(run.result.output,
                            std::regex("kolorun: rank 1 killed by signal SIGKILL \\(pid \\d+ on " +
                                       this_host() + "\\)\n")));
    CHECK(run.seconds < 3);
  }
  SECTION("--elastic: a rank killed by a signal does not stop the others") {
    Run run = run_kolorun({"--elastic", "-np", "3", "/bin/sh", "-c",
                           "if [ $KOLO_RANK = 1 ]; then kill -KILL $$; fi; sleep 1; "
                           "echo rank $KOLO_RANK done"});
    INFO("output: " << run.result.output);
    CHECK(run.result.exit_code == 0);
    CHECK(std::regex_search(run.result.output,
                            std::regex("kolorun: rank 1 killed by signal SIGKILL \\(pid \\d+ on " +
                                       this_host() + "\\); --elastic: the other ranks go on")));
    CHECK_THAT(run.result.output, Contains("rank 0 done"));
    CHECK_THAT(run.result.output, Contains("rank 2 done"));
  }
  SECTION("--elastic: a rank that exits non-zero still stops the job") {
    Run run = run_kolorun({"--elastic", "-np", "2", "/bin/sh", "-c",
                           "if [ $KOLO_RANK = 1 ]; then exit 3; fi; exec sleep 30"});
    INFO("output: " << run.result.output);
    CHECK(run.result.exit_code == 3);
    CHECK(run.seconds < 3);
  }
  SECTION("--elastic: every rank killed is a failure") {
    Run run = run_kolorun({"--elastic", "-np", "2", "/bin/sh", "-c", "kill -KILL $$"});
    INFO("output: " << run.result.output);
    CHECK(run.result.exit_code == 128 + SIGKILL);
  }
  SECTION("ranks that ignore SIGTERM are killed when the grace period ends") {
    Run run = run_kolorun({"--grace", "0.5", "-np", "3", "/bin/sh", "-c",
                           "trap '' TERM; echo pid=$$; "
                           "if [ $KOLO_RANK = 0 ]; then sleep 0.2; exit 5; fi; exec sleep 30"});
    INFO("output: " << run.result.output);
    CHECK(run.result.exit_code == 5);
    CHECK(run.seconds >= 0.7);  // rank 0's 0.2 s, then the whole grace period
    CHECK(run.seconds < 3);
    CHECK(reported_pids(run.result.output).size() == 3);
    CHECK(all_gone_within(reported_pids(run.result.output), 1));
  }
}

TEST_CASE("kolorun forwards SIGTERM, SIGINT, SIGHUP and SIGQUIT to every rank", "[kolorun]") {
  int signal = GENERATE(SIGTERM, SIGINT, SIGHUP, SIGQUIT);
  Process kolorun({kolorun_path(), "-np", "3", "/bin/sh", "-c", "echo pid=$$; exec sleep 30"}, {});
  REQUIRE(output_appears(kolorun, 3, "pid="));
  Clock::time_point start = Clock::now();
  kolorun.kill(signal);  // the ranks lead their own process groups: only kolorun gets this
  ProcessResult result = kolorun.wait(10);
  INFO("output: " << result.output);
  CHECK(result.exit_code == 128 + signal);
  CHECK(seconds_since(start) < 3);
  std::vector<pid_t> pids = reported_pids(result.output);
  CHECK(pids.size() == 3);
  CHECK(all_gone_within(pids, 1));
}

TEST_CASE("kolorun forwards SIGUSR1 and SIGUSR2 and the job goes on", "[kolorun]") {
  int signal = GENERATE(SIGUSR1, SIGUSR2);
  Process kolorun({kolorun_path(), "-np", "2", "/bin/sh", "-c",
                   "trap 'echo got USR1' USR1; trap 'echo got USR2' USR2; echo pid=$$; "
                   "while :; do sleep 0.05; done"},
                  {});
  REQUIRE(output_appears(kolorun, 2, "pid="));
  kolorun.kill(signal);
  std::string expected = signal == SIGUSR1 ? "got USR1" : "got USR2";
  CHECK(output_appears(kolorun, 2, expected));
  std::this_thread::sleep_for(std::chrono::milliseconds(200));
  CHECK_FALSE(contains_exit(kolorun.output_so_far()));  // the job is still running
  kolorun.kill(SIGTERM);
  ProcessResult result = kolorun.wait(10);
  INFO("output: " << result.output);
  CHECK(result.exit_code == 128 + SIGTERM);
}

// The state letter of a process in /proc/<pid>/stat ('T' when stopped); '?' when it is gone.
char process_state(pid_t pid) {
  std::ifstream stat("/proc/" + std::to_string(pid) + "/stat");
  std::string line;
  if (!stat || !std::getline(stat, line)) return '?';
  size_t state = line.rfind(')') + 2;  // the command name in parentheses may contain spaces
  return state < line.size() ? line[state] : '?';
}

bool all_in_state_within(const std::vector<pid_t>& pids, char state, double seconds) {
  Clock::time_point start = Clock::now();
  for (;;) {
    if (std::all_of(pids.begin(), pids.end(),
                    [&](pid_t pid) { return process_state(pid) == state; }))
      return true;
    if (seconds_since(start) > seconds) return false;
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
}

TEST_CASE("kolorun passes job control on: SIGTSTP stops the ranks and itself, SIGCONT resumes",
          "[kolorun]") {
  // Each rank ticks 40 times, 0.1 s apart: work that a stop arriving within its first 4 s (even
  // on a slow, loaded machine) interrupts.
  Process kolorun({kolorun_path(), "-np", "2", "/bin/sh", "-c",
                   "echo pid=$$; i=0; while [ $i -lt 40 ]; do echo tick; sleep 0.1; "
                   "i=$((i + 1)); done; echo rank $KOLO_RANK done"},
                  {});
  REQUIRE(output_appears(kolorun, 2, "pid="));
  std::vector<pid_t> ranks = reported_pids(kolorun.output_so_far());
  REQUIRE(ranks.size() == 2);
  kolorun.kill(SIGTSTP);  // as a shell's Ctrl-Z does to kolorun's process group
  // A rank in uninterruptible sleep ('D', in the kernel) stops only once it leaves it; on a busy
  // machine one run saw a rank stay 'D' for over 4 s after the signal.
  const bool stopped = all_in_state_within(ranks, 'T', 15);
  INFO("the ranks' states after SIGTSTP: " << process_state(ranks[0]) << process_state(ranks[1])
                                           << "; kolorun's output: " << kolorun.output_so_far());
  CHECK(stopped);
  CHECK(all_in_state_within({kolorun.pid()}, 'T', 15));  // the shell gets its prompt back
  // They stay stopped (kolorun, stopped too, forwards no output meanwhile: the state says it).
  std::this_thread::sleep_for(std::chrono::milliseconds(1000));
  for (pid_t rank : ranks) CHECK(process_state(rank) == 'T');
  CHECK(kolo::test::count(kolorun.output_so_far(), "tick") < 80);  // stopped before the end
  kolorun.kill(SIGCONT);  // as fg or bg does
  ProcessResult result = kolorun.wait(10);
  INFO("output: " << result.output);
  CHECK(result.exit_code == 0);
  CHECK_THAT(result.output, Contains("rank 0 done") && Contains("rank 1 done"));
  CHECK(kolo::test::count(result.output, "tick") == 80);  // resumed where they were stopped
}

TEST_CASE("nothing the ranks started outlives the job", "[kolorun]") {
  SECTION("a child left in the group of a rank that failed") {
    Run run = run_kolorun({"-np", "2", "/bin/sh", "-c",
                           "sleep 777 & echo child=$!; "
                           "if [ $KOLO_RANK = 1 ]; then sleep 0.3; exit 1; fi; exec sleep 30"});
    INFO("output: " << run.result.output);
    CHECK(run.result.exit_code == 1);
    REQUIRE(reported_pids(run.result.output, "child").size() == 2);
    CHECK(all_gone_within(reported_pids(run.result.output, "child"), 1));
  }
  SECTION("a child that left the group of a rank that succeeded") {
    Run run =
        run_kolorun({"-np", "2", "/bin/sh", "-c",
                     "setsid /bin/sh -c 'echo child=$$; exec sleep 778' & sleep 0.2; exit 0"});
    INFO("output: " << run.result.output);
    CHECK(run.result.exit_code == 0);
    REQUIRE(reported_pids(run.result.output, "child").size() == 2);
    CHECK(all_gone_within(reported_pids(run.result.output, "child"), 1));
  }
  SECTION("a child that ignores SIGTERM is killed when the grace period ends") {
    Run run = run_kolorun({"--grace", "0.3", "-np", "1", "/bin/sh", "-c",
                           "/bin/sh -c \"trap '' TERM; echo child=\\$\\$; exec sleep 779\" & "
                           "sleep 0.2; exit 0"});
    INFO("output: " << run.result.output);
    CHECK(run.result.exit_code == 0);
    CHECK(run.seconds >= 0.4);
    REQUIRE(reported_pids(run.result.output, "child").size() == 1);
    CHECK(all_gone_within(reported_pids(run.result.output, "child"), 1));
  }
}

TEST_CASE("the ranks die with kolorun", "[kolorun]") {
  Process kolorun({kolorun_path(), "-np", "2", "/bin/sh", "-c", "echo pid=$$; exec sleep 30"}, {});
  REQUIRE(output_appears(kolorun, 2, "pid="));
  kolorun.kill(SIGKILL);
  ProcessResult result = kolorun.wait(5);
  CHECK(result.signal == SIGKILL);
  CHECK(all_gone_within(reported_pids(result.output), 2));
}

TEST_CASE("kolorun --timeout stops the job and exits 124", "[kolorun]") {
  Run run = run_kolorun({"--timeout", "0.3", "-np", "2", "sleep", "30"});
  INFO("output: " << run.result.output);
  CHECK(run.result.exit_code == 124);
  CHECK_THAT(run.result.output, Contains("timed out"));
  CHECK(run.seconds < 3);
}

TEST_CASE("kolorun takes a --timeout too long to matter as none", "[kolorun]") {
  Run run = run_kolorun({"--timeout", "1e12", "-np", "2", "true"});
  INFO("output: " << run.result.output);
  CHECK(run.result.exit_code == 0);
  CHECK(run.result.output.empty());
}

TEST_CASE("kolorun finds programs on PATH and says nothing when all goes well", "[kolorun]") {
  Run run = run_kolorun({"-np", "2", "true"});
  CHECK(run.result.exit_code == 0);
  CHECK(run.result.output.empty());
}

TEST_CASE("kolorun exits 127 when the program cannot be run", "[kolorun]") {
  Run run = run_kolorun({"-np", "2", "/nonexistent/program"});
  INFO("output: " << run.result.output);
  CHECK(run.result.exit_code == 127);
  // The rank that could not run says which it is and where it ran (the first one's failure stops
  // the others, which may not have reached exec yet).
  CHECK(std::regex_search(run.result.output,
                          std::regex("kolorun: rank [01] on " + this_host() +
                                     ": cannot run /nonexistent/program: No such file or "
                                     "directory\n")));
}

TEST_CASE("kolorun leaves the program's own arguments alone", "[kolorun]") {
  std::vector<std::string> separator =
      GENERATE(std::vector<std::string>{}, std::vector<std::string>{"--"});
  std::vector<std::string> args = {"--np=2"};
  args.insert(args.end(), separator.begin(), separator.end());
  for (const char* arg : {"/bin/sh", "-c", "echo \"$@\"", "sh", "-np", "5", "--verbose"}) {
    args.push_back(arg);
  }
  Run run = run_kolorun(args);
  INFO("output: " << run.result.output);
  CHECK(run.result.exit_code == 0);
  std::vector<std::string> lines = lines_of(run.result.output);
  std::sort(lines.begin(), lines.end());
  CHECK(lines == std::vector<std::string>{"-np 5 --verbose", "-np 5 --verbose"});
}

TEST_CASE("kolorun rejects bad arguments with exit status 2 and says why", "[kolorun]") {
  std::vector<std::string> args = GENERATE(
      std::vector<std::string>{}, std::vector<std::string>{"/bin/true"},
      std::vector<std::string>{"-np"}, std::vector<std::string>{"-np", "0", "/bin/true"},
      std::vector<std::string>{"-np", "x", "/bin/true"}, std::vector<std::string>{"-np", "2"},
      std::vector<std::string>{"-np", "2", "--bogus", "/bin/true"},
      std::vector<std::string>{"--timeout", "nan", "-np", "2", "/bin/true"},
      std::vector<std::string>{"--grace", "inf", "-np", "2", "/bin/true"},
      std::vector<std::string>{"--timeout", "-1", "-np", "2", "/bin/true"});
  Run run = run_kolorun(args);
  INFO("output: " << run.result.output);
  CHECK(run.result.exit_code == 2);
  CHECK_THAT(run.result.output, Contains("kolorun: ") && Contains("Usage: kolorun -np N"));
}

TEST_CASE("kolorun's errors show one usage line; --help adds examples, variables, exit codes",
          "[kolorun]") {
  Run missing = run_kolorun({"/bin/true"});
  INFO("output: " << missing.result.output);
  CHECK(missing.result.exit_code == 2);
  CHECK(kolo::test::count(missing.result.output, "Usage:") == 1);
  CHECK(lines_of(missing.result.output).size() == 2);  // what was wrong, and the usage line

  Run help = run_kolorun({"--help"});
  INFO("help: " << help.result.output);
  CHECK(help.result.exit_code == 0);
  CHECK(kolo::test::count(help.result.output,
                          "Usage: kolorun -np N [options] [--] program [args...]") == 1);
  CHECK(kolo::test::count(help.result.output, "Usage:") == 1);
  for (const char* word : {"Examples:",
                           "kolorun -np 4 ",
                           "--tag-output",
                           "KOLO_RANK",
                           "KOLO_SIZE",
                           "KOLO_LOCAL_RANK",
                           "KOLO_LOCAL_SIZE",
                           "KOLO_ADDR",
                           "KOLO_STORE_FD",
                           "KOLO_SECRET",
                           "Exit status:",
                           "124",
                           "127",
                           "128+S",
                           "-H,--host",
                           "--hostfile",
                           "-x",
                           "--ssh-port",
                           "255",
                           "node1:4,node2:4"}) {
    CHECK_THAT(help.result.output, Contains(word));
  }
}

// ---- Several hosts (-H, --hostfile), on one machine: every name of this machine runs its ranks
// here, and a stand-in for ssh (first on PATH) runs "another host"'s agent here too, with an
// environment as bare as sshd gives, after writing down the command line it was given. Hosts
// named dead* cannot be reached: it says so as ssh does and exits 255. The real ssh, on a
// simulated cluster, is tests/test_kolorun_hosts.cpp's.

struct FakeSsh {
  std::string folder;
  std::string log;  // one line per ssh started: its arguments
  FakeSsh() {
    char name[] = "/tmp/kolorun-fake-ssh-XXXXXX";
    REQUIRE(::mkdtemp(name) != nullptr);
    folder = name;
    log = folder + "/log";
    std::ofstream script(folder + "/ssh");
    script << "#!/bin/sh\n"
              "printf '%s\\n' \"$*\" >> '"
           << log
           << "'\n"
              "host=; command=\n"
              "for arg; do host=$command; command=$arg; done\n"
              "case $host in dead*) echo \"ssh: connect to host $host port 22: Connection timed "
              "out\" >&2; exit 255;; esac\n"
              "exec env -i HOME=/ PATH=/usr/bin:/bin FAKE_HOST=$host /bin/sh -c \"$command\"\n";
    script.close();
    ::chmod((folder + "/ssh").c_str(), 0755);
  }
  ~FakeSsh() {
    std::error_code ignored;
    std::filesystem::remove_all(folder, ignored);
  }
  std::map<std::string, std::string> env() const {
    return {{"PATH", folder + ":" + std::getenv("PATH")}};
  }
  std::string arguments() const {
    std::ifstream file(log);
    std::ostringstream text;
    text << file.rdbuf();
    return text.str();
  }
};

const char* const kPlaceScript =
    "echo rank=$KOLO_RANK size=$KOLO_SIZE local=$KOLO_LOCAL_RANK/$KOLO_LOCAL_SIZE "
    "fd=${KOLO_STORE_FD:-none} addr=$KOLO_ADDR secret=$KOLO_SECRET on=${FAKE_HOST:-here}";

TEST_CASE("kolorun -H: every name of this machine is one host, whose ranks start without ssh",
          "[kolorun][hosts]") {
  clear_job_environment();
  FakeSsh ssh;
  Run run = run_kolorun({"-H", "localhost:2," + this_host() + ",127.0.0.1", "--tag-output",
                         "/bin/sh", "-c", kPlaceScript},
                        ssh.env());
  INFO("output: " << run.result.output);
  CHECK(run.result.exit_code == 0);
  std::vector<std::string> lines = lines_of(run.result.output);
  std::sort(lines.begin(), lines.end());
  REQUIRE(lines.size() == 4);  // no -np: every slot
  for (int rank = 0; rank < 4; ++rank) {
    std::string prefix = fmt::format(
        "[{0}] rank={0} size=4 local={0}/4 fd={1} addr=127.0.0.1:", rank, rank == 0 ? "3" : "none");
    CHECK(lines[rank].rfind(prefix, 0) == 0);
    CHECK_THAT(lines[rank], Contains("on=here"));
  }
  CHECK(ssh.arguments().empty());
}

TEST_CASE("kolorun --hostfile reads mpirun's and horovodrun's lines and fills hosts in order",
          "[kolorun][hosts]") {
  clear_job_environment();
  FakeSsh ssh;
  std::string hostfile = ssh.folder + "/hosts";
  std::ofstream(hostfile) << "# the nodes of this job\n"
                             "alpha slots=2 max_slots=8  # mpirun's words\n"
                             "\n"
                             "   beta:3\n"  // horovodrun's
                             "gamma\n";     // one slot
  auto env = ssh.env();
  env["KOLO_SECRET"] = "a-secret-of-this-test-0123456789";
  Run run = run_kolorun(
      {"-np", "5", "--hostfile", hostfile, "--tag-output", "/bin/sh", "-c", kPlaceScript}, env);
  INFO("output: " << run.result.output);
  CHECK(run.result.exit_code == 0);
  std::vector<std::string> lines = lines_of(run.result.output);
  std::sort(lines.begin(), lines.end());
  REQUIRE(lines.size() == 5);
  // Rank 0 runs on alpha, whose agent bound the store's port and named alpha in KOLO_ADDR.
  std::smatch port;
  REQUIRE(std::regex_search(lines[0], port, std::regex(R"(addr=alpha:(\d+) )")));
  const std::string hosts[] = {"alpha", "alpha", "beta", "beta", "beta"};
  const std::string local[] = {"0/2", "1/2", "0/3", "1/3", "2/3"};
  for (int rank = 0; rank < 5; ++rank) {
    CHECK(lines[rank] == fmt::format("[{0}@{1}] rank={0} size=5 local={2} fd={3} addr=alpha:{4} "
                                     "secret=a-secret-of-this-test-0123456789 on={1}",
                                     rank, hosts[rank], local[rank], rank == 0 ? "3" : "none",
                                     port[1].str()));
  }
  // One ssh per host that runs ranks (gamma runs none), BatchMode, and no secret in its arguments.
  std::string arguments = ssh.arguments();
  CHECK(lines_of(arguments).size() == 2);
  CHECK_THAT(arguments, Contains("-o BatchMode=yes") && Contains(" alpha exec '") &&
                            Contains(" beta exec '") && Contains("' --agent"));
  CHECK_THAT(arguments, !Contains("a-secret-of-this-test") && !Contains("gamma"));
}

TEST_CASE("kolorun forwards PATH, PYTHONPATH, KOLO_* and -x variables to other hosts, no others",
          "[kolorun][hosts]") {
  clear_job_environment();
  FakeSsh ssh;
  auto env = ssh.env();
  env.insert({{"PYTHONPATH", "/some/python"},
              {"KOLO_TIMEOUT", "77"},
              {"ASKED_FOR", "yes"},
              {"NOT_ASKED", "no"}});
  Run run = run_kolorun({"-H", "localhost:1,otherhost:1", "-x", "ASKED_FOR", "-x", "SET_HERE=1 2",
                         "--tag-output", "/bin/sh", "-c",
                         "echo path=$PATH py=$PYTHONPATH timeout=$KOLO_TIMEOUT asked=$ASKED_FOR "
                         "set=\"$SET_HERE\" not=${NOT_ASKED:-unset}"},
                        env);
  INFO("output: " << run.result.output);
  CHECK(run.result.exit_code == 0);
  const std::string common = fmt::format("path={}:{} py=/some/python timeout=77 asked=yes set=1 2",
                                         ssh.folder, std::getenv("PATH"));
  CHECK_THAT(run.result.output, Contains("[0@localhost] " + common + " not=no"));
  CHECK_THAT(run.result.output, Contains("[1@otherhost] " + common + " not=unset"));
}

TEST_CASE("kolorun reports a host it cannot reach with its ranks, stops the others, exits 255",
          "[kolorun][hosts]") {
  clear_job_environment();
  FakeSsh ssh;
  Run run =
      run_kolorun({"-H", "localhost:2,deadhost:2", "/bin/sh", "-c", "exec sleep 30"}, ssh.env());
  INFO("output: " << run.result.output);
  CHECK(run.result.exit_code == 255);
  CHECK_THAT(run.result.output, Contains("Connection timed out") &&
                                    Contains("kolorun: could not start ranks 2-3 on deadhost: "
                                             "ssh exited with status 255"));
  CHECK(run.seconds < 8);  // the local ranks were stopped, not waited for
}

TEST_CASE("kolorun reports a program missing on another host by rank and host, exits 127",
          "[kolorun][hosts]") {
  clear_job_environment();
  FakeSsh ssh;
  Run run = run_kolorun({"-H", "remote1:2", "/nonexistent/program"}, ssh.env());
  INFO("output: " << run.result.output);
  CHECK(run.result.exit_code == 127);
  // The first rank to fail names itself; the other may be stopped before it fails too.
  CHECK(std::regex_search(
      run.result.output,
      std::regex(fmt::format("kolorun: rank [01] on {}: cannot run /nonexistent/program: No such "
                             "file or directory",
                             this_host()))));
}

TEST_CASE("kolorun's SIGTERM reaches the ranks on other hosts, which then end",
          "[kolorun][hosts]") {
  clear_job_environment();
  FakeSsh ssh;
  std::vector<std::string> argv = {kolorun_path(),
                                   "-H",
                                   "remote1:2,remote2",
                                   "/bin/sh",
                                   "-c",
                                   "echo pid=$$; trap 'echo term-$KOLO_RANK; exit 5' TERM; "
                                   "while :; do sleep 0.1; done"};
  Process kolorun(argv, ssh.env());
  REQUIRE(output_appears(kolorun, 3, "pid="));
  std::vector<pid_t> ranks = reported_pids(kolorun.output_so_far());
  ::kill(kolorun.pid(), SIGTERM);
  ProcessResult result = kolorun.wait(10);
  INFO("output: " << result.output);
  CHECK(result.exit_code == 5);
  for (int rank = 0; rank < 3; ++rank)
    CHECK_THAT(result.output, Contains(fmt::format("term-{}", rank)));
  CHECK(all_gone_within(ranks, 5));
}

TEST_CASE("the ranks on other hosts die with kolorun", "[kolorun][hosts]") {
  clear_job_environment();
  FakeSsh ssh;
  Process kolorun(
      {kolorun_path(), "-H", "remote1:2", "/bin/sh", "-c", "echo pid=$$; exec sleep 30"},
      ssh.env());
  REQUIRE(output_appears(kolorun, 2, "pid="));
  std::vector<pid_t> ranks = reported_pids(kolorun.output_so_far());
  ::kill(kolorun.pid(), SIGKILL);  // its ssh dies with it; the agent sees its stdin end
  kolorun.wait(5);
  CHECK(all_gone_within(ranks, 10));
}

TEST_CASE("kolorun rejects bad hosts, hostfiles and -x with exit status 2 and says why",
          "[kolorun][hosts]") {
  clear_job_environment();
  FakeSsh ssh;
  auto hostfile = [&](const std::string& text) {
    std::string path = ssh.folder + "/hosts-" + std::to_string(std::hash<std::string>()(text));
    std::ofstream(path) << text;
    return path;
  };
  struct Bad {
    std::vector<std::string> args;
    std::string says;
  };
  std::vector<Bad> cases = {
      {{"-np", "9", "-H", "a:4,b:4", "/bin/true"}, "-np 9 is more than the 8 slots"},
      {{"-H", "a:0", "/bin/true"}, "-H a:0: cannot read 'a:0'"},
      {{"-H", "a:x", "/bin/true"}, "cannot read 'a:x'"},
      {{"-H", "a,,b", "/bin/true"}, "cannot read ''"},
      {{"-H", "a:2:3", "/bin/true"}, "cannot read 'a:2:3'"},
      {{"-H", "a", "--hostfile", hostfile("b\n"), "/bin/true"}, "give one of them"},
      {{"--hostfile", ssh.folder + "/none", "/bin/true"}, "cannot read it: No such file"},
      {{"--hostfile", hostfile("a slots=2\nb slots=two\n"), "/bin/true"},
       "line 2: cannot read 'slots=two'"},
      {{"--hostfile", hostfile("a cpus=2\n"), "/bin/true"}, "line 1: cannot read 'cpus=2'"},
      {{"--hostfile", hostfile("# nothing\n\n"), "/bin/true"}, "names no host"},
      {{"-H", "a", "-x", "KOLO_NOT_SET_ANYWHERE", "/bin/true"}, "is not set here"},
      {{"-H", "a", "-x", "=1", "/bin/true"}, "expected NAME or NAME=VALUE"},
      {{"-H", "a", "--ssh-port", "http", "/bin/true"}, "--ssh-port http: not a port number"},
  };
  for (const Bad& bad : cases) {
    Run run = run_kolorun(bad.args, ssh.env());
    INFO("args: " << fmt::format("{}", fmt::join(bad.args, " "))
                  << "\noutput: " << run.result.output);
    CHECK(run.result.exit_code == 2);
    CHECK_THAT(run.result.output,
               Contains("kolorun: ") && Contains(bad.says) && Contains("Usage: kolorun -np N"));
  }
  CHECK(ssh.arguments().empty());  // nothing was started
}
