// kolorun: starts N ranks of one program, on this machine or across hosts, and supervises them.
//
//   kolorun -np N [-H host:slots,... | --hostfile FILE] [--tag-output] [--timeout S] [--grace S]
//           [--elastic [--host-discovery-script S --min-np A --max-np B --slots-per-host K
//                       --reset-limit R --start-timeout T]]
//           [-x NAME[=VALUE]]... [--ssh-port P] [--ssh-identity-file F] [--verbose]
//           [--] program [args...]
//
// Each rank runs with the environment plus KOLO_RANK=i, KOLO_SIZE=N, KOLO_LOCAL_RANK (its place
// among the ranks of its host), KOLO_LOCAL_SIZE (their number), KOLO_ADDR=<host>:<port>, where
// rank 0 serves the rendezvous store, and KOLO_SECRET=<32 random bytes in hex>, which every rank
// shares and an outsider cannot guess. A KOLO_ADDR or KOLO_SECRET already in the environment is
// kept (and no descriptor handed down); with KOLO_SECRET_FILE set, no secret is generated and the
// ranks read that file.
//
// Where the store's port comes from. No port is ever chosen and then bound later, so none can be
// taken in between: the process that starts rank 0 binds port 0 (the kernel picks a free one),
// listens, and hands the listening socket to rank 0 as an inherited descriptor named by
// KOLO_STORE_FD (rank 0's store serves on it). On one machine that is kolorun itself, bound to
// 127.0.0.1. Across hosts, rank 0 runs on the first host: when that is this machine, kolorun binds
// every interface; when it is another host, kolorun's agent there (below) binds it and sends the
// port back over ssh before any other host is started. The other ranks may connect at once, and
// are answered once rank 0 serves.
//
// Across hosts (-H, --hostfile): ranks are placed block-wise, filling each host's slots in order
// (an entry without slots counts 1). Ranks of a host that is this machine (its host name, short or
// full, localhost, 127.x) are started here; every other host gets one ssh connection (BatchMode,
// ConnectTimeout 10 s; keys, users and ports come from the user's ssh configuration, --ssh-port
// and --ssh-identity-file add -p and -i) that runs "kolorun --agent" at this kolorun's own path.
// Everything the agent needs - working directory, program and arguments, the ranks it starts, and
// the environment forwarded (PATH, PYTHONPATH, LD_LIBRARY_PATH, every KOLO_* including the
// secret, and each -x NAME) - goes down ssh's stdin, hex-encoded, never on a command line, which
// `ps` shows every user on both ends. The agent starts its ranks as kolorun does here, passes their
// lines back over ssh (tagged by the agent), and afterwards reads ssh's stdin for signals to
// forward; end of file there (kolorun or its ssh died, or the connection broke) stops its ranks,
// so that no rank outlives the job on any host. ssh itself runs in its own process group and is
// never signalled to stop a job: a signal that killed it would leave the remote ranks to the
// agent's end-of-file rule only, and lose their last lines. A host whose ssh fails before its
// agent says it is ready is reported with its ranks, and the job stops.
//
// Every line a rank writes is passed on whole to kolorun's stdout or stderr, matching the stream
// it came from, so that lines of different ranks never mix within a line and a rank's stderr never
// lands in stdout. Lines go out as the rank wrote them, as mpirun passes them on; --tag-output (the
// name mpirun gives it) puts "[i] " before each, and "[i@host] " when the job spans hosts. Untagged
// is the default so that output meant to be parsed (nccl-tests' tables, anchored on "#") reads the
// same under kolorun as alone. A rank runs in its own process group, so that a signal reaches
// everything it started; its stdin is /dev/null, and it is SIGKILLed if kolorun (or the agent that
// started it) dies. kolorun adopts (as child subreaper) and reaps what stopped ranks leave behind,
// so no zombie is left even where init reaps nothing, as in many containers.
// SIGINT, SIGTERM, SIGHUP and SIGQUIT sent to kolorun are forwarded to every rank and stop the
// job; SIGUSR1 and SIGUSR2 are forwarded and the job goes on. Job control is passed on too: the
// ranks lead process groups of their own, which a shell's Ctrl-Z does not reach, so SIGTSTP is
// forwarded to them, after which kolorun stops itself (the shell then has its prompt back), and
// the SIGCONT of fg or bg is forwarded when kolorun continues.
//
// Nothing the ranks started outlives the job: a rank's process group is signalled for as long as
// any process is left in it (its leader may have exited), and what escaped the group but was
// adopted by kolorun is signalled too. When the last rank has exited, leftovers get SIGTERM, and
// SIGKILL --grace seconds later; kolorun returns once they are gone.
//
// The first rank to fail (non-zero exit or a signal) stops the job: the others get SIGTERM, and
// SIGKILL --grace seconds later; kolorun exits with that rank's status (128+signal when killed).
// With --elastic, for jobs that survive a lost rank (kolo_comm_shrink, kolo.torch.elastic), a rank
// killed by a signal is reported and the others go on; kolorun then exits 0 when every rank that
// exited on its own exited 0, and with the first killed rank's status when none did. A rank that
// exits non-zero still stops the job. With --elastic and --host-discovery-script, the driver
// (elastic_driver.hpp) starts the ranks on the slots a script names, grows and shrinks the job
// with them (kolo_elastic_update), restarts failed ranks' slots and decides the exit status. A
// slot on another host gets its one rank through an agent of its own over ssh, as -H starts a
// host's ranks (start_remote_slot): its set-up names the slot, and a newcomer's carries
// KOLO_INVITATION and no KOLO_RANK or KOLO_SIZE; the ssh's exit is the rank's for the driver.
// --timeout stops the job the same way and exits 124. Bad
// arguments exit 2; a program that cannot be executed makes its ranks exit 127; a host that ssh
// cannot reach makes kolorun exit with ssh's status (255). What kolorun says about a rank names
// it, its pid and its host.
#include <arpa/inet.h>
#include <fcntl.h>
#include <fmt/format.h>
#include <netinet/in.h>
#include <poll.h>
#include <signal.h>
#include <sodium.h>
#include <sys/prctl.h>
#include <sys/signalfd.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <fstream>
#include <memory>
#include <optional>
#include <sstream>
#include <string>
#include <string_view>
#include <vector>

#include "core/config.hpp"
#include "kolo/status.hpp"
#include "kolo_build_config.h"
#include "tools/elastic_driver.hpp"

extern char** environ;

namespace {

using Clock = std::chrono::steady_clock;
constexpr Clock::time_point kNever = Clock::time_point::max();
constexpr std::string_view kUsage = "Usage: kolorun -np N [options] [--] program [args...]";
// The agent's first line on its stdout, with the store's port (0 when it serves none): kolorun
// takes it out of the output and knows from it that the host's ranks are starting.
constexpr std::string_view kReadyLine = "kolorun-agent: ready ";
// How long a remote host's agent may take to say it is ready: ssh's ConnectTimeout (10 s), the
// login, and the agent reading its set-up.
constexpr double kAgentStartSeconds = 30;
// After telling an agent to SIGKILL its ranks, how long before its ssh is killed too.
constexpr double kAgentKillSeconds = 3;

void write_all(int fd, std::string_view text) {
  while (!text.empty()) {
    ssize_t written = ::write(fd, text.data(), text.size());
    if (written < 0 && errno == EINTR) continue;
    if (written <= 0) return;  // our stdout is gone: drop the output, keep supervising the job
    text.remove_prefix(static_cast<size_t>(written));
  }
}

template <typename... Args>
void say(fmt::format_string<Args...> format, Args&&... args) {
  write_all(STDERR_FILENO, "kolorun: " + fmt::format(format, std::forward<Args>(args)...) + "\n");
}

// One output stream of one rank (or of one host's agent), read from a non-blocking pipe. Complete
// lines go out in one write(), so lines never interleave; a line longer than 1 MiB is passed on in
// pieces.
struct Stream {
  int fd = -1;
  int target = -1;  // STDOUT_FILENO or STDERR_FILENO
  std::string prefix;
  std::string pending;             // bytes after the last newline
  bool awaiting_ready = false;     // an agent's stdout: its ready line is still to come
  std::optional<long> ready_port;  // what the ready line said

  void pass_lines(bool at_end) {
    std::string lines;
    size_t start = 0;
    for (size_t end; (end = pending.find('\n', start)) != std::string::npos; start = end + 1) {
      std::string_view line(pending.data() + start, end - start);
      if (awaiting_ready && line.starts_with(kReadyLine)) {
        awaiting_ready = false;
        ready_port = std::strtol(std::string(line.substr(kReadyLine.size())).c_str(), nullptr, 10);
        continue;
      }
      lines.append(prefix).append(pending, start, end + 1 - start);
    }
    pending.erase(0, start);
    if (!pending.empty() && (at_end || pending.size() > (1u << 20))) {
      lines.append(prefix).append(pending).push_back('\n');
      pending.clear();
    }
    write_all(target, lines);
  }

  // Reads what is there now; at end of file, passes on a last partial line and closes.
  void read_available() {
    if (fd < 0) return;
    char buffer[65536];
    ssize_t count;
    while ((count = ::read(fd, buffer, sizeof buffer)) > 0 || (count < 0 && errno == EINTR)) {
      if (count > 0) pending.append(buffer, static_cast<size_t>(count));
    }
    bool at_end = count == 0 || errno != EAGAIN;
    pass_lines(at_end);
    if (at_end) {
      ::close(fd);
      fd = -1;
    }
  }
};

// "rank 4" or "ranks 4-7".
std::string describe_ranks(int first, int count) {
  return count == 1 ? fmt::format("rank {}", first)
                    : fmt::format("ranks {}-{}", first, first + count - 1);
}

// The ranks one host runs: ranks first..first+count-1 of the job.
struct HostPlan {
  std::string name;  // as the user wrote it (-H, --hostfile), or this machine's name
  int slots = 1;
  bool local = false;  // this machine: its ranks are started without ssh
  int first_rank = 0;
  int rank_count = 0;
};

// A process kolorun started and supervises: one rank, or the ssh that runs a host's agent.
struct Child {
  pid_t pid = -1;
  bool running = false;
  bool group_alive = false;  // its process group may still have members
  Stream streams[2];         // stdout, stderr
  int first_rank = 0;
  int rank_count = 1;
  bool remote = false;  // an ssh to the agent of `plan`
  const HostPlan* plan = nullptr;
  int control_fd = -1;  // remote: ssh's stdin, which carries signals to the agent
  Clock::time_point kill_ssh_at = kNever;
  std::string slot;  // --host-discovery-script: its KOLO_ELASTIC_SLOT

  std::string ranks_text() const { return describe_ranks(first_rank, rank_count); }
};

// The children of this (single-threaded) process: ranks, and the orphans it adopted as subreaper.
std::vector<pid_t> own_children() {
  std::vector<pid_t> children;
  FILE* file = std::fopen(fmt::format("/proc/self/task/{}/children", ::getpid()).c_str(), "r");
  if (file == nullptr) return children;
  for (long pid; std::fscanf(file, "%ld", &pid) == 1;) children.push_back(static_cast<pid_t>(pid));
  std::fclose(file);
  return children;
}

std::string signal_name(int signal) {
  const char* abbreviation = sigabbrev_np(signal);
  return abbreviation ? fmt::format("SIG{}", abbreviation) : std::to_string(signal);
}

std::string describe(int status) {
  if (WIFEXITED(status)) return fmt::format("exited with status {}", WEXITSTATUS(status));
  return "killed by signal " + signal_name(WTERMSIG(status));
}

int exit_code_of(int status) {
  return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
}

// A socket listening at a port the kernel picks, for rank 0's store (KOLO_STORE_FD): on 127.0.0.1
// for a job on this machine alone, on every IPv4 interface when ranks on other hosts connect.
// Close-on-exec, and above the standard descriptors, which a rank's own set-up replaces. -1 (errno
// set) when none can be had.
int listen_for_store(bool every_interface, int* port) {
  int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return -1;
  if (fd <= STDERR_FILENO) {  // started with a standard descriptor closed
    int moved = ::fcntl(fd, F_DUPFD_CLOEXEC, STDERR_FILENO + 1);
    ::close(fd);
    if (moved < 0) return -1;
    fd = moved;
  }
  int one = 1;
  ::setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
  sockaddr_in address{};
  address.sin_family = AF_INET;
  address.sin_addr.s_addr = htonl(every_interface ? INADDR_ANY : INADDR_LOOPBACK);
  socklen_t length = sizeof address;
  auto* generic = reinterpret_cast<sockaddr*>(&address);
  if (::bind(fd, generic, length) != 0 || ::listen(fd, 128) != 0 ||
      ::getsockname(fd, generic, &length) != 0) {
    int error = errno;
    ::close(fd);
    errno = error;
    return -1;
  }
  *port = ntohs(address.sin_port);
  return fd;
}

std::string to_hex(std::string_view bytes) {
  std::string hex(2 * bytes.size() + 1, '\0');
  sodium_bin2hex(hex.data(), hex.size(), reinterpret_cast<const unsigned char*>(bytes.data()),
                 bytes.size());
  hex.pop_back();
  return hex;
}

std::optional<std::string> from_hex(std::string_view hex) {
  std::string bytes(hex.size() / 2, '\0');
  size_t length = 0;
  if (hex.size() % 2 != 0 ||
      sodium_hex2bin(reinterpret_cast<unsigned char*>(bytes.data()), bytes.size(), hex.data(),
                     hex.size(), nullptr, &length, nullptr) != 0 ||
      length != bytes.size()) {
    return std::nullopt;
  }
  return bytes;
}

std::string make_secret() {
  unsigned char bytes[32];
  randombytes_buf(bytes, sizeof bytes);
  return to_hex({reinterpret_cast<const char*>(bytes), sizeof bytes});
}

std::string this_host_name() {
  char host[256] = {};
  ::gethostname(host, sizeof host - 1);
  return host;
}

// Whether a host named in -H or a hostfile is this machine, whose ranks need no ssh.
bool is_this_machine(const std::string& name) {
  if (name == "localhost" || name.starts_with("127.") || name == "::1") return true;
  std::string own = this_host_name();
  auto short_name = [](const std::string& full) { return full.substr(0, full.find('.')); };
  return name == own || name == short_name(own);
}

// "4" as a host's slots: a whole number from 1 to 100000; nullopt otherwise.
std::optional<int> parse_slots(std::string_view text) {
  if (text.empty() || text.size() > 6 || text.find_first_not_of("0123456789") != text.npos) {
    return std::nullopt;
  }
  int slots = std::stoi(std::string(text));
  if (slots < 1 || slots > 100000) return std::nullopt;
  return slots;
}

// Adds a host, or its slots to an entry already there (mpirun counts "-H a,a" as a:2); every name
// of this machine is one host.
void add_host(std::vector<HostPlan>& hosts, const std::string& name, int slots) {
  bool local = is_this_machine(name);
  for (HostPlan& host : hosts) {
    if (host.name == name || (local && host.local)) {
      host.slots += slots;
      return;
    }
  }
  hosts.push_back({name, slots, local, 0, 0});
}

bool valid_host_name(std::string_view name) {
  return !name.empty() && name[0] != '-' &&
         name.find_first_of(" \t'\"\\;&|$`*?<>()[]{}!#,:") == name.npos;
}

// -H's value, as horovodrun and mpirun take it: "host1:2,host2:2,host3" (no slots: 1). An empty
// string when all is well, else what is wrong.
std::string parse_host_list(std::string_view list, std::vector<HostPlan>& hosts) {
  size_t start = 0;
  for (;;) {
    size_t comma = list.find(',', start);
    std::string_view entry = list.substr(start, comma == list.npos ? list.npos : comma - start);
    size_t colon = entry.rfind(':');
    std::string name(entry.substr(0, colon));
    std::optional<int> slots = colon == entry.npos ? 1 : parse_slots(entry.substr(colon + 1));
    if (!valid_host_name(name) || !slots) {
      return fmt::format(
          "-H {}: cannot read '{}' (expected host or host:slots, slots a whole number from 1 to "
          "100000, entries separated by commas)",
          list, entry);
    }
    add_host(hosts, name, *slots);
    if (comma == list.npos) return {};
    start = comma + 1;
  }
}

// A hostfile as mpirun ("host slots=4") and horovodrun ("host:4") write it: one host per line,
// "#" to the end of a line a comment, blank lines ignored, a host without slots 1 (mpirun's
// max_slots=N is accepted and ignored). An empty string when all is well, else what is wrong.
std::string parse_hostfile(const std::string& path, std::vector<HostPlan>& hosts) {
  std::ifstream file(path);
  if (!file) return fmt::format("--hostfile {}: cannot read it: {}", path, std::strerror(errno));
  int line_number = 0;
  for (std::string line; std::getline(file, line);) {
    ++line_number;
    line = line.substr(0, line.find('#'));
    std::istringstream words(line);
    std::string host;
    if (!(words >> host)) continue;
    auto problem = [&](const std::string& word) {
      return fmt::format(
          "--hostfile {}, line {}: cannot read '{}' (expected 'host', 'host slots=N' or "
          "'host:N', N a whole number from 1 to 100000)",
          path, line_number, word);
    };
    std::optional<int> slots = 1;
    size_t colon = host.rfind(':');
    if (colon != host.npos) {
      slots = parse_slots(std::string_view(host).substr(colon + 1));
      host.erase(colon);
    }
    if (!valid_host_name(host) || !slots) return problem(line);
    bool slots_given = colon != std::string::npos;
    for (std::string word; words >> word;) {
      if (word.starts_with("slots=") && !slots_given) {
        slots = parse_slots(std::string_view(word).substr(6));
        slots_given = true;
        if (!slots) return problem(word);
      } else if (!word.starts_with("max_slots=") && !word.starts_with("max-slots=")) {
        return problem(word);
      }
    }
    add_host(hosts, host, *slots);
  }
  if (hosts.empty()) return fmt::format("--hostfile {}: names no host", path);
  return {};
}

// Block placement: ranks fill each host's slots in order; hosts left without a rank are dropped.
// An empty string when all is well, else what is wrong.
std::string place_ranks(int size, std::vector<HostPlan>& hosts) {
  long slots = 0;
  for (const HostPlan& host : hosts) slots += host.slots;
  if (size > slots) {
    return fmt::format("-np {} is more than the {} slots of the hosts given", size, slots);
  }
  int next = 0;
  for (HostPlan& host : hosts) {
    host.first_rank = next;
    host.rank_count = std::min(host.slots, size - next);
    next += host.rank_count;
  }
  std::erase_if(hosts, [](const HostPlan& host) { return host.rank_count == 0; });
  return {};
}

// CLI11 reads "-np 4" as "-n p" and a stray "4"; MPI users type -np, so it becomes --np. The scan
// stops at the program (or "--") so that the program's own arguments are left alone.
std::vector<std::string> normalize_arguments(int argc, char** argv) {
  std::vector<std::string> args(argv, argv + argc);
  for (size_t i = 1; i < args.size(); ++i) {
    std::string& arg = args[i];
    if (arg == "--" || arg.empty() || arg[0] != '-') break;
    if (arg == "-np" || arg.starts_with("-np=")) arg.insert(0, "-");
    for (const char* with_value :
         {"--np", "-n", "--timeout", "--grace", "-H", "--host", "--hostfile", "-x", "--ssh-port",
          "--ssh-identity-file", "--min-np", "--max-np", "--host-discovery-script",
          "--slots-per-host", "--reset-limit", "--start-timeout"}) {
      if (arg == with_value) ++i;  // its value
    }
  }
  return args;
}

// Past about 31 years the clock's nanoseconds would overflow: such a wait never ends.
Clock::time_point seconds_from_now(double seconds) {
  using std::chrono::duration, std::chrono::duration_cast;
  if (!(seconds < 1e9)) return kNever;
  return Clock::now() + duration_cast<Clock::duration>(duration<double>(seconds));
}

// What an agent on another host is told over ssh's stdin, one "key hex-value" line each, so that
// no value needs quoting and none appears on a command line.
struct AgentSetup {
  std::string directory;
  std::vector<std::string> command;
  std::vector<std::string> environment;  // NAME=VALUE
  std::string host;                      // the host's name as the user gave it
  std::string slot;  // --host-discovery-script: the one rank's slot (first_rank -1: a newcomer)
  int first_rank = 0, rank_count = 0, size = 0;
  bool serve_store = false, tag_output = false, tag_hosts = false, verbose = false, elastic = false;
  double grace_s = 5;

  std::string encode() const {
    std::string text = "kolorun-agent 1\n";
    text += "directory " + to_hex(directory) + "\n";
    for (const std::string& arg : command) text += "arg " + to_hex(arg) + "\n";
    for (const std::string& variable : environment) text += "env " + to_hex(variable) + "\n";
    text += "host " + to_hex(host) + "\n";
    if (!slot.empty()) text += "slot " + to_hex(slot) + "\n";
    text += fmt::format("ranks {} {} {}\n", first_rank, rank_count, size);
    text += fmt::format("options {} {} {} {} {} {}\n", int{serve_store}, int{tag_output},
                        int{tag_hosts}, int{verbose}, int{elastic}, grace_s);
    return text + "end\n";
  }

  // One line of encode()'s; false when it is not one.
  bool decode(const std::string& line) {
    std::istringstream words(line);
    std::string key, value;
    words >> key;
    if (key == "kolorun-agent") return (words >> value) && value == "1";
    if (key == "ranks") return bool(words >> first_rank >> rank_count >> size);
    if (key == "options") {
      int flags[5];
      for (int& flag : flags) words >> flag;
      words >> grace_s;
      if (!words) return false;
      serve_store = flags[0], tag_output = flags[1], tag_hosts = flags[2], verbose = flags[3],
      elastic = flags[4];
      return true;
    }
    if (!(words >> value)) return false;
    std::optional<std::string> text = from_hex(value);
    if (!text) return false;
    if (key == "directory") {
      directory = *text;
    } else if (key == "arg") {
      command.push_back(*text);
    } else if (key == "env") {
      environment.push_back(*text);
    } else if (key == "host") {
      host = *text;
    } else if (key == "slot") {
      slot = *text;
    } else {
      return false;
    }
    return true;
  }
};

struct Job {
  std::vector<std::string> command;
  std::vector<HostPlan> hosts;  // where the ranks run, in rank order
  int size = 0;
  int store_fd = -1;  // the store's listening socket, until rank 0 has inherited it
  double timeout_s = 0, grace_s = 5;
  bool verbose = false;
  bool elastic = false;
  bool tag_output = false;  // "[i] " before every line of rank i
  bool tag_hosts = false;   // "[i@host] " instead, for a job across hosts
  std::string host;         // this machine's name, in what kolorun says about a rank
  std::string ssh_port, ssh_identity_file;
  std::vector<std::string> forwarded;  // -x NAME: variables remote ranks get besides the defaults
  std::string self_path;               // this kolorun, which runs as the agent on other hosts
  int control_in = -1;  // an agent: ssh's stdin, where signals arrive; end of file stops the job
  std::string control_pending;
  std::optional<int> first_lost;  // --elastic: the status of the first rank killed by a signal
  int finished = 0;               // ranks that exited on their own
  std::vector<Child> children;
  int running = 0;
  std::optional<int> failure_code;  // exit code of the first rank that failed
  // --host-discovery-script: the driver, which starts the ranks and plans the job's changes
  kolorun::ElasticDriver* driver = nullptr;
  std::string remote_elastic_addr;  // KOLO_ELASTIC_ADDR as other hosts reach the driver's store
  std::deque<HostPlan> slot_plans;  // the hosts of ranks started in remote slots (stable)
  std::optional<kolorun::RankLaunch> agent_slot;  // an agent: the one slot rank it starts
  bool stopping = false, timed_out = false;
  Clock::time_point kill_at = kNever, timeout_at = kNever, ready_by = kNever;

  std::string tag(int rank, const HostPlan& plan) const {
    if (!tag_output) return {};
    return tag_hosts ? fmt::format("[{}@{}] ", rank, plan.name) : fmt::format("[{}] ", rank);
  }

  void adopt(Child child, int out_fd, int err_fd, const std::string& prefix) {
    for (int fd : {out_fd, err_fd}) ::fcntl(fd, F_SETFL, O_NONBLOCK);
    child.running = child.group_alive = true;
    child.streams[0] = {out_fd, STDOUT_FILENO, prefix, {}, child.remote, {}};
    child.streams[1] = {err_fd, STDERR_FILENO, prefix, {}, false, {}};
    children.push_back(std::move(child));
    ++running;
  }

  // Forks rank `index` of `plan`, whose environment is ours (KOLO_SIZE, ADDR, SECRET set by main)
  // plus its rank, and for rank 0 the store's socket. The child runs the program or exits 127.
  // False (errno set) when it cannot be started; the job is then stopped, and kolorun exits soon,
  // so the pipes of that failure stay open.
  bool start(int index, const HostPlan& plan) {
    ::setenv("KOLO_RANK", std::to_string(index).c_str(), 1);
    ::setenv("KOLO_LOCAL_RANK", std::to_string(index - plan.first_rank).c_str(), 1);
    ::setenv("KOLO_LOCAL_SIZE", std::to_string(plan.rank_count).c_str(), 1);
    return spawn(index, plan, {}) > 0;
  }

  // The elastic driver's start of one rank in a slot of this machine: an initial rank, or a
  // newcomer (KOLO_INVITATION, no KOLO_RANK or KOLO_SIZE: the growth decides them). Its pid, or
  // -1 (errno set).
  pid_t start_in_slot(const kolorun::RankLaunch& launch) {
    const std::string slot_host = launch.slot.substr(0, launch.slot.rfind(':'));
    if (!agent_slot && !is_this_machine(slot_host)) return start_remote_slot(launch, slot_host);
    if (!agent_slot && launch.rank == 0 && launch.spans_hosts && !span_store()) return -1;
    ::setenv("KOLO_ELASTIC_SLOT", launch.slot.c_str(), 1);
    if (launch.rank >= 0) {
      ::unsetenv("KOLO_INVITATION");
      for (const char* name : {"KOLO_RANK", "KOLO_LOCAL_RANK"}) {
        ::setenv(name, std::to_string(launch.rank).c_str(), 1);
      }
      for (const char* name : {"KOLO_SIZE", "KOLO_LOCAL_SIZE"}) {
        ::setenv(name, std::to_string(launch.size).c_str(), 1);
      }
    } else {
      for (const char* name : {"KOLO_RANK", "KOLO_LOCAL_RANK", "KOLO_SIZE", "KOLO_LOCAL_SIZE"}) {
        ::unsetenv(name);
      }
      ::setenv("KOLO_INVITATION", launch.invitation.c_str(), 1);
    }
    pid_t pid = spawn(launch.rank, hosts[0], launch.slot);
    ::unsetenv("KOLO_INVITATION");
    return pid;
  }

  // Rank 0 here, in a job whose first hosts include others: its store listens on every interface,
  // at this machine's name, instead of main's loopback socket. False (said) when it cannot.
  bool span_store() {
    if (store_fd >= 0) ::close(store_fd);
    int port = 0;
    store_fd = listen_for_store(/*every_interface=*/true, &port);
    if (store_fd < 0) {
      say("cannot listen on a port of this machine for the rendezvous store: {}",
          std::strerror(errno));
      return false;
    }
    ::setenv("KOLO_ADDR", fmt::format("{}:{}", host, port).c_str(), 1);
    return true;
  }

  // The driver's start of a rank in a slot of another host: ssh runs kolorun's agent there, which
  // starts that one rank (a newcomer's KOLO_INVITATION travels in its set-up, on ssh's stdin). A
  // rank 0 there serves the world's store: its agent binds the port and says it before this
  // returns (bounded by kAgentStartSeconds), so that the other ranks get KOLO_ADDR. The ssh's pid,
  // which the driver tracks as the rank's: it exits with the agent, as the rank did; or -1.
  pid_t start_remote_slot(const kolorun::RankLaunch& launch, const std::string& slot_host) {
    ::setenv("KOLO_ELASTIC_SLOT", launch.slot.c_str(), 1);
    if (launch.rank >= 0) {
      ::unsetenv("KOLO_INVITATION");
    } else {
      ::setenv("KOLO_INVITATION", launch.invitation.c_str(), 1);
    }
    const bool serve_store = launch.rank == 0;
    if (serve_store) {
      if (store_fd >= 0) ::close(store_fd);
      store_fd = -1;
      ::unsetenv("KOLO_ADDR");
    }
    slot_plans.push_back({slot_host, 1, false, std::max(launch.rank, 0), 1});
    bool started = start_remote(slot_plans.back(), serve_store, &launch);
    ::unsetenv("KOLO_INVITATION");
    if (!started) return -1;
    Child& child = children.back();
    if (serve_store) {
      std::optional<long> port = await_ready(child);
      if (!port || *port <= 0) {
        say("rank 0 in slot {}: kolorun's agent on {} did not say where its store is within {} s",
            launch.slot, slot_host, kAgentStartSeconds);
        tell_agent(child, SIGKILL);
        child.kill_ssh_at = seconds_from_now(kAgentKillSeconds);
        return -1;
      }
      ::setenv("KOLO_ADDR", fmt::format("{}:{}", slot_host, *port).c_str(), 1);
    }
    return child.pid;
  }

  // Waits (at most kAgentStartSeconds) for the ready line of a remote child's agent, passing on
  // what else it writes meanwhile: the port it names, or nothing when its ssh ended first.
  std::optional<long> await_ready(Child& child) {
    Clock::time_point give_up = seconds_from_now(kAgentStartSeconds);
    while (!child.streams[0].ready_port && child.streams[0].fd >= 0) {
      auto left = std::chrono::ceil<std::chrono::milliseconds>(give_up - Clock::now()).count();
      if (left <= 0) break;
      std::vector<pollfd> polled;
      for (Stream& stream : child.streams) {
        if (stream.fd >= 0) polled.push_back({stream.fd, POLLIN, 0});
      }
      ::poll(polled.data(), polled.size(), static_cast<int>(std::min<long>(left, 1000)));
      for (Stream& stream : child.streams) stream.read_available();
    }
    return child.streams[0].ready_port;
  }

  // The driver's kill of a rank that did not leave: here its process group; on another host,
  // through its agent (SIGKILL to its ranks), and its ssh kAgentKillSeconds later.
  void kill_rank(pid_t pid) {
    for (Child& child : children) {
      if (child.pid != pid || !child.running) continue;
      if (!child.remote) {
        ::kill(-pid, SIGKILL);
      } else if (child.kill_ssh_at == kNever) {
        tell_agent(child, SIGKILL);
        child.kill_ssh_at = seconds_from_now(kAgentKillSeconds);
      }
    }
  }

  // Forks one rank (index -1: a newcomer, named by its slot) with kolorun's environment as it is
  // now. Its pid, or -1 (errno set).
  pid_t spawn(int index, const HostPlan& plan, const std::string& slot) {
    const bool hand_down = index == 0 && store_fd >= 0;
    if (hand_down) {
      ::setenv("KOLO_STORE_FD", std::to_string(store_fd).c_str(), 1);
    } else {
      ::unsetenv("KOLO_STORE_FD");
    }
    std::vector<char*> argv;
    for (std::string& arg : command) argv.push_back(arg.data());
    argv.push_back(nullptr);
    int out_pipe[2], err_pipe[2];
    if (::pipe2(out_pipe, O_CLOEXEC) != 0 || ::pipe2(err_pipe, O_CLOEXEC) != 0) return -1;
    pid_t parent = ::getpid();
    pid_t pid = ::fork();
    if (pid < 0) return -1;
    if (pid == 0) {
      ::setpgid(0, 0);
      ::prctl(PR_SET_PDEATHSIG, SIGKILL);
      if (::getppid() != parent) _exit(127);  // kolorun died before the line above took effect
      sigset_t none;
      sigemptyset(&none);
      ::sigprocmask(SIG_SETMASK, &none, nullptr);
      ::signal(SIGPIPE, SIG_DFL);
      ::dup2(::open("/dev/null", O_RDONLY), STDIN_FILENO);
      ::dup2(out_pipe[1], STDOUT_FILENO);
      ::dup2(err_pipe[1], STDERR_FILENO);
      if (hand_down) ::fcntl(store_fd, F_SETFD, 0);  // inherited across exec by rank 0 alone
      ::execvp(argv[0], argv.data());
      std::string error = std::strerror(errno);
      write_all(STDERR_FILENO, fmt::format("kolorun: {} on {}: cannot run {}: {}\n",
                                           index >= 0 ? fmt::format("rank {}", index)
                                                      : "the newcomer in slot " + slot,
                                           host, command[0], error));
      _exit(127);
    }
    ::setpgid(pid, pid);  // as in the child: whichever runs first, no kill finds the group missing
    if (hand_down) {      // rank 0 holds it now: when rank 0 is gone, nothing answers at the port
      ::close(store_fd);
      store_fd = -1;
    }
    ::close(out_pipe[1]);
    ::close(err_pipe[1]);
    Child child;
    child.pid = pid;
    child.first_rank = index;
    child.plan = &plan;
    child.slot = slot;
    std::string prefix = tag(index, plan);
    if (index < 0 && tag_output) prefix = fmt::format("[+{}] ", slot);
    adopt(std::move(child), out_pipe[0], err_pipe[0], prefix);
    return pid;
  }

  // What the agent on `plan`'s host needs: the variables forwarded by default are PATH,
  // PYTHONPATH, LD_LIBRARY_PATH and every KOLO_* but those the agent sets per rank, plus -x's.
  AgentSetup setup_for(const HostPlan& plan, bool serve_store,
                       const kolorun::RankLaunch* launch = nullptr) const {
    AgentSetup setup;
    char directory[4096];
    setup.directory = ::getcwd(directory, sizeof directory) ? directory : "/";
    setup.command = command;
    for (char** entry = environ; *entry != nullptr; ++entry) {
      std::string_view variable(*entry);
      std::string name(variable.substr(0, variable.find('=')));
      bool by_default = name == "PATH" || name == "PYTHONPATH" || name == "LD_LIBRARY_PATH" ||
                        (name.starts_with("KOLO_") && name != "KOLO_RANK" &&
                         name != "KOLO_LOCAL_RANK" && name != "KOLO_LOCAL_SIZE" &&
                         name != "KOLO_STORE_FD" && !(serve_store && name == "KOLO_ADDR"));
      if (name == "KOLO_ELASTIC_ADDR" && !remote_elastic_addr.empty()) {
        setup.environment.push_back("KOLO_ELASTIC_ADDR=" + remote_elastic_addr);
      } else if (by_default ||
                 std::find(forwarded.begin(), forwarded.end(), name) != forwarded.end()) {
        setup.environment.emplace_back(variable);
      }
    }
    setup.host = plan.name;
    setup.first_rank = plan.first_rank;
    setup.rank_count = plan.rank_count;
    setup.size = size;
    setup.serve_store = serve_store;
    setup.tag_output = tag_output;
    setup.tag_hosts = tag_hosts;
    setup.verbose = verbose;
    setup.elastic = elastic;
    setup.grace_s = grace_s;
    if (launch) {
      setup.slot = launch->slot;
      setup.first_rank = launch->rank;
      setup.rank_count = 1;
      setup.size = launch->size;
    }
    return setup;
  }

  // Starts ssh to `plan`'s host running "kolorun --agent", and writes the agent's set-up to its
  // stdin, which stays open for signals. False (errno set) when ssh cannot be forked.
  bool start_remote(const HostPlan& plan, bool serve_store,
                    const kolorun::RankLaunch* launch = nullptr) {
    std::vector<std::string> ssh = {
        "ssh", "-T", "-x", "-o", "BatchMode=yes", "-o", "ConnectTimeout=10"};
    if (!ssh_port.empty()) ssh.insert(ssh.end(), {"-p", ssh_port});
    if (!ssh_identity_file.empty()) ssh.insert(ssh.end(), {"-i", ssh_identity_file});
    ssh.push_back(plan.name);
    ssh.push_back("exec '" + self_path + "' --agent");  // main refuses a path with a quote
    std::vector<char*> argv;
    for (std::string& arg : ssh) argv.push_back(arg.data());
    argv.push_back(nullptr);
    int in_pipe[2], out_pipe[2], err_pipe[2];
    if (::pipe2(in_pipe, O_CLOEXEC) != 0 || ::pipe2(out_pipe, O_CLOEXEC) != 0 ||
        ::pipe2(err_pipe, O_CLOEXEC) != 0) {
      return false;
    }
    pid_t parent = ::getpid();
    pid_t pid = ::fork();
    if (pid < 0) return false;
    if (pid == 0) {
      ::setpgid(0, 0);
      ::prctl(PR_SET_PDEATHSIG, SIGKILL);  // the agent then sees end of file and stops its ranks
      if (::getppid() != parent) _exit(127);
      sigset_t none;
      sigemptyset(&none);
      ::sigprocmask(SIG_SETMASK, &none, nullptr);
      ::signal(SIGPIPE, SIG_DFL);
      ::dup2(in_pipe[0], STDIN_FILENO);
      ::dup2(out_pipe[1], STDOUT_FILENO);
      ::dup2(err_pipe[1], STDERR_FILENO);
      ::execvp(argv[0], argv.data());
      std::string error = std::strerror(errno);
      write_all(STDERR_FILENO,
                fmt::format("kolorun: cannot run ssh for {}: {}\n", plan.name, error));
      _exit(255);
    }
    ::setpgid(pid, pid);
    ::close(in_pipe[0]);
    ::close(out_pipe[1]);
    ::close(err_pipe[1]);
    // The set-up is usually a few KiB, less than a pipe holds, so this write does not wait for ssh;
    // a larger one (a very long command line) waits until ssh has connected and reads it.
    write_all(in_pipe[1], setup_for(plan, serve_store, launch).encode());
    ::fcntl(in_pipe[1], F_SETFL, O_NONBLOCK);
    Child child;
    child.pid = pid;
    child.first_rank = plan.first_rank;
    child.rank_count = plan.rank_count;
    child.remote = true;
    child.plan = &plan;
    child.control_fd = in_pipe[1];
    if (launch) {
      child.first_rank = launch->rank;
      child.slot = launch->slot;
    }
    if (verbose) {
      say("started ssh {} for {} (pid {})", plan.name,
          launch ? "slot " + launch->slot : child.ranks_text(), pid);
    }
    adopt(std::move(child), out_pipe[0], err_pipe[0], "");
    return true;
  }

  void start_host(const HostPlan& plan, bool serve_store) {
    if (plan.local) {
      for (int i = plan.first_rank; i < plan.first_rank + plan.rank_count && !stopping; ++i) {
        if (!start(i, plan)) {
          say("cannot start rank {} on {}: {}", i, host, std::strerror(errno));
          failure_code = 1;
          stop(SIGTERM);
        }
      }
    } else if (!start_remote(plan, serve_store)) {
      say("cannot start ssh for ranks on {}: {}", plan.name, std::strerror(errno));
      failure_code = 1;
      stop(SIGTERM);
    }
  }

  // To the agent behind a remote child: the signal for it to pass to its ranks.
  static void tell_agent(Child& child, int signal) {
    if (child.control_fd < 0) return;
    std::string line = fmt::format("signal {}\n", signal);
    if (::write(child.control_fd, line.data(), line.size()) < 0 && errno != EAGAIN) {
      ::close(child.control_fd);
      child.control_fd = -1;
    }
  }

  // Every process group of a rank that still has members, every adopted orphan, and every host's
  // agent. An agent told SIGKILL has kAgentKillSeconds before its ssh is killed as well.
  void signal_ranks(int signal) {
    for (Child& child : children) {
      if (child.remote) {
        if (!child.running) continue;
        if (signal != SIGKILL) {
          tell_agent(child, signal);
        } else if (child.kill_ssh_at == kNever) {
          tell_agent(child, signal);
          child.kill_ssh_at = seconds_from_now(kAgentKillSeconds);
        }
        continue;
      }
      if (child.group_alive && ::kill(-child.pid, signal) != 0 && errno == ESRCH) {
        child.group_alive = false;
      }
    }
    for (pid_t pid : own_children()) {
      bool leader = std::any_of(children.begin(), children.end(),
                                [&](const Child& child) { return child.pid == pid; });
      if (!leader) ::kill(pid, signal);
    }
  }

  // Whether anything the ranks started is still there, once every rank has exited.
  bool leftovers() {
    for (Child& child : children) {
      if (child.group_alive && ::kill(-child.pid, 0) != 0 && errno == ESRCH) {
        child.group_alive = false;
      }
    }
    return std::any_of(children.begin(), children.end(),
                       [](const Child& child) { return child.group_alive; }) ||
           !own_children().empty();
  }

  void stop(int signal) {  // the first stop also starts the grace period
    if (driver) driver->stop();
    signal_ranks(signal);
    if (!stopping) kill_at = seconds_from_now(grace_s);
    stopping = true;
  }

  // "rank 2 exited with status 3 (pid 4242 on node7)": which rank, what became of it, and where
  // to look for it.
  std::string ended(const Child& child, int status) const {
    std::string who = child.first_rank >= 0 ? fmt::format("rank {}", child.first_rank)
                                            : "the newcomer in slot " + child.slot;
    return fmt::format("{} {} (pid {} on {})", who, describe(status), child.pid, host);
  }

  void note_failure(int status) {
    if (!failure_code) failure_code = exit_code_of(status);
    stop(SIGTERM);
  }

  // A host's ssh has ended. Its agent has already named any rank of its that failed; here is said
  // what the agent could not: that it never started, or that the connection was lost.
  void remote_ended(Child& child, int status) {
    for (Stream& stream : child.streams) stream.read_available();  // its ready line may be there
    if (child.control_fd >= 0) ::close(child.control_fd);
    child.control_fd = -1;
    bool failed = !WIFEXITED(status) || WEXITSTATUS(status) != 0;
    bool started = !child.streams[0].awaiting_ready;
    if (WIFEXITED(status)) finished += child.rank_count;
    if (!started && (!stopping || failed)) {
      say("could not start {} on {}: ssh {}{}", child.ranks_text(), child.plan->name,
          describe(status),
          WIFEXITED(status) && WEXITSTATUS(status) == 127
              ? fmt::format(" (is kolorun at {} there?)", self_path)
              : "");
      if (!failure_code) failure_code = failed ? exit_code_of(status) : 1;
      stop(SIGTERM);
      return;
    }
    if (verbose || (failed && !stopping && (!WIFEXITED(status) || WEXITSTATUS(status) == 255))) {
      say("{} on {}: ssh {}", child.ranks_text(), child.plan->name, describe(status));
    }
    if (failed) note_failure(status);
  }

  void reap() {
    int status;
    for (pid_t pid; (pid = ::waitpid(-1, &status, WNOHANG)) > 0;) {
      if (driver && std::none_of(children.begin(), children.end(),
                                 [&](const Child& child) { return child.pid == pid; })) {
        driver->reaped(pid, status);  // its discovery script
        continue;
      }
      for (Child& child : children) {
        if (child.pid != pid) continue;
        child.running = false;
        --running;
        if (driver && child.remote) {  // a slot's agent: what it passed on is all there is
          for (Stream& stream : child.streams) stream.read_available();
          if (child.control_fd >= 0) ::close(child.control_fd);
          child.control_fd = -1;
          child.kill_ssh_at = kNever;
        }
        if (driver && driver->reaped(pid, status)) continue;  // it decides what a rank's end means
        if (child.remote) {
          remote_ended(child, status);
          continue;
        }
        bool failed = !WIFEXITED(status) || WEXITSTATUS(status) != 0;
        if (WIFEXITED(status)) ++finished;
        if (elastic && WIFSIGNALED(status) && !stopping) {
          say("{}; --elastic: the other ranks go on", ended(child, status));
          if (!first_lost) first_lost = 128 + WTERMSIG(status);
          continue;
        }
        if (verbose || (failed && !stopping)) say("{}", ended(child, status));
        if (failed) note_failure(status);
      }
    }
  }

  // A signal kolorun received, or an agent was told of: passed on to the ranks.
  void forward(int signal) {
    if (verbose) say("forwarding {} to the ranks", signal_name(signal));
    if (signal == SIGUSR1 || signal == SIGUSR2 || signal == SIGCONT) {
      signal_ranks(signal);
    } else if (signal == SIGTSTP) {
      signal_ranks(signal);
      if (control_in < 0)
        ::raise(SIGSTOP);  // continues here on SIGCONT, which then reaches the ranks too
    } else if (signal == SIGKILL) {
      signal_ranks(signal);
      stopping = true;
    } else {
      stop(signal);
    }
  }

  // An agent: the lines that arrived from kolorun ("signal N"); end of file stops the job.
  void read_control() {
    char buffer[4096];
    ssize_t count;
    while ((count = ::read(control_in, buffer, sizeof buffer)) > 0 ||
           (count < 0 && errno == EINTR)) {
      if (count > 0) control_pending.append(buffer, static_cast<size_t>(count));
    }
    const bool at_end = count == 0 || errno != EAGAIN;  // before forwarding changes errno
    take_control_lines();
    if (at_end) {
      if (verbose || !stopping) say("lost kolorun's connection on {}: stopping the ranks", host);
      ::close(control_in);
      control_in = -1;
      if (!failure_code) failure_code = 1;
      if (!stopping) stop(SIGTERM);
    }
  }

  void take_control_lines() {
    for (size_t end; (end = control_pending.find('\n')) != std::string::npos;) {
      std::string line = control_pending.substr(0, end);
      control_pending.erase(0, end + 1);
      int signal = 0;
      if (std::sscanf(line.c_str(), "signal %d", &signal) == 1 && signal > 0 && signal < NSIG) {
        forward(signal);
        // told to stop before any rank started: the agent ends as its ranks would have
        if (stopping && children.empty() && !failure_code) failure_code = 128 + signal;
      }
    }
  }

  // Where the store is, once known, and the hosts still to start: the first host (rank 0's) is
  // started first; the others once KOLO_ADDR is known, which for a remote rank 0 is when its
  // agent has sent the port it bound.
  void start_the_rest(size_t* started) {
    if (*started == 0 || *started >= hosts.size() || stopping) return;
    if (!std::getenv("KOLO_ADDR")) {
      Child& first = children.front();
      if (!first.streams[0].ready_port) return;
      ready_by = kNever;
      ::setenv("KOLO_ADDR",
               fmt::format("{}:{}", hosts[0].name, *first.streams[0].ready_port).c_str(), 1);
      if (verbose) say("rank 0's store is at {}", std::getenv("KOLO_ADDR"));
    }
    for (; *started < hosts.size() && !stopping; ++*started) start_host(hosts[*started], false);
  }

  // Starts the ranks and passes on their output until all have exited; returns kolorun's status.
  int run(int signal_fd) {
    if (timeout_s > 0) timeout_at = seconds_from_now(timeout_s);
    const bool remote_store = !hosts[0].local && !std::getenv("KOLO_ADDR");
    if (remote_store) ready_by = seconds_from_now(kAgentStartSeconds);
    if (control_in >= 0) take_control_lines();  // what came with the set-up, before any start
    if (!stopping && agent_slot) {
      if (start_in_slot(*agent_slot) <= 0) {
        say("cannot start the rank of slot {} on {}: {}", agent_slot->slot, host,
            std::strerror(errno));
        failure_code = 1;
      }
    } else if (!stopping && !driver) {
      start_host(hosts[0], remote_store);
    }
    size_t started = driver || agent_slot ? hosts.size() : 1;
    start_the_rest(&started);
    bool cleaning_up = false;  // every rank has exited; what they left behind is being stopped
    while (running > 0 || cleaning_up || (driver && driver->starting())) {
      std::vector<pollfd> polled = {{signal_fd, POLLIN, 0}};
      if (control_in >= 0) polled.push_back({control_in, POLLIN, 0});
      const size_t first_stream = polled.size();
      std::vector<Stream*> streams;
      Clock::time_point deadline = std::min({kill_at, timeout_at, ready_by});
      for (Child& child : children) {
        if (child.running) deadline = std::min(deadline, child.kill_ssh_at);
        for (Stream& stream : child.streams) {
          if (stream.fd < 0) continue;
          polled.push_back({stream.fd, POLLIN, 0});
          streams.push_back(&stream);
        }
      }
      auto until_deadline = std::chrono::ceil<std::chrono::milliseconds>(deadline - Clock::now());
      long wait_ms = deadline == kNever ? -1 : std::clamp<long>(until_deadline.count(), 0, 1000);
      // Leftovers that are not kolorun's children die without a SIGCHLD: look again soon.
      if (cleaning_up) wait_ms = wait_ms < 0 ? 50 : std::min(wait_ms, 50L);
      if (driver) {
        wait_ms = wait_ms < 0 ? driver->wait_ms() : std::min<long>(wait_ms, driver->wait_ms());
      }
      ::poll(polled.data(), polled.size(), static_cast<int>(wait_ms));
      for (size_t i = first_stream; i < polled.size(); ++i) {
        if (polled[i].revents) streams[i - first_stream]->read_available();
      }
      if (control_in >= 0 && polled[1].revents) read_control();
      signalfd_siginfo info;
      while (::read(signal_fd, &info, sizeof info) == sizeof info) {
        int signal = static_cast<int>(info.ssi_signo);
        if (signal == SIGCHLD) continue;  // reap() finds every exited child, however many SIGCHLDs
        forward(signal);
      }
      reap();
      if (driver && !stopping) {
        driver->tick();
        if (driver->fatal()) {
          say("{}", *driver->fatal());
          if (!failure_code) failure_code = 1;
          stop(SIGTERM);
        }
      }
      start_the_rest(&started);
      Clock::time_point now = Clock::now();
      if (now >= ready_by) {
        ready_by = kNever;
        if (!stopping) {
          say("kolorun on {} (rank 0's host) did not say it was ready within {} s; stopping",
              hosts[0].name, kAgentStartSeconds);
          if (!failure_code) failure_code = 1;
          stop(SIGTERM);
        }
      }
      if (now >= timeout_at) {
        say("job timed out after {} s; stopping it", timeout_s);
        timed_out = true;
        timeout_at = kNever;
        stop(SIGTERM);
      }
      if (now >= kill_at) {
        if (verbose) say("grace period over; killing what is left");
        kill_at = kNever;
        signal_ranks(SIGKILL);
      }
      for (Child& child : children) {
        if (child.remote && child.running && now >= child.kill_ssh_at) {
          say("{} on {}: no answer to SIGKILL within {} s; killing its ssh", child.ranks_text(),
              child.plan->name, kAgentKillSeconds);
          child.kill_ssh_at = kNever;
          ::kill(-child.pid, SIGKILL);
        }
      }
      if (running == 0 && !(driver && driver->starting())) {  // its script is no leftover
        cleaning_up = leftovers();
        if (cleaning_up && kill_at == kNever && !stopping) {
          if (verbose) say("stopping what the ranks left running");
          stop(SIGTERM);
        } else if (cleaning_up && kill_at == kNever) {
          signal_ranks(SIGKILL);  // after the grace period, until they are gone
        }
      }
    }
    // What the ranks wrote before they exited is in the pipes now; what their leftover children
    // write later is not waited for.
    for (Child& child : children) {
      for (Stream& stream : child.streams) {
        if (stream.fd < 0) continue;
        stream.read_available();
        stream.pass_lines(/*at_end=*/true);
        if (stream.fd >= 0) ::close(stream.fd);
      }
      if (child.control_fd >= 0) ::close(child.control_fd);
    }
    if (timed_out) return 124;
    if (driver) return failure_code.value_or(driver->exit_code());
    if (!failure_code && finished == 0 && first_lost) return *first_lost;
    return failure_code.value_or(0);
  }
};

// Signals arrive through a signalfd, so that Job::run handles them between two polls.
int handle_signals() {
  sigset_t handled;
  sigemptyset(&handled);
  // A blocked SIGCONT still continues kolorun; the signalfd then reports it, to pass it on.
  for (int signal :
       {SIGCHLD, SIGINT, SIGTERM, SIGHUP, SIGQUIT, SIGUSR1, SIGUSR2, SIGTSTP, SIGCONT}) {
    sigaddset(&handled, signal);
  }
  ::sigprocmask(SIG_BLOCK, &handled, nullptr);
  int signal_fd = ::signalfd(-1, &handled, SFD_CLOEXEC | SFD_NONBLOCK);
  ::signal(SIGPIPE, SIG_IGN);
  ::prctl(PR_SET_CHILD_SUBREAPER, 1);  // reap() then also collects orphans of the ranks
  return signal_fd;
}

// kolorun --agent, started over ssh by kolorun on another host: reads its set-up from stdin
// (bounded: kAgentStartSeconds), starts this host's ranks, says it is ready (with the store's
// port when it serves rank 0's store), and supervises them as kolorun does, taking signals from
// stdin. Its messages and its ranks' lines reach the user through kolorun.
int agent_main() {
  std::string host = this_host_name();
  AgentSetup setup;
  std::string input;
  Clock::time_point give_up = seconds_from_now(kAgentStartSeconds);
  bool complete = false;
  while (!complete) {
    auto left = std::chrono::ceil<std::chrono::milliseconds>(give_up - Clock::now()).count();
    pollfd polled = {STDIN_FILENO, POLLIN, 0};
    if (left <= 0 || ::poll(&polled, 1, static_cast<int>(left)) <= 0) {
      say("agent on {}: no set-up from kolorun within {} s", host, kAgentStartSeconds);
      return 1;
    }
    char buffer[65536];
    ssize_t count = ::read(STDIN_FILENO, buffer, sizeof buffer);
    if (count < 0 && errno == EINTR) continue;
    if (count <= 0) {
      say("agent on {}: kolorun's set-up ended early (kolorun --agent is started by kolorun -H)",
          host);
      return 1;
    }
    input.append(buffer, static_cast<size_t>(count));
    for (size_t end; !complete && (end = input.find('\n')) != std::string::npos;) {
      std::string line = input.substr(0, end);
      input.erase(0, end + 1);
      if (line == "end") {
        complete = true;
      } else if (!setup.decode(line)) {
        say("agent on {}: cannot read kolorun's set-up line '{}' (a different kolorun version?)",
            host, line.substr(0, 40));
        return 1;
      }
    }
  }
  const bool newcomer = !setup.slot.empty() && setup.first_rank < 0;
  if (setup.command.empty() || setup.rank_count < 1 || (setup.size < 1 && !newcomer)) {
    say("agent on {}: kolorun's set-up names no program or no ranks", host);
    return 1;
  }
  if (::chdir(setup.directory.c_str()) != 0) {
    say("{} on {}: cannot enter the working directory {}: {}",
        describe_ranks(setup.first_rank, setup.rank_count), host, setup.directory,
        std::strerror(errno));
    return 1;
  }
  for (const std::string& variable : setup.environment) {
    size_t equals = variable.find('=');
    if (equals == std::string::npos) continue;
    ::setenv(variable.substr(0, equals).c_str(), variable.substr(equals + 1).c_str(), 1);
  }
  ::setenv("KOLO_SIZE", std::to_string(setup.size).c_str(), 1);
  Job job;
  job.command = setup.command;
  job.size = setup.size;
  job.host = host;
  job.grace_s = setup.grace_s;
  job.verbose = setup.verbose;
  job.elastic = setup.elastic;
  job.tag_output = setup.tag_output;
  job.tag_hosts = setup.tag_hosts;
  job.hosts.push_back(
      {setup.host, setup.rank_count, true, std::max(setup.first_rank, 0), setup.rank_count});
  if (!setup.slot.empty()) {
    const char* invitation = std::getenv("KOLO_INVITATION");
    job.agent_slot = kolorun::RankLaunch{setup.slot, setup.first_rank, setup.size,
                                         invitation ? invitation : "", false};
  }
  int port = 0;
  if (setup.serve_store) {
    job.store_fd = listen_for_store(/*every_interface=*/true, &port);
    if (job.store_fd < 0) {
      say("agent on {}: cannot listen on a port for the rendezvous store: {}", host,
          std::strerror(errno));
      return 1;
    }
    // An elastic rank 0 names this host by the address kolorun's ssh reached (SSH_CONNECTION's
    // third word), not by its name: its own name often maps to 127.0.1.1 here (Debian's hosts
    // file), and ranks that all reach their store over loopback listen there, where a newcomer on
    // another host, invited later, cannot reach them.
    std::string store_host = setup.host;
    if (!setup.slot.empty()) {
      std::istringstream words(std::getenv("SSH_CONNECTION") ? std::getenv("SSH_CONNECTION") : "");
      std::string client, client_port, server;
      if (words >> client >> client_port >> server && server.find(':') == std::string::npos) {
        store_host = server;
      }
    }
    ::setenv("KOLO_ADDR", fmt::format("{}:{}", store_host, port).c_str(), 1);
  }
  int signal_fd = handle_signals();
  write_all(STDOUT_FILENO, fmt::format("{}{}\n", kReadyLine, port));
  job.control_in = STDIN_FILENO;
  job.control_pending = input;
  ::fcntl(STDIN_FILENO, F_SETFL, ::fcntl(STDIN_FILENO, F_GETFL) | O_NONBLOCK);
  return job.run(signal_fd);
}

}  // namespace

// --help's text after the options: what a user needs to start a job and read its end.
constexpr std::string_view kHelpFooter = R"(
Examples:
  kolorun -np 4 ./my_program --its-own-flags
  kolorun -np 2 --tag-output all_reduce_perf -b 8 -e 128M -f 2
  kolorun -np 4 --timeout 600 python3 train.py
  kolorun -np 8 -H node1:4,node2:4 python3 train.py
  kolorun -np 8 --hostfile hosts.txt -x NCCL_DEBUG python3 train.py
  KOLO_SECRET_FILE=~/.kolo-secret kolorun -np 2 ./my_program
  kolorun --elastic -np 4 --min-np 2 --max-np 8 --host-discovery-script ./discover.sh ./train

Across hosts (-H, --hostfile): ranks fill each host's slots in order (ranks 0-3 on node1 above).
This machine's ranks start here, the others over ssh (BatchMode: keys and users from your ssh
configuration), which runs kolorun at this same path there, in this same directory. They get PATH,
PYTHONPATH, LD_LIBRARY_PATH, every KOLO_* and each -x NAME; the job secret travels over ssh's
stdin, never on a command line. A hostfile line is "host slots=N" (mpirun) or "host:N"
(horovodrun); "#" starts a comment.

Every rank gets kolorun's environment plus:
  KOLO_RANK                    the rank, 0 to N-1
  KOLO_SIZE                    N
  KOLO_LOCAL_RANK              its place among the ranks of its host, from 0
  KOLO_LOCAL_SIZE              the number of ranks on its host
  KOLO_ADDR                    <rank 0's host>:<a free port> where rank 0 serves the rendezvous
                               store (127.0.0.1 on one machine; kept when already set)
  KOLO_STORE_FD                rank 0 only: the listening socket bound at that port for it
  KOLO_SECRET                  a random job secret (kept when KOLO_SECRET or KOLO_SECRET_FILE is
                               set)

Elastic jobs (--elastic --host-discovery-script S, docs/elastic.md): S runs about once a second
and prints "host" or "host:slots" lines; the ranks call kolo_elastic_update at each commit, and
then ranks on vanished hosts leave (exit 0), free slots get new ranks (up to --max-np), a failed
rank's slot is restarted (up to --reset-limit), and below --min-np with no free slot the job stops
(exit 1). A failing script is reported and its last good output kept; 10 failures in a row stop
the job. Each rank also gets KOLO_ELASTIC_ADDR (the driver) and KOLO_ELASTIC_SLOT (host:n); a new
rank gets KOLO_INVITATION instead of KOLO_RANK and KOLO_SIZE. A host that is not this machine
gets its ranks over ssh, as with -H; the driver then listens on every interface.

Output: each line of a rank goes whole to kolorun's stdout or stderr, the stream the rank wrote it
to; --tag-output puts "[rank] " before it ("[rank@host] " across hosts).

Exit status:
  0         every rank exited 0
  N         the first rank that failed exited with N (the others are then stopped)
  128+S     the first rank that failed was killed by signal S
  124       --timeout passed
  127       the program could not be run
  255       a host could not be reached over ssh
  2         a bad command line
  1         kolorun itself failed (no port for the store, ...)
)";

// --help's usage line is kolorun's own (CLI11's would read "kolorun [OPTIONS]").
class UsageFormatter : public CLI::Formatter {
 public:
  std::string make_usage(const CLI::App*, std::string) const override {
    return std::string(kUsage) + "\n";
  }
};

int main(int argc, char** argv) {
  if (argc == 2 && std::string_view(argv[1]) == "--agent") return agent_main();
  Job job;
  std::string host_list, hostfile;
  kolorun::ElasticOptions elastic;
  std::vector<std::string> exports;
  CLI::App app{
      "kolorun: starts N ranks of a program on this machine or across hosts, with the KOLO_* "
      "environment set, and passes on their output.",
      "kolorun"};
  app.formatter(std::make_shared<UsageFormatter>());
  app.footer(std::string(kHelpFooter));
  app.add_option("-n,--np", job.size,
                 "number of ranks (also -np); with -H or --hostfile, all their slots by default");
  app.add_option("-H,--host", host_list, "hosts and their slots: host1:4,host2:4 (no slots: 1)");
  app.add_option("--hostfile", hostfile, "a file naming one host per line: host slots=N or host:N");
  app.add_option("-x", exports,
                 "NAME or NAME=VALUE: a variable remote ranks get too (repeatable); =VALUE sets it "
                 "for every rank")
      ->allow_extra_args(false);
  app.add_option("--ssh-port", job.ssh_port, "the port ssh connects to (ssh -p)");
  app.add_option("--ssh-identity-file", job.ssh_identity_file,
                 "the private key ssh authenticates with (ssh -i)");
  app.add_flag("--tag-output", job.tag_output,
               "put \"[rank] \" (across hosts \"[rank@host] \") before every line of output");
  app.add_option("--timeout", job.timeout_s, "stop the job after this many seconds; exit 124");
  app.add_option("--grace", job.grace_s, "seconds between SIGTERM and SIGKILL when stopping (5)");
  app.add_flag("--elastic", job.elastic,
               "a rank killed by a signal does not stop the others (for kolo_comm_shrink)");
  app.add_option("--host-discovery-script", elastic.script,
                 "--elastic: a command printing the hosts to run on, one 'host' or 'host:slots' "
                 "a line, run every second; ranks follow it (docs/elastic.md)");
  app.add_option("--min-np", elastic.min_np,
                 "--elastic with a discovery script: the fewest ranks the job runs with (-np)");
  app.add_option("--max-np", elastic.max_np,
                 "--elastic with a discovery script: the most ranks the job grows to (no limit)");
  app.add_option("--slots-per-host", elastic.slots_per_host,
                 "--elastic with a discovery script: the slots of a host printed without (1)");
  app.add_option("--reset-limit", elastic.reset_limit,
                 "--elastic with a discovery script: how often a failed rank's slot is restarted "
                 "(no limit)");
  app.add_option("--start-timeout", elastic.start_timeout_s,
                 "--elastic with a discovery script: seconds to wait for --min-np slots (60)");
  app.add_flag("-v,--verbose", job.verbose, "say what kolorun does");
  app.set_version_flag("--version", "kolorun (kolo) " KOLO_VERSION_STRING);
  app.prefix_command();  // the program and everything after it are left in remaining()
  app.failure_message([](const CLI::App*, const CLI::Error& error) {
    return fmt::format("kolorun: {}\n{}\n", error.what(), kUsage);
  });
  std::vector<std::string> args = normalize_arguments(argc, argv);
  std::vector<char*> arg_pointers;
  for (std::string& arg : args) arg_pointers.push_back(arg.data());
  try {
    app.parse(static_cast<int>(arg_pointers.size()), arg_pointers.data());
  } catch (const CLI::ParseError& error) {
    return app.exit(error) == 0 ? 0 : 2;
  }
  job.command = app.remaining();
  bool after_separator = !job.command.empty() && job.command.front() == "--";
  if (after_separator) job.command.erase(job.command.begin());
  const bool np_given = app.count("--np") > 0;
  job.host = this_host_name();
  std::string problem;
  if (!host_list.empty() && !hostfile.empty()) {
    problem = "-H and --hostfile name the hosts twice: give one of them";
  } else if (!host_list.empty()) {
    problem = parse_host_list(host_list, job.hosts);
  } else if (app.count("--hostfile") > 0) {
    problem = parse_hostfile(hostfile, job.hosts);
  } else if (app.count("--host") > 0) {
    problem = "-H names no host";
  }
  if (problem.empty() && !job.hosts.empty() && !np_given) {
    job.size = 0;
    for (const HostPlan& plan : job.hosts) job.size += plan.slots;
  }
  if (!problem.empty()) {
    // said below
  } else if (!np_given && job.hosts.empty()) {
    problem = "-np is required (or -H or --hostfile, whose slots it then counts)";
  } else if (job.size < 1 || !(job.timeout_s >= 0) || !(job.grace_s >= 0) ||
             std::isinf(job.timeout_s) || std::isinf(job.grace_s)) {
    problem = "-np must be at least 1, --timeout and --grace finite numbers, not negative";
  } else if (job.command.empty()) {
    problem = "no program given";
  } else if (!after_separator && job.command[0][0] == '-') {
    problem = fmt::format("unknown option {}", job.command[0]);
  } else if (!job.ssh_port.empty() && !parse_slots(job.ssh_port)) {
    problem = fmt::format("--ssh-port {}: not a port number", job.ssh_port);
  } else if (job.hosts.empty()) {
    job.hosts.push_back({job.host, job.size, true, 0, 0});
  }
  const bool discovering = app.count("--host-discovery-script") > 0;
  size_t elastic_flags = 0;
  for (const char* flag :
       {"--min-np", "--max-np", "--slots-per-host", "--reset-limit", "--start-timeout"}) {
    elastic_flags += app.count(flag);
  }
  if (!problem.empty()) {
    // said below
  } else if (elastic_flags > 0 && !discovering) {
    problem =
        "--host-discovery-script is what --min-np, --max-np, --slots-per-host, "
        "--reset-limit and --start-timeout go with";
  } else if (discovering && !job.elastic) {
    problem = "--host-discovery-script needs --elastic";
  } else if (discovering && (!host_list.empty() || app.count("--hostfile") > 0)) {
    problem = "--host-discovery-script names the hosts: give no -H or --hostfile";
  } else if (discovering && elastic.script.empty()) {
    problem = "--host-discovery-script is empty";
  } else if (discovering) {
    if (app.count("--min-np") == 0) elastic.min_np = job.size;
    if (app.count("--max-np") == 0) elastic.max_np = 1 << 20;
    elastic.np = job.size;
    if (!(elastic.min_np >= 1 && elastic.min_np <= job.size && job.size <= elastic.max_np)) {
      problem = fmt::format("--elastic needs 1 <= --min-np <= -np <= --max-np, not {} <= {} <= {}",
                            elastic.min_np, job.size, elastic.max_np);
    } else if (elastic.slots_per_host < 1 || elastic.slots_per_host > 100000) {
      problem = fmt::format("--slots-per-host {}: expected 1 to 100000", elastic.slots_per_host);
    } else if (app.count("--reset-limit") > 0 && elastic.reset_limit < 0) {
      problem = fmt::format("--reset-limit {}: expected 0 or more", elastic.reset_limit);
    } else if (!(elastic.start_timeout_s > 0) || std::isinf(elastic.start_timeout_s)) {
      problem = "--start-timeout must be a finite number of seconds above 0";
    }
  }
  if (problem.empty()) problem = place_ranks(job.size, job.hosts);
  for (const std::string& exported : exports) {
    if (!problem.empty()) break;
    size_t equals = exported.find('=');
    std::string name = exported.substr(0, equals);
    if (name.empty() ||
        name.find_first_not_of("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz"
                               "0123456789_") != name.npos) {
      problem = fmt::format("-x {}: expected NAME or NAME=VALUE", exported);
    } else if (equals != std::string::npos) {
      ::setenv(name.c_str(), exported.substr(equals + 1).c_str(), 1);
    } else if (!std::getenv(name.c_str())) {
      problem =
          fmt::format("-x {}: {} is not set here, so there is nothing to forward", name, name);
    }
    job.forwarded.push_back(name);
  }
  if (!problem.empty()) {
    say("{}\n{}", problem, kUsage);
    return 2;
  }
  job.tag_hosts = job.hosts.size() > 1 || !job.hosts[0].local;
  if (job.verbose || job.tag_hosts || discovering) {
    char path[4096] = {};
    ssize_t length = ::readlink("/proc/self/exe", path, sizeof path - 1);
    job.self_path = length > 0 ? std::string(path, static_cast<size_t>(length)) : argv[0];
    if (job.self_path.find('\'') != std::string::npos) {
      say("kolorun's own path {} holds a quote, which its ssh command line cannot carry",
          job.self_path);
      return 1;
    }
  }

  // The ranks inherit kolorun's environment: what they share is set here, their rank by start().
  // Rank 0's store: bound here when rank 0 runs here; on another host its agent binds it.
  const char* address = std::getenv("KOLO_ADDR");
  if ((!address || !*address) && job.hosts[0].local) {
    int port = 0;
    job.store_fd = listen_for_store(/*every_interface=*/job.tag_hosts, &port);
    if (job.store_fd < 0) {
      say("cannot listen on a port of {} for the rendezvous store: {}",
          job.tag_hosts ? "this machine" : "127.0.0.1", std::strerror(errno));
      return 1;
    }
    // Another host reaches this one by the name it was given, unless that name means loopback.
    std::string name = job.hosts[0].name;
    if (!job.tag_hosts) {
      name = "127.0.0.1";
    } else if (name == "localhost" || name.starts_with("127.") || name == "::1") {
      name = job.host;
    }
    ::setenv("KOLO_ADDR", fmt::format("{}:{}", name, port).c_str(), 1);
  } else if (address && !*address) {
    ::unsetenv("KOLO_ADDR");
  }
  // The job's own secret, where it has one, wins: KOLO_SECRET, or KOLO_SECRET_FILE (which the
  // ranks read; kolorun setting KOLO_SECRET beside it would make them refuse both).
  const char* secret = std::getenv("KOLO_SECRET");
  const char* secret_file = std::getenv("KOLO_SECRET_FILE");
  if (sodium_init() < 0) {
    say("cannot initialise libsodium");
    return 1;
  }
  if ((!secret || !*secret) && (!secret_file || !*secret_file)) {
    ::setenv("KOLO_SECRET", make_secret().c_str(), 1);
  }
  ::setenv("KOLO_SIZE", std::to_string(job.size).c_str(), 1);
  if (discovering) {  // the driver's store proves the job secret the ranks will hold
    kolo::ConfigOverrides overrides;
    overrides.rank = 0;
    overrides.size = 1;
    overrides.addr = "127.0.0.1:1";
    try {
      kolo::Config config = kolo::resolve_config(overrides, kolo::process_environment());
      elastic.secret = config.secret;
      elastic.rank_timeout_s = config.timeout_s;
    } catch (const kolo::Error& error) {
      say("{}", error.what());
      return 2;
    }
    elastic.is_this_machine = is_this_machine;
  }

  int signal_fd = handle_signals();
  std::unique_ptr<kolorun::ElasticDriver> driver;
  if (discovering) {  // after handle_signals: the store's thread must not take kolorun's signals
    driver = std::make_unique<kolorun::ElasticDriver>(
        elastic, [&job](const kolorun::RankLaunch& launch) { return job.start_in_slot(launch); },
        [](const std::string& message) { say("{}", message); }, job.verbose);
    std::string failed = driver->serve();
    if (!failed.empty()) {
      say("{}", failed);
      return 1;
    }
    job.driver = driver.get();
    job.remote_elastic_addr = fmt::format("{}:{}", job.host, driver->port());
    driver->set_kill([&job](pid_t pid) { job.kill_rank(pid); });
  }
  if (job.verbose) {
    for (const HostPlan& plan : job.hosts) {
      say("{} on {}{}", describe_ranks(plan.first_rank, plan.rank_count), plan.name,
          plan.local ? " (this machine)" : " (over ssh)");
    }
    const char* known = std::getenv("KOLO_ADDR");
    say("starting {} ranks of {} with KOLO_ADDR={}", job.size, job.command[0],
        known ? known : "(from rank 0's host, once its agent has bound it)");
  }
  return job.run(signal_fd);
}
