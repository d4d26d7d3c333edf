// What the tests on the simulated cluster (scripts/cluster.sh) share: where the scripts are,
// running cluster.sh with a test's own subnet, the ranks' parameter digests, and a main() that
// skips where the cluster cannot be made.
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

}  // namespace kolo::test
