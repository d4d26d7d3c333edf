// kolorun: starts N ranks of one program on this machine and supervises them.
//
//   kolorun -np N [--tag-output] [--timeout S] [--grace S] [--elastic] [--verbose] [--] program
//           [args...]
//
// Each rank runs with the environment plus KOLO_RANK=i, KOLO_SIZE=N, KOLO_LOCAL_RANK=i,
// KOLO_LOCAL_SIZE=N, KOLO_ADDR=127.0.0.1:<port>, where rank 0 serves the rendezvous store, and
// KOLO_SECRET=<32 random bytes in hex>, which every rank shares and an outsider cannot guess. The
// port is one kolorun binds and listens on itself before any rank starts, and hands to rank 0 as
// an inherited descriptor named by KOLO_STORE_FD (rank 0's store serves on it), so that no other
// process can take the port between its choice and the store's start; the other ranks may connect
// at once, and are answered once rank 0 serves. A KOLO_ADDR or KOLO_SECRET already in the
// environment is kept (and no descriptor handed down); with KOLO_SECRET_FILE set, no secret is
// generated and the ranks read that file.
//
// Every line a rank writes is passed on whole to kolorun's stdout or stderr, matching the stream
// it came from, so that lines of different ranks never mix within a line and a rank's stderr never
// lands in stdout. Lines go out as the rank wrote them, as mpirun passes them on; --tag-output (the
// name mpirun gives it) puts "[i] " before each. Untagged is the default so that output meant to
// be parsed (nccl-tests' tables, anchored on "#") reads the same under kolorun as alone. A rank
// runs in its own process group, so that a signal reaches everything it started; its stdin is
// /dev/null, and it is SIGKILLed if kolorun itself dies.
// kolorun adopts (as child subreaper) and reaps what stopped ranks leave behind, so no zombie is
// left even where init reaps nothing, as in many containers.
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
// exits non-zero still stops the job. --timeout stops the job the same way and exits 124. Bad
// arguments exit 2; a program that cannot be executed makes its ranks exit 127. What kolorun says
// about a rank names it, its pid and this host.
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
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "kolo_build_config.h"

namespace {

using Clock = std::chrono::steady_clock;
constexpr Clock::time_point kNever = Clock::time_point::max();
constexpr std::string_view kUsage = "Usage: kolorun -np N [options] [--] program [args...]";

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

// One output stream of one rank, read from a non-blocking pipe. Complete lines go out in one
// write(), so lines never interleave; a line longer than 1 MiB is passed on in pieces.
struct Stream {
  int fd = -1;
  int target = -1;  // STDOUT_FILENO or STDERR_FILENO
  std::string prefix;
  std::string pending;  // bytes after the last newline

  void pass_lines(bool at_end) {
    std::string lines;
    size_t start = 0;
    for (size_t end; (end = pending.find('\n', start)) != std::string::npos; start = end + 1) {
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

struct Rank {
  pid_t pid = -1;
  bool running = false;
  bool group_alive = false;  // its process group may still have members
  Stream streams[2];         // stdout, stderr
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

// A socket listening on 127.0.0.1 at a port the kernel picks, for rank 0's store (KOLO_STORE_FD):
// close-on-exec, and above the standard descriptors, which a rank's own set-up replaces. -1 (errno
// set) when none can be had.
int listen_for_store(int* port) {
  int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return -1;
  if (fd <= STDERR_FILENO) {  // kolorun was started with a standard descriptor closed
    int moved = ::fcntl(fd, F_DUPFD_CLOEXEC, STDERR_FILENO + 1);
    ::close(fd);
    if (moved < 0) return -1;
    fd = moved;
  }
  int one = 1;
  ::setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
  sockaddr_in address{};
  address.sin_family = AF_INET;
  address.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
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

std::string make_secret() {
  unsigned char bytes[32];
  char hex[2 * sizeof bytes + 1];
  randombytes_buf(bytes, sizeof bytes);
  return sodium_bin2hex(hex, sizeof hex, bytes, sizeof bytes);
}

// CLI11 reads "-np 4" as "-n p" and a stray "4"; MPI users type -np, so it becomes --np. The scan
// stops at the program (or "--") so that the program's own arguments are left alone.
std::vector<std::string> normalize_arguments(int argc, char** argv) {
  std::vector<std::string> args(argv, argv + argc);
  for (size_t i = 1; i < args.size(); ++i) {
    std::string& arg = args[i];
    if (arg == "--" || arg.empty() || arg[0] != '-') break;
    if (arg == "-np" || arg.starts_with("-np=")) arg.insert(0, "-");
    if (arg == "--np" || arg == "-n" || arg == "--timeout" || arg == "--grace") ++i;  // its value
  }
  return args;
}

// Past about 31 years the clock's nanoseconds would overflow: such a wait never ends.
Clock::time_point seconds_from_now(double seconds) {
  using std::chrono::duration, std::chrono::duration_cast;
  if (!(seconds < 1e9)) return kNever;
  return Clock::now() + duration_cast<Clock::duration>(duration<double>(seconds));
}

struct Job {
  std::vector<std::string> command;
  int store_fd = -1;  // the store's listening socket, until rank 0 has inherited it
  double timeout_s = 0, grace_s = 5;
  bool verbose = false;
  bool elastic = false;
  bool tag_output = false;        // "[i] " before every line of rank i
  std::string host;               // this machine's name, in what kolorun says about a rank
  std::optional<int> first_lost;  // --elastic: the status of the first rank killed by a signal
  int finished = 0;               // ranks that exited on their own
  std::vector<Rank> ranks;
  int running = 0;
  std::optional<int> failure_code;  // exit code of the first rank that failed
  bool stopping = false, timed_out = false;
  Clock::time_point kill_at = kNever, timeout_at = kNever;

  // Forks rank `index`, whose environment is ours (KOLO_SIZE, ADDR, SECRET set by main) plus its
  // rank, and for rank 0 the store's socket. The child runs the program or exits 127. False
  // (errno set) when it cannot be started; the job is then stopped, and kolorun exits soon, so the
  // pipes of that failure stay open.
  bool start(int index) {
    ::setenv("KOLO_RANK", std::to_string(index).c_str(), 1);
    ::setenv("KOLO_LOCAL_RANK", std::to_string(index).c_str(), 1);
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
    if (::pipe2(out_pipe, O_CLOEXEC) != 0 || ::pipe2(err_pipe, O_CLOEXEC) != 0) return false;
    pid_t parent = ::getpid();
    pid_t pid = ::fork();
    if (pid < 0) return false;
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
      write_all(STDERR_FILENO, fmt::format("kolorun: rank {} on {}: cannot run {}: {}\n", index,
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
    for (int fd : {out_pipe[0], err_pipe[0]}) ::fcntl(fd, F_SETFL, O_NONBLOCK);
    std::string prefix = tag_output ? fmt::format("[{}] ", index) : std::string();
    ranks[index] = {
        pid,
        true,
        true,
        {{out_pipe[0], STDOUT_FILENO, prefix, {}}, {err_pipe[0], STDERR_FILENO, prefix, {}}}};
    ++running;
    return true;
  }

  // Every process group of a rank that still has members, and every adopted orphan.
  void signal_ranks(int signal) {
    for (Rank& rank : ranks) {
      if (rank.group_alive && ::kill(-rank.pid, signal) != 0 && errno == ESRCH) {
        rank.group_alive = false;
      }
    }
    for (pid_t child : own_children()) {
      bool leader = std::any_of(ranks.begin(), ranks.end(),
                                [&](const Rank& rank) { return rank.pid == child; });
      if (!leader) ::kill(child, signal);
    }
  }

  // Whether anything the ranks started is still there, once every rank has exited.
  bool leftovers() {
    for (Rank& rank : ranks) {
      if (rank.group_alive && ::kill(-rank.pid, 0) != 0 && errno == ESRCH) {
        rank.group_alive = false;
      }
    }
    return std::any_of(ranks.begin(), ranks.end(),
                       [](const Rank& rank) { return rank.group_alive; }) ||
           !own_children().empty();
  }

  void stop(int signal) {  // the first stop also starts the grace period
    signal_ranks(signal);
    if (!stopping) kill_at = seconds_from_now(grace_s);
    stopping = true;
  }

  // "rank 2 exited with status 3 (pid 4242 on node7)": which rank, what became of it, and where
  // to look for it.
  std::string ended(size_t index, int status) const {
    return fmt::format("rank {} {} (pid {} on {})", index, describe(status), ranks[index].pid,
                       host);
  }

  void reap() {
    int status;
    for (pid_t pid; (pid = ::waitpid(-1, &status, WNOHANG)) > 0;) {
      for (size_t i = 0; i < ranks.size(); ++i) {
        if (ranks[i].pid != pid) continue;
        ranks[i].running = false;
        --running;
        bool failed = !WIFEXITED(status) || WEXITSTATUS(status) != 0;
        if (WIFEXITED(status)) ++finished;
        if (elastic && WIFSIGNALED(status) && !stopping) {
          say("{}; --elastic: the other ranks go on", ended(i, status));
          if (!first_lost) first_lost = 128 + WTERMSIG(status);
          continue;
        }
        if (verbose || (failed && !stopping)) say("{}", ended(i, status));
        if (failed && !failure_code) {
          failure_code = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
        }
        if (failed) stop(SIGTERM);
      }
    }
  }

  // Starts the ranks and passes on their output until all have exited; returns kolorun's status.
  int run(int size, int signal_fd) {
    ranks.resize(static_cast<size_t>(size));
    if (timeout_s > 0) timeout_at = seconds_from_now(timeout_s);
    for (int i = 0; i < size && !stopping; ++i) {
      if (!start(i)) {
        say("cannot start rank {} on {}: {}", i, host, std::strerror(errno));
        failure_code = 1;
        stop(SIGTERM);
      }
    }
    bool cleaning_up = false;  // every rank has exited; what they left behind is being stopped
    while (running > 0 || cleaning_up) {
      std::vector<pollfd> polled = {{signal_fd, POLLIN, 0}};
      std::vector<Stream*> streams;
      for (Rank& rank : ranks) {
        for (Stream& stream : rank.streams) {
          if (stream.fd < 0) continue;
          polled.push_back({stream.fd, POLLIN, 0});
          streams.push_back(&stream);
        }
      }
      Clock::time_point deadline = std::min(kill_at, timeout_at);
      auto until_deadline = std::chrono::ceil<std::chrono::milliseconds>(deadline - Clock::now());
      long wait_ms = deadline == kNever ? -1 : std::clamp<long>(until_deadline.count(), 0, 1000);
      // Leftovers that are not kolorun's children die without a SIGCHLD: look again soon.
      if (cleaning_up) wait_ms = wait_ms < 0 ? 50 : std::min(wait_ms, 50L);
      ::poll(polled.data(), polled.size(), static_cast<int>(wait_ms));
      for (size_t i = 1; i < polled.size(); ++i) {
        if (polled[i].revents) streams[i - 1]->read_available();
      }
      signalfd_siginfo info;
      while (::read(signal_fd, &info, sizeof info) == sizeof info) {
        int signal = static_cast<int>(info.ssi_signo);
        if (signal == SIGCHLD) continue;  // reap() finds every exited child, however many SIGCHLDs
        if (verbose) say("forwarding {} to the ranks", signal_name(signal));
        if (signal == SIGUSR1 || signal == SIGUSR2 || signal == SIGCONT) {
          signal_ranks(signal);
        } else if (signal == SIGTSTP) {
          signal_ranks(signal);
          ::raise(SIGSTOP);  // continues here on SIGCONT, which then reaches the ranks too
        } else {
          stop(signal);
        }
      }
      reap();
      if (Clock::now() >= timeout_at) {
        say("job timed out after {} s; stopping it", timeout_s);
        timed_out = true;
        timeout_at = kNever;
        stop(SIGTERM);
      }
      if (Clock::now() >= kill_at) {
        if (verbose) say("grace period over; killing what is left");
        kill_at = kNever;
        signal_ranks(SIGKILL);
      }
      if (running == 0) {
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
    for (Rank& rank : ranks) {
      for (Stream& stream : rank.streams) {
        if (stream.fd < 0) continue;
        stream.read_available();
        stream.pass_lines(/*at_end=*/true);
        if (stream.fd >= 0) ::close(stream.fd);
      }
    }
    if (timed_out) return 124;
    if (!failure_code && finished == 0 && first_lost) return *first_lost;
    return failure_code.value_or(0);
  }
};

}  // namespace

// --help's text after the options: what a user needs to start a job and read its end.
constexpr std::string_view kHelpFooter = R"(
Examples:
  kolorun -np 4 ./my_program --its-own-flags
  kolorun -np 2 --tag-output all_reduce_perf -b 8 -e 128M -f 2
  kolorun -np 4 --timeout 600 python3 train.py
  KOLO_SECRET_FILE=~/.kolo-secret kolorun -np 2 ./my_program

Every rank gets kolorun's environment plus:
  KOLO_RANK, KOLO_LOCAL_RANK   the rank, 0 to N-1 (one machine: both the same)
  KOLO_SIZE, KOLO_LOCAL_SIZE   N
  KOLO_ADDR                    127.0.0.1:<a free port> where rank 0 serves the rendezvous store
                               (kept when already set)
  KOLO_STORE_FD                rank 0 only: the listening socket kolorun bound at that port
  KOLO_SECRET                  a random job secret (kept when KOLO_SECRET or KOLO_SECRET_FILE is
                               set)

Output: each line of a rank goes whole to kolorun's stdout or stderr, the stream the rank wrote it
to; --tag-output puts "[rank] " before it.

Exit status:
  0         every rank exited 0
  N         the first rank that failed exited with N (the others are then stopped)
  128+S     the first rank that failed was killed by signal S
  124       --timeout passed
  127       the program could not be run
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
  Job job;
  int size = 0;
  CLI::App app{
      "kolorun: starts N ranks of a program on this machine, with the KOLO_* environment "
      "set, and passes on their output.",
      "kolorun"};
  app.formatter(std::make_shared<UsageFormatter>());
  app.footer(std::string(kHelpFooter));
  app.add_option("-n,--np", size, "number of ranks (also -np)")->required();
  app.add_flag("--tag-output", job.tag_output, "put \"[rank] \" before every line of output");
  app.add_option("--timeout", job.timeout_s, "stop the job after this many seconds; exit 124");
  app.add_option("--grace", job.grace_s, "seconds between SIGTERM and SIGKILL when stopping (5)");
  app.add_flag("--elastic", job.elastic,
               "a rank killed by a signal does not stop the others (for kolo_comm_shrink)");
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
  std::string problem;
  if (size < 1 || !(job.timeout_s >= 0) || !(job.grace_s >= 0) || std::isinf(job.timeout_s) ||
      std::isinf(job.grace_s)) {
    problem = "-np must be at least 1, --timeout and --grace finite numbers, not negative";
  } else if (job.command.empty()) {
    problem = "no program given";
  } else if (!after_separator && job.command[0][0] == '-') {
    problem = fmt::format("unknown option {}", job.command[0]);
  }
  if (!problem.empty()) {
    say("{}\n{}", problem, kUsage);
    return 2;
  }

  char host[256] = {};
  ::gethostname(host, sizeof host - 1);
  job.host = host;

  // The ranks inherit kolorun's environment: what they share is set here, their rank by start().
  const char* address = std::getenv("KOLO_ADDR");
  if (!address || !*address) {
    int port = 0;
    job.store_fd = listen_for_store(&port);
    if (job.store_fd < 0) {
      say("cannot listen on a port of 127.0.0.1 for the rendezvous store: {}",
          std::strerror(errno));
      return 1;
    }
    ::setenv("KOLO_ADDR", fmt::format("127.0.0.1:{}", port).c_str(), 1);
  }
  // The job's own secret, where it has one, wins: KOLO_SECRET, or KOLO_SECRET_FILE (which the
  // ranks read; kolorun setting KOLO_SECRET beside it would make them refuse both).
  const char* secret = std::getenv("KOLO_SECRET");
  const char* secret_file = std::getenv("KOLO_SECRET_FILE");
  if ((!secret || !*secret) && (!secret_file || !*secret_file)) {
    if (sodium_init() < 0) {
      say("cannot initialise libsodium");
      return 1;
    }
    ::setenv("KOLO_SECRET", make_secret().c_str(), 1);
  }
  ::setenv("KOLO_SIZE", std::to_string(size).c_str(), 1);
  ::setenv("KOLO_LOCAL_SIZE", std::to_string(size).c_str(), 1);

  // Signals arrive through a signalfd, so that Job::run handles them between two polls.
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
  if (job.verbose) {
    say("starting {} ranks of {} with KOLO_ADDR={}", size, job.command[0],
        std::getenv("KOLO_ADDR"));
  }
  return job.run(size, signal_fd);
}
