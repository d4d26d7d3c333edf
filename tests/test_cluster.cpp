// Multi-host tests on a simulated cluster (scripts/cluster.sh): hosts are network namespaces with
// host names of their own, joined by a bridge; each host's own name resolves to 127.0.1.1 there,
// as on Debian. Ranks start inside their host with the variables a real launcher sets (torchrun's
// with MASTER_ADDR as a host name, Slurm's and Open MPI's with KOLO_ADDR), run the test workers,
// which check every element against their own reference, and log at INFO what kolo chose: the
// test asserts the transport, the node count and that no rank published a loopback address.
// Needs root and network namespaces; without them the program says why and exits 77 (skipped).
#define CATCH_CONFIG_RUNNER
#include <fmt/format.h>
#include <unistd.h>

#include <catch2/catch.hpp>
#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <functional>
#include <map>
#include <regex>
#include <sstream>
#include <string>
#include <vector>

#include "cluster.hpp"
#include "faults.hpp"
#include "process.hpp"

using namespace kolo::test;

namespace {

const char* kClusterName = "kolotest";

int run_script(const std::string& arguments) {
  return run_cluster_script(arguments);
}

// The hosts of one test, taken down again whatever happens.
struct Cluster {
  int hosts;
  explicit Cluster(int host_count, const std::string& rate = "none") : hosts(host_count) {
    REQUIRE(run_script(fmt::format("up {} {} {}", kClusterName, hosts, rate)) == 0);
  }
  ~Cluster() { run_script(fmt::format("down {}", kClusterName)); }
  Cluster(const Cluster&) = delete;
  Cluster& operator=(const Cluster&) = delete;
};

enum class Launcher { kTorchrun, kSlurm, kOpenMpi };

const char* launcher_name(Launcher launcher) {
  switch (launcher) {
    case Launcher::kTorchrun:
      return "torchrun (MASTER_ADDR=kolotest1, a host name)";
    case Launcher::kSlurm:
      return "srun (KOLO_ADDR=10.77.0.1, an address)";
    case Launcher::kOpenMpi:
      return "mpirun (KOLO_ADDR=kolotest1, a host name)";
  }
  return "";
}

// What the launcher would export for global rank `rank`, the `local`-th of `per_host` on its host.
std::map<std::string, std::string> launcher_env(Launcher launcher, int rank, int size, int local,
                                                int per_host) {
  std::map<std::string, std::string> env = {
      {"KOLO_SECRET", kTestSecret}, {"KOLO_TIMEOUT", "60"}, {"KOLO_DEBUG", "INFO"}};
  switch (launcher) {
    case Launcher::kTorchrun:
      env.insert({{"RANK", std::to_string(rank)},
                  {"WORLD_SIZE", std::to_string(size)},
                  {"LOCAL_RANK", std::to_string(local)},
                  {"LOCAL_WORLD_SIZE", std::to_string(per_host)},
                  {"MASTER_ADDR", "kolotest1"},
                  {"MASTER_PORT", "29500"}});
      break;
    case Launcher::kSlurm:
      env.insert({{"SLURM_PROCID", std::to_string(rank)},
                  {"SLURM_NTASKS", std::to_string(size)},
                  {"SLURM_LOCALID", std::to_string(local)},
                  {"SLURM_NTASKS_PER_NODE", std::to_string(per_host)},
                  {"KOLO_ADDR", "10.77.0.1:29500"}});
      break;
    case Launcher::kOpenMpi:
      env.insert({{"OMPI_COMM_WORLD_RANK", std::to_string(rank)},
                  {"OMPI_COMM_WORLD_SIZE", std::to_string(size)},
                  {"OMPI_COMM_WORLD_LOCAL_RANK", std::to_string(local)},
                  {"OMPI_COMM_WORLD_LOCAL_SIZE", std::to_string(per_host)},
                  {"KOLO_ADDR", "kolotest1:29500"}});
      break;
  }
  return env;
}

// Ranks 0..R-1 on host 1, R..2R-1 on host 2, and so on, as block placement does.
// Hosts beyond `hosts` (when given) run no rank; the last rank gets last_rank_env too.
std::vector<Process> start_ranks(const Cluster& cluster, int per_host, Launcher launcher,
                                 const std::vector<std::string>& worker_args,
                                 const std::map<std::string, std::string>& extra_env = {},
                                 int hosts = 0,
                                 const std::map<std::string, std::string>& last_rank_env = {}) {
  std::vector<Process> ranks;
  const int size = (hosts > 0 ? hosts : cluster.hosts) * per_host;
  for (int rank = 0; rank < size; ++rank) {
    int host = rank / per_host + 1;
    auto env = launcher_env(launcher, rank, size, rank % per_host, per_host);
    for (const auto& [key, value] : extra_env) env[key] = value;
    if (rank == size - 1) {
      for (const auto& [key, value] : last_rank_env) env[key] = value;
    }
    std::vector<std::string> argv = {"/bin/sh", cluster_script(), "exec", kClusterName,
                                     std::to_string(host)};
    argv.insert(argv.end(), worker_args.begin(), worker_args.end());
    ranks.emplace_back(argv, env);
  }
  return ranks;
}

// Listeners on a loopback address whose communicator then reports more than one node.
int loopback_listeners_spanning_hosts(const std::string& output) {
  static const std::regex listens(R"(listens on (\S+))");
  static const std::regex ready(R"(ready: .* (\d+) node\(s\))");
  int count = 0;
  bool loopback_pending = false;
  std::istringstream lines(output);
  for (std::string line; std::getline(lines, line);) {
    std::smatch match;
    if (std::regex_search(line, match, listens)) {
      loopback_pending = match[1].str().rfind("127.", 0) == 0;
    } else if (loopback_pending && std::regex_search(line, match, ready)) {
      count += match[1] != "1";
      loopback_pending = false;
    }
  }
  return count;
}

// Every rank passed its checks, ran on the transport named, saw every host, and listened on the
// address of its host's network interface (its sub-communicators too, unless all their ranks
// share one host).
void expect_passed(std::vector<Process>& ranks, int hosts, int per_host, const char* marker,
                   const std::string& transport) {
  for (size_t rank = 0; rank < ranks.size(); ++rank) {
    ProcessResult result = ranks[rank].wait(300);
    const std::string host_address = fmt::format("10.77.0.{}:", rank / per_host + 1);
    INFO("rank " << rank << " output:\n" << result.output);
    CHECK_FALSE(result.timed_out);
    CHECK(result.exit_code == 0);
    CHECK(contains(result.output, marker));
    CHECK(contains(result.output, fmt::format("{} node(s), transport {}", hosts, transport)));
    // The world communicator's listener comes first; a sub-communicator may listen on loopback
    // only when all of its ranks share one host.
    std::smatch first;
    REQUIRE(std::regex_search(result.output, first, std::regex(R"(rank (\d+) listens on (\S+))")));
    CHECK(first[1] == std::to_string(rank));
    CHECK(first[2].str().rfind(host_address, 0) == 0);
    CHECK(loopback_listeners_spanning_hosts(result.output) == 0);
  }
}

struct Shape {
  int hosts;
  int per_host;
  Launcher launcher;
};
const Shape kShapes[] = {{2, 1, Launcher::kTorchrun},
                         {2, 2, Launcher::kSlurm},
                         {4, 1, Launcher::kOpenMpi},
                         {4, 2, Launcher::kTorchrun}};

struct Program {
  std::vector<std::string> args;  // worker and its arguments, relative to the build folder first
  const char* marker;
};

void run_everywhere(const Program& program, const std::string& transport) {
  for (const Shape& shape : kShapes) {
    DYNAMIC_SECTION(shape.hosts << " hosts x " << shape.per_host << " ranks, "
                                << launcher_name(shape.launcher)) {
      Cluster cluster(shape.hosts);
      std::vector<std::string> args = program.args;
      args[0] = built_program(args[0]);
      auto ranks = start_ranks(cluster, shape.per_host, shape.launcher, args,
                               {{"KOLO_TRANSPORT", transport}});
      expect_passed(ranks, shape.hosts, shape.per_host, program.marker, transport);
    }
  }
}

const std::map<std::string, Program> kPrograms = {
    {"allreduce", {{"tests/kolo_test_worker", "allreduce", "quick"}, "allreduce checks passed"}},
    {"broadcast", {{"tests/kolo_test_worker", "broadcast"}, "broadcast checks passed"}},
    {"barrier", {{"tests/kolo_test_worker", "barrier"}, "barrier checks passed"}},
    {"allgather",
     {{"tests/kolo_test_collectives", "allgather", "quick"}, "allgather checks passed"}},
    {"reduce_scatter",
     {{"tests/kolo_test_collectives", "reduce_scatter", "quick"}, "reduce_scatter checks passed"}},
    {"alltoall", {{"tests/kolo_test_collectives", "alltoall", "quick"}, "alltoall checks passed"}},
    {"reduce", {{"tests/kolo_test_collectives", "reduce", "quick"}, "reduce checks passed"}},
    {"sendrecv", {{"tests/kolo_test_collectives", "sendrecv"}, "sendrecv checks passed"}},
    {"split", {{"tests/kolo_test_collectives", "split"}, "split checks passed"}},
    {"fusion", {{"tests/kolo_fusion_worker", "orders"}, "orders checks passed"}},
};

}  // namespace

TEST_CASE("every collective, split and named operation across hosts over TCP", "[cluster][tcp]") {
  for (const auto& [name, program] : kPrograms) {
    DYNAMIC_SECTION(name) {
      run_everywhere(program, "tcp");
    }
  }
}

// Each rank passed and reached each peer on its host through kolo's rings and each other one
// through `network` ("UCX", "TCP"), as its INFO log says.
void expect_ring_paths(std::vector<Process>& ranks, const Program& program, int hosts, int per_host,
                       const std::string& transport, const std::string& network,
                       const std::function<void(const std::string&)>& more_checks) {
  for (size_t rank = 0; rank < ranks.size(); ++rank) {
    ProcessResult result = ranks[rank].wait(300);
    INFO("rank " << rank << " output:\n" << result.output);
    CHECK_FALSE(result.timed_out);
    CHECK(result.exit_code == 0);
    CHECK(contains(result.output, program.marker));
    CHECK(contains(result.output, fmt::format("{} node(s), transport {}", hosts, transport)));
    more_checks(result.output);
    for (size_t peer = 0; peer < ranks.size(); ++peer) {
      if (peer == rank) continue;
      bool same_host = peer / per_host == rank / per_host;
      CHECK(contains(
          result.output,
          fmt::format("{}: rank {} reaches rank {} through {}", transport, rank, peer,
                      same_host ? "kolo's shared-memory ring" : network + " (another host)")));
    }
  }
}

// Over UCX, each peer on this host through kolo's rings and each other one through UCX's TCP:
// never UCX's shared memory, which would bypass the links (the hosts share one kernel).
void expect_ucx_paths(std::vector<Process>& ranks, const Program& program, int hosts,
                      int per_host) {
  expect_ring_paths(ranks, program, hosts, per_host, "ucx", "UCX", [](const std::string& output) {
    CHECK(contains(output, "UCX's shared-memory transports left out (UCX_TLS=^sm)"));
    std::smatch lanes;
    REQUIRE(std::regex_search(output, lanes, std::regex("reaches its peers through (.*)")));
    CHECK(contains(lanes[1], "tcp/eth0"));
    CHECK_FALSE(contains(lanes[1], "memory"));  // cma/memory, sysv/memory, posix/memory
    // Without RDMA UCX's rendezvous over TCP stalls where a ring's two directions share one
    // connection (2 hosts x 1 rank); kolo sends eagerly instead.
    std::error_code error;
    if (std::filesystem::is_empty("/sys/class/infiniband", error) || error) {
      CHECK(contains(output, "messages sent eagerly (UCX_RNDV_THRESH=inf)"));
    }
  });
}

TEST_CASE("collectives, a split and named operations across hosts over UCX", "[cluster][ucx]") {
  for (const char* name : {"allreduce", "allgather", "split", "fusion"}) {
    for (const Shape& shape : {kShapes[0], kShapes[3]}) {
      DYNAMIC_SECTION(name << ", " << shape.hosts << " hosts x " << shape.per_host << " ranks") {
        const Program& program = kPrograms.at(name);
        Cluster cluster(shape.hosts);
        std::vector<std::string> args = program.args;
        args[0] = built_program(args[0]);
        auto ranks = start_ranks(cluster, shape.per_host, shape.launcher, args,
                                 {{"KOLO_TRANSPORT", "ucx"}, {"UCX_TLS", ""}});
        expect_ucx_paths(ranks, program, shape.hosts, shape.per_host);
      }
    }
  }
}

TEST_CASE("by default, TCP between hosts and kolo's rings inside each, in one communicator",
          "[cluster][auto]") {
  // KOLO_TRANSPORT unset (an empty variable counts as unset): without RDMA, auto takes TCP, and
  // KOLO_SHM's default puts the peers of each host on the rings. Also the hierarchical
  // allreduce, whose steps inside a host then go through the rings.
  struct Case {
    const char* program;
    Shape shape;
    const char* allreduce;
  };
  const Case cases[] = {{"allreduce", kShapes[1], "auto"},
                        {"allgather", kShapes[3], "auto"},
                        {"split", kShapes[1], "auto"},
                        {"fusion", kShapes[3], "auto"},
                        {"allreduce", {2, 3, Launcher::kTorchrun}, "hierarchical"}};
  for (const Case& c : cases) {
    DYNAMIC_SECTION(c.program << ", " << c.shape.hosts << " hosts x " << c.shape.per_host
                              << " ranks, KOLO_ALLREDUCE=" << c.allreduce) {
      const Program& program = kPrograms.at(c.program);
      Cluster cluster(c.shape.hosts);
      std::vector<std::string> args = program.args;
      args[0] = built_program(args[0]);
      auto ranks = start_ranks(cluster, c.shape.per_host, c.shape.launcher, args,
                               {{"KOLO_TRANSPORT", ""}, {"KOLO_ALLREDUCE", c.allreduce}});
      expect_ring_paths(ranks, program, c.shape.hosts, c.shape.per_host, "tcp", "TCP",
                        [](const std::string& output) {
                          CHECK(contains(output, "KOLO_TRANSPORT=auto chose tcp"));
                        });
    }
  }
}

TEST_CASE("UCX's shared memory between hosts, if asked for, does not stall waits",
          "[cluster][ucx]") {
  // UCX_TLS=all lets UCX reach the other namespace through shared memory, whose wake-ups do not
  // cross namespaces; waits must notice and look often instead of sleeping 100 ms each.
  // A wake-up is missed only when a wait actually sleeps, which a run may not need; so a rank
  // either reports the missed wake-up or finished quickly (sleeping 100 ms per wait, the quick
  // allreduce's hundreds of collectives would take minutes).
  Cluster cluster(2);
  const auto started = std::chrono::steady_clock::now();
  auto ranks = start_ranks(cluster, 1, Launcher::kTorchrun,
                           {built_program("tests/kolo_test_worker"), "allreduce", "quick"},
                           {{"KOLO_TRANSPORT", "ucx"}, {"UCX_TLS", "all"}});
  for (size_t rank = 0; rank < ranks.size(); ++rank) {
    ProcessResult result = ranks[rank].wait(300);
    const double seconds =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - started).count();
    INFO("rank " << rank << " after " << seconds << " s, output:\n" << result.output);
    CHECK(result.exit_code == 0);
    CHECK(contains(result.output, "allreduce checks passed"));
    CHECK(contains(result.output, "UCX_TLS=all kept"));
    std::smatch lanes;
    REQUIRE(std::regex_search(result.output, lanes, std::regex("reaches its peers through (.*)")));
    if (contains(lanes[1], "memory")) {
      CHECK((contains(result.output, "UCX's wake-ups do not arrive") || seconds < 30.0));
    }
  }
}

// The hierarchical allreduce between real network namespaces: at 2 hosts x 3 ranks auto chooses
// it through the leaders for small buffers (recursive doubling would cross between the hosts four
// times) and by shards for large ones (the quick checks' 256 KiB buffers), forced it runs at every
// size, on the world and on sub-communicators that span the hosts.
TEST_CASE("hierarchical allreduce across hosts", "[cluster][hierarchical]") {
  struct Case {
    int hosts;
    int per_host;
    const char* mode;
    const char* program;
    const char* choice;  // what rank 0 logs at INFO
  };
  const Case cases[] = {
      {2, 3, "auto", "allreduce",
       "KOLO_ALLREDUCE=auto: hierarchical up to 196608 bytes, hierarchical by shards above;"},
      {2, 3, "hierarchical", "allreduce",
       "KOLO_ALLREDUCE=hierarchical: hierarchical up to 196608 bytes, hierarchical by shards "
       "above;"},
      {2, 2, "hierarchical", "split",
       "KOLO_ALLREDUCE=hierarchical: hierarchical up to 131072 bytes, hierarchical by shards "
       "above;"},
  };
  for (const Case& c : cases) {
    DYNAMIC_SECTION(c.program << ", " << c.hosts << " hosts x " << c.per_host
                              << " ranks, KOLO_ALLREDUCE=" << c.mode) {
      const Program& program = kPrograms.at(c.program);
      Cluster cluster(c.hosts);
      std::vector<std::string> args = program.args;
      args[0] = built_program(args[0]);
      auto ranks = start_ranks(cluster, c.per_host, Launcher::kTorchrun, args,
                               {{"KOLO_TRANSPORT", "tcp"}, {"KOLO_ALLREDUCE", c.mode}});
      expect_passed(ranks, c.hosts, c.per_host, program.marker, "tcp");
      const std::string first = ranks[0].wait(1).output;  // reaped already: the output
      INFO("rank 0 output:\n" << first);
      CHECK(contains(first, c.choice));
      CHECK(contains(first, fmt::format("{} hosts (leaders 0,{})", c.hosts, c.per_host)));
    }
  }
}

TEST_CASE("a bracketed IPv6 address in KOLO_ADDR", "[cluster][tcp]") {
  Cluster cluster(2);
  auto ranks = start_ranks(cluster, 1, Launcher::kSlurm,
                           {built_program("tests/kolo_test_worker"), "allreduce", "quick"},
                           {{"KOLO_ADDR", "[fd77::1]:29500"}});
  for (size_t rank = 0; rank < ranks.size(); ++rank) {
    ProcessResult result = ranks[rank].wait(300);
    INFO("rank " << rank << " output:\n" << result.output);
    CHECK(result.exit_code == 0);
    CHECK(contains(result.output, "allreduce checks passed"));
    CHECK(contains(result.output, fmt::format("rank {} listens on [fd77::{}]:", rank, rank + 1)));
  }
}

TEST_CASE("a host that vanishes is reported lost by name on every survivor", "[cluster][lost]") {
  Cluster cluster(3);
  Job job;
  job.ranks = start_ranks(cluster, 1, Launcher::kTorchrun,
                          {built_program("tests/kolo_test_worker"), "loop", "60"});
  wait_until_looping(job);
  std::this_thread::sleep_for(std::chrono::milliseconds(500));
  const int victim = 2;
  auto cut_at = std::chrono::steady_clock::now();
  REQUIRE(run_script(fmt::format("cut {} {}", kClusterName, victim + 1)) == 0);
  // TCP's keepalive and user timeout give up on the silent host after 10 s.
  expect_survivors_report_lost(job, victim, cut_at, 15.0);
  job.ranks[victim].kill(SIGKILL);
}

TEST_CASE("survivors on other hosts shrink and go on when rank 0's host loses its rank",
          "[cluster][shrink]") {
  // Four hosts, one rank each; rank 0, whose process serves the job's store, dies (SIGKILL, by
  // its own hand) in an allreduce. The survivors agree across hosts, the lowest one serves the
  // new store, and the worker checks everything after the shrink element by element
  // (tests/worker_elastic.cpp).
  for (const std::string transport : {"tcp", "ucx"}) {
    DYNAMIC_SECTION("over " << transport) {
      Cluster cluster(4);
      Job job;
      job.ranks = start_ranks(cluster, 1, Launcher::kTorchrun,
                              {built_program("tests/kolo_test_elastic"), "allreduce", "0"},
                              {{"KOLO_TRANSPORT", transport}, {"KOLO_TIMEOUT", "10"}});
      double died = 0, last_first_step = 0;
      for (int rank = 0; rank < 4; ++rank) {
        ProcessResult result = job.ranks[rank].wait(120);
        INFO("rank " << rank << " output:\n" << result.output);
        CHECK_FALSE(result.timed_out);
        std::smatch match;
        if (rank == 0) {
          CHECK(result.signal == SIGKILL);
          REQUIRE(std::regex_search(result.output, match, std::regex(R"(dying at ([0-9.]+))")));
          died = std::stod(match[1]);
        } else {
          CHECK(result.exit_code == 0);
          CHECK(contains(result.output, fmt::format("elastic passed, rank {} of 3", rank - 1)));
          CHECK(contains(result.output, "transport " + transport));
          REQUIRE(std::regex_search(result.output, match,
                                    std::regex(R"(first allreduce after shrink at ([0-9.]+))")));
          last_first_step = std::max(last_first_step, std::stod(match[1]));
        }
      }
      WARN("cluster shrink over " << transport << ", 4 hosts, rank 0 killed: first death -> "
                                  << "first allreduce after shrink: "
                                  << (last_first_step - died) * 1000 << " ms");
    }
  }
}

TEST_CASE("strangers on a host of their own change nothing the ranks agree on",
          "[cluster][strangers]") {
  // Four hosts with a rank each and a fifth with strangers only: while the ranks start (the last
  // one 1.5 s late), run allreduces for 2 s, lose rank 0 (the store's) and shrink, the fifth host
  // holds 200 silent and 20 garbage connections to every port any rank listens on, renewed every
  // second (tests/stranger_crowd.cpp). Every survivor must hold the same three members and correct
  // sums (tests/worker_elastic.cpp checks).
  for (const std::string transport : {"tcp", "ucx"}) {
    DYNAMIC_SECTION("over " << transport) {
      Cluster cluster(5);
      Job job;
      job.ranks = start_ranks(
          cluster, 1, Launcher::kTorchrun,
          {built_program("tests/kolo_test_elastic"), "allreduce", "0"},
          {{"KOLO_TRANSPORT", transport}, {"KOLO_TIMEOUT", "10"}, {"ELASTIC_STEADY_MS", "2000"}}, 4,
          {{"ELASTIC_LATE_MS", "1500"}});
      std::vector<std::string> crowd_args = {"/bin/sh", cluster_script(),
                                             "exec",    kClusterName,
                                             "5",       built_program("tests/kolo_stranger_crowd")};
      for (int rank = 0; rank < 4; ++rank) {
        crowd_args.push_back(fmt::format("10.77.0.{}={}", rank + 1, job.ranks[rank].pid()));
      }
      Process crowd(crowd_args, {});
      for (int rank = 0; rank < 4; ++rank) {
        ProcessResult result = job.ranks[rank].wait(120);
        INFO("rank " << rank << " output:\n" << result.output);
        CHECK_FALSE(result.timed_out);
        if (rank == 0) {
          CHECK(result.signal == SIGKILL);
        } else {
          CHECK(result.exit_code == 0);
          CHECK(contains(result.output, fmt::format("elastic passed, rank {} of 3", rank - 1)));
          CHECK(contains(result.output, "transport " + transport));
        }
      }
      crowd.kill(SIGTERM);
      ProcessResult crowded = crowd.wait(30);
      INFO("strangers: " << crowded.output);
      CHECK(crowded.exit_code == 0);
      // The store (on every address of rank 0's host) and every rank's lifeline, at least.
      std::smatch match;
      REQUIRE(std::regex_search(crowded.output, match,
                                std::regex(R"(stranger_crowd: (\d+) connections to (\d+) ports)")));
      CHECK(std::stoi(match[2]) >= 5);
      CHECK(contains(crowded.output, "10.77.0.1:29500"));
      WARN("cluster strangers over " << transport << ": " << crowded.output);
    }
  }
}

int main(int argc, char** argv) {
  if (kolo::test::cluster_unavailable()) return kolo::test::kSkipped;
  return Catch::Session().run(argc, argv);
}
