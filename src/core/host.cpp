#include "core/host.hpp"

#include <fmt/format.h>
#include <unistd.h>

#include <climits>
#include <fstream>

#include "core/config.hpp"

namespace kolo {

std::string host_identity(const Config& config) {
  if (!config.host_id.empty()) return config.host_id;
  char name[HOST_NAME_MAX + 1] = {};
  ::gethostname(name, sizeof(name) - 1);
  std::string boot;
  std::ifstream("/proc/sys/kernel/random/boot_id") >> boot;
  return fmt::format("{}/{}", name, boot);
}

}  // namespace kolo
