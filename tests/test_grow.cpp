// Growing a communicator (kolo_comm_invite, kolo_comm_grow, kolo_comm_init with KOLO_INVITATION)
// with real processes on loopback: members started as a job, newcomers started by this test with
// the invitation that rank 0 of the members publishes in a shared directory, as a launcher would
// hand it on. The worker (tests/worker_grow.cpp) checks every result against values it computes
// itself; here, that every process passed or was refused with the expected status and message,
// in bounded time.
#include <signal.h>

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

#include "job.hpp"

using namespace kolo::test;

namespace {

const char* kWorker = "tests/kolo_test_grow";

// A fresh directory for one test's files, removed with it.
struct GrowDir {
  std::string path;
  GrowDir() {
    char pattern[] = "/tmp/kolo-grow-XXXXXX";
    path = ::mkdtemp(pattern);
  }
  ~GrowDir() { std::filesystem::remove_all(path); }
};

// The text a member published as `name`, waiting up to a minute for it.
std::string read_published(const GrowDir& dir, const std::string& name, Job& members) {
  const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(60);
  const std::string path = dir.path + "/" + name;
  while (!std::filesystem::exists(path)) {
    if (std::chrono::steady_clock::now() > until) {
      std::string outputs;
      for (auto& rank : members.ranks) outputs += rank.output_so_far() + "\n";
      FAIL("no " << name << " from the members within 60 s; their output:\n" << outputs);
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  std::ifstream in(path);
  std::string text;
  std::getline(in, text);
  return text;
}

Process start_newcomer(const std::string& scenario, const std::string& invitation,
                       const GrowDir& dir, std::map<std::string, std::string> env = {}) {
  std::map<std::string, std::string> full = {{"KOLO_INVITATION", invitation},
                                             {"KOLO_SECRET", kTestSecret},
                                             {"KOLO_TIMEOUT", "30"},
                                             {"GROW_DIR", dir.path}};
  for (const auto& [key, value] : env) full[key] = value;
  return Process({built_program(kWorker), scenario}, full);
}

// Waits (up to a minute) until a newcomer started with KOLO_DEBUG=INFO has arrived at the growth.
void wait_for_arrival(Process& newcomer) {
  std::string output;
  if (!newcomer.wait_for_output("waiting for the members", 1, std::chrono::seconds(60),
                                std::chrono::milliseconds(20), &output)) {
    FAIL("the newcomer did not arrive within 60 s:\n" << output);
  }
}

// A newcomer that was refused: it ran in time and printed the status and a message matching
// `message`.
void expect_refused(const ProcessResult& result, const std::string& status,
                    const std::string& message) {
  INFO("newcomer output:\n" << result.output);
  CHECK_FALSE(result.timed_out);
  CHECK(result.exit_code == 0);
  CHECK(result.output.find("refused: " + status) != std::string::npos);
  CHECK(std::regex_search(result.output, std::regex(message)));
}

}  // namespace

TEST_CASE("grow 2 -> 4 -> 5, stale, forged and unauthenticated invitations", "[grow][grow_basic]") {
  GrowDir dir;
  Job members = start_job(2, {"grow"}, {{"GROW_DIR", dir.path}, {"KOLO_TIMEOUT", "30"}}, kWorker);
  const std::string first = read_published(dir, "invitation1", members);
  REQUIRE(first.rfind("kolo-grow-1:", 0) == 0);
  std::vector<Process> newcomers;
  newcomers.push_back(start_newcomer("grow", first, dir));
  newcomers.push_back(start_newcomer("grow", first, dir));

  // The members are now in their second growth, to 5, with a new invitation.
  const std::string second = read_published(dir, "invitation2", members);
  REQUIRE(second != first);
  expect_refused(start_newcomer("grow", first, dir).wait(30), "KOLO_ERR_CONFIG",
                 "stale: its growth .* has already taken place");
  std::string forged = second;
  forged[12] = forged[12] == '0' ? '1' : '0';  // the token's first digit
  expect_refused(start_newcomer("grow", forged, dir).wait(30), "KOLO_ERR_CONFIG",
                 "knows no growth [0-9a-f]{16}: KOLO_INVITATION is forged");
  expect_refused(start_newcomer("grow", "kolo-grow-1:not-hex", dir).wait(30), "KOLO_ERR_CONFIG",
                 "is no invitation of kolo_comm_invite");
  const ProcessResult stranger =
      start_newcomer("grow", second, dir,
                     {{"KOLO_SECRET", "a-different-secret-of-32-chars!!"}, {"KOLO_TIMEOUT", "3"}})
          .wait(30);
  INFO("newcomer with the wrong secret:\n" << stranger.output);
  CHECK(stranger.output.find("refused: KOLO_ERR") != std::string::npos);
  CHECK(stranger.output.find("could not join the growth") != std::string::npos);
  CHECK(stranger.output.find("grow passed") == std::string::npos);

  newcomers.push_back(start_newcomer("grow", second, dir));
  std::vector<ProcessResult> results = members.wait(120);
  for (auto& newcomer : newcomers) results.push_back(newcomer.wait(120));
  expect_all_pass(results, "grow passed");
  for (int rank = 0; rank < 2; ++rank) {
    INFO("member " << rank << ":\n" << results[rank].output);
    CHECK(results[rank].output.find("old communicator: communicator 1 grew to 4 ranks") !=
          std::string::npos);
  }
}

TEST_CASE("4 -> 3 (a rank dies, shrink) -> 4 (grow), split, -> 3 (the newcomer dies, shrink)",
          "[grow][grow_again]") {
  GrowDir dir;
  Job members = start_job(4, {"again"}, {{"GROW_DIR", dir.path}, {"KOLO_TIMEOUT", "20"}}, kWorker);
  Process newcomer = start_newcomer("again", read_published(dir, "invitation1", members), dir);
  std::vector<ProcessResult> results = members.wait(180);
  const ProcessResult joined = newcomer.wait(120);
  for (int rank = 0; rank < 4; ++rank) {
    INFO("member " << rank << ":\n" << results[rank].output);
    if (rank == 3) {
      CHECK(results[rank].signal == SIGKILL);
    } else {
      CHECK(results[rank].exit_code == 0);
      CHECK(results[rank].output.find("grow passed") != std::string::npos);
    }
  }
  INFO("newcomer:\n" << joined.output);
  CHECK(joined.signal == SIGKILL);
  CHECK(joined.output.find("rank 3: checked a communicator of 4 ranks") != std::string::npos);
  CHECK(joined.output.find("rank 3: dying") != std::string::npos);
}

TEST_CASE("members that ask for different sizes; a replaced invitation", "[grow][grow_mismatch]") {
  GrowDir dir;
  Job members =
      start_job(2, {"mismatch"}, {{"GROW_DIR", dir.path}, {"KOLO_TIMEOUT", "30"}}, kWorker);
  const std::string replaced = read_published(dir, "invitation0", members);
  const std::string current = read_published(dir, "invitation1", members);
  expect_refused(start_newcomer("mismatch", replaced, dir).wait(30), "KOLO_ERR_CONFIG",
                 "stale: rank 0 replaced it with a newer invitation");
  Process newcomer = start_newcomer("mismatch", current, dir, {{"KOLO_DEBUG", "INFO"}});
  wait_for_arrival(newcomer);
  std::ofstream(dir.path + "/go").put('\n');
  std::vector<ProcessResult> results = members.wait(120);
  expect_all_pass(results, "grow passed", [](const std::string& output) {
    CHECK(output.find("refused: KOLO_ERR_MISMATCH") != std::string::npos);
    CHECK(output.find("rank 0 asked for 4 ranks, rank 1 for 5") != std::string::npos);
  });
  expect_refused(newcomer.wait(60), "KOLO_ERR_MISMATCH", "rank 0 asked for 4 ranks, rank 1 for 5");
}

TEST_CASE("a newcomer killed while joining fails the growth everywhere", "[grow][grow_killed]") {
  GrowDir dir;
  constexpr double kTimeout = 8;
  Job members = start_job(
      2, {"killed"}, {{"GROW_DIR", dir.path}, {"KOLO_TIMEOUT", std::to_string(kTimeout)}}, kWorker);
  const std::string invitation = read_published(dir, "invitation1", members);
  const std::map<std::string, std::string> timeout = {{"KOLO_TIMEOUT", std::to_string(kTimeout)}};
  Process survivor = start_newcomer("killed", invitation, dir, timeout);
  std::map<std::string, std::string> dying = timeout;
  dying["GROW_DIE_AFTER_MS"] = "700";  // it has arrived by then, and waits for the decision
  dying["KOLO_DEBUG"] = "INFO";
  const ProcessResult victim = start_newcomer("killed", invitation, dir, dying).wait(30);
  INFO("the newcomer that dies:\n" << victim.output);
  REQUIRE(victim.signal == SIGKILL);
  REQUIRE(victim.output.find("waiting for the members") != std::string::npos);  // it had arrived
  std::ofstream(dir.path + "/go").put('\n');

  std::vector<ProcessResult> results = members.wait(120);
  expect_all_pass(results, "grow passed", [&](const std::string& output) {
    CHECK(std::regex_search(output, std::regex("refused: KOLO_ERR_(TIMEOUT|PEER_LOST)")));
    std::smatch took;
    REQUIRE(std::regex_search(output, took, std::regex("failed after ([0-9.]+) s")));
    CHECK(std::stod(took[1]) < 3 * kTimeout);
  });
  const ProcessResult left = survivor.wait(60);
  INFO("the newcomer that lives:\n" << left.output);
  CHECK_FALSE(left.timed_out);
  CHECK(std::regex_search(left.output, std::regex("refused: KOLO_ERR_(TIMEOUT|PEER_LOST)")));
}

TEST_CASE("too few newcomers within KOLO_TIMEOUT", "[grow][grow_few]") {
  GrowDir dir;
  const std::map<std::string, std::string> timeout = {{"KOLO_TIMEOUT", "4"}};
  Job members = start_job(2, {"killed"}, {{"GROW_DIR", dir.path}, {"KOLO_TIMEOUT", "4"}}, kWorker);
  std::map<std::string, std::string> env = timeout;
  env["KOLO_DEBUG"] = "INFO";
  Process newcomer =
      start_newcomer("killed", read_published(dir, "invitation1", members), dir, env);
  wait_for_arrival(newcomer);
  std::ofstream(dir.path + "/go").put('\n');  // the members grow to 4: one newcomer short
  const std::string expected = "1 of the 2 newcomer\\(s\\) arrived within 4 s";
  expect_all_pass(members.wait(120), "grow passed", [&](const std::string& output) {
    CHECK(output.find("refused: KOLO_ERR_TIMEOUT") != std::string::npos);
    CHECK(std::regex_search(output, std::regex(expected)));
  });
  expect_refused(newcomer.wait(60), "KOLO_ERR_TIMEOUT", expected);
}

TEST_CASE("a newcomer whose KOLO_ALLREDUCE differs", "[grow][grow_allreduce]") {
  GrowDir dir;
  Job members = start_job(2, {"killed"}, {{"GROW_DIR", dir.path}, {"KOLO_TIMEOUT", "10"}}, kWorker);
  const std::string invitation = read_published(dir, "invitation1", members);
  std::vector<Process> newcomers;
  for (const char* mode : {"auto", "ring"}) {
    newcomers.push_back(
        start_newcomer("killed", invitation, dir,
                       {{"KOLO_ALLREDUCE", mode}, {"KOLO_TIMEOUT", "10"}, {"KOLO_DEBUG", "INFO"}}));
    wait_for_arrival(newcomers.back());
  }
  std::ofstream(dir.path + "/go").put('\n');
  const std::string expected =
      "the newcomer 1 \\(process [0-9]+\\) has KOLO_ALLREDUCE=ring and rank "
      "0 has auto";
  expect_all_pass(members.wait(120), "grow passed", [&](const std::string& output) {
    CHECK(output.find("refused: KOLO_ERR_CONFIG") != std::string::npos);
    CHECK(std::regex_search(output, std::regex(expected)));
  });
  for (auto& newcomer : newcomers) expect_refused(newcomer.wait(60), "KOLO_ERR_CONFIG", expected);
}

TEST_CASE("a newcomer beyond the growth's size is refused", "[grow][grow_extra]") {
  GrowDir dir;
  Job members = start_job(2, {"extra"}, {{"GROW_DIR", dir.path}, {"KOLO_TIMEOUT", "30"}}, kWorker);
  const std::string invitation = read_published(dir, "invitation1", members);
  std::vector<Process> newcomers;
  for (int i = 0; i < 2; ++i) {
    newcomers.push_back(start_newcomer("extra", invitation, dir, {{"KOLO_DEBUG", "INFO"}}));
    wait_for_arrival(newcomers.back());  // in this order
  }
  std::ofstream(dir.path + "/go").put('\n');
  expect_all_pass(members.wait(120), "grow passed");
  const ProcessResult first = newcomers[0].wait(60);
  INFO("the first newcomer:\n" << first.output);
  CHECK(first.exit_code == 0);
  CHECK(first.output.find("rank 2: grow passed") != std::string::npos);
  expect_refused(newcomers[1].wait(60), "KOLO_ERR_CONFIG",
                 "KOLO_INVITATION is used up: its growth took 1 newcomer\\(s\\), and this process "
                 "came later \\(arrival 2\\)");
}
