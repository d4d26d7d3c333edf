// The PMIx rendezvous in a build without PMIx (meson -Dpmix=disabled, or no libpmix-dev).
#include <fmt/format.h>

#include "bootstrap/pmix.hpp"
#include "kolo/status.hpp"

namespace kolo::pmix {

bool built_with_pmix() {
  return false;
}

namespace {

[[noreturn]] void refuse(const Config& config) {
  throw Error(Status::kUnsupported,
              fmt::format("kolo: rank {} of {}: the launcher ({}) runs a PMIx server "
                          "(PMIX_NAMESPACE is set) and no address was given, but this kolo was "
                          "built without PMIx (libpmix-dev, meson -Dpmix=enabled): set "
                          "KOLO_ADDR=host:port (rank 0's host and a free port) in the job",
                          config.rank, config.size, config.launcher));
}

}  // namespace

std::vector<std::string> exchange(const Config& config, const std::string&) {
  refuse(config);
}

std::string route_target(const Config& config) {
  refuse(config);
}

}  // namespace kolo::pmix
