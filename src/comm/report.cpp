// The report of who is stuck (comm/report.hpp).
#include "comm/report.hpp"

#include <fcntl.h>
#include <signal.h>
#include <unistd.h>

#include <cerrno>
#include <mutex>
#include <set>
#include <thread>

#include "comm/communicator.hpp"
#include "core/log.hpp"

namespace kolo {
namespace {

std::mutex g_mutex;                // guards the set, and is held while reporting
std::set<Communicator*>& live() {  // never destroyed: the reporter may outlive main()
  static auto* communicators = new std::set<Communicator*>;
  return *communicators;
}
int g_pipe[2] = {-1, -1};

void on_signal(int) {
  const int saved = errno;
  const char byte = 1;
  [[maybe_unused]] ssize_t ignored = ::write(g_pipe[1], &byte, 1);  // full pipe: one is enough
  errno = saved;
}

void write_reports() {
  for (;;) {
    char byte = 0;
    const ssize_t got = ::read(g_pipe[0], &byte, 1);
    if (got < 0 && errno == EINTR) continue;
    if (got <= 0) return;
    std::lock_guard<std::mutex> lock(g_mutex);
    if (live().empty()) log::warn("SIGUSR1: this process has no kolo communicator");
    for (Communicator* communicator : live()) log::warn("SIGUSR1: {}", communicator->report());
  }
}

void install_handler() {
  struct sigaction current {};
  if (::sigaction(SIGUSR1, nullptr, &current) != 0) return;
  if (current.sa_handler != SIG_DFL || (current.sa_flags & SA_SIGINFO)) {
    log::info("SIGUSR1 has a handler of the application's: kolo's report of who is stuck is off");
    return;
  }
  if (::pipe2(g_pipe, O_CLOEXEC) != 0) return;
  ::fcntl(g_pipe[1], F_SETFL, O_NONBLOCK);  // the handler never blocks
  struct sigaction action {};
  action.sa_handler = on_signal;
  sigemptyset(&action.sa_mask);
  action.sa_flags = SA_RESTART;
  if (::sigaction(SIGUSR1, &action, nullptr) != 0) return;
  std::thread(write_reports).detach();
}

}  // namespace

void report_on(Communicator* communicator) {
  static std::once_flag once;
  std::call_once(once, install_handler);
  std::lock_guard<std::mutex> lock(g_mutex);
  live().insert(communicator);
}

void stop_reporting_on(Communicator* communicator) {
  std::lock_guard<std::mutex> lock(g_mutex);
  live().erase(communicator);
}

}  // namespace kolo
