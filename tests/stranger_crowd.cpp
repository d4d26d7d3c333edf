// Strangers on every port from another host: `kolo_stranger_crowd ADDRESS=PID ...` crowds every
// TCP port the processes PID listen on (tests/strangers.hpp), reaching a listener on every address
// at ADDRESS, until SIGTERM or SIGINT; then prints how many connections it opened to which ports.
// test_cluster runs it in a namespace of its own beside the ranks' hosts.
#include <signal.h>

#include <cstdio>
#include <string>
#include <vector>

#include "strangers.hpp"

int main(int argc, char** argv) {
  std::vector<kolo::test::Target> targets;
  for (int i = 1; i < argc; ++i) {
    const std::string argument = argv[i];
    const size_t equals = argument.find('=');
    if (equals == std::string::npos) {
      std::fprintf(stderr, "usage: %s ADDRESS=PID ...\n", argv[0]);
      return 2;
    }
    targets.push_back({static_cast<pid_t>(std::stol(argument.substr(equals + 1))),
                       argument.substr(0, equals), true});
  }
  sigset_t stop;
  sigemptyset(&stop);
  sigaddset(&stop, SIGTERM);
  sigaddset(&stop, SIGINT);
  pthread_sigmask(SIG_BLOCK, &stop, nullptr);  // before the crowd's thread starts
  std::set<kolo::test::ListeningPort> ports;
  uint64_t connections = 0;
  {
    kolo::test::Strangers crowd(targets);
    std::puts("stranger_crowd: started");
    std::fflush(stdout);
    int signal = 0;
    sigwait(&stop, &signal);
    ports = crowd.ports();
    connections = crowd.connections();
  }
  std::printf("stranger_crowd: %llu connections to %zu ports:", static_cast<unsigned long long>(connections),
              ports.size());
  for (const auto& port : ports) std::printf(" %s:%u", port.address.c_str(), port.port);
  std::printf("\n");
  return 0;
}
