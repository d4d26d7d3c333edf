// What the tests on the simulated cluster (scripts/cluster.sh) share: where the scripts are,
// running cluster.sh with a test's own subnet, a cluster with an sshd on every host, the ranks'
// parameter digests, and a main() that skips where the cluster cannot be made.
#pragma once

#include <map>
#include <string>
#include <utility>
#include <vector>

namespace kolo::test {

// $TESTS_SOURCE_DIR (set by meson test), else "..": the checkout, with scripts/ and examples/.
std::string source_dir();
// $TESTS_CLUSTER_SCRIPT, else source_dir()/scripts/cluster.sh.
std::string cluster_script();

bool contains(const std::string& text, const std::string& part);

// `sh cluster.sh ARGUMENTS`, quiet, with CLUSTER_SUBNET (and CLUSTER_SUBNET6) when given, so that
// tests with subnets of their own can run side by side; returns its exit status.
int run_cluster_script(const std::string& arguments, const std::string& subnet = "",
                       const std::string& subnet6 = "");

// A test program's own cluster: its name (hosts NAME1 .. NAMEn), its subnets (so that it can run
// beside the other cluster tests) and its number of hosts.
struct ClusterId {
  std::string name;
  std::string subnet;
  std::string subnet6;
  int hosts = 0;

  // "NAME<number>", the host name cluster.sh gives host `number`.
  std::string host(int number) const;
  // run_cluster_script with this cluster's subnets.
  int run_script(const std::string& arguments) const;
  // The command line that runs `shell_command` with /bin/sh -c on host `number`.
  std::vector<std::string> exec(int number, const std::string& shell_command) const;
};

// The hosts of `id` with an sshd on each (`cluster.sh up`, then `sshd`), for the tests that start
// ranks over ssh; taken down again whatever happens. Fails the test case (REQUIRE) where either
// step fails.
class SshCluster {
 public:
  explicit SshCluster(const ClusterId& id);
  ~SshCluster();
  SshCluster(const SshCluster&) = delete;
  SshCluster& operator=(const SshCluster&) = delete;

 private:
  const ClusterId id_;
};

// Every "rank R: parameters sha256 HEX" line of output (examples/pytorch_digits.py and
// ddp_digits.py print one per rank, whatever a launcher puts before it): R -> HEX.
std::map<int, std::string> parameter_digests(const std::string& output);
// Exactly `size` ranks printed a digest, all the same one.
void expect_same_parameters(const std::string& output, int size);

// Exit 77, Meson's code for a skipped test.
constexpr int kSkipped = 77;
// True, after saying why, when the cluster cannot be made here: no root, no `ip netns` or
// `unshare`, or one of `needs` fails: (shell command, what is missing). A test's main() then
// returns kSkipped.
bool cluster_unavailable(const std::vector<std::pair<std::string, std::string>>& needs = {});
// The need of the tests that start an SshCluster, for cluster_unavailable.
inline const std::pair<std::string, std::string> kNeedsSshd = {
    "test -x /usr/sbin/sshd", "/usr/sbin/sshd (openssh-server) is not installed"};

}  // namespace kolo::test
