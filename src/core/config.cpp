// Reading the configuration: the caller's overrides, KOLO_* variables, the launcher's variables and
// the defaults, in that order for every field (see config.hpp for the launcher table).
//
// Every value is validated here, and every error names where the value came from ("KOLO_TIMEOUT",
// "kolo_config_t.rank", "OMPI_COMM_WORLD_SIZE"), the value itself and what would be accepted, so
// that a user can fix a job script from the message alone.
#include "core/config.hpp"

#include <fcntl.h>
#include <fmt/format.h>
#include <fmt/ranges.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <charconv>
#include <cmath>
#include <cstring>
#include <initializer_list>
#include <limits>
#include <mutex>
#include <set>
#include <string_view>
#include <type_traits>

#include "core/hostlist.hpp"
#include "core/log.hpp"
#include "kolo/status.hpp"

extern char** environ;

namespace kolo {
namespace {

// The one list of KOLO_* variables; docs/environment.md's table is checked against it.
const std::vector<EnvVarInfo> kKnownVariables = {
    {"KOLO_RANK", "from the launcher", "this process's rank, 0 <= rank < size"},
    {"KOLO_SIZE", "from the launcher", "the number of ranks in the job"},
    {"KOLO_LOCAL_RANK", "from the launcher, else by host", "this rank's index on its machine"},
    {"KOLO_LOCAL_SIZE", "from the launcher, else by host", "the number of ranks on this machine"},
    {"KOLO_ADDR", "MASTER_ADDR:MASTER_PORT; under srun, from the step",
     "host:port where rank 0 serves the rendezvous store"},
    {"KOLO_STORE_FD", "(none: rank 0 binds KOLO_ADDR)",
     "rank 0: an inherited descriptor that already listens at KOLO_ADDR's port (kolorun sets it)"},
    {"KOLO_INVITATION", "(none)",
     "an invitation from kolo_comm_invite: this process joins that growing communicator"},
    {"KOLO_ELASTIC_ADDR", "(none: kolo_elastic_update changes nothing)",
     "host:port of kolorun --elastic's driver, which kolo_elastic_update asks (kolorun sets it)"},
    {"KOLO_ELASTIC_SLOT", "(none)",
     "host:n, the slot kolorun --elastic started this process in (kolorun sets it)"},
    {"KOLO_SECRET", "(none: unauthenticated)",
     "the job secret every connection must prove, at least 16 characters"},
    {"KOLO_SECRET_FILE", "(none)",
     "a file holding the job secret, readable by its owner only (instead of KOLO_SECRET)"},
    {"KOLO_TIMEOUT", "300", "seconds any single wait may last (decimals allowed)"},
    {"KOLO_TCP_STREAMS", "1", "TCP connections per peer for data, 1..16"},
    {"KOLO_TCP_CONGESTION", "auto",
     "TCP congestion control of data connections: auto (reno within this host, the system's "
     "across hosts), system, or an algorithm's name such as cubic"},
    {"KOLO_SOCKET_IFNAME", "(any interface)", "network interface to listen on, such as eth0"},
    {"KOLO_SEGMENT_BYTES", "1M",
     "largest ring pipeline segment, 4K..256M (K/M/G suffixes, powers of 1024)"},
    {"KOLO_TRANSPORT", "auto", "tcp, ucx or auto"},
    {"KOLO_ALLREDUCE", "auto",
     "allreduce schedule: ring (flat), hierarchical (by host: leaders or shards) or auto"},
    {"KOLO_HOST_ID", "(host name and boot id)",
     "what counts as this rank's host: ranks with the same value share one"},
    {"KOLO_SHM", "auto",
     "kolo's shared-memory rings between ranks of one host: 1, 0, or auto (under ucx and "
     "KOLO_TRANSPORT=auto, not under an explicit tcp)"},
    {"KOLO_SHM_COPY", "auto",
     "copies into the rings: auto, plain or stream (non-temporal stores, for cores without a "
     "shared cache)"},
    {"KOLO_BIND", "none", "CPU binding of each rank: none, core or numa"},
    {"KOLO_GPU_BACKEND", "auto", "GPU buffers: auto, nccl or staged (through host memory)"},
    {"KOLO_DEBUG", "WARN", "log level: WARN, INFO or TRACE"},
    {"KOLO_CYCLE_TIME_MS", "5", "fusion engine cycle in milliseconds, > 0 and <= 10000"},
    {"KOLO_CACHE_CAPACITY", "1024", "negotiation cache entries, 0 (off)..1048576"},
    {"KOLO_FUSION_THRESHOLD", "64M", "fusion buffer size, 0 (off)..4G (K/M/G suffixes)"},
    {"KOLO_STALL_WARNING_S", "60", "seconds before warning about a stalled tensor, 0 = never"},
    {"KOLO_STALL_ABORT_S", "0", "seconds before failing a stalled tensor, 0 = never"},
    {"KOLO_TIMELINE", "(off)", "file to write a Chrome-trace timeline to"},
    {"KOLO_AUTOTUNE", "0",
     "1: rank 0 tunes the fusion threshold, cycle time and segment size from measured throughput"},
    {"KOLO_AUTOTUNE_LOG", "(off)", "CSV file where rank 0 logs every autotuning trial"},
    {"KOLO_AUTOTUNE_WINDOW_MS", "1000",
     "busy milliseconds of the engine measured per autotuning trial, > 0 and <= 600000"},
    {"KOLO_LIBRARY", "(see docs/environment.md)",
     "the libkolo.so that the Python package loads; the library itself does not read it"},
};

// A value and where it came from, so that errors can say both.
struct Setting {
  std::string source;  // "KOLO_RANK" or "kolo_config_t.rank"
  std::string text;    // the value as given
};

// An empty variable counts as unset: job scripts often export VAR= to clear it.
std::optional<Setting> from_env(const Environment& env, const char* name) {
  auto it = env.find(name);
  if (it == env.end() || it->second.empty()) return std::nullopt;
  return Setting{name, it->second};
}

std::string_view trim(std::string_view text) {
  while (!text.empty() && std::isspace(static_cast<unsigned char>(text.front()))) {
    text.remove_prefix(1);
  }
  while (!text.empty() && std::isspace(static_cast<unsigned char>(text.back()))) {
    text.remove_suffix(1);
  }
  return text;
}

std::string to_lower(std::string_view text) {
  std::string lower(text);
  for (char& c : lower) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  return lower;
}

[[noreturn]] void fail(const std::string& message) {
  throw Error(Status::kConfig, message);
}

std::optional<int64_t> parse_integer(std::string_view text) {
  text = trim(text);
  int64_t value = 0;
  auto [end, error] = std::from_chars(text.data(), text.data() + text.size(), value);
  if (text.empty() || error != std::errc() || end != text.data() + text.size()) return std::nullopt;
  return value;
}

std::optional<double> parse_decimal(std::string_view text) {
  text = trim(text);
  double value = 0;
  auto [end, error] = std::from_chars(text.data(), text.data() + text.size(), value);
  if (text.empty() || error != std::errc() || end != text.data() + text.size()) return std::nullopt;
  return value;
}

int integer_in_range(const Setting& setting, int64_t min, int64_t max,
                     const std::string& expected) {
  auto value = parse_integer(setting.text);
  if (!value)
    fail(fmt::format("kolo: {}={} is not an integer: expected {}", setting.source, setting.text,
                     expected));
  if (*value < min || *value > max) {
    fail(fmt::format("kolo: {}={} is out of range: expected {}", setting.source, setting.text,
                     expected));
  }
  return static_cast<int>(*value);
}

// min_exclusive: whether the value must be strictly greater than min (a timeout of 0 is useless).
double decimal_in_range(const Setting& setting, double min, bool min_exclusive, double max,
                        const std::string& expected) {
  auto value = parse_decimal(setting.text);
  if (!value)
    fail(fmt::format("kolo: {}={} is not a number: expected {}", setting.source, setting.text,
                     expected));
  bool too_small = min_exclusive ? !(*value > min) : !(*value >= min);
  if (!std::isfinite(*value) || too_small || *value > max) {
    fail(fmt::format("kolo: {}={} is out of range: expected {}", setting.source, setting.text,
                     expected));
  }
  return *value;
}

uint64_t size_in_range(const Setting& setting, uint64_t min, uint64_t max,
                       const std::string& expected) {
  auto value = parse_size(setting.text);
  if (!value)
    fail(fmt::format("kolo: {}={} is not a size: expected {}", setting.source, setting.text,
                     expected));
  if (*value < min || *value > max) {
    fail(fmt::format("kolo: {}={} is out of range: expected {}", setting.source, setting.text,
                     expected));
  }
  return *value;
}

std::string one_of(const Setting& setting, std::initializer_list<const char*> choices) {
  std::string value = to_lower(trim(setting.text));
  for (const char* choice : choices) {
    if (value == choice) return value;
  }
  std::string list;
  for (const char* choice : choices) list += (list.empty() ? "" : ", ") + std::string(choice);
  fail(fmt::format("kolo: {}={} is not accepted: expected one of {}", setting.source, setting.text,
                   list));
}

// Light check of "host:port" (the transport parses it fully): a host, a colon, a port 1..65535.
void check_host_port(const Setting& setting) {
  std::string_view text = trim(setting.text);
  auto colon = text.rfind(':');
  auto port =
      colon == std::string_view::npos ? std::nullopt : parse_integer(text.substr(colon + 1));
  if (colon == std::string_view::npos || colon == 0 || !port || *port < 1 || *port > 65535) {
    fail(
        fmt::format("kolo: {}={} is not an address: expected host:port with a port from 1 to "
                    "65535, such as node0:29500 or [fe80::1]:29500",
                    setting.source, setting.text));
  }
}

// ---- Launchers ---------------------------------------------------------------------------------

struct LauncherValues {
  std::string name;  // as in Config::launcher
  std::optional<Setting> rank, size, local_rank, local_size;
};

// Slurm writes tasks per node as "4(x2),3": four tasks on each of the first two nodes, then three.
// Returns the count of node `node_id`, or nullopt when the text is malformed or too short.
std::optional<int64_t> slurm_tasks_on_node(std::string_view text, int64_t node_id) {
  int64_t first_node = 0;
  while (!text.empty()) {
    auto comma = text.find(',');
    std::string_view entry = text.substr(0, comma);
    text = comma == std::string_view::npos ? std::string_view() : text.substr(comma + 1);
    int64_t repeat = 1;
    if (auto paren = entry.find("(x"); paren != std::string_view::npos) {
      if (entry.back() != ')') return std::nullopt;
      auto count = parse_integer(entry.substr(paren + 2, entry.size() - paren - 3));
      if (!count || *count < 1) return std::nullopt;
      repeat = *count;
      entry = entry.substr(0, paren);
    }
    auto tasks = parse_integer(entry);
    if (!tasks) return std::nullopt;
    if (node_id < first_node + repeat) return tasks;
    first_node += repeat;
  }
  return std::nullopt;
}

std::optional<Setting> slurm_local_size(const Environment& env) {
  // The step's own layout (srun) is more precise than the job's, and both beat the requested
  // --ntasks-per-node, which srun -n may override.
  for (const char* name : {"SLURM_STEP_TASKS_PER_NODE", "SLURM_TASKS_PER_NODE"}) {
    auto layout = from_env(env, name);
    if (!layout) continue;
    auto node_id = from_env(env, "SLURM_NODEID");
    int64_t node = node_id ? parse_integer(node_id->text).value_or(-1) : 0;
    if (node < 0) continue;
    auto tasks = slurm_tasks_on_node(layout->text, node);
    // Without SLURM_NODEID the first entry is right only when it covers every node; accept it
    // only when the layout is a single entry.
    if (tasks && (node_id || layout->text.find(',') == std::string::npos)) {
      return Setting{fmt::format("{} (node {})", name, node), std::to_string(*tasks)};
    }
  }
  if (auto per_node = from_env(env, "SLURM_NTASKS_PER_NODE");
      per_node && parse_integer(per_node->text)) {
    return per_node;
  }
  return std::nullopt;
}

// The launcher that exported a rank, in the order of config.hpp's table; nullopt if none did.
std::optional<LauncherValues> detect_launcher(const Environment& env) {
  auto torchrun = [&] {
    return LauncherValues{"torchrun", from_env(env, "RANK"), from_env(env, "WORLD_SIZE"),
                          from_env(env, "LOCAL_RANK"), from_env(env, "LOCAL_WORLD_SIZE")};
  };
  if (from_env(env, "RANK") && from_env(env, "TORCHELASTIC_RUN_ID")) return torchrun();
  if (auto rank = from_env(env, "OMPI_COMM_WORLD_RANK")) {
    return LauncherValues{"ompi", rank, from_env(env, "OMPI_COMM_WORLD_SIZE"),
                          from_env(env, "OMPI_COMM_WORLD_LOCAL_RANK"),
                          from_env(env, "OMPI_COMM_WORLD_LOCAL_SIZE")};
  }
  if (auto rank = from_env(env, "PMI_RANK")) {
    return LauncherValues{"pmi", rank, from_env(env, "PMI_SIZE"), from_env(env, "MPI_LOCALRANKID"),
                          from_env(env, "MPI_LOCALNRANKS")};
  }
  if (auto rank = from_env(env, "SLURM_PROCID")) {
    auto size = from_env(env, "SLURM_NTASKS");
    if (!size) size = from_env(env, "SLURM_NPROCS");
    return LauncherValues{"slurm", rank, size, from_env(env, "SLURM_LOCALID"),
                          slurm_local_size(env)};
  }
  if (auto rank = from_env(env, "PMIX_RANK")) {
    return LauncherValues{"pmi", rank, from_env(env, "PMI_SIZE"), from_env(env, "MPI_LOCALRANKID"),
                          from_env(env, "MPI_LOCALNRANKS")};
  }
  if (from_env(env, "RANK")) return torchrun();
  return std::nullopt;
}

template <typename T>
std::optional<Setting> from_override(const std::optional<T>& value, const char* field) {
  if (!value) return std::nullopt;
  if constexpr (std::is_same_v<T, std::string>) {
    return Setting{fmt::format("kolo_config_t.{}", field), *value};
  } else {
    return Setting{fmt::format("kolo_config_t.{}", field), fmt::format("{}", *value)};
  }
}

// The first source that has a value: the override, the KOLO_* variable, then the launcher's.
std::optional<Setting> first_of(std::optional<Setting> a, std::optional<Setting> b,
                                std::optional<Setting> c = std::nullopt) {
  if (a) return a;
  if (b) return b;
  return c;
}

// The variables that say a launcher started this process, without its rank. One of them set while
// no rank is found is a launch gone wrong (a typo, a wrapper that dropped KOLO_RANK), not a
// process started on its own.
constexpr const char* kLauncherSizeVariables[] = {
    "KOLO_SIZE",  "KOLO_LOCAL_RANK", "KOLO_LOCAL_SIZE",  "OMPI_COMM_WORLD_SIZE", "PMI_SIZE",
    "WORLD_SIZE", "LOCAL_RANK",      "LOCAL_WORLD_SIZE", "TORCHELASTIC_RUN_ID",
};

// No rank from the caller, KOLO_RANK or a launcher: a process started alone (a benchmark run by
// hand, a training script being debugged), which is a world of one, as under nccl-tests and
// Horovod. Its store listens on the loopback at a port the system picks (KOLO_ADDR may still
// name one). kNoLauncher tells the communicator to say so in one INFO line.
void resolve_world_of_one(const ConfigOverrides& overrides, const Environment& env,
                          Config& config) {
  std::vector<std::string> partial;
  if (overrides.size) partial.push_back("kolo_config_t.size");
  if (overrides.local_rank) partial.push_back("kolo_config_t.local_rank");
  if (overrides.local_size) partial.push_back("kolo_config_t.local_size");
  for (const char* name : kLauncherSizeVariables) {
    if (auto setting = from_env(env, name))
      partial.push_back(fmt::format("{}={}", name, setting->text));
  }
  if (!partial.empty()) {
    fail(fmt::format(
        "kolo: cannot find this process's rank, yet {} is set: set KOLO_RANK (and KOLO_SIZE, "
        "KOLO_ADDR), or start under kolorun, mpirun, srun or torchrun; a process started alone "
        "with none of these is a world of one",
        fmt::join(partial, ", ")));
  }
  config.launcher = kNoLauncher;
  config.rank = 0;
  config.size = 1;
  config.local_rank = 0;
  config.local_size = 1;
}

void resolve_identity(const ConfigOverrides& overrides, const Environment& env, Config& config) {
  std::optional<LauncherValues> launcher;
  if (overrides.rank) {
    config.launcher = "config";
  } else if (from_env(env, "KOLO_RANK")) {
    config.launcher = "kolo";
  } else if ((launcher = detect_launcher(env))) {
    config.launcher = launcher->name;
  } else {
    resolve_world_of_one(overrides, env, config);
    return;
  }
  LauncherValues none;
  const LauncherValues& from_launcher = launcher ? *launcher : none;

  auto rank = first_of(from_override(overrides.rank, "rank"), from_env(env, "KOLO_RANK"),
                       from_launcher.rank);
  auto size = first_of(from_override(overrides.size, "size"), from_env(env, "KOLO_SIZE"),
                       from_launcher.size);
  if (!size) {
    fail(
        fmt::format("kolo: the rank comes from {} but the number of ranks was not found: set "
                    "KOLO_SIZE{}",
                    rank->source, overrides.rank ? " or kolo_config_t.size" : ""));
  }
  constexpr int64_t kMaxInt = std::numeric_limits<int>::max();
  config.size = integer_in_range(*size, 1, kMaxInt, "an integer >= 1 (the number of ranks)");
  config.rank = integer_in_range(*rank, 0, kMaxInt, "an integer >= 0");
  if (config.rank >= config.size) {
    fail(
        fmt::format("kolo: rank {} (from {}) is not less than the size {} (from {}): expected "
                    "0 <= rank < size",
                    rank->text, rank->source, size->text, size->source));
  }

  auto local_rank = first_of(from_override(overrides.local_rank, "local_rank"),
                             from_env(env, "KOLO_LOCAL_RANK"), from_launcher.local_rank);
  auto local_size = first_of(from_override(overrides.local_size, "local_size"),
                             from_env(env, "KOLO_LOCAL_SIZE"), from_launcher.local_size);
  if (local_size) {
    config.local_size = integer_in_range(
        *local_size, 1, config.size, fmt::format("an integer from 1 to the size {}", config.size));
  }
  if (local_rank) {
    config.local_rank = integer_in_range(*local_rank, 0, config.size - 1,
                                         fmt::format("an integer from 0 to {}", config.size - 1));
  }
  if (local_rank && local_size && config.local_rank >= config.local_size) {
    fail(
        fmt::format("kolo: local rank {} (from {}) is not less than the local size {} (from {}): "
                    "expected 0 <= local rank < local size",
                    local_rank->text, local_rank->source, local_size->text, local_size->source));
  }
  if (config.size == 1) {
    config.local_rank = 0;
    config.local_size = 1;
  }
}

// A plain srun step exports no address, but every task sees the step's node list and ids. Rank 0
// (task 0) runs on the list's first node under block, cyclic and plane distributions, and its store
// listens at a port from the job and step ids: every task computes the same address, and steps that
// run at once on one node differ unless their job ids differ by a multiple of 1000.
constexpr int64_t kSlurmFirstPort = 20000;
constexpr int64_t kSlurmPortCount = 10000;

std::string slurm_step_address(const Environment& env) {
  const char* advice = "or set KOLO_ADDR=host:port (rank 0's host and a free port)";
  auto step = from_env(env, "SLURM_STEP_ID");
  if (!step) step = from_env(env, "SLURM_STEPID");
  if (!step) {
    fail(fmt::format(
        "kolo: SLURM_PROCID is set but SLURM_STEP_ID is not: this is a Slurm job's batch script "
        "or allocation shell, not a task that srun started; start the program with srun, {}",
        advice));
  }
  // Slurm's ids are 32-bit unsigned; integer_in_range() stops at int's range.
  auto slurm_id = [](const Setting& setting) {
    auto value = parse_integer(setting.text);
    if (!value || *value < 0 || *value > std::numeric_limits<uint32_t>::max()) {
      fail(fmt::format("kolo: {}={} is not a Slurm id: expected an integer from 0 to {}",
                       setting.source, setting.text, std::numeric_limits<uint32_t>::max()));
    }
    return *value;
  };
  int64_t step_id = slurm_id(*step);
  auto job = from_env(env, "SLURM_JOB_ID");
  if (!job) job = from_env(env, "SLURM_JOBID");
  if (!job) {
    fail(fmt::format("kolo: srun exported no SLURM_JOB_ID to derive a port from; {}", advice));
  }
  int64_t job_id = slurm_id(*job);
  if (auto distribution = from_env(env, "SLURM_DISTRIBUTION")) {
    // "cyclic:block,Pack": the first word places tasks on nodes; "*" is the default, block.
    std::string_view text = trim(distribution->text);
    std::string_view nodes = text.substr(0, text.find_first_of(":,"));
    if (nodes != "block" && nodes != "cyclic" && nodes != "plane" && nodes != "*") {
      fail(fmt::format(
          "kolo: SLURM_DISTRIBUTION={} does not place task 0 on the step's first node (kolo "
          "derives rank 0's address only for block, cyclic and plane); {}",
          distribution->text, advice));
    }
  }
  auto nodes = from_env(env, "SLURM_STEP_NODELIST");
  if (!nodes) nodes = from_env(env, "SLURM_JOB_NODELIST");
  if (!nodes) {
    fail(fmt::format("kolo: srun exported neither SLURM_STEP_NODELIST nor SLURM_JOB_NODELIST; {}",
                     advice));
  }
  std::string host;
  try {
    host = first_host_of_hostlist(nodes->text);
  } catch (const Error& error) {
    fail(fmt::format("kolo: cannot read {} as a Slurm node list: {}; {}", nodes->source,
                     error.what(), advice));
  }
  int64_t port = kSlurmFirstPort + (10 * job_id + step_id) % kSlurmPortCount;
  log::info(
      "srun step {}.{}: rank 0's store at {}:{} (the first node of {}={}; KOLO_ADDR "
      "overrides)",
      job_id, step_id, host, port, nodes->source, nodes->text);
  return fmt::format("{}:{}", host, port);
}

void resolve_address(const ConfigOverrides& overrides, const Environment& env, Config& config) {
  if (auto fd = from_env(env, "KOLO_STORE_FD")) {
    config.store_fd =
        integer_in_range(*fd, 0, std::numeric_limits<int>::max(), "a descriptor number >= 0");
  }
  if (auto addr = first_of(from_override(overrides.addr, "addr"), from_env(env, "KOLO_ADDR"))) {
    check_host_port(*addr);
    config.addr = std::string(trim(addr->text));
    return;
  }
  if (config.launcher == kNoLauncher) {
    config.addr = "127.0.0.1:0";  // the store binds a free port and tells the communicator
    return;
  }
  auto master_addr = from_env(env, "MASTER_ADDR");
  auto master_port = from_env(env, "MASTER_PORT");
  if (master_addr && master_port) {
    int port = integer_in_range(*master_port, 1, 65535, "a TCP port from 1 to 65535");
    // Under torchrun's static rendezvous (TORCHELASTIC_USE_AGENT_STORE=True) the elastic agent's
    // own store listens on MASTER_PORT: kolo's store takes the port after it. Under its c10d (or
    // etcd) rendezvous nothing listens there: the agent found the port free and left it to the
    // workers, and the port after it is often where the agent's own connections come from.
    auto agent_store = from_env(env, "TORCHELASTIC_USE_AGENT_STORE");
    if (from_env(env, "TORCHELASTIC_RUN_ID") && agent_store && trim(agent_store->text) == "True") {
      if (port == 65535) {
        fail("kolo: under torchrun MASTER_PORT=65535 leaves no port for kolo's store after "
             "torchrun's own; set KOLO_ADDR=host:port");
      }
      ++port;
    }
    std::string host(trim(master_addr->text));
    // A bare IPv6 address needs brackets to be told apart from the port.
    bool bare_ipv6 = host.find(':') != std::string::npos && host.front() != '[';
    config.addr = bare_ipv6 ? fmt::format("[{}]:{}", host, port) : fmt::format("{}:{}", host, port);
    return;
  }
  if (master_addr || master_port) {
    fail(fmt::format("kolo: {} is set but {} is not: set both, or KOLO_ADDR=host:port",
                     master_addr ? "MASTER_ADDR" : "MASTER_PORT",
                     master_addr ? "MASTER_PORT" : "MASTER_ADDR"));
  }
  if ((config.launcher == "ompi" || config.launcher == "pmi" || config.launcher == "slurm") &&
      from_env(env, "PMIX_NAMESPACE") && from_env(env, "PMIX_RANK")) {
    config.pmix_rendezvous = true;  // the communicator asks PMIx for rank 0's store address
    return;
  }
  if (config.launcher == "slurm") {
    config.addr = slurm_step_address(env);
    return;
  }
  std::string hint;
  if (config.launcher == "ompi" || config.launcher == "pmi") {
    hint =
        "; mpirun exports no address, so set KOLO_ADDR to rank 0's host and a free "
        "port in the job script, e.g. KOLO_ADDR=$(hostname):29500";
  }
  fail(
      "kolo: no rendezvous address: set KOLO_ADDR=host:port (rank 0 serves the store there), or "
      "MASTER_ADDR and MASTER_PORT" +
      hint);
}

// The secret in KOLO_SECRET_FILE: a regular file that only its owner may read (like an SSH key),
// of at most 4 KiB, whose content without surrounding white space is not empty.
std::string read_secret_file(const std::string& path) {
  auto refuse = [&](const std::string& why) {
    fail(fmt::format("kolo: KOLO_SECRET_FILE={}: {}", path, why));
  };
  int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NOCTTY);
  if (fd < 0) refuse(std::strerror(errno));
  struct stat info {};
  std::string content(4097, '\0');
  ssize_t length = -1;
  if (::fstat(fd, &info) == 0 && S_ISREG(info.st_mode) && (info.st_mode & 077) == 0) {
    length = ::read(fd, content.data(), content.size());
  }
  ::close(fd);
  if (!S_ISREG(info.st_mode)) refuse("not a regular file");
  if ((info.st_mode & 077) != 0) {
    refuse(fmt::format("group or others may access it (mode {:o}): chmod 600 it",
                       info.st_mode & 0777));
  }
  if (length < 0) refuse(std::strerror(errno));
  if (length > 4096) refuse("longer than 4096 bytes");
  content.resize(static_cast<size_t>(length));
  std::string secret(trim(content));
  if (secret.empty()) refuse("the file is empty");
  return secret;
}

void resolve_tuning(const ConfigOverrides& overrides, const Environment& env, Config& config) {
  auto secret_file = from_env(env, "KOLO_SECRET_FILE");
  std::string secret_source;
  if (auto secret =
          first_of(from_override(overrides.secret, "secret"), from_env(env, "KOLO_SECRET"))) {
    if (secret_file && secret->source == "KOLO_SECRET") {
      fail("kolo: KOLO_SECRET and KOLO_SECRET_FILE are both set: set one of them");
    }
    config.secret = secret->text;
    secret_source = secret->source;
  } else if (secret_file) {
    config.secret = read_secret_file(secret_file->text);
    secret_source = "KOLO_SECRET_FILE=" + secret_file->text;
  }
  // A short secret can be guessed from one recorded handshake, however slow its key derivation
  // (net/auth.hpp). No secret at all stays possible, and is warned about.
  if (!config.secret.empty() && config.secret.size() < kMinSecretLength) {
    fail(fmt::format("kolo: {} gives a job secret of {} characters; it must have at least {} "
                     "(use a random one, e.g. head -c 32 /dev/urandom | od -An -tx1 | tr -d ' "
                     "\\n'; kolorun makes one itself)",
                     secret_source, config.secret.size(), kMinSecretLength));
  }
  if (auto ifname = first_of(from_override(overrides.socket_ifname, "socket_ifname"),
                             from_env(env, "KOLO_SOCKET_IFNAME"))) {
    config.socket_ifname = std::string(trim(ifname->text));
  }
  // Upper bound keeps deadlines representable in steady_clock's 64-bit nanoseconds.
  if (auto timeout = first_of(from_override(overrides.timeout_s, "timeout_s"),
                              from_env(env, "KOLO_TIMEOUT"))) {
    config.timeout_s =
        decimal_in_range(*timeout, 0.0, true, 1e9, "seconds > 0 and <= 1e9, such as 300 or 0.5");
  }
  if (auto streams = first_of(from_override(overrides.tcp_streams, "tcp_streams"),
                              from_env(env, "KOLO_TCP_STREAMS"))) {
    config.tcp_streams = integer_in_range(*streams, 1, 16, "an integer from 1 to 16");
  }
  if (auto congestion = from_env(env, "KOLO_TCP_CONGESTION")) {
    config.tcp_congestion = std::string(trim(congestion->text));
    std::transform(config.tcp_congestion.begin(), config.tcp_congestion.end(),
                   config.tcp_congestion.begin(),
                   [](unsigned char c) { return static_cast<char>(std::tolower(c)); });
    const bool name_like =
        !config.tcp_congestion.empty() && config.tcp_congestion.size() < kMaxCongestionNameBytes &&
        std::all_of(config.tcp_congestion.begin(), config.tcp_congestion.end(), [](char c) {
          return std::islower(static_cast<unsigned char>(c)) ||
                 std::isdigit(static_cast<unsigned char>(c)) || c == '_' || c == '-';
        });
    if (!name_like) {
      fail(
          fmt::format("kolo: {}={} is not a congestion control: expected auto, system or an "
                      "algorithm's name such as reno or cubic (letters, digits, _ and -, at most "
                      "{} characters)",
                      congestion->source, congestion->text, kMaxCongestionNameBytes - 1));
    }
  }
  if (auto segment = first_of(from_override(overrides.segment_bytes, "segment_bytes"),
                              from_env(env, "KOLO_SEGMENT_BYTES"))) {
    config.segment_bytes = size_in_range(*segment, kSmallestSegmentBytes, kLargestSegmentBytes,
                                         "a size from 4K to 256M, such as 65536, 512K or 1M");
  }
  if (auto transport = from_env(env, "KOLO_TRANSPORT")) {
    config.transport = one_of(*transport, {"tcp", "ucx", "auto"});
  }
  if (auto allreduce = from_env(env, "KOLO_ALLREDUCE")) {
    config.allreduce = one_of(*allreduce, {"auto", "ring", "hierarchical"});
  }
  if (auto host = from_env(env, "KOLO_HOST_ID")) {
    config.host_id = std::string(trim(host->text));
    if (config.host_id.size() > kMaxHostIdBytes) {
      fail(fmt::format("kolo: {}={} is longer than {} bytes", host->source, host->text,
                       kMaxHostIdBytes));
    }
  }
  for (const char* old_name : {"KOLO_UCX_SHM", "KOLO_UCX_SHM_COPY"}) {
    if (auto old = from_env(env, old_name)) {
      fail(fmt::format(
          "kolo: {}={}: this variable is now {} (the rings serve the TCP transport "
          "too); rename it",
          old->source, old->text, old->source == "KOLO_UCX_SHM" ? "KOLO_SHM" : "KOLO_SHM_COPY"));
    }
  }
  if (auto shm = from_env(env, "KOLO_SHM")) config.shm = one_of(*shm, {"auto", "0", "1"});
  if (auto copy = from_env(env, "KOLO_SHM_COPY")) {
    config.shm_copy = one_of(*copy, {"auto", "plain", "stream"});
  }
  if (auto bind = from_env(env, "KOLO_BIND")) config.bind = one_of(*bind, {"none", "core", "numa"});
  if (auto gpu = from_env(env, "KOLO_GPU_BACKEND")) {
    config.gpu_backend = one_of(*gpu, {"auto", "nccl", "staged"});
  }
}

void resolve_fusion(const Environment& env, Config& config) {
  if (auto cycle = from_env(env, "KOLO_CYCLE_TIME_MS")) {
    config.cycle_time_ms = decimal_in_range(*cycle, 0.0, true, kMaxCycleTimeMs,
                                            "milliseconds > 0 and <= 10000, such as 5 or 0.5");
  }
  if (auto capacity = from_env(env, "KOLO_CACHE_CAPACITY")) {
    config.cache_capacity =
        integer_in_range(*capacity, 0, 1 << 20, "an integer from 0 (no cache) to 1048576");
  }
  if (auto threshold = from_env(env, "KOLO_FUSION_THRESHOLD")) {
    config.fusion_threshold_bytes = size_in_range(*threshold, 0, kMaxFusionThresholdBytes,
                                                  "a size from 0 (no fusion) to 4G, such as 64M");
  }
  if (auto warning = from_env(env, "KOLO_STALL_WARNING_S")) {
    config.stall_warning_s =
        decimal_in_range(*warning, 0.0, false, 1e9, "seconds >= 0 (0: never warn), such as 60");
  }
  if (auto abort = from_env(env, "KOLO_STALL_ABORT_S")) {
    config.stall_abort_s =
        decimal_in_range(*abort, 0.0, false, 1e9, "seconds >= 0 (0: never abort), such as 600");
  }
  if (auto timeline = from_env(env, "KOLO_TIMELINE")) config.timeline_path = timeline->text;
  if (auto autotune = from_env(env, "KOLO_AUTOTUNE")) {
    config.autotune = one_of(*autotune, {"0", "1"}) == "1";
  }
  if (auto log = from_env(env, "KOLO_AUTOTUNE_LOG")) config.autotune_log_path = log->text;
  if (auto window = from_env(env, "KOLO_AUTOTUNE_WINDOW_MS")) {
    config.autotune_window_ms = decimal_in_range(
        *window, 0.0, true, 600000.0, "milliseconds > 0 and <= 600000, such as 1000 or 50");
  }
}

// Horovod's booleans: an integer, true when > 0 (Horovod reads them with strtol).
bool horovod_flag(const Setting& setting) {
  return integer_in_range(setting, std::numeric_limits<int>::min(),
                          std::numeric_limits<int>::max(), "an integer (> 0: on, else off)") > 0;
}

// Warns once per process about each HOROVOD_* variable kolo ignores: a program that makes
// several communicators would otherwise repeat the same warning for each.
void warn_ignored_horovod_variables(const std::vector<std::string>& ignored) {
  static std::mutex mutex;
  static std::set<std::string> warned;
  std::lock_guard<std::mutex> lock(mutex);
  for (const auto& name : ignored) {
    if (warned.insert(name).second) {
      log::warn("{} is set, but kolo does not honour this Horovod variable (or this value of "
                "it): ignored (docs/horovod.md lists the ones kolo reads)",
                name);
    }
  }
}

}  // namespace

HorovodTranslation translate_horovod_variables(const Environment& env) {
  HorovodTranslation result{env, {}, {}};
  std::set<std::string> honoured;
  // Sets kolo_name to value unless the job set kolo_name itself, and notes which happened.
  auto map = [&](const Setting& horovod, const char* kolo_name, const std::string& value) {
    honoured.insert(horovod.source);
    if (auto own = from_env(env, kolo_name)) {
      result.notes.push_back(fmt::format("{}={} not used: {}={} is set and wins", horovod.source,
                                         horovod.text, kolo_name, own->text));
      return;
    }
    result.env[kolo_name] = value;
    result.notes.push_back(
        fmt::format("{}={} read as {}={}", horovod.source, horovod.text, kolo_name, value));
  };
  if (auto threshold = from_env(env, "HOROVOD_FUSION_THRESHOLD")) {
    map(*threshold, "KOLO_FUSION_THRESHOLD",
        std::to_string(size_in_range(*threshold, 0, kMaxFusionThresholdBytes,
                                     "bytes from 0 (no fusion) to 4294967296, such as 67108864")));
  }
  if (auto cycle = from_env(env, "HOROVOD_CYCLE_TIME")) {
    const double ms = decimal_in_range(*cycle, 0.0, true, kMaxCycleTimeMs,
                                       "milliseconds > 0 and <= 10000, such as 5 or 0.5");
    map(*cycle, "KOLO_CYCLE_TIME_MS", fmt::format("{}", ms));
  }
  if (auto capacity = from_env(env, "HOROVOD_CACHE_CAPACITY")) {
    map(*capacity, "KOLO_CACHE_CAPACITY",
        std::to_string(integer_in_range(*capacity, 0, 1 << 20,
                                        "an integer from 0 (no cache) to 1048576")));
  }
  if (auto timeline = from_env(env, "HOROVOD_TIMELINE")) {
    // DYNAMIC: Horovod's programs start and stop the timeline themselves; kolo's is a file only.
    if (timeline->text != "DYNAMIC") map(*timeline, "KOLO_TIMELINE", timeline->text);
  }
  if (auto autotune = from_env(env, "HOROVOD_AUTOTUNE")) {
    map(*autotune, "KOLO_AUTOTUNE", horovod_flag(*autotune) ? "1" : "0");
  }
  if (auto log = from_env(env, "HOROVOD_AUTOTUNE_LOG")) map(*log, "KOLO_AUTOTUNE_LOG", log->text);
  const auto stall_disable = from_env(env, "HOROVOD_STALL_CHECK_DISABLE");
  const bool stall_off = stall_disable && horovod_flag(*stall_disable);
  if (stall_disable) honoured.insert(stall_disable->source);
  if (stall_off) {
    map(*stall_disable, "KOLO_STALL_WARNING_S", "0");
    map(*stall_disable, "KOLO_STALL_ABORT_S", "0");
  }
  if (auto check = from_env(env, "HOROVOD_STALL_CHECK_TIME_SECONDS")) {
    const int seconds = integer_in_range(*check, 0, std::numeric_limits<int>::max(),
                                         "whole seconds >= 0 (0: never warn), such as 60");
    if (stall_off) {
      honoured.insert(check->source);
      result.notes.push_back(fmt::format("{}={} not used: HOROVOD_STALL_CHECK_DISABLE={} turns "
                                         "the stall check off",
                                         check->source, check->text, stall_disable->text));
    } else {
      map(*check, "KOLO_STALL_WARNING_S", std::to_string(seconds));
    }
  }
  if (auto shutdown = from_env(env, "HOROVOD_STALL_SHUTDOWN_TIME_SECONDS")) {
    const int seconds = integer_in_range(*shutdown, 0, std::numeric_limits<int>::max(),
                                         "whole seconds >= 0 (0: never), such as 600");
    if (stall_off) {
      honoured.insert(shutdown->source);
      result.notes.push_back(fmt::format("{}={} not used: HOROVOD_STALL_CHECK_DISABLE={} turns "
                                         "the stall check off",
                                         shutdown->source, shutdown->text, stall_disable->text));
    } else {
      map(*shutdown, "KOLO_STALL_ABORT_S", std::to_string(seconds));
    }
  }
  if (auto hierarchical = from_env(env, "HOROVOD_HIERARCHICAL_ALLREDUCE")) {
    map(*hierarchical, "KOLO_ALLREDUCE", horovod_flag(*hierarchical) ? "hierarchical" : "ring");
  }
  if (auto timeout = from_env(env, "HOROVOD_GLOO_TIMEOUT_SECONDS")) {
    const double seconds =
        decimal_in_range(*timeout, 0.0, true, 1e9, "seconds > 0 and <= 1e9, such as 30");
    map(*timeout, "KOLO_TIMEOUT", fmt::format("{}", seconds));
  }
  if (auto iface = from_env(env, "HOROVOD_GLOO_IFACE")) {
    map(*iface, "KOLO_SOCKET_IFNAME", std::string(trim(iface->text)));
  }
  if (auto dynamic = from_env(env, "HOROVOD_DYNAMIC_PROCESS_SETS")) {
    honoured.insert(dynamic->source);
    result.notes.push_back(fmt::format("{}={}: process sets can always be added and removed "
                                       "after init in kolo",
                                       dynamic->source, dynamic->text));
  }
  for (const auto& [name, value] : env) {
    if (name.rfind("HOROVOD_", 0) == 0 && !value.empty() && honoured.count(name) == 0) {
      result.ignored.push_back(name);
    }
  }
  return result;
}

const std::vector<EnvVarInfo>& known_variables() {
  return kKnownVariables;
}

Environment process_environment() {
  Environment env;
  for (char** entry = environ; entry != nullptr && *entry != nullptr; ++entry) {
    std::string_view text(*entry);
    auto equals = text.find('=');
    if (equals == std::string_view::npos) continue;
    env.emplace(std::string(text.substr(0, equals)), std::string(text.substr(equals + 1)));
  }
  return env;
}

std::optional<uint64_t> parse_size(const std::string& text) {
  std::string_view rest = trim(text);
  uint64_t value = 0;
  auto [end, error] = std::from_chars(rest.data(), rest.data() + rest.size(), value);
  if (error != std::errc() || end == rest.data()) return std::nullopt;
  rest.remove_prefix(static_cast<size_t>(end - rest.data()));

  std::string suffix = to_lower(rest);
  int shift = 0;
  if (!suffix.empty()) {
    switch (suffix.front()) {
      case 'k':
        shift = 10;
        break;
      case 'm':
        shift = 20;
        break;
      case 'g':
        shift = 30;
        break;
      case 't':
        shift = 40;
        break;
      case 'b':
        shift = 0;
        break;
      default:
        return std::nullopt;
    }
    // After a multiplier: "", "b" or "ib"; a bare "b" stands alone.
    std::string_view tail = std::string_view(suffix).substr(1);
    bool valid =
        suffix.front() == 'b' ? tail.empty() : (tail.empty() || tail == "b" || tail == "ib");
    if (!valid) return std::nullopt;
  }
  if (shift > 0 && value > (std::numeric_limits<uint64_t>::max() >> shift)) return std::nullopt;
  return value << shift;
}

Config resolve_config(const ConfigOverrides& overrides, const Environment& given_env,
                      std::vector<std::string>* unknown) {
  const HorovodTranslation horovod = translate_horovod_variables(given_env);
  for (const auto& note : horovod.notes) log::info("{}", note);
  warn_ignored_horovod_variables(horovod.ignored);
  const Environment& env = horovod.env;
  if (unknown != nullptr) {
    unknown->clear();
    for (const auto& entry : env) {
      const std::string& name = entry.first;
      if (name.rfind("KOLO_", 0) != 0) continue;
      bool known = std::any_of(kKnownVariables.begin(), kKnownVariables.end(),
                               [&](const EnvVarInfo& info) { return name == info.name; });
      if (!known) unknown->push_back(name);
    }
  }
  Config config;
  if (auto invitation = from_env(env, "KOLO_INVITATION")) {
    config.invitation = invitation->text;  // rank, size and store: from the growth (comm/grow.cpp)
    config.launcher = "invitation";
  } else {
    resolve_identity(overrides, env, config);
    resolve_address(overrides, env, config);
  }
  resolve_tuning(overrides, env, config);
  resolve_fusion(env, config);
  return config;
}

}  // namespace kolo
