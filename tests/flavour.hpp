// The transport flavour a multi-process test runs in, and the check that it really ran on it.
//
// tests/meson.build runs test_more_collectives and test_fusion again with KOLO_TRANSPORT=ucx and
// the variables of each UCX flavour in the test's environment, which every rank inherits. Were
// those variables ignored, the tests would still pass over TCP; so under a flavour the ranks log
// at INFO (with_flavour_logging), and every passing rank's log must name the transport and, when
// the rank has peers, the path of that flavour (check_flavour, which expect_all_pass_on_transport
// runs on every rank), as tests/test_ucx.cpp checks its own runs.
#pragma once

#include <catch2/catch.hpp>
#include <cstdlib>
#include <map>
#include <optional>
#include <regex>
#include <string>
#include <vector>

#include "job.hpp"

namespace kolo::test {

struct TransportFlavour {
  std::string transport;  // as "communicator ready: ... transport <name>" says
  std::string path;       // a regular expression: the log line that shows the flavour's path
};

// The flavour of this test process's environment: UCX's, or TCP beside kolo's rings
// (KOLO_TRANSPORT=tcp KOLO_SHM=1); none for plain TCP.
inline std::optional<TransportFlavour> flavour_of_environment() {
  auto is = [](const char* name, const char* value) {
    const char* set = std::getenv(name);
    return set != nullptr && std::string(set) == value;
  };
  if (is("KOLO_TRANSPORT", "tcp") && is("KOLO_SHM", "1")) {
    return TransportFlavour{"tcp",
                            "tcp: rank [0-9]+ reaches rank [0-9]+ through kolo's "
                            "shared-memory ring"};
  }
  if (!is("KOLO_TRANSPORT", "ucx")) return std::nullopt;
  if (is("KOLO_SHM", "0")) {
    return TransportFlavour{"ucx", is("UCX_TLS", "tcp") ? "reaches its peers through .*tcp/lo"
                                                        : "reaches its peers through .*/memory"};
  }
  if (is("KOLO_SHM_COPY", "stream")) {
    return TransportFlavour{"ucx", "through kolo's shared-memory ring .*streamed copies"};
  }
  return TransportFlavour{"ucx", "reaches rank [0-9]+ through kolo's shared-memory ring"};
}

// The ranks' environment, with KOLO_DEBUG=INFO under a flavour (unless the test sets a level).
inline std::map<std::string, std::string> with_flavour_logging(
    std::map<std::string, std::string> env) {
  if (flavour_of_environment() && !env.count("KOLO_DEBUG")) env["KOLO_DEBUG"] = "INFO";
  return env;
}

// Under a flavour, the log of a rank of a job of `ranks` names its transport and path.
inline void check_flavour(const std::string& output, size_t ranks) {
  const std::optional<TransportFlavour> flavour = flavour_of_environment();
  if (!flavour) return;
  CHECK(output.find("transport " + flavour->transport) != std::string::npos);
  if (ranks > 1) CHECK(std::regex_search(output, std::regex(flavour->path)));
}

// Every rank passed (expect_all_pass) and, under a flavour, ran on its transport and path.
inline void expect_all_pass_on_transport(const std::vector<ProcessResult>& results,
                                         const std::string& marker) {
  expect_all_pass(results, marker,
                  [&](const std::string& output) { check_flavour(output, results.size()); });
}

}  // namespace kolo::test
