// Each child leads its own process group, so that one killpg() reaches everything it started, and
// writes stdout and stderr to one temporary file, which needs no reader while it runs (a pipe
// would block a chatty child until someone drains it).
//
// The test process makes itself a child subreaper: what a child leaves behind when it dies is
// adopted by the test, not by init, so the test can reap it. (In containers init often reaps
// nothing, and every killed grandchild would stay a zombie.) Members of a child's group are
// reaped when the child is; a test that knows other pids can waitpid() them itself.
#include "process.hpp"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <memory>
#include <sstream>
#include <stdexcept>
#include <string_view>
#include <system_error>
#include <thread>

#include "tools/free_port.hpp"

extern char** environ;

namespace kolo::test {
namespace {

[[noreturn]] void throw_errno(const std::string& what) {
  throw std::system_error(errno, std::generic_category(), what);
}

// The current environment with extra_env laid over it, as "NAME=value" strings.
std::vector<std::string> merged_environment(const std::map<std::string, std::string>& extra_env) {
  std::vector<std::string> merged;
  for (char** entry = environ; *entry; ++entry) {
    std::string_view text = *entry;
    if (!extra_env.contains(std::string(text.substr(0, text.find('='))))) merged.emplace_back(text);
  }
  for (const auto& [name, value] : extra_env) merged.push_back(name + "=" + value);
  return merged;
}

// SIGKILLs what is left of the group and reaps the members that the subreaper setting made ours.
// Gives up after a second on members that are someone else's children.
void kill_and_reap_group(pid_t group) {
  auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(1);
  while (::killpg(group, SIGKILL) == 0 && std::chrono::steady_clock::now() < deadline) {
    int status;
    while (::waitpid(-group, &status, WNOHANG) > 0) {
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
}

ProcessResult result_of(int status) {
  ProcessResult result;
  if (WIFEXITED(status)) result.exit_code = WEXITSTATUS(status);
  if (WIFSIGNALED(status)) result.signal = WTERMSIG(status);
  return result;
}

}  // namespace

Process::Process(const std::vector<std::string>& argv,
                 const std::map<std::string, std::string>& extra_env) {
  if (argv.empty()) throw std::invalid_argument("Process: empty argv");
  // Everything the child needs is built before fork(): between fork and exec only
  // async-signal-safe calls are allowed, and the test may have other threads.
  std::vector<std::string> arguments = argv, environment = merged_environment(extra_env);
  std::vector<char*> argv_pointers, envp_pointers;
  for (std::string& arg : arguments) argv_pointers.push_back(arg.data());
  for (std::string& entry : environment) envp_pointers.push_back(entry.data());
  argv_pointers.push_back(nullptr);
  envp_pointers.push_back(nullptr);
  std::string exec_failed = "Process: cannot execute " + argv[0] + "\n";

  static const bool subreaper = ::prctl(PR_SET_CHILD_SUBREAPER, 1) == 0;
  (void)subreaper;

  char path_template[] = "/tmp/kolo-test-output-XXXXXX";
  int output_fd = ::mkostemp(path_template, O_CLOEXEC);
  if (output_fd < 0) throw_errno("Process: mkostemp");
  output_path_ = path_template;
  int null_fd = ::open("/dev/null", O_RDONLY | O_CLOEXEC);

  // Signals stay blocked from fork() until the child has reset its handlers: a handler of the
  // test (Catch2 installs some) must never run in the child.
  sigset_t all, previous;
  sigfillset(&all);
  ::pthread_sigmask(SIG_SETMASK, &all, &previous);
  pid_t pid = ::fork();
  if (pid == 0) {
    ::setpgid(0, 0);
    for (int signal = 1; signal < NSIG; ++signal) ::signal(signal, SIG_DFL);
    sigset_t none;
    sigemptyset(&none);
    ::sigprocmask(SIG_SETMASK, &none, nullptr);
    if (null_fd >= 0) ::dup2(null_fd, STDIN_FILENO);
    ::dup2(output_fd, STDOUT_FILENO);
    ::dup2(output_fd, STDERR_FILENO);
    ::execve(argv_pointers[0], argv_pointers.data(), envp_pointers.data());
    ssize_t ignored = ::write(STDERR_FILENO, exec_failed.data(), exec_failed.size());
    (void)ignored;
    _exit(127);
  }
  int fork_errno = errno;
  ::pthread_sigmask(SIG_SETMASK, &previous, nullptr);
  ::close(output_fd);
  if (null_fd >= 0) ::close(null_fd);
  if (pid < 0) {
    ::unlink(output_path_.c_str());
    errno = fork_errno;
    throw_errno("Process: fork " + argv[0]);
  }
  ::setpgid(pid, pid);  // as in the child: whichever runs first, kill() finds the group
  pid_ = pid;
}

Process::Process(Process&& other) noexcept
    : pid_(other.pid_), reaped_(other.reaped_), output_path_(std::move(other.output_path_)) {
  other.pid_ = -1;
  other.reaped_ = true;
  other.output_path_.clear();
}

Process::~Process() {
  if (pid_ > 0 && !reaped_) {
    ::killpg(pid_, SIGKILL);
    int status;
    while (::waitpid(pid_, &status, 0) < 0 && errno == EINTR) {
    }
    kill_and_reap_group(pid_);
  }
  if (!output_path_.empty()) ::unlink(output_path_.c_str());
}

void Process::kill(int signal) {
  if (pid_ > 0 && !reaped_) ::killpg(pid_, signal);
}

ProcessResult Process::wait(double timeout_s) {
  if (pid_ <= 0 || reaped_) {
    ProcessResult result;  // already waited for: only the output is left to report
    result.output = output_so_far();
    return result;
  }
  auto deadline = std::chrono::steady_clock::now() + std::chrono::duration<double>(timeout_s);
  bool timed_out = false;
  int status = 0;
  for (;;) {
    pid_t done = ::waitpid(pid_, &status, WNOHANG);
    if (done == pid_) break;
    if (done < 0 && errno != EINTR) throw_errno("Process: waitpid");
    if (std::chrono::steady_clock::now() >= deadline) {
      timed_out = true;
      ::killpg(pid_, SIGKILL);
      while (::waitpid(pid_, &status, 0) < 0 && errno == EINTR) {
      }
      break;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(2));
  }
  reaped_ = true;
  // Whatever the leader left behind in its group dies with it, so that no test leaves a process
  // running. While members remain, their group id cannot be given to a new process; when none
  // remain, this finds no group (process ids are not reused this soon).
  kill_and_reap_group(pid_);
  ProcessResult result = result_of(status);
  result.timed_out = timed_out;
  result.output = output_so_far();
  return result;
}

std::string Process::output_so_far() const {
  std::ifstream file(output_path_, std::ios::binary);
  std::ostringstream contents;
  contents << file.rdbuf();
  return contents.str();
}

bool Process::wait_for_output(const std::string& marker, size_t times,
                              std::chrono::milliseconds timeout,
                              std::chrono::milliseconds poll_interval, std::string* output) const {
  auto give_up = std::chrono::steady_clock::now() + timeout;
  std::string seen;
  bool found = false;
  while (!found && std::chrono::steady_clock::now() < give_up) {
    seen = output_so_far();
    found = count(seen, marker) >= times;
    if (!found) std::this_thread::sleep_for(poll_interval);
  }
  if (output) *output = std::move(seen);
  return found;
}

size_t count(const std::string& text, const std::string& part) {
  size_t found = 0;
  for (size_t at = text.find(part); at != std::string::npos; at = text.find(part, at + 1)) ++found;
  return found;
}

std::string process_table(const std::vector<std::string>& words) {
  std::unique_ptr<FILE, int (*)(FILE*)> ps(
      ::popen("ps -eo pid,ppid,stat,etimes,wchan:24,args --forest 2>&1", "r"), ::pclose);
  if (!ps) return "(ps could not be started)\n";
  std::string output;
  char buffer[4096];
  for (size_t got; (got = std::fread(buffer, 1, sizeof buffer, ps.get())) > 0;) {
    output.append(buffer, got);
  }
  std::istringstream lines(output);
  std::string table;
  bool first = true;
  for (std::string line; std::getline(lines, line); first = false) {
    if (first || std::any_of(words.begin(), words.end(), [&](const std::string& word) {
          return line.find(word) != std::string::npos;
        })) {
      table += line.substr(0, 400) + "\n";  // a long command line is cut, not its process
    }
  }
  return table;
}

int free_tcp_port() {
  int port = kolo::tools::pick_free_local_port();
  if (port < 0) throw_errno("free_tcp_port: bind 127.0.0.1");
  return port;
}

std::string build_dir() {
  const char* dir = std::getenv("TESTS_BUILD_DIR");
  return dir && *dir ? dir : ".";
}

std::string built_program(const std::string& relative_path) {
  return build_dir() + "/" + relative_path;
}

}  // namespace kolo::test
