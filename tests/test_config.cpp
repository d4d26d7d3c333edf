// Configuration from launchers' environments, precedence, validation and its messages; sizes;
// status names; the logger's line format; hwloc topology and binding.
//
// Every test passes its environment explicitly, so the environment the tests run in (a CI job
// under Slurm, say) cannot change their outcome.
#include <sched.h>
#include <sys/stat.h>
#include <unistd.h>

#include <catch2/catch.hpp>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <regex>
#include <set>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "capture_stderr.hpp"
#include "comm/communicator.hpp"
#include "core/config.hpp"
#include "core/log.hpp"
#include "core/topology.hpp"
#include "kolo/status.hpp"
#include "process.hpp"

using Catch::Matchers::Contains;
using kolo::Config;
using kolo::ConfigOverrides;
using kolo::Environment;
using kolo::Status;

namespace {

Config resolve(const Environment& env, const ConfigOverrides& overrides = {}) {
  return kolo::resolve_config(overrides, env);
}

struct Failure {
  bool thrown = false;
  Status status = Status::kSuccess;
  std::string message;
};

Failure resolve_failure(const Environment& env, const ConfigOverrides& overrides = {}) {
  try {
    kolo::resolve_config(overrides, env);
  } catch (const kolo::Error& error) {
    return {true, error.status(), error.what()};
  }
  return {};
}

// A valid two-rank job set up by hand, to which each test adds or changes one thing.
Environment kolo_job(Environment extra = {}) {
  Environment env = {{"KOLO_RANK", "1"}, {"KOLO_SIZE", "2"}, {"KOLO_ADDR", "node0:29500"}};
  for (auto& [name, value] : extra) env[name] = value;
  return env;
}

}  // namespace

// ---- Launchers ---------------------------------------------------------------------------------

TEST_CASE("kolo's own variables (kolorun) give rank, size and locals", "[config]") {
  Config config = resolve({{"KOLO_RANK", "2"},
                           {"KOLO_SIZE", "4"},
                           {"KOLO_LOCAL_RANK", "0"},
                           {"KOLO_LOCAL_SIZE", "2"},
                           {"KOLO_ADDR", "node0:29500"}});
  CHECK(config.launcher == "kolo");
  CHECK(config.rank == 2);
  CHECK(config.size == 4);
  CHECK(config.local_rank == 0);
  CHECK(config.local_size == 2);
  CHECK(config.addr == "node0:29500");
}

TEST_CASE("Open MPI's mpirun variables", "[config]") {
  Config config = resolve({{"OMPI_COMM_WORLD_RANK", "5"},
                           {"OMPI_COMM_WORLD_SIZE", "8"},
                           {"OMPI_COMM_WORLD_LOCAL_RANK", "1"},
                           {"OMPI_COMM_WORLD_LOCAL_SIZE", "4"},
                           {"PMIX_RANK", "5"},
                           {"KOLO_ADDR", "10.0.0.1:29500"}});
  CHECK(config.launcher == "ompi");
  CHECK(config.rank == 5);
  CHECK(config.size == 8);
  CHECK(config.local_rank == 1);
  CHECK(config.local_size == 4);
}

TEST_CASE("MPICH / Intel MPI (Hydra, PMI) variables", "[config]") {
  Config config = resolve({{"PMI_RANK", "3"},
                           {"PMI_SIZE", "6"},
                           {"MPI_LOCALRANKID", "0"},
                           {"MPI_LOCALNRANKS", "3"},
                           {"SLURM_PROCID", "0"},  // Hydra inside an allocation: PMI wins
                           {"SLURM_NTASKS", "2"},
                           {"KOLO_ADDR", "node0:29500"}});
  CHECK(config.launcher == "pmi");
  CHECK(config.rank == 3);
  CHECK(config.size == 6);
  CHECK(config.local_rank == 0);
  CHECK(config.local_size == 3);
}

TEST_CASE("Slurm's srun variables", "[config]") {
  Environment env = {{"SLURM_PROCID", "5"},
                     {"SLURM_NTASKS", "8"},
                     {"SLURM_LOCALID", "1"},
                     {"SLURM_NODEID", "1"},
                     {"SLURM_TASKS_PER_NODE", "4(x2)"},
                     {"KOLO_ADDR", "node0:29500"}};

  SECTION("uniform layout") {
    Config config = resolve(env);
    CHECK(config.launcher == "slurm");
    CHECK(config.rank == 5);
    CHECK(config.size == 8);
    CHECK(config.local_rank == 1);
    CHECK(config.local_size == 4);
  }
  SECTION("uneven layout: this node's entry is used") {
    env["SLURM_PROCID"] = "9";
    env["SLURM_NTASKS"] = "11";
    env["SLURM_NODEID"] = "2";
    env["SLURM_TASKS_PER_NODE"] = "4(x2),3";
    Config config = resolve(env);
    CHECK(config.local_size == 3);
  }
  SECTION("the step's layout beats the job's") {
    env["SLURM_STEP_TASKS_PER_NODE"] = "2(x4)";
    CHECK(resolve(env).local_size == 2);
  }
  SECTION("SLURM_NPROCS when SLURM_NTASKS is missing") {
    env.erase("SLURM_NTASKS");
    env["SLURM_NPROCS"] = "8";
    CHECK(resolve(env).size == 8);
  }
  SECTION("SLURM_NTASKS_PER_NODE when no layout is exported") {
    env.erase("SLURM_TASKS_PER_NODE");
    env["SLURM_NTASKS_PER_NODE"] = "4";
    CHECK(resolve(env).local_size == 4);
  }
  SECTION("an uneven layout without SLURM_NODEID leaves the local size unknown") {
    env.erase("SLURM_NODEID");
    env["SLURM_TASKS_PER_NODE"] = "4,4";
    Config config = resolve(env);
    CHECK(config.local_size == -1);
    CHECK(config.local_rank == 1);
  }
  SECTION("srun --mpi=pmix exports PMIX_RANK as well; still slurm") {
    env["PMIX_RANK"] = "5";
    Config config = resolve(env);
    CHECK(config.launcher == "slurm");
    CHECK(config.size == 8);
  }
}

TEST_CASE("torchrun's variables, with MASTER_ADDR and MASTER_PORT", "[config]") {
  Environment env = {{"RANK", "3"},
                     {"WORLD_SIZE", "4"},
                     {"LOCAL_RANK", "1"},
                     {"LOCAL_WORLD_SIZE", "2"},
                     {"MASTER_ADDR", "node7"},
                     {"MASTER_PORT", "29400"},
                     {"TORCHELASTIC_RUN_ID", "none"},
                     {"TORCHELASTIC_USE_AGENT_STORE", "True"}};
  Config config = resolve(env);
  CHECK(config.launcher == "torchrun");
  CHECK(config.rank == 3);
  CHECK(config.size == 4);
  CHECK(config.local_rank == 1);
  CHECK(config.local_size == 2);
  CHECK(config.addr == "node7:29401");  // torchrun's own store holds MASTER_PORT

  SECTION("under torchrun's c10d rendezvous no agent store holds MASTER_PORT: it is kolo's") {
    env["TORCHELASTIC_USE_AGENT_STORE"] = "False";
    CHECK(resolve(env).addr == "node7:29400");
    env.erase("TORCHELASTIC_USE_AGENT_STORE");
    CHECK(resolve(env).addr == "node7:29400");
  }
  SECTION("without torchrun's agent, MASTER_PORT is kolo's") {
    env.erase("TORCHELASTIC_RUN_ID");
    env["KOLO_RANK"] = "3";
    env["KOLO_SIZE"] = "4";
    CHECK(resolve(env).addr == "node7:29400");
  }
  SECTION("no port after MASTER_PORT=65535") {
    env["MASTER_PORT"] = "65535";
    Failure failure = resolve_failure(env);
    CHECK(failure.status == Status::kConfig);
    CHECK_THAT(failure.message, Contains("65535") && Contains("KOLO_ADDR"));
  }

  SECTION("torchrun inside an srun step: torchrun is the innermost launcher") {
    env["SLURM_PROCID"] = "1";
    env["SLURM_NTASKS"] = "2";
    env["SLURM_LOCALID"] = "0";
    CHECK(resolve(env).launcher == "torchrun");
    CHECK(resolve(env).rank == 3);
  }
  SECTION("a bare IPv6 MASTER_ADDR gets brackets") {
    env["MASTER_ADDR"] = "fe80::1";
    CHECK(resolve(env).addr == "[fe80::1]:29401");
  }
  SECTION("KOLO_ADDR beats MASTER_ADDR") {
    env["KOLO_ADDR"] = "node0:1234";
    CHECK(resolve(env).addr == "node0:1234");
  }
}

TEST_CASE("a bare PMIx launch without a size asks for KOLO_SIZE", "[config]") {
  Failure failure = resolve_failure({{"PMIX_RANK", "0"}, {"KOLO_ADDR", "node0:29500"}});
  REQUIRE(failure.thrown);
  CHECK(failure.status == Status::kConfig);
  CHECK_THAT(failure.message, Contains("PMIX_RANK") && Contains("KOLO_SIZE"));
  CHECK(resolve({{"PMIX_RANK", "0"}, {"KOLO_SIZE", "2"}, {"KOLO_ADDR", "n:1"}}).launcher == "pmi");
}

// ---- Precedence ------------------------------------------------------------------------------

TEST_CASE("precedence: overrides > KOLO_* > launcher > defaults", "[config]") {
  Environment env = {{"OMPI_COMM_WORLD_RANK", "1"},
                     {"OMPI_COMM_WORLD_SIZE", "4"},
                     {"OMPI_COMM_WORLD_LOCAL_RANK", "1"},
                     {"OMPI_COMM_WORLD_LOCAL_SIZE", "2"},
                     {"KOLO_ADDR", "node0:29500"}};

  SECTION("KOLO_SIZE beats the launcher's size; the launcher still supplies the rank") {
    env["KOLO_SIZE"] = "8";
    Config config = resolve(env);
    CHECK(config.launcher == "ompi");
    CHECK(config.rank == 1);
    CHECK(config.size == 8);
  }
  SECTION("an override beats KOLO_*") {
    env["KOLO_SIZE"] = "8";
    env["KOLO_LOCAL_RANK"] = "0";
    ConfigOverrides overrides;
    overrides.size = 16;
    overrides.local_rank = 1;
    overrides.addr = "other:1";
    Config config = resolve(env, overrides);
    CHECK(config.size == 16);
    CHECK(config.local_rank == 1);
    CHECK(config.addr == "other:1");
  }
  SECTION("KOLO_RANK beats the launcher, and then no launcher variable is read") {
    env["KOLO_RANK"] = "0";
    env["KOLO_SIZE"] = "2";
    Config config = resolve(env);
    CHECK(config.launcher == "kolo");
    CHECK(config.rank == 0);
    CHECK(config.size == 2);
    CHECK(config.local_rank == -1);  // not OMPI's 1: one launcher at a time
    CHECK(config.local_size == -1);
  }
  SECTION("a rank from the config struct is reported as \"config\"") {
    ConfigOverrides overrides;
    overrides.rank = 3;
    overrides.size = 4;
    Config config = resolve(env, overrides);
    CHECK(config.launcher == "config");
    CHECK(config.rank == 3);
    CHECK(config.local_rank == -1);
  }
  SECTION("tuning fields: override beats KOLO_*, KOLO_* beats the default") {
    env["KOLO_TIMEOUT"] = "10";
    env["KOLO_TCP_STREAMS"] = "4";
    env["KOLO_SEGMENT_BYTES"] = "64K";
    env["KOLO_SECRET"] = "from-env-0123456789";
    env["KOLO_SOCKET_IFNAME"] = "eth0";
    Config from_env = resolve(env);
    CHECK(from_env.timeout_s == 10.0);
    CHECK(from_env.tcp_streams == 4);
    CHECK(from_env.segment_bytes == 64 * 1024);
    CHECK(from_env.secret == "from-env-0123456789");
    CHECK(from_env.socket_ifname == "eth0");

    ConfigOverrides overrides;
    overrides.timeout_s = 2.5;
    overrides.tcp_streams = 2;
    overrides.segment_bytes = 8192;
    overrides.secret = "from-config-0123456789";
    overrides.socket_ifname = "ib0";
    Config from_config = resolve(env, overrides);
    CHECK(from_config.timeout_s == 2.5);
    CHECK(from_config.tcp_streams == 2);
    CHECK(from_config.segment_bytes == 8192);
    CHECK(from_config.secret == "from-config-0123456789");
    CHECK(from_config.socket_ifname == "ib0");
  }
}

TEST_CASE("defaults", "[config]") {
  Config config = resolve(kolo_job());
  CHECK(config.timeout_s == 300.0);
  CHECK(config.tcp_streams == 1);
  CHECK(config.segment_bytes == 1024 * 1024);
  CHECK(config.transport == "auto");
  CHECK(config.allreduce == "auto");
  CHECK(config.host_id.empty());
  CHECK(config.bind == "none");
  CHECK(config.secret.empty());
  CHECK(config.socket_ifname.empty());
  CHECK(config.local_rank == -1);  // size 2 with no local information: derived later
  CHECK(config.local_size == -1);
  CHECK(config.cycle_time_ms == 5.0);
  CHECK(config.cache_capacity == 1024);
  CHECK(config.fusion_threshold_bytes == 64u << 20);
  CHECK(config.stall_warning_s == 60.0);
  CHECK(config.stall_abort_s == 0.0);
  CHECK(config.timeline_path.empty());
  CHECK(config.store_fd == -1);
}

TEST_CASE("a job of one rank has local rank 0 of 1", "[config]") {
  Config config = resolve({{"KOLO_RANK", "0"}, {"KOLO_SIZE", "1"}, {"KOLO_ADDR", "localhost:1"}});
  CHECK(config.local_rank == 0);
  CHECK(config.local_size == 1);
}

TEST_CASE("accepted spellings", "[config]") {
  CHECK(resolve(kolo_job({{"KOLO_TIMEOUT", "0.5"}})).timeout_s == 0.5);
  CHECK(resolve(kolo_job({{"KOLO_STORE_FD", "3"}})).store_fd == 3);
  CHECK(resolve(kolo_job({{"KOLO_TIMEOUT", " 30 "}})).timeout_s == 30.0);
  CHECK(resolve(kolo_job({{"KOLO_TRANSPORT", "UCX"}})).transport == "ucx");
  CHECK(resolve(kolo_job({{"KOLO_TRANSPORT", "auto"}})).transport == "auto");
  CHECK(resolve(kolo_job()).shm == "auto");
  CHECK(resolve(kolo_job({{"KOLO_SHM", "0"}})).shm == "0");
  CHECK(resolve(kolo_job({{"KOLO_SHM", " 1 "}})).shm == "1");
  CHECK(resolve(kolo_job({{"KOLO_SHM", "AUTO"}})).shm == "auto");
  CHECK(resolve(kolo_job({})).shm_copy == "auto");
  CHECK(resolve(kolo_job({{"KOLO_SHM_COPY", "stream"}})).shm_copy == "stream");
  CHECK(resolve(kolo_job({{"KOLO_SHM_COPY", "plain"}})).shm_copy == "plain");
  CHECK(resolve(kolo_job()).tcp_congestion == "auto");
  CHECK(resolve(kolo_job({{"KOLO_TCP_CONGESTION", " Cubic "}})).tcp_congestion == "cubic");
  CHECK(resolve(kolo_job({{"KOLO_TCP_CONGESTION", "system"}})).tcp_congestion == "system");
  CHECK(resolve(kolo_job({{"KOLO_TCP_CONGESTION", "dctcp"}})).tcp_congestion == "dctcp");
  CHECK(resolve(kolo_job({{"KOLO_ALLREDUCE", "Hierarchical"}})).allreduce == "hierarchical");
  CHECK(resolve(kolo_job({{"KOLO_ALLREDUCE", "ring"}})).allreduce == "ring");
  CHECK(resolve(kolo_job({{"KOLO_HOST_ID", " rack3-node7 "}})).host_id == "rack3-node7");
  CHECK(resolve(kolo_job({{"KOLO_BIND", "Core"}})).bind == "core");
  CHECK(resolve(kolo_job({{"KOLO_BIND", "numa"}})).bind == "numa");
  CHECK(resolve(kolo_job()).gpu_backend == "auto");
  CHECK(resolve(kolo_job({{"KOLO_GPU_BACKEND", "NCCL"}})).gpu_backend == "nccl");
  CHECK(resolve(kolo_job({{"KOLO_GPU_BACKEND", "staged"}})).gpu_backend == "staged");
  CHECK(resolve(kolo_job({{"KOLO_SEGMENT_BYTES", "4KiB"}})).segment_bytes == 4096);
  CHECK(resolve(kolo_job({{"KOLO_SEGMENT_BYTES", "256M"}})).segment_bytes == 256u << 20);
  CHECK(resolve(kolo_job({{"KOLO_TCP_STREAMS", "16"}})).tcp_streams == 16);
  CHECK(resolve(kolo_job({{"KOLO_ADDR", "[::1]:29500"}})).addr == "[::1]:29500");
  CHECK(resolve(kolo_job({{"KOLO_FUSION_THRESHOLD", "0"}})).fusion_threshold_bytes == 0);
  CHECK(resolve(kolo_job({{"KOLO_CYCLE_TIME_MS", "3.5"}})).cycle_time_ms == 3.5);
  CHECK(resolve(kolo_job({{"KOLO_TIMELINE", "/tmp/t.json"}})).timeline_path == "/tmp/t.json");
  CHECK_FALSE(resolve(kolo_job()).autotune);
  CHECK(resolve(kolo_job({{"KOLO_AUTOTUNE", "1"}})).autotune);
  CHECK_FALSE(resolve(kolo_job({{"KOLO_AUTOTUNE", "0"}})).autotune);
  CHECK(resolve(kolo_job({{"KOLO_AUTOTUNE_LOG", "/tmp/a.csv"}})).autotune_log_path ==
        "/tmp/a.csv");
  CHECK(resolve(kolo_job()).autotune_window_ms == 1000);
  CHECK(resolve(kolo_job({{"KOLO_AUTOTUNE_WINDOW_MS", "50"}})).autotune_window_ms == 50);
  // An empty variable counts as unset.
  CHECK(resolve(kolo_job({{"KOLO_TIMEOUT", ""}})).timeout_s == 300.0);
}

// A file in /tmp holding `content` with the given mode, removed again by the destructor.
struct SecretFile {
  std::string path;
  SecretFile(const std::string& content, mode_t mode) {
    char name[] = "/tmp/kolo-secret-XXXXXX";
    int fd = ::mkstemp(name);
    REQUIRE(fd >= 0);
    REQUIRE(::write(fd, content.data(), content.size()) == static_cast<ssize_t>(content.size()));
    REQUIRE(::fchmod(fd, mode) == 0);
    ::close(fd);
    path = name;
  }
  ~SecretFile() { ::unlink(path.c_str()); }
};

TEST_CASE("KOLO_SECRET_FILE: the secret from a file only its owner can read", "[config]") {
  SECTION("read, surrounding white space dropped") {
    SecretFile file("  0123abcd-job-secret\n", 0600);
    CHECK(resolve(kolo_job({{"KOLO_SECRET_FILE", file.path}})).secret == "0123abcd-job-secret");
  }
  SECTION("the config struct's secret still wins") {
    SecretFile file("from-file-0123456789", 0400);
    ConfigOverrides overrides;
    overrides.secret = "from-config-0123456789";
    CHECK(resolve(kolo_job({{"KOLO_SECRET_FILE", file.path}}), overrides).secret ==
          "from-config-0123456789");
  }
  SECTION("refused, naming the file and why") {
    SecretFile open_to_group("secret-0123456789", 0640);
    SecretFile empty(" \n", 0600);
    SecretFile too_long(std::string(5000, 'x'), 0600);
    struct Case {
      Environment env;
      std::vector<std::string> words;
    };
    std::vector<Case> cases = {
        {kolo_job({{"KOLO_SECRET_FILE", open_to_group.path}}),
         {open_to_group.path, "mode 640", "chmod 600"}},
        {kolo_job({{"KOLO_SECRET_FILE", empty.path}}), {empty.path, "empty"}},
        {kolo_job({{"KOLO_SECRET_FILE", too_long.path}}), {too_long.path, "4096"}},
        {kolo_job({{"KOLO_SECRET_FILE", "/nonexistent/kolo-secret"}}),
         {"/nonexistent/kolo-secret", "No such file"}},
        {kolo_job({{"KOLO_SECRET_FILE", "/tmp"}}), {"/tmp", "not a regular file"}},
        {kolo_job({{"KOLO_SECRET_FILE", empty.path}, {"KOLO_SECRET", "x"}}),
         {"KOLO_SECRET and KOLO_SECRET_FILE are both set"}},
    };
    for (const Case& c : cases) {
      Failure failure = resolve_failure(c.env);
      INFO(failure.message);
      CHECK(failure.thrown);
      CHECK(failure.status == Status::kConfig);
      for (const auto& word : c.words) CHECK_THAT(failure.message, Contains(word));
    }
  }
}

// ---- Errors ----------------------------------------------------------------------------------

TEST_CASE("a job secret shorter than 16 characters is refused, naming where it came from",
          "[config]") {
  SecretFile short_file("  fifteen-chars!\n", 0600);
  ConfigOverrides short_override;
  short_override.secret = "short";
  struct Case {
    Environment env;
    ConfigOverrides overrides;
    std::string source;
  };
  std::vector<Case> cases = {
      {kolo_job({{"KOLO_SECRET", "only-15-chars!!"}}), {}, "KOLO_SECRET"},
      {kolo_job({{"KOLO_SECRET_FILE", short_file.path}}), {}, "KOLO_SECRET_FILE=" + short_file.path},
      {kolo_job(), short_override, "kolo_config_t.secret"},
  };
  for (const Case& c : cases) {
    Failure failure = resolve_failure(c.env, c.overrides);
    INFO(failure.message);
    CHECK(failure.thrown);
    CHECK(failure.status == Status::kConfig);
    CHECK_THAT(failure.message, Contains(c.source) && Contains("at least 16"));
    CHECK_THAT(failure.message, !Contains("only-15-chars") && !Contains("fifteen"));  // not shown
  }
  // 16 is enough; no secret at all is still allowed (and warned about by the communicator).
  CHECK(resolve(kolo_job({{"KOLO_SECRET", std::string(16, 's')}})).secret.size() == 16);
  CHECK(resolve(kolo_job({{"KOLO_SECRET", ""}})).secret.empty());
}

TEST_CASE("no launcher at all: a world of one on the loopback", "[config]") {
  Config config = resolve({{"HOME", "/root"}, {"PATH", "/usr/bin"}});
  CHECK(config.launcher == kolo::kNoLauncher);
  CHECK(config.rank == 0);
  CHECK(config.size == 1);
  CHECK(config.local_rank == 0);
  CHECK(config.local_size == 1);
  CHECK(config.addr == "127.0.0.1:0");
  // An address of the caller's choosing still wins, and MASTER_* alone names no launcher.
  CHECK(resolve({{"KOLO_ADDR", "node0:1"}}).addr == "node0:1");
  CHECK(resolve({{"MASTER_ADDR", "node0"}, {"MASTER_PORT", "5"}}).size == 1);
}

TEST_CASE("a launcher's size or local rank without a rank is an error, not a world of one",
          "[config]") {
  const char* partial[] = {
      "KOLO_SIZE",  "KOLO_LOCAL_RANK", "KOLO_LOCAL_SIZE",  "OMPI_COMM_WORLD_SIZE", "PMI_SIZE",
      "WORLD_SIZE", "LOCAL_RANK",      "LOCAL_WORLD_SIZE", "TORCHELASTIC_RUN_ID"};
  for (const char* name : partial) {
    INFO(name);
    Failure failure = resolve_failure({{name, "2"}, {"KOLO_ADDR", "node0:1"}});
    REQUIRE(failure.thrown);
    CHECK(failure.status == Status::kConfig);
    CHECK_THAT(failure.message, Contains(std::string(name) + "=2"));
    for (const char* word : {"KOLO_RANK", "kolorun", "mpirun", "srun", "torchrun"}) {
      CHECK_THAT(failure.message, Contains(word));
    }
  }
  ConfigOverrides overrides;
  overrides.size = 4;
  Failure failure = resolve_failure({}, overrides);
  REQUIRE(failure.thrown);
  CHECK_THAT(failure.message, Contains("kolo_config_t.size"));
}

TEST_CASE("a rank without a size names KOLO_SIZE", "[config]") {
  Failure failure = resolve_failure({{"KOLO_RANK", "0"}, {"KOLO_ADDR", "node0:1"}});
  REQUIRE(failure.thrown);
  CHECK(failure.status == Status::kConfig);
  CHECK_THAT(failure.message, Contains("KOLO_RANK") && Contains("KOLO_SIZE"));
}

TEST_CASE("under a PMIx server with no address given, the address comes from PMIx", "[config]") {
  Environment mpirun = {{"OMPI_COMM_WORLD_RANK", "1"}, {"OMPI_COMM_WORLD_SIZE", "2"},
                        {"PMIX_RANK", "1"}, {"PMIX_NAMESPACE", "1234"}};
  SECTION("mpirun") {
    Config config = resolve(mpirun);
    CHECK(config.pmix_rendezvous);
    CHECK(config.addr.empty());
  }
  SECTION("srun --mpi=pmix") {
    Config config = resolve({{"SLURM_PROCID", "0"}, {"SLURM_NTASKS", "2"},
                             {"PMIX_RANK", "0"}, {"PMIX_NAMESPACE", "slurm.pmix.7.0"}});
    CHECK(config.launcher == "slurm");
    CHECK(config.pmix_rendezvous);
  }
  SECTION("KOLO_ADDR wins") {
    mpirun["KOLO_ADDR"] = "node0:29500";
    Config config = resolve(mpirun);
    CHECK_FALSE(config.pmix_rendezvous);
    CHECK(config.addr == "node0:29500");
  }
  SECTION("MASTER_ADDR and MASTER_PORT win") {
    mpirun["MASTER_ADDR"] = "node0";
    mpirun["MASTER_PORT"] = "29500";
    Config config = resolve(mpirun);
    CHECK_FALSE(config.pmix_rendezvous);
    CHECK(config.addr == "node0:29500");
  }
  SECTION("KOLO_RANK's job (kolorun inside an allocation) does not use it") {
    Failure failure = resolve_failure(
        {{"KOLO_RANK", "0"}, {"KOLO_SIZE", "2"}, {"PMIX_RANK", "0"}, {"PMIX_NAMESPACE", "1"}});
    REQUIRE(failure.thrown);
    CHECK_THAT(failure.message, Contains("KOLO_ADDR=host:port"));
  }
  SECTION("PMIX_RANK without PMIX_NAMESPACE is no PMIx server") {
    mpirun.erase("PMIX_NAMESPACE");
    Failure failure = resolve_failure(mpirun);
    REQUIRE(failure.thrown);
    CHECK_THAT(failure.message, Contains("mpirun") && Contains("KOLO_ADDR"));
  }
}

TEST_CASE("no address: the message says what to set", "[config]") {
  SECTION("by hand") {
    Failure failure = resolve_failure({{"KOLO_RANK", "0"}, {"KOLO_SIZE", "2"}});
    REQUIRE(failure.thrown);
    CHECK(failure.status == Status::kConfig);
    CHECK_THAT(failure.message, Contains("KOLO_ADDR=host:port") && Contains("MASTER_ADDR") &&
                                    Contains("MASTER_PORT"));
  }
  SECTION("in a Slurm batch script, which is no srun step") {
    Failure failure =
        resolve_failure({{"SLURM_PROCID", "0"}, {"SLURM_NTASKS", "2"}, {"SLURM_LOCALID", "0"}});
    REQUIRE(failure.thrown);
    CHECK_THAT(failure.message, Contains("SLURM_STEP_ID is not") && Contains("with srun") &&
                                    Contains("KOLO_ADDR=host:port"));
  }
  SECTION("under mpirun") {
    Failure failure =
        resolve_failure({{"OMPI_COMM_WORLD_RANK", "0"}, {"OMPI_COMM_WORLD_SIZE", "2"}});
    REQUIRE(failure.thrown);
    CHECK_THAT(failure.message, Contains("mpirun") && Contains("KOLO_ADDR"));
  }
  SECTION("MASTER_ADDR without MASTER_PORT") {
    Failure failure =
        resolve_failure({{"KOLO_RANK", "0"}, {"KOLO_SIZE", "2"}, {"MASTER_ADDR", "node0"}});
    REQUIRE(failure.thrown);
    CHECK_THAT(failure.message, Contains("MASTER_PORT"));
  }
}

TEST_CASE("bad values name the variable and the value", "[config]") {
  struct Case {
    Environment change;
    std::string variable;  // must appear in the message
    std::string value;     // must appear in the message
  };
  std::vector<Case> cases = {
      {{{"KOLO_TIMEOUT", "abc"}}, "KOLO_TIMEOUT", "abc"},
      {{{"KOLO_TIMEOUT", "-1"}}, "KOLO_TIMEOUT", "-1"},
      {{{"KOLO_TIMEOUT", "0"}}, "KOLO_TIMEOUT", "0"},
      {{{"KOLO_TIMEOUT", "inf"}}, "KOLO_TIMEOUT", "inf"},
      {{{"KOLO_TIMEOUT", "nan"}}, "KOLO_TIMEOUT", "nan"},
      {{{"KOLO_TIMEOUT", "10s"}}, "KOLO_TIMEOUT", "10s"},
      {{{"KOLO_TCP_STREAMS", "0"}}, "KOLO_TCP_STREAMS", "0"},
      {{{"KOLO_TCP_STREAMS", "17"}}, "KOLO_TCP_STREAMS", "17"},
      {{{"KOLO_TCP_STREAMS", "two"}}, "KOLO_TCP_STREAMS", "two"},
      {{{"KOLO_TCP_CONGESTION", "reno!"}}, "KOLO_TCP_CONGESTION", "reno!"},
      {{{"KOLO_TCP_CONGESTION", "sixteen-letters1"}}, "KOLO_TCP_CONGESTION", "sixteen-letters1"},
      {{{"KOLO_SEGMENT_BYTES", "1"}}, "KOLO_SEGMENT_BYTES", "1"},
      {{{"KOLO_SEGMENT_BYTES", "512M"}}, "KOLO_SEGMENT_BYTES", "512M"},
      {{{"KOLO_SEGMENT_BYTES", "1X"}}, "KOLO_SEGMENT_BYTES", "1X"},
      {{{"KOLO_TRANSPORT", "foo"}}, "KOLO_TRANSPORT", "foo"},
      {{{"KOLO_SHM", "yes"}}, "KOLO_SHM", "yes"},
      {{{"KOLO_UCX_SHM", "0"}}, "KOLO_UCX_SHM", "KOLO_SHM"},  // renamed: the error says so
      {{{"KOLO_UCX_SHM_COPY", "plain"}}, "KOLO_UCX_SHM_COPY", "KOLO_SHM_COPY"},
      {{{"KOLO_ALLREDUCE", "tree"}}, "KOLO_ALLREDUCE", "tree"},
      {{{"KOLO_HOST_ID", std::string(129, 'h')}}, "KOLO_HOST_ID", std::string(129, 'h')},
      {{{"KOLO_SHM_COPY", "nt"}}, "KOLO_SHM_COPY", "nt"},
      {{{"KOLO_BIND", "socket"}}, "KOLO_BIND", "socket"},
      {{{"KOLO_GPU_BACKEND", "mpi"}}, "KOLO_GPU_BACKEND", "mpi"},
      {{{"KOLO_RANK", "2"}}, "KOLO_RANK", "2"},  // size is 2
      {{{"KOLO_RANK", "-1"}}, "KOLO_RANK", "-1"},
      {{{"KOLO_RANK", "one"}}, "KOLO_RANK", "one"},
      {{{"KOLO_SIZE", "0"}}, "KOLO_SIZE", "0"},
      {{{"KOLO_SIZE", "99999999999"}}, "KOLO_SIZE", "99999999999"},
      {{{"KOLO_LOCAL_RANK", "2"}, {"KOLO_LOCAL_SIZE", "2"}}, "KOLO_LOCAL_RANK", "2"},
      {{{"KOLO_LOCAL_SIZE", "3"}}, "KOLO_LOCAL_SIZE", "3"},  // more than the size
      {{{"KOLO_ADDR", "node0"}}, "KOLO_ADDR", "node0"},
      {{{"KOLO_ADDR", "node0:99999"}}, "KOLO_ADDR", "node0:99999"},
      {{{"KOLO_ADDR", ":29500"}}, "KOLO_ADDR", ":29500"},
      {{{"KOLO_STORE_FD", "-1"}}, "KOLO_STORE_FD", "-1"},
      {{{"KOLO_STORE_FD", "socket"}}, "KOLO_STORE_FD", "socket"},
      {{{"KOLO_CYCLE_TIME_MS", "0"}}, "KOLO_CYCLE_TIME_MS", "0"},
      {{{"KOLO_CACHE_CAPACITY", "-1"}}, "KOLO_CACHE_CAPACITY", "-1"},
      {{{"KOLO_FUSION_THRESHOLD", "8G"}}, "KOLO_FUSION_THRESHOLD", "8G"},
      {{{"KOLO_STALL_WARNING_S", "-5"}}, "KOLO_STALL_WARNING_S", "-5"},
      {{{"KOLO_STALL_ABORT_S", "soon"}}, "KOLO_STALL_ABORT_S", "soon"},
      {{{"KOLO_AUTOTUNE", "yes"}}, "KOLO_AUTOTUNE", "yes"},
      {{{"KOLO_AUTOTUNE", "2"}}, "KOLO_AUTOTUNE", "2"},
      {{{"KOLO_AUTOTUNE_WINDOW_MS", "0"}}, "KOLO_AUTOTUNE_WINDOW_MS", "0"},
      {{{"KOLO_AUTOTUNE_WINDOW_MS", "1s"}}, "KOLO_AUTOTUNE_WINDOW_MS", "1s"},
      {{{"KOLO_AUTOTUNE_WINDOW_MS", "600001"}}, "KOLO_AUTOTUNE_WINDOW_MS", "600001"},
  };
  for (const Case& c : cases) {
    Environment env = kolo_job(c.change);
    INFO("environment change: " << c.change.begin()->first << "=" << c.change.begin()->second);
    Failure failure = resolve_failure(env);
    REQUIRE(failure.thrown);
    CHECK(failure.status == Status::kConfig);
    CHECK_THAT(failure.message, Contains(c.variable) && Contains(c.value));
  }
}

TEST_CASE("bad launcher values and overrides name their source", "[config]") {
  Failure launcher = resolve_failure(
      {{"OMPI_COMM_WORLD_RANK", "0"}, {"OMPI_COMM_WORLD_SIZE", "many"}, {"KOLO_ADDR", "node0:1"}});
  REQUIRE(launcher.thrown);
  CHECK_THAT(launcher.message, Contains("OMPI_COMM_WORLD_SIZE") && Contains("many"));

  Failure port = resolve_failure(
      {{"KOLO_RANK", "0"}, {"KOLO_SIZE", "2"}, {"MASTER_ADDR", "n"}, {"MASTER_PORT", "http"}});
  REQUIRE(port.thrown);
  CHECK_THAT(port.message, Contains("MASTER_PORT") && Contains("http"));

  ConfigOverrides rank;
  rank.rank = 7;
  Failure rank_failure = resolve_failure(kolo_job(), rank);
  REQUIRE(rank_failure.thrown);
  CHECK(rank_failure.status == Status::kConfig);
  CHECK_THAT(rank_failure.message, Contains("kolo_config_t.rank") && Contains("7"));

  ConfigOverrides timeout;
  timeout.timeout_s = -2;
  Failure timeout_failure = resolve_failure(kolo_job(), timeout);
  REQUIRE(timeout_failure.thrown);
  CHECK_THAT(timeout_failure.message, Contains("kolo_config_t.timeout_s") && Contains("-2"));

  ConfigOverrides streams;
  streams.tcp_streams = 0;
  CHECK_THAT(resolve_failure(kolo_job(), streams).message, Contains("kolo_config_t.tcp_streams"));
}

// ---- Sizes -----------------------------------------------------------------------------------

TEST_CASE("parse_size", "[config]") {
  using kolo::parse_size;
  CHECK(parse_size("0") == 0u);
  CHECK(parse_size("4096") == 4096u);
  CHECK(parse_size("64K") == 64u << 10);
  CHECK(parse_size("64k") == 64u << 10);
  CHECK(parse_size("64KiB") == 64u << 10);
  CHECK(parse_size("64kib") == 64u << 10);
  CHECK(parse_size("64KB") == 64u << 10);
  CHECK(parse_size("1M") == 1u << 20);
  CHECK(parse_size("1mb") == 1u << 20);
  CHECK(parse_size("2G") == uint64_t{2} << 30);
  CHECK(parse_size("2GiB") == uint64_t{2} << 30);
  CHECK(parse_size("1T") == uint64_t{1} << 40);
  CHECK(parse_size("4096B") == 4096u);
  CHECK(parse_size(" 8M ") == 8u << 20);
  CHECK(parse_size("18446744073709551615") == UINT64_MAX);

  for (const char* bad : {"", " ", "K", "-1", "+1", "1.5M", "1X", "1KK", "1iB", "1Kib2", "1 M",
                          "0x10", "1Bi", "18446744073709551616", "17179869184G"}) {
    INFO("parse_size(\"" << bad << "\")");
    CHECK_FALSE(parse_size(bad).has_value());
  }
}

// ---- Unknown variables -----------------------------------------------------------------------

TEST_CASE("unknown KOLO_* variables are reported, known ones are not", "[config]") {
  std::vector<std::string> unknown = {"stale"};
  kolo::resolve_config({},
                       kolo_job({{"KOLO_FOO", "1"},
                                 {"KOLO_TIMOUT", "5"},
                                 {"KOLO_TIMEOUT", "5"},
                                 {"KOLO_DEBUG", "INFO"},
                                 {"KOLO_CYCLE_TIME_MS", "2"},
                                 {"NOT_KOLO_FOO", "1"},
                                 {"kolo_lower", "1"}}),
                       &unknown);
  CHECK(unknown == std::vector<std::string>{"KOLO_FOO", "KOLO_TIMOUT"});
}

// ---- Horovod's variables -----------------------------------------------------------------------

TEST_CASE("Horovod's variables become kolo's, in kolo's units", "[config][horovod]") {
  Config config = resolve(kolo_job({{"HOROVOD_FUSION_THRESHOLD", "33554432"},
                                    {"HOROVOD_CYCLE_TIME", "0.5"},
                                    {"HOROVOD_CACHE_CAPACITY", "0"},
                                    {"HOROVOD_TIMELINE", "/tmp/hvd-timeline.json"},
                                    {"HOROVOD_AUTOTUNE", "1"},
                                    {"HOROVOD_AUTOTUNE_LOG", "/tmp/hvd-autotune.csv"},
                                    {"HOROVOD_STALL_CHECK_TIME_SECONDS", "7"},
                                    {"HOROVOD_STALL_SHUTDOWN_TIME_SECONDS", "90"},
                                    {"HOROVOD_HIERARCHICAL_ALLREDUCE", "1"},
                                    {"HOROVOD_GLOO_TIMEOUT_SECONDS", "45"},
                                    {"HOROVOD_GLOO_IFACE", "lo"}}));
  CHECK(config.fusion_threshold_bytes == 32u << 20);
  CHECK(config.cycle_time_ms == 0.5);
  CHECK(config.cache_capacity == 0);
  CHECK(config.timeline_path == "/tmp/hvd-timeline.json");
  CHECK(config.autotune);
  CHECK(config.autotune_log_path == "/tmp/hvd-autotune.csv");
  CHECK(config.stall_warning_s == 7.0);
  CHECK(config.stall_abort_s == 90.0);
  CHECK(config.allreduce == "hierarchical");
  CHECK(config.timeout_s == 45.0);
  CHECK(config.socket_ifname == "lo");

  // Horovod's booleans are integers, on when > 0
  CHECK(resolve(kolo_job({{"HOROVOD_HIERARCHICAL_ALLREDUCE", "0"}})).allreduce == "ring");
  CHECK_FALSE(resolve(kolo_job({{"HOROVOD_AUTOTUNE", "0"}})).autotune);
  Config off = resolve(kolo_job({{"HOROVOD_STALL_CHECK_DISABLE", "1"},
                                 {"HOROVOD_STALL_CHECK_TIME_SECONDS", "7"},
                                 {"HOROVOD_STALL_SHUTDOWN_TIME_SECONDS", "90"}}));
  CHECK(off.stall_warning_s == 0.0);
  CHECK(off.stall_abort_s == 0.0);
  CHECK(resolve(kolo_job({{"HOROVOD_STALL_CHECK_DISABLE", "0"},
                          {"HOROVOD_STALL_CHECK_TIME_SECONDS", "7"}}))
            .stall_warning_s == 7.0);
  // DYNAMIC asks for a timeline the program starts itself: no file
  CHECK(resolve(kolo_job({{"HOROVOD_TIMELINE", "DYNAMIC"}})).timeline_path.empty());
}

TEST_CASE("kolo's own variable wins over Horovod's", "[config][horovod]") {
  Config config = resolve(kolo_job({{"HOROVOD_FUSION_THRESHOLD", "1024"},
                                    {"KOLO_FUSION_THRESHOLD", "2M"},
                                    {"HOROVOD_CYCLE_TIME", "20"},
                                    {"KOLO_CYCLE_TIME_MS", "3"},
                                    {"HOROVOD_HIERARCHICAL_ALLREDUCE", "1"},
                                    {"KOLO_ALLREDUCE", "ring"}}));
  CHECK(config.fusion_threshold_bytes == 2u << 20);
  CHECK(config.cycle_time_ms == 3.0);
  CHECK(config.allreduce == "ring");
  // and the configuration struct wins over both
  ConfigOverrides overrides;
  overrides.timeout_s = 12.0;
  CHECK(resolve(kolo_job({{"HOROVOD_GLOO_TIMEOUT_SECONDS", "45"}, {"KOLO_TIMEOUT", "30"}}),
                overrides)
            .timeout_s == 12.0);
  CHECK(resolve(kolo_job({{"HOROVOD_GLOO_TIMEOUT_SECONDS", "45"}, {"KOLO_TIMEOUT", "30"}}))
            .timeout_s == 30.0);
}

TEST_CASE("a note per mapping; the other HOROVOD_* variables are named as ignored",
          "[config][horovod]") {
  auto translation = kolo::translate_horovod_variables(
      {{"HOROVOD_FUSION_THRESHOLD", "1024"},
       {"HOROVOD_CYCLE_TIME", "20"},
       {"KOLO_CYCLE_TIME_MS", "3"},
       {"HOROVOD_DYNAMIC_PROCESS_SETS", "1"},
       {"HOROVOD_TIMELINE", "DYNAMIC"},
       {"HOROVOD_NUM_NCCL_STREAMS", "2"},
       {"HOROVOD_CONTROLLER", "gloo"},
       {"HOROVOD_EMPTY", ""},
       {"NOT_HOROVOD_X", "1"}});
  CHECK(translation.env.at("KOLO_FUSION_THRESHOLD") == "1024");
  CHECK(translation.env.at("KOLO_CYCLE_TIME_MS") == "3");
  REQUIRE(translation.notes.size() == 3);
  CHECK(translation.notes[0] == "HOROVOD_FUSION_THRESHOLD=1024 read as KOLO_FUSION_THRESHOLD=1024");
  CHECK(translation.notes[1] ==
        "HOROVOD_CYCLE_TIME=20 not used: KOLO_CYCLE_TIME_MS=3 is set and wins");
  CHECK_THAT(translation.notes[2], Contains("HOROVOD_DYNAMIC_PROCESS_SETS=1"));
  CHECK(translation.ignored ==
        std::vector<std::string>{"HOROVOD_CONTROLLER", "HOROVOD_NUM_NCCL_STREAMS",
                                 "HOROVOD_TIMELINE"});

  // resolve_config warns about each ignored name once per process (the notes go to INFO, which
  // KOLO_DEBUG shows)
  std::string first = capture_stderr(
      [] { resolve(kolo_job({{"HOROVOD_CYCLE_TIME", "2"}, {"HOROVOD_TORUS_ALLREDUCE", "1"}})); });
  std::string second = capture_stderr(
      [] { resolve(kolo_job({{"HOROVOD_CYCLE_TIME", "2"}, {"HOROVOD_TORUS_ALLREDUCE", "1"}})); });
  const size_t named = first.find("HOROVOD_TORUS_ALLREDUCE");
  CHECK(named != std::string::npos);
  CHECK(first.find("HOROVOD_TORUS_ALLREDUCE", named + 1) == std::string::npos);
  CHECK_THAT(first, Contains("WARN") && Contains("kolo does not honour"));
  CHECK(second.find("HOROVOD_TORUS_ALLREDUCE") == std::string::npos);
}

TEST_CASE("bad Horovod values name the Horovod variable and the value", "[config][horovod]") {
  struct Case {
    const char* name;
    const char* value;
    const char* expected;
  };
  for (const Case& c : std::vector<Case>{
           {"HOROVOD_FUSION_THRESHOLD", "lots", "is not a size"},
           {"HOROVOD_FUSION_THRESHOLD", "8589934592", "is out of range"},
           {"HOROVOD_CYCLE_TIME", "0", "is out of range"},
           {"HOROVOD_CYCLE_TIME", "fast", "is not a number"},
           {"HOROVOD_CACHE_CAPACITY", "-1", "is out of range"},
           {"HOROVOD_AUTOTUNE", "yes", "is not an integer"},
           {"HOROVOD_STALL_CHECK_TIME_SECONDS", "1.5", "is not an integer"},
           {"HOROVOD_STALL_SHUTDOWN_TIME_SECONDS", "-3", "is out of range"},
           {"HOROVOD_HIERARCHICAL_ALLREDUCE", "true", "is not an integer"},
           {"HOROVOD_GLOO_TIMEOUT_SECONDS", "0", "is out of range"}}) {
    CAPTURE(c.name, c.value);
    Failure failure = resolve_failure(kolo_job({{c.name, c.value}}));
    REQUIRE(failure.thrown);
    CHECK(failure.status == Status::kConfig);
    CHECK_THAT(failure.message, Contains(std::string(c.name) + "=" + c.value) &&
                                    Contains(c.expected));
  }
}

TEST_CASE("the table of known variables is complete and well formed", "[config]") {
  const auto& table = kolo::known_variables();
  std::set<std::string> names;
  for (const auto& info : table) {
    INFO(info.name);
    CHECK(std::string(info.name).rfind("KOLO_", 0) == 0);
    CHECK(std::string(info.default_value).size() > 0);
    CHECK(std::string(info.description).size() > 0);
    CHECK(names.insert(info.name).second);  // no duplicates
  }
  for (const char* name : {"KOLO_RANK",
                           "KOLO_SIZE",
                           "KOLO_LOCAL_RANK",
                           "KOLO_LOCAL_SIZE",
                           "KOLO_ADDR",
                           "KOLO_SECRET",
                           "KOLO_TIMEOUT",
                           "KOLO_TCP_STREAMS",
                           "KOLO_SOCKET_IFNAME",
                           "KOLO_SEGMENT_BYTES",
                           "KOLO_TRANSPORT",
                           "KOLO_BIND",
                           "KOLO_DEBUG",
                           "KOLO_CYCLE_TIME_MS",
                           "KOLO_CACHE_CAPACITY",
                           "KOLO_FUSION_THRESHOLD",
                           "KOLO_STALL_WARNING_S",
                           "KOLO_STALL_ABORT_S",
                           "KOLO_TIMELINE",
                           "KOLO_GPU_BACKEND",
                           "KOLO_SHM",
                           "KOLO_SHM_COPY",
                           "KOLO_SECRET_FILE",
                           "KOLO_LIBRARY",
                           "KOLO_ALLREDUCE",
                           "KOLO_HOST_ID",
                           "KOLO_AUTOTUNE",
                           "KOLO_AUTOTUNE_LOG",
                           "KOLO_AUTOTUNE_WINDOW_MS",
                           "KOLO_TCP_CONGESTION",
                           "KOLO_STORE_FD",
                           "KOLO_INVITATION",
                           "KOLO_ELASTIC_ADDR",
                           "KOLO_ELASTIC_SLOT"}) {
    CHECK(names.count(name) == 1);
  }
  CHECK(names.size() == 34);
}

TEST_CASE("a newcomer's KOLO_INVITATION replaces the launcher's rank, size and address",
          "[config]") {
  // KOLO_SIZE without a rank is refused for a process of a job, and ignored for a newcomer.
  const Environment env = {{"KOLO_INVITATION", "kolo-grow-1:00000000000000ff:127.0.0.1:1"},
                           {"KOLO_SIZE", "4"}};
  const Config config = kolo::resolve_config({}, env);
  CHECK(config.invitation == "kolo-grow-1:00000000000000ff:127.0.0.1:1");
  CHECK(config.launcher == "invitation");
  CHECK(config.rank == -1);
  CHECK(config.addr.empty());
  CHECK_THROWS(kolo::resolve_config({}, {{"KOLO_SIZE", "4"}}));
}

TEST_CASE("docs/environment.md's table of variables lists exactly the known ones", "[config]") {
  const char* root = std::getenv("TESTS_SOURCE_DIR");
  REQUIRE(root != nullptr);  // set by meson test
  std::ifstream readme(std::string(root) + "/docs/environment.md");
  REQUIRE(readme);
  std::set<std::string> documented;
  std::regex row(R"(^\| `(KOLO_[A-Z0-9_]+)` \|)");
  for (std::string line; std::getline(readme, line);) {
    std::smatch match;
    if (std::regex_search(line, match, row)) documented.insert(match[1]);
  }
  std::set<std::string> known;
  for (const auto& info : kolo::known_variables()) known.insert(info.name);
  CHECK(documented == known);
}

TEST_CASE("process_environment reads the real environment", "[config]") {
  REQUIRE(setenv("KOLO_TEST_PROCESS_ENVIRONMENT", "a=b", 1) == 0);
  Environment env = kolo::process_environment();
  unsetenv("KOLO_TEST_PROCESS_ENVIRONMENT");
  CHECK(env["KOLO_TEST_PROCESS_ENVIRONMENT"] == "a=b");  // only the first '=' separates
}

// ---- Status names ----------------------------------------------------------------------------

TEST_CASE("status_from_wire accepts exactly the statuses of kolo_status_t", "[status]") {
  kolo::Status status = Status::kInternal;
  for (int64_t value = 0; value <= 9; ++value) {
    CHECK(kolo::status_from_wire(value, status));
    CHECK(static_cast<int64_t>(status) == value);
  }
  for (int64_t value : {int64_t{-1}, int64_t{10}, int64_t{64}, int64_t{1} << 40}) {
    status = Status::kTimeout;
    CHECK_FALSE(kolo::status_from_wire(value, status));
    CHECK(status == Status::kTimeout);  // left alone
  }
}

TEST_CASE("status_name for every status", "[status]") {
  // The C enumerator each status mirrors, value for value (capi/kolo.h).
  std::vector<std::pair<Status, std::string>> enumerators = {
      {Status::kSuccess, "KOLO_SUCCESS"},
      {Status::kInvalidArgument, "KOLO_ERR_INVALID_ARGUMENT"},
      {Status::kTimeout, "KOLO_ERR_TIMEOUT"},
      {Status::kPeerLost, "KOLO_ERR_PEER_LOST"},
      {Status::kMismatch, "KOLO_ERR_MISMATCH"},
      {Status::kInternal, "KOLO_ERR_INTERNAL"},
      {Status::kSystem, "KOLO_ERR_SYSTEM"},
      {Status::kConfig, "KOLO_ERR_CONFIG"},
      {Status::kUnsupported, "KOLO_ERR_UNSUPPORTED"},
  };
  for (const auto& [status, enumerator] : enumerators) {
    std::string name = kolo::status_name(status);
    INFO("status " << static_cast<int>(status) << " is named \"" << name << "\"");
    CHECK(name.rfind(enumerator + ": ", 0) == 0);
    CHECK(name.size() > enumerator.size() + 5);  // an explanation follows the enumerator
  }
  CHECK(std::string(kolo::status_name(Status::kPeerLost)) ==
        "KOLO_ERR_PEER_LOST: a peer rank was lost");
  CHECK(std::string(kolo::status_name(static_cast<Status>(99))) == "unknown kolo status");
  CHECK(std::string(kolo::status_name(static_cast<Status>(-1))) == "unknown kolo status");
}

// ---- Logger ----------------------------------------------------------------------------------

TEST_CASE("log lines carry host, rank and level, one line per message", "[log]") {
  char host[256] = {};
  gethostname(host, sizeof(host) - 1);
  std::string short_host(host);
  short_host = short_host.substr(0, short_host.find('.'));

  std::string text = capture_stderr([] {
    kolo::log::set_rank(-1);
    kolo::log::warn("before the rank is known");
    kolo::log::set_rank(3);
    kolo::log::warn("peer {} lost", 5);
    kolo::log::write(kolo::log::Level::kWarn, "ends with a newline\n");
  });
  kolo::log::set_rank(-1);
  CHECK(text == "kolo " + short_host + ":? WARN  before the rank is known\n" + "kolo " +
                    short_host + ":3 WARN  peer 5 lost\n" + "kolo " + short_host +
                    ":3 WARN  ends with a newline\n");
}

TEST_CASE("log lines of concurrent threads never interleave", "[log]") {
  constexpr int kThreads = 8;
  constexpr int kLines = 200;
  std::string text = capture_stderr([] {
    std::vector<std::thread> threads;
    for (int t = 0; t < kThreads; ++t) {
      threads.emplace_back([t] {
        for (int i = 0; i < kLines; ++i)
          kolo::log::warn("thread {} line {} {}", t, i, std::string(100, 'x'));
      });
    }
    for (auto& thread : threads) thread.join();
  });
  std::istringstream lines(text);
  std::string line;
  int count = 0;
  while (std::getline(lines, line)) {
    ++count;
    INFO(line);
    CHECK(line.rfind("kolo ", 0) == 0);
    CHECK(line.find(" WARN  thread ") != std::string::npos);
    CHECK(line.size() > 100);
    CHECK(line.substr(line.size() - 100) == std::string(100, 'x'));
  }
  CHECK(count == kThreads * kLines);
}

// The level is read once per process, so each KOLO_DEBUG value runs this binary again with only
// the hidden test below, and looks at what it wrote to stderr.
TEST_CASE("log level child: writes one line at each level", "[.log_level_child]") {
  kolo::log::warn("warn line");
  kolo::log::info("info line");
  kolo::log::trace("trace line");
}

namespace {

std::string run_log_level_child(const std::string& kolo_debug) {
  char self[4096] = {};
  ssize_t length = readlink("/proc/self/exe", self, sizeof(self) - 1);
  REQUIRE(length > 0);
  // stderr into the pipe, Catch's own report (stdout) away.
  std::string command = "KOLO_DEBUG='" + kolo_debug + "' '" + std::string(self, length) +
                        "' '[.log_level_child]' 2>&1 >/dev/null";
  std::FILE* pipe = popen(command.c_str(), "r");
  REQUIRE(pipe != nullptr);
  std::string output;
  char buffer[4096];
  size_t got;
  while ((got = std::fread(buffer, 1, sizeof(buffer), pipe)) > 0) output.append(buffer, got);
  CHECK(pclose(pipe) == 0);
  return output;
}

}  // namespace

TEST_CASE("KOLO_DEBUG selects the level, case-insensitively, and warns once about bad values",
          "[log]") {
  std::string unset = run_log_level_child("");
  CHECK(kolo::test::count(unset, "\n") == 1);
  CHECK_THAT(unset, Contains(" WARN  warn line"));

  std::string info = run_log_level_child("info");
  CHECK_THAT(info, Contains(" WARN  warn line") && Contains(" INFO  info line"));
  CHECK(kolo::test::count(info, "trace line") == 0);

  std::string trace = run_log_level_child("TrAcE");
  CHECK_THAT(trace, Contains(" INFO  info line") && Contains(" TRACE trace line"));

  std::string warn = run_log_level_child("WARN");
  CHECK(kolo::test::count(warn, "\n") == 1);

  std::string bogus = run_log_level_child("bogus");
  CHECK(kolo::test::count(bogus, "KOLO_DEBUG=bogus") == 1);
  CHECK(bogus.find("KOLO_DEBUG=bogus") < bogus.find("warn line"));  // reported first
  CHECK_THAT(bogus, Contains("WARN, INFO or TRACE") && Contains(" WARN  warn line"));
  CHECK(kolo::test::count(bogus, "info line") == 0);
}

// ---- A world of one -----------------------------------------------------------------------------

// A communicator made in a process that no launcher started: the parent runs this binary again
// with only this hidden test and an environment holding no launcher's variable.
TEST_CASE("world of one child: a communicator of one rank, its allreduce the input",
          "[.world_of_one_child]") {
  kolo::Communicator comm(ConfigOverrides{});
  REQUIRE(comm.rank() == 0);
  REQUIRE(comm.size() == 1);
  std::vector<float> input = {1.5f, -2.0f, 3.25f}, output(3, 0.0f);
  comm.allreduce(input.data(), output.data(), input.size(), kolo::DataType::kFloat32,
                 kolo::ReduceOp::kSum);
  CHECK(output == input);
  std::printf("world of one: rank %d of %d\n", comm.rank(), comm.size());
}

TEST_CASE("a process started alone is a world of one, and says so once at INFO", "[config]") {
  char self[4096] = {};
  ssize_t length = readlink("/proc/self/exe", self, sizeof(self) - 1);
  REQUIRE(length > 0);
  // env -i: nothing of the test's own environment (a CI job under Slurm, say) reaches the child,
  // but the sanitizer runs' settings (scripts/sanitize.sh: UCX_MEM_EVENTS=no keeps UCX's memory
  // hooks out of ThreadSanitizer's way) do.
  std::string kept;
  for (const char* name : {"UCX_MEM_EVENTS", "TSAN_OPTIONS", "ASAN_OPTIONS", "UBSAN_OPTIONS",
                           "LSAN_OPTIONS"}) {
    if (const char* value = std::getenv(name)) kept += std::string(name) + "='" + value + "' ";
  }
  std::string command = "env -i PATH=/usr/bin:/bin " + kept +
                        "KOLO_DEBUG=INFO KOLO_TRANSPORT=tcp timeout 60 '" +
                        std::string(self, length) + "' '[.world_of_one_child]' 2>&1";
  std::FILE* pipe = popen(command.c_str(), "r");
  REQUIRE(pipe != nullptr);
  std::string output;
  char buffer[4096];
  size_t got;
  while ((got = std::fread(buffer, 1, sizeof(buffer), pipe)) > 0) output.append(buffer, got);
  INFO(output);
  CHECK(pclose(pipe) == 0);
  CHECK(kolo::test::count(output, "world of one: rank 0 of 1") == 1);
  CHECK(kolo::test::count(output, " INFO  no launcher found") == 1);
  CHECK(kolo::test::count(output, "this process is a world of one") == 1);
  CHECK_THAT(output, Contains("communicator ready: rank 0 of 1"));
  CHECK_THAT(output, Contains("All tests passed"));
}

// ---- Topology --------------------------------------------------------------------------------

TEST_CASE("hwloc sees at least one core", "[topology]") {
  const kolo::Topology& topology = kolo::local_topology();
  CHECK(topology.cores >= 1);
  CHECK(topology.pus >= topology.cores);
  CHECK(topology.numa_nodes >= 1);
  CHECK(&topology == &kolo::local_topology());  // loaded once
}

TEST_CASE("bind_process policies", "[topology]") {
  CHECK(kolo::bind_process("none", 0) == "not bound (KOLO_BIND=none)");

  try {
    kolo::bind_process("bogus", 0);
    FAIL("bind_process(\"bogus\") did not throw");
  } catch (const kolo::Error& error) {
    CHECK(error.status() == Status::kConfig);
    CHECK_THAT(std::string(error.what()), Contains("bogus") && Contains("KOLO_BIND"));
  }
  try {
    kolo::bind_process("core", -1);
    FAIL("bind_process(\"core\", -1) did not throw");
  } catch (const kolo::Error& error) {
    CHECK(error.status() == Status::kInvalidArgument);
  }

  // Binding really narrows this process's CPU set; restore it afterwards so that other tests
  // keep every CPU. A machine that forbids binding (some containers) reports kSystem.
  cpu_set_t original;
  REQUIRE(sched_getaffinity(0, sizeof(original), &original) == 0);
  for (const char* policy : {"core", "numa"}) {
    INFO("policy " << policy);
    try {
      std::string description = kolo::bind_process(policy, 1);
      CHECK_THAT(description, Contains("bound to") && Contains("PUs"));
      cpu_set_t bound;
      REQUIRE(sched_getaffinity(0, sizeof(bound), &bound) == 0);
      CHECK(CPU_COUNT(&bound) >= 1);
      CHECK(CPU_COUNT(&bound) <= CPU_COUNT(&original));
      if (std::string(policy) == "core") {
        CHECK(CPU_COUNT(&bound) <= kolo::local_topology().pus / kolo::local_topology().cores + 1);
      }
    } catch (const kolo::Error& error) {
      CHECK(error.status() == Status::kSystem);
      WARN("binding not permitted here: " << error.what());
    }
    REQUIRE(sched_setaffinity(0, sizeof(original), &original) == 0);
  }
}

// ---- Plain srun: rank 0's address from the step -------------------------------------------------

TEST_CASE("srun: rank 0's store is on the step's first node at a port from the job and step",
          "[config][slurm]") {
  // As srun 22.05 exports them to task 3 of `srun -N 2 --ntasks-per-node 2` in job 1234.
  Environment env = {{"SLURM_PROCID", "3"},
                     {"SLURM_NTASKS", "4"},
                     {"SLURM_LOCALID", "1"},
                     {"SLURM_NODEID", "1"},
                     {"SLURM_STEP_TASKS_PER_NODE", "2(x2)"},
                     {"SLURM_JOB_ID", "1234"},
                     {"SLURM_STEP_ID", "0"},
                     {"SLURM_STEP_NODELIST", "gpu[07-08]"},
                     {"SLURM_JOB_NODELIST", "gpu[05-08]"},
                     {"SLURM_DISTRIBUTION", "block"}};
  // 20000 + (10 * job + step) mod 10000, computed by hand.
  SECTION("the step's node list and ids") {
    CHECK(resolve(env).addr == "gpu07:22340");
  }
  SECTION("the next step of the job gets the next port") {
    env["SLURM_STEP_ID"] = "1";
    CHECK(resolve(env).addr == "gpu07:22341");
  }
  SECTION("Slurm's older names") {
    env.erase("SLURM_STEP_ID");
    env.erase("SLURM_JOB_ID");
    env["SLURM_STEPID"] = "2";
    env["SLURM_JOBID"] = "98765";
    CHECK(resolve(env).addr == "gpu07:27652");
  }
  SECTION("the job's node list when the step's is missing") {
    env.erase("SLURM_STEP_NODELIST");
    CHECK(resolve(env).addr == "gpu05:22340");
  }
  SECTION("a list of names") {
    env["SLURM_STEP_NODELIST"] = "a1,b[2,5-7]";
    CHECK(resolve(env).addr == "a1:22340");
  }
  SECTION("the largest ids") {
    env["SLURM_JOB_ID"] = "4294967295";
    env["SLURM_STEP_ID"] = "4294967293";
    CHECK(resolve(env).addr == "gpu07:20243");
  }
  SECTION("cyclic and plane also start on the first node") {
    for (const char* distribution :
         {"cyclic", "plane", "cyclic:block", "block:cyclic,Pack", "*:*"}) {
      env["SLURM_DISTRIBUTION"] = distribution;
      CHECK(resolve(env).addr == "gpu07:22340");
    }
  }
  SECTION("KOLO_ADDR and MASTER_ADDR still win") {
    env["KOLO_ADDR"] = "login:29500";
    CHECK(resolve(env).addr == "login:29500");
    env.erase("KOLO_ADDR");
    env["MASTER_ADDR"] = "node9";
    env["MASTER_PORT"] = "29400";
    CHECK(resolve(env).addr == "node9:29400");
  }
  SECTION("refused: an arbitrary distribution") {
    env["SLURM_DISTRIBUTION"] = "arbitrary";
    Failure failure = resolve_failure(env);
    CHECK(failure.status == Status::kConfig);
    CHECK_THAT(failure.message,
               Contains("SLURM_DISTRIBUTION=arbitrary") && Contains("KOLO_ADDR=host:port"));
  }
  SECTION("refused: a malformed node list, named with where it is wrong") {
    env["SLURM_STEP_NODELIST"] = "gpu[07-08";
    Failure failure = resolve_failure(env);
    CHECK(failure.status == Status::kConfig);
    CHECK_THAT(failure.message, Contains("SLURM_STEP_NODELIST") && Contains("unbalanced '['") &&
                                    Contains("KOLO_ADDR"));
  }
  SECTION("refused: no node list") {
    env.erase("SLURM_STEP_NODELIST");
    env.erase("SLURM_JOB_NODELIST");
    CHECK_THAT(resolve_failure(env).message,
               Contains("neither SLURM_STEP_NODELIST nor SLURM_JOB_NODELIST"));
  }
  SECTION("refused: no job id, or ids that are no Slurm ids") {
    env.erase("SLURM_JOB_ID");
    CHECK_THAT(resolve_failure(env).message, Contains("no SLURM_JOB_ID"));
    env["SLURM_JOB_ID"] = "-1";
    CHECK_THAT(resolve_failure(env).message, Contains("SLURM_JOB_ID=-1 is not a Slurm id"));
    env["SLURM_JOB_ID"] = "12";
    env["SLURM_STEP_ID"] = "4294967296";
    CHECK_THAT(resolve_failure(env).message,
               Contains("SLURM_STEP_ID=4294967296 is not a Slurm id"));
  }
}
