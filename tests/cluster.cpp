#include "cluster.hpp"

#include <fmt/format.h>
#include <unistd.h>

#include <catch2/catch.hpp>
#include <cstdio>
#include <cstdlib>
#include <regex>

namespace kolo::test {

std::string source_dir() {
  const char* path = std::getenv("TESTS_SOURCE_DIR");
  return path != nullptr ? path : "..";
}

std::string cluster_script() {
  const char* path = std::getenv("TESTS_CLUSTER_SCRIPT");
  return path != nullptr ? path : source_dir() + "/scripts/cluster.sh";
}

bool contains(const std::string& text, const std::string& part) {
  return text.find(part) != std::string::npos;
}

int run_cluster_script(const std::string& arguments, const std::string& subnet,
                       const std::string& subnet6) {
  std::string settings;
  if (!subnet.empty()) settings += fmt::format("CLUSTER_SUBNET={} ", subnet);
  if (!subnet6.empty()) settings += fmt::format("CLUSTER_SUBNET6={} ", subnet6);
  const std::string command =
      fmt::format("{}sh '{}' {} >/dev/null 2>&1", settings, cluster_script(), arguments);
  return std::system(command.c_str());
}

std::string ClusterId::host(int number) const {
  return fmt::format("{}{}", name, number);
}

int ClusterId::run_script(const std::string& arguments) const {
  return run_cluster_script(arguments, subnet, subnet6);
}

std::vector<std::string> ClusterId::exec(int number, const std::string& shell_command) const {
  std::vector<std::string> command = {"/bin/sh", cluster_script(), "exec", name,
                                      std::to_string(number)};
  command.insert(command.end(), {"/bin/sh", "-c", shell_command});
  return command;
}

SshCluster::SshCluster(const ClusterId& id) : id_(id) {
  REQUIRE(id_.run_script(fmt::format("up {} {}", id_.name, id_.hosts)) == 0);
  REQUIRE(id_.run_script(fmt::format("sshd {}", id_.name)) == 0);
}

SshCluster::~SshCluster() {
  id_.run_script(fmt::format("down {}", id_.name));
}

std::map<int, std::string> parameter_digests(const std::string& output) {
  static const std::regex digest(R"(rank (\d+): parameters sha256 ([0-9a-f]{64}))");
  std::map<int, std::string> digests;
  for (auto it = std::sregex_iterator(output.begin(), output.end(), digest);
       it != std::sregex_iterator(); ++it) {
    digests[std::stoi((*it)[1])] = (*it)[2];
  }
  return digests;
}

void expect_same_parameters(const std::string& output, int size) {
  const std::map<int, std::string> digests = parameter_digests(output);
  REQUIRE(static_cast<int>(digests.size()) == size);
  for (const auto& [rank, hex] : digests) {
    INFO("rank " << rank);
    CHECK(hex == digests.begin()->second);
  }
}

bool cluster_unavailable(const std::vector<std::pair<std::string, std::string>>& needs) {
  if (::geteuid() != 0) {
    std::puts("skipped: the simulated cluster needs root (ip netns, unshare)");
    return true;
  }
  if (std::system("ip netns list >/dev/null 2>&1 && command -v unshare >/dev/null") != 0) {
    std::puts("skipped: `ip netns` or `unshare` is not available here");
    return true;
  }
  for (const auto& [command, missing] : needs) {
    if (std::system(command.c_str()) != 0) {
      std::printf("skipped: %s\n", missing.c_str());
      return true;
    }
  }
  return false;
}

}  // namespace kolo::test
