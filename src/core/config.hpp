// Configuration of a communicator: where each setting comes from and its default.
//
// Precedence for every field: the kolo_config_t field when the caller set it, then the KOLO_*
// variable, then (for rank, size, local rank, local size and address) what a known launcher
// exported, then the documented default. This is the one place that reads KOLO_* variables
// (except KOLO_DEBUG, which the logger reads itself so that it works before any config exists).
//
// Launchers. The rank decides whose variables are read, so that one job never mixes two
// launchers' views (a torchrun inside an srun step sees both RANK and SLURM_PROCID). The first
// row that matches wins:
//   launcher   rank from              size, local rank, local size from
//   kolo       KOLO_RANK              KOLO_SIZE, KOLO_LOCAL_RANK, KOLO_LOCAL_SIZE (kolorun)
//   torchrun   RANK, if TORCHELASTIC_RUN_ID is set (torchrun is always the innermost launcher)
//   ompi       OMPI_COMM_WORLD_RANK   OMPI_COMM_WORLD_SIZE, ..._LOCAL_RANK, ..._LOCAL_SIZE
//   pmi        PMI_RANK               PMI_SIZE, MPI_LOCALRANKID, MPI_LOCALNRANKS (MPICH, Intel MPI)
//   slurm      SLURM_PROCID           SLURM_NTASKS or SLURM_NPROCS, SLURM_LOCALID, and this node's
//                                     entry of SLURM_STEP_TASKS_PER_NODE or SLURM_TASKS_PER_NODE
//                                     ("4(x2),3", indexed by SLURM_NODEID), else
//                                     SLURM_NTASKS_PER_NODE
//   pmi        PMIX_RANK              PMI_SIZE (a bare PMIx launch exports no size: set KOLO_SIZE)
//   torchrun   RANK                   WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE
// When the rank comes from kolo_config_t ("config") or KOLO_RANK ("kolo"), no launcher variable
// is read for the other fields either. The address comes from KOLO_ADDR, else torchrun's
// MASTER_ADDR and MASTER_PORT, whatever the launcher, else (under mpirun, MPICH or srun with a
// PMIx server: PMIX_NAMESPACE and PMIX_RANK set) from PMIx at start-up (bootstrap/pmix.hpp); under
// plain srun, rank 0's host is the step's first node and its port comes from the job and step ids
// (slurm_step_address in config.cpp); other launchers export none, so jobs they start must set
// KOLO_ADDR. When no row matches, the process was started alone and is a world of one (rank 0 of
// 1, its store on the loopback), unless a size or local rank says that a launcher did start it
// (KOLO_SIZE without KOLO_RANK, say): that is an error naming the variable.
#pragma once

#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <vector>

namespace kolo {

// Config::launcher of a process that no launcher started: a world of one whose store listens on
// the loopback at a port the system picks.
inline constexpr const char* kNoLauncher = "none";

// The largest fusion threshold (KOLO_FUSION_THRESHOLD, kolo_comm_set_fusion_threshold).
inline constexpr uint64_t kMaxFusionThresholdBytes = uint64_t{4} << 30;

// The range of a ring pipeline segment (KOLO_SEGMENT_BYTES, and the autotuner's choices).
inline constexpr uint64_t kSmallestSegmentBytes = uint64_t{4} << 10;
inline constexpr uint64_t kLargestSegmentBytes = uint64_t{256} << 20;

// The longest fusion engine cycle (KOLO_CYCLE_TIME_MS), in milliseconds.
inline constexpr double kMaxCycleTimeMs = 10000.0;

// The longest KOLO_HOST_ID: host identities travel in fixed start-up frames.
inline constexpr size_t kMaxHostIdBytes = 128;
// Linux's TCP_CA_NAME_MAX: a congestion control's name and its terminating zero.
inline constexpr size_t kMaxCongestionNameBytes = 16;

// The shortest job secret resolve_config accepts (an empty one aside).
inline constexpr size_t kMinSecretLength = 16;

struct Config {
  int rank = -1;
  int size = -1;
  // -1 when neither the caller, KOLO_LOCAL_* nor the launcher says (each independently); the
  // communicator then derives them by grouping the ranks by host (core/host.hpp). A job of size
  // 1 always has local_rank 0 and local_size 1. When both are known, 0 <= local_rank <
  // local_size <= size.
  int local_rank = -1;
  int local_size = -1;
  std::string addr;                  // "host:port" of the rendezvous store served by rank 0
  // No address was given and a PMIx server started the job: rank 0's store binds a free port and
  // the communicator hands "host:port" out through PMIx (bootstrap/pmix.hpp) and sets addr.
  bool pmix_rendezvous = false;
  // KOLO_STORE_FD: a socket listening at addr's port that rank 0's launcher bound and handed down
  // (kolorun does), which rank 0's store serves on instead of binding the port; -1: none.
  int store_fd = -1;
  // How many communicators this process has made as this rank from a configuration at addr, this
  // one included (set by the communicator, not configured). Store clients name it and rank 0's store
  // admits only its own: a rank that destroys a communicator and makes the next one at the same
  // address (Horovod's shutdown and init) before rank 0 has destroyed the old one would otherwise
  // register in the old store, which then vanishes under it.
  uint64_t store_generation = 0;
  // KOLO_SECRET (or KOLO_SECRET_FILE's): empty means unauthenticated (warned), else at least
  // kMinSecretLength characters.
  std::string secret;
  double timeout_s = 300.0;          // KOLO_TIMEOUT
  int tcp_streams = 1;               // KOLO_TCP_STREAMS, 1..16
  std::string socket_ifname;         // KOLO_SOCKET_IFNAME
  // KOLO_TCP_CONGESTION: auto, system or an algorithm's name (net::set_congestion_control).
  std::string tcp_congestion = "auto";
  uint64_t segment_bytes = 1 << 20;  // KOLO_SEGMENT_BYTES, 4 KiB .. 256 MiB
  std::string transport = "auto";    // KOLO_TRANSPORT: tcp | ucx | auto
  // KOLO_ALLREDUCE: auto | ring | hierarchical (ring/algorithms.hpp); the same on every rank.
  std::string allreduce = "auto";
  // KOLO_HOST_ID: what makes two ranks one host (core/host.hpp); "" = host name and boot id.
  std::string host_id;
  std::string shm = "auto";       // KOLO_SHM: kolo's shared-memory rings within a host: auto, 0, 1
  std::string shm_copy = "auto";  // KOLO_SHM_COPY: auto, plain or stream
  std::string bind = "none";         // KOLO_BIND: none | core | numa
  std::string gpu_backend = "auto";  // KOLO_GPU_BACKEND: auto | nccl | staged (gpu/backend.hpp)
  std::string launcher;              // who supplied the rank: config|kolo|ompi|pmi|slurm|torchrun,
                                     // or kNoLauncher (a world of one)
  // KOLO_INVITATION: this process joins a growing communicator (comm/grow.cpp) instead of a job;
  // its rank, size and store come from the growth, not from the launcher's variables.
  std::string invitation;

  // Settings of the fusion engine (named, asynchronous calls); read here so that every KOLO_*
  // variable is parsed and validated in one place.
  double cycle_time_ms = 5.0;                  // KOLO_CYCLE_TIME_MS, > 0 and <= 10000
  int cache_capacity = 1024;                   // KOLO_CACHE_CAPACITY, 0 (off) .. 1048576 entries
  uint64_t fusion_threshold_bytes = 64 << 20;  // KOLO_FUSION_THRESHOLD, 0 (off) .. 4 GiB
  double stall_warning_s = 60.0;               // KOLO_STALL_WARNING_S, 0 = never warn
  double stall_abort_s = 0.0;                  // KOLO_STALL_ABORT_S, 0 = never abort
  std::string timeline_path;                   // KOLO_TIMELINE, "" = no timeline
  // KOLO_AUTOTUNE: rank 0 tunes the threshold, cycle time and segment online (fusion/autotune.hpp).
  bool autotune = false;
  std::string autotune_log_path;     // KOLO_AUTOTUNE_LOG, "" = no log
  double autotune_window_ms = 1000;  // KOLO_AUTOTUNE_WINDOW_MS, > 0 and <= 600000
};

// The caller's overrides (from kolo_config_t); unset fields are std::nullopt.
struct ConfigOverrides {
  std::optional<int> rank, size, local_rank, local_size;
  std::optional<std::string> addr, secret, socket_ifname;
  std::optional<double> timeout_s;
  std::optional<int> tcp_streams;
  std::optional<uint64_t> segment_bytes;
};

using Environment = std::map<std::string, std::string>;

// The process environment as a map.
Environment process_environment();

// Builds the configuration. Throws kolo::Error(kConfig) naming the variable to set when rank,
// size or the address cannot be found, and kolo::Error(kConfig) naming the variable and value for
// values out of range or not numbers. Unknown KOLO_* variables are returned in *unknown (if
// non-null) so that the caller can warn about them.
Config resolve_config(const ConfigOverrides& overrides, const Environment& env,
                      std::vector<std::string>* unknown = nullptr);

// One KOLO_* variable as docs/environment.md documents it. known_variables() is the single list of
// them: resolve_config() reports every other KOLO_* name as unknown.
struct EnvVarInfo {
  const char* name;           // "KOLO_TIMEOUT"
  const char* default_value;  // "300", or a phrase such as "from the launcher"
  const char* description;    // one line
};
const std::vector<EnvVarInfo>& known_variables();

// Horovod's variables, so that a job script written for Horovod keeps its settings. Each
// HOROVOD_* variable with a meaning in kolo is read in Horovod's units, validated (an error names
// the HOROVOD_* variable and its value) and becomes its KOLO_* counterpart, unless that is set:
// kolo's own name wins. resolve_config() applies it first, logs each note at INFO and warns once
// per process about each ignored name.
//   HOROVOD_FUSION_THRESHOLD (bytes)            KOLO_FUSION_THRESHOLD
//   HOROVOD_CYCLE_TIME (milliseconds)           KOLO_CYCLE_TIME_MS
//   HOROVOD_CACHE_CAPACITY (entries)            KOLO_CACHE_CAPACITY
//   HOROVOD_TIMELINE (a file)                   KOLO_TIMELINE
//   HOROVOD_AUTOTUNE (integer > 0: on)          KOLO_AUTOTUNE
//   HOROVOD_AUTOTUNE_LOG (a file)               KOLO_AUTOTUNE_LOG
//   HOROVOD_STALL_CHECK_TIME_SECONDS            KOLO_STALL_WARNING_S
//   HOROVOD_STALL_CHECK_DISABLE (> 0: off)      KOLO_STALL_WARNING_S=0 (and KOLO_STALL_ABORT_S=0)
//   HOROVOD_STALL_SHUTDOWN_TIME_SECONDS         KOLO_STALL_ABORT_S
//   HOROVOD_HIERARCHICAL_ALLREDUCE (> 0: on)    KOLO_ALLREDUCE=hierarchical, else ring
//   HOROVOD_GLOO_TIMEOUT_SECONDS                KOLO_TIMEOUT
//   HOROVOD_GLOO_IFACE                          KOLO_SOCKET_IFNAME
//   HOROVOD_DYNAMIC_PROCESS_SETS                (always so in kolo: a note, nothing to set)
// HOROVOD_TIMELINE=DYNAMIC (a timeline started from the program) has no counterpart and is
// ignored like every other HOROVOD_* variable.
struct HorovodTranslation {
  Environment env;                   // the input plus the KOLO_* variables it implies
  std::vector<std::string> notes;    // one sentence per HOROVOD_* variable honoured
  std::vector<std::string> ignored;  // the names of the HOROVOD_* variables set but ignored
};
HorovodTranslation translate_horovod_variables(const Environment& env);

// Parses sizes such as "4096", "64K", "1M", "2G" (powers of 1024). std::nullopt if malformed.
// Suffixes K, M, G and T in either case, optionally followed by "iB" or "B" ("64KiB", "1mb",
// "4096B"); surrounding blanks are ignored; no sign, fraction or overflow is accepted.
std::optional<uint64_t> parse_size(const std::string& text);

}  // namespace kolo
