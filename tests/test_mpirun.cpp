// Open MPI's mpirun on this machine, with nothing of kolo's set: no KOLO_ADDR, no MASTER_ADDR,
// no rank. Ranks exchange their start-up records through mpirun's PMIx server in one fence, and
// no store serves until a split or the fusion engine needs one (src/bootstrap/pmix.hpp,
// src/comm/connect.hpp); in a build without PMIx every rank is told to set KOLO_ADDR. The
// workers (and tests/mpirun_pmix_checks.py) check their results against their own reference.
// Skipped (77) where mpirun is not installed.
#define CATCH_CONFIG_RUNNER
#include <dlfcn.h>
#include <fmt/format.h>
#include <unistd.h>

#include <catch2/catch.hpp>
#include <chrono>
#include <cstdlib>
#include <map>
#include <string>
#include <vector>

#include "kolo_build_config.h"
#include "process.hpp"

using namespace kolo::test;

namespace {

#ifdef KOLO_HAVE_PMIX
constexpr bool kBuiltWithPmix = true;
#else
constexpr bool kBuiltWithPmix = false;
#endif

bool contains(const std::string& text, const std::string& part) {
  return text.find(part) != std::string::npos;
}

// The source tree (TESTS_SOURCE_DIR, set by Meson), or the parent of the build directory.
std::string source_dir() {
  const char* path = std::getenv("TESTS_SOURCE_DIR");
  return path && *path ? path : build_dir() + "/..";
}

// mpirun with the machine's environment minus every variable that would give kolo an address or
// a rank, so that only what mpirun itself exports is left. As root mpirun needs its two consent
// variables (users are not root).
ProcessResult mpirun(const std::vector<std::string>& arguments,
                     const std::map<std::string, std::string>& env = {}, double timeout_s = 120) {
  std::vector<std::string> argv = {"/usr/bin/env"};
  for (const char* name : {"KOLO_ADDR", "MASTER_ADDR", "MASTER_PORT", "KOLO_RANK", "KOLO_SIZE",
                           "KOLO_LOCAL_RANK", "KOLO_LOCAL_SIZE", "RANK", "WORLD_SIZE"}) {
    argv.insert(argv.end(), {"-u", name});
  }
  argv.insert(argv.end(), {"mpirun", "--oversubscribe", "--bind-to", "none"});
  argv.insert(argv.end(), arguments.begin(), arguments.end());
  std::map<std::string, std::string> extra = {{"KOLO_DEBUG", "INFO"}, {"KOLO_TIMEOUT", "60"}};
  if (::geteuid() == 0) {
    extra["OMPI_ALLOW_RUN_AS_ROOT"] = "1";
    extra["OMPI_ALLOW_RUN_AS_ROOT_CONFIRM"] = "1";
  }
  for (const auto& [name, value] : env) extra[name] = value;
  Process job(argv, extra);
  return job.wait(timeout_s);
}

// In a build without PMIx the ranks refuse, naming PMIx and KOLO_ADDR. mpirun ends the job at the
// first rank that exits with an error, so not every rank may get to say it: every rank that
// reports anything reports this, and none passes.
void expect_refused_without_pmix(const ProcessResult& result) {
  CHECK(result.exit_code != 0);
  CHECK(count(result.output, "init failed") >= 1);
  CHECK(count(result.output, "init failed: KOLO_ERR_UNSUPPORTED") ==
        count(result.output, "init failed"));
  CHECK(count(result.output, "built without PMIx") == count(result.output, "init failed"));
  CHECK(contains(result.output, "set KOLO_ADDR=host:port"));
  CHECK_FALSE(contains(result.output, "checks passed"));
}

}  // namespace

TEST_CASE("mpirun with no address: collectives compute right, rendezvous through PMIx",
          "[mpirun]") {
  const std::string worker = built_program("tests/kolo_test_worker");
  for (int ranks : {2, 4}) {
    for (const char* scenario : {"allreduce", "broadcast", "barrier"}) {
      DYNAMIC_SECTION(scenario << ", mpirun -np " << ranks) {
        ProcessResult result = mpirun({"-np", std::to_string(ranks), worker, scenario, "quick"},
                                      {{"KOLO_TRANSPORT", "tcp"}});
        INFO(result.output);
        CHECK_FALSE(result.timed_out);
        if (!kBuiltWithPmix) {
          expect_refused_without_pmix(result);
          continue;
        }
        CHECK(result.exit_code == 0);
        CHECK(count(result.output, fmt::format("{} checks passed", scenario)) ==
              static_cast<size_t>(ranks));
        CHECK(contains(result.output, "started by ompi, rendezvous through PMIx"));
        CHECK(count(result.output, fmt::format("start-up records of {} ranks from PMIx", ranks)) ==
              static_cast<size_t>(ranks));
        // Every start-up exchange went through the one fence: no rank asked the store anything,
        // and rank 0 never started serving it.
        CHECK(count(result.output, "and 0 store request(s)") == static_cast<size_t>(ranks));
        CHECK_FALSE(contains(result.output, "serving the rendezvous store"));
        CHECK_FALSE(contains(result.output, "no rendezvous address"));
      }
    }
  }
}

TEST_CASE("mpirun: communicators made one after another each get their own PMIx key", "[mpirun]") {
  ProcessResult result =
      mpirun({"-np", "3", built_program("tests/kolo_test_worker"), "reinit", "0.2"});
  INFO(result.output);
  CHECK_FALSE(result.timed_out);
  if (!kBuiltWithPmix) return expect_refused_without_pmix(result);
  CHECK(result.exit_code == 0);
  CHECK(count(result.output, "made 3 communicators one after the other") == 3);
}

TEST_CASE("mpirun: UCX's worker addresses go over its control connections, no store", "[mpirun]") {
  if (!kBuiltWithPmix) return;
  const std::string worker = built_program("tests/kolo_test_worker");
  // KOLO_TRANSPORT=auto on one host picks UCX where it is built (else TCP); ucx names it.
  for (const char* transport : {"auto", "ucx"}) {
    DYNAMIC_SECTION("KOLO_TRANSPORT=" << transport) {
      ProcessResult result = mpirun({"-np", "3", worker, "allreduce", "quick"},
                                    {{"KOLO_TRANSPORT", transport}});
      INFO(result.output);
      CHECK_FALSE(result.timed_out);
      if (std::string(transport) == "ucx" && contains(result.output, "is not available")) {
        continue;  // a build without UCX refuses it, as tested elsewhere
      }
      CHECK(result.exit_code == 0);
      CHECK(count(result.output, "allreduce checks passed") == 3);
      CHECK(count(result.output, "and 0 store request(s)") == 3);
      CHECK_FALSE(contains(result.output, "serving the rendezvous store"));
    }
  }
  SECTION("a rank whose UCX cannot start fails the others at once, naming it") {
    const auto started = std::chrono::steady_clock::now();
    ProcessResult result = mpirun({"-np", "1", "env", "UCX_TLS=no_such_transport", worker,
                                   "allreduce", "quick", ":", "-np", "2", worker, "allreduce",
                                   "quick"},
                                  {{"KOLO_TRANSPORT", "ucx"}, {"KOLO_TIMEOUT", "30"}});
    const double seconds =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - started).count();
    INFO(result.output);
    if (contains(result.output, "is not available")) return;  // no UCX in this build
    CHECK_FALSE(result.timed_out);
    CHECK(result.exit_code != 0);
    CHECK(contains(result.output, "ucx: UCX could not start"));
    CHECK_FALSE(contains(result.output, "checks passed"));
    CHECK(seconds < 25);  // well before KOLO_TIMEOUT
  }
}

// tests/mpirun_pmix_checks.py under Debian's Python (numpy): no store listens after start-up, a
// split and the fusion engine start it on world rank 0's process; shrink and grow work.
TEST_CASE("mpirun: no store at start-up; split, fusion, shrink and grow", "[mpirun]") {
  if (!kBuiltWithPmix) return;
  // Under scripts/sanitize.sh asan every program links AddressSanitizer's runtime, which must come
  // first in a process: Debian's python cannot load the instrumented libkolo. The same checks in C
  // (the sections above, and the split, shrink and grow tests) run under ASan.
  if (::dlsym(RTLD_DEFAULT, "__asan_init") != nullptr) {
    WARN("skipped under AddressSanitizer: Debian's python cannot load an instrumented libkolo");
    return;
  }
  if (std::system("/usr/bin/python3 -c 'import numpy' >/dev/null 2>&1") != 0) {
    WARN("skipped: Debian's /usr/bin/python3 with numpy is not installed");
    return;
  }
  const std::map<std::string, std::string> python = {
      {"PYTHONPATH", source_dir() + "/python"},
      {"KOLO_LIBRARY", built_program("capi/libkolo.so")},
      {"KOLO_TRANSPORT", "tcp"}};  // UCX opens listeners of its own
  const std::string script = source_dir() + "/tests/mpirun_pmix_checks.py";
  for (const char* scenario : {"startup", "shrink", "grow"}) {
    DYNAMIC_SECTION(scenario) {
      ProcessResult result = mpirun({"-np", "3", "/usr/bin/python3", script, scenario}, python);
      INFO(result.output);
      CHECK_FALSE(result.timed_out);
      CHECK(result.exit_code == 0);
      CHECK(count(result.output, fmt::format("{} checks passed", scenario)) == 3);
      if (std::string(scenario) == "startup") {
        CHECK(count(result.output, "1 listening socket(s) after start-up") == 3);
        CHECK(count(result.output, "serving the rendezvous store at port") == 1);
      }
      if (std::string(scenario) == "grow") CHECK(contains(result.output, "newcomer passed"));
    }
  }
}

TEST_CASE("mpirun: a process of the job that never starts kolo fails the fence within KOLO_TIMEOUT",
          "[mpirun]") {
  if (!kBuiltWithPmix) return;
  // Rank 1 is in mpirun's job but sleeps instead of calling kolo_comm_init: rank 0 waits in the
  // PMIx fence, gives up after KOLO_TIMEOUT and says what to set instead.
  const auto started = std::chrono::steady_clock::now();
  ProcessResult result = mpirun({"-np", "1", built_program("tests/kolo_test_worker"), "allreduce",
                                 "quick", ":", "-np", "1", "sleep", "8"},
                                {{"KOLO_TIMEOUT", "2"}});
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - started).count();
  INFO(result.output);
  CHECK_FALSE(result.timed_out);
  CHECK(result.exit_code != 0);
  CHECK(contains(result.output, "init failed: KOLO_ERR_TIMEOUT"));
  CHECK(contains(result.output, "rank 0 of 2: the PMIx fence"));
  CHECK(contains(result.output, "within 2 s (KOLO_TIMEOUT)"));
  CHECK(contains(result.output, "set KOLO_ADDR=host:port"));
  CHECK(seconds < 30);
}

int main(int argc, char** argv) {
  if (std::system("command -v mpirun >/dev/null 2>&1") != 0) {
    std::puts("skipped: mpirun (Debian's openmpi-bin) is not installed");
    return 77;
  }
  return Catch::Session().run(argc, argv);
}
