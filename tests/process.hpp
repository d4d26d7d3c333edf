// Starting and supervising real processes from tests: every child is killed by the destructor,
// so a failing test leaves no process behind.
#pragma once

#include <sys/types.h>

#include <chrono>
#include <map>
#include <string>
#include <vector>

namespace kolo::test {

struct ProcessResult {
  int exit_code = -1;    // exit status when the process exited normally, else -1
  int signal = 0;        // terminating signal, 0 when it exited normally
  bool timed_out = false;  // true when wait() had to kill it
  std::string output;    // stdout and stderr together
};

class Process {
 public:
  // Starts argv[0] (a path) with the current environment plus extra_env (which overrides), in a
  // new process group. Output goes to a temporary file, read back by wait().
  Process(const std::vector<std::string>& argv, const std::map<std::string, std::string>& extra_env);
  Process(Process&& other) noexcept;
  Process& operator=(Process&&) = delete;
  Process(const Process&) = delete;
  ~Process();  // SIGKILLs the whole process group if still running, removes the temporary file

  pid_t pid() const { return pid_; }
  void kill(int signal);  // to the process group
  // Waits up to timeout_s; past it, SIGKILLs the process group and reports timed_out.
  ProcessResult wait(double timeout_s);
  // Output written so far (for tests that watch a running process).
  std::string output_so_far() const;
  // Reads the output every poll_interval until `marker` occurs in it at least `times` times (as
  // count() counts), for up to `timeout`; whether it did. Whether the process is still running
  // does not matter: only the clock ends the wait. `output`, when given, receives the output last
  // read: the one that held the marker, or what there was when the time ran out.
  bool wait_for_output(const std::string& marker, size_t times, std::chrono::milliseconds timeout,
                       std::chrono::milliseconds poll_interval,
                       std::string* output = nullptr) const;

 private:
  pid_t pid_ = -1;
  bool reaped_ = false;
  std::string output_path_;
};

// How many times `part` occurs in `text` (overlapping occurrences each count).
size_t count(const std::string& text, const std::string& part);

// The machine's processes whose line in `ps` names one of `words` (with the header), as a tree,
// with their state, age in seconds and kernel wait channel: what a test prints when something it
// waits for never comes, so that the failure shows which process is stuck where.
std::string process_table(const std::vector<std::string>& words);

// A TCP port on 127.0.0.1 that was free a moment ago, outside the kernel's ephemeral range.
int free_tcp_port();
// $TESTS_BUILD_DIR (set by meson test), or "." when unset; paths to built programs.
std::string build_dir();
std::string built_program(const std::string& relative_path);  // build_dir() + "/" + relative_path

}  // namespace kolo::test
