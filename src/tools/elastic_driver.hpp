// kolorun --elastic --host-discovery-script S: the driver of an elastic job (docs/elastic.md).
//
// The driver keeps the job's ranks on the slots that a discovery script names, as horovodrun's
// elastic driver does:
//   - Discovery. S runs through /bin/sh -c about once a second, bounded (killed after
//     kScriptTimeoutSeconds). Each line of its output is "host" (--slots-per-host slots) or
//     "host:slots"; blank lines are ignored. A run that fails (a non-zero exit, a signal, a
//     timeout, a line that is neither) is reported, naming the script and the status or the
//     line, and the last good host set is kept; the report is repeated only when the failure
//     changes. After kMaxScriptFailures failed runs in a row the job stops (exit 1): an elastic
//     job that cannot see its hosts cannot follow them.
//   - Start. Once a run names at least --min-np usable slots (within --start-timeout), the first
//     min(-np, --max-np, slots) ranks start on the first slots, as a fixed job's ranks do, each
//     also with KOLO_ELASTIC_ADDR (the driver's store) and KOLO_ELASTIC_SLOT.
//   - Plans. The ranks' kolo_elastic_update (comm/elastic.cpp) asks for a plan with the slots of
//     the members. Members on slots that are gone (their host vanished, was blacklisted, or names
//     fewer slots) leave; free slots - new ones, and those of ranks that failed, up to
//     --reset-limit failures each - get newcomers, never beyond --max-np (refused, said once until
//     the job is below it again). The newcomers start once the ranks hand over the invitation;
//     a rank that leaves and is still running kLeaveGraceSeconds later is killed.
//   - Failures. A rank that exits non-zero or is killed does not stop the others: its slot is
//     free for a newcomer at the next plan, unless it has failed more than --reset-limit times.
//     A host on which kBlacklistFailures ranks have failed is blacklisted (said once): its ranks
//     leave, and none start there again. A rank that exits 0 is no failure (a leaving rank does).
//   - Below --min-np. When fewer ranks than --min-np run and no slot is free to start one, the
//     job stops with an error (exit 1).
// Across hosts. A slot whose host is not this machine gets its rank through kolorun's agent over
// ssh (kolorun.cpp); the driver's store then serves every interface, so that remote ranks reach
// it at this machine's name (secret-authenticated, as the world's store is).
#pragma once

#include <sys/types.h>

#include <chrono>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <vector>

namespace kolo {
class StoreServer;
class StoreClient;
}  // namespace kolo

namespace kolorun {

using Clock = std::chrono::steady_clock;

inline constexpr double kScriptTimeoutSeconds = 10;
inline constexpr double kDiscoveryIntervalSeconds = 1;
inline constexpr int kMaxScriptFailures = 10;
inline constexpr int kBlacklistFailures = 3;
inline constexpr double kLeaveGraceSeconds = 30;

struct ElasticOptions {
  std::string script;
  int np = 0, min_np = 0, max_np = 0;
  int slots_per_host = 1;
  int reset_limit = -1;  // -1: no limit
  double start_timeout_s = 60;
  std::string secret;
  double rank_timeout_s = 300;  // KOLO_TIMEOUT: how long a plan's invitation may take
  std::function<bool(const std::string&)> is_this_machine;
};

// One rank for the launcher to start: an initial rank (rank >= 0) or a newcomer (invitation).
struct RankLaunch {
  std::string slot;
  int rank = -1, size = 0;
  std::string invitation;
  bool spans_hosts = false;  // an initial rank of a job whose first host set names other hosts
};

class ElasticDriver {
 public:
  using Starter = std::function<pid_t(const RankLaunch&)>;  // -1 when it could not
  using Say = std::function<void(const std::string&)>;
  using Kill = std::function<void(pid_t)>;  // SIGKILLs the rank started as pid, wherever it runs

  ElasticDriver(ElasticOptions options, Starter start, Say say, bool verbose);
  ~ElasticDriver();

  // Serves the driver's store on every interface (call after the signals are blocked: its thread
  // must not take them). An error message, or "" when it serves; KOLO_ELASTIC_ADDR is then set.
  std::string serve();
  // The port of the driver's store (after serve()).
  int port() const;
  // How a rank that did not leave in time is killed (by default: its process group, here).
  void set_kill(Kill kill) { kill_ = std::move(kill); }

  // Runs discovery, starts ranks, answers plans, kills ranks that do not leave. Call often.
  void tick();
  // The longest the caller may sleep before the next tick.
  int wait_ms() const;
  // A child process ended: true when it was the driver's (the script, or a rank it tracks).
  bool reaped(pid_t pid, int status);
  // Set when the job must stop: the message to say.
  const std::optional<std::string>& fatal() const { return fatal_; }
  // Whether the first ranks are still to be started.
  bool starting() const { return !started_ && !stopping_; }
  // kolorun's exit status when the last rank has exited.
  int exit_code() const;
  // The job is stopping: no more discovery or starts.
  void stop();

 private:
  struct Slot {
    pid_t pid = -1;
    int failures = 0;
    bool reserved = false;  // promised to a plan's newcomer, not started yet
    bool leaving = false;
    Clock::time_point leave_by = Clock::time_point::max();
  };
  struct Growth {
    std::vector<std::string> slots;
    Clock::time_point give_up;
  };

  void run_discovery();
  void finish_discovery(int status);
  void start_first_ranks();
  void answer_requests();
  std::string plan_for(long long request, const std::vector<std::string>& members);
  void start_newcomers();
  std::vector<std::string> free_slots(const std::set<std::string>& taken);
  bool usable(const std::string& slot) const;
  int running_ranks() const;
  void fail_job(const std::string& message);
  void report(const std::string& message);  // said once until a different one

  ElasticOptions options_;
  Starter start_;
  Say say_;
  Kill kill_;
  bool verbose_;
  std::unique_ptr<kolo::StoreServer> server_;
  std::unique_ptr<kolo::StoreClient> client_;

  // discovery
  pid_t script_pid_ = -1;
  int script_fd_ = -1;
  std::string script_output_;
  Clock::time_point script_deadline_ = Clock::time_point::max();
  Clock::time_point next_discovery_;
  bool script_timed_out_ = false;
  int script_failures_ = 0;
  std::string last_report_;
  std::optional<std::vector<std::pair<std::string, int>>> hosts_;  // the last good set, in order

  // ranks
  std::map<std::string, Slot> slots_;
  std::map<pid_t, std::string> slot_of_pid_;
  std::map<std::string, int> host_failures_;
  std::set<std::string> blacklist_;
  bool started_ = false;
  bool stopping_ = false;
  bool said_max_np_ = false;
  Clock::time_point start_by_;
  long long next_request_ = 1;
  Clock::time_point request_gap_since_ = Clock::time_point::max();
  std::map<long long, Growth> growths_;
  std::optional<int> last_exit_;
  std::optional<std::string> fatal_;
};

}  // namespace kolorun
