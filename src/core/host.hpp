// What "the same host" means to kolo: two ranks share a host when their host identities are equal.
//
// The identity is KOLO_HOST_ID where it is set (ranks with the same value count as one host, the
// way to say it in containers, whose host names and boot ids may hide or invent a machine), else
// the host name and the kernel's boot id, so that two containers with one name on different
// machines, or a machine rebooted under a rank that cached its name, are never taken for one.
// Everything that groups ranks by host uses it: local rank and size, the node count, the host map
// of the hierarchical allreduce and which peers kolo's shared-memory rings connect.
#pragma once

#include <string>

namespace kolo {

struct Config;

// KOLO_HOST_ID, else "hostname/boot id" (the boot id left out where /proc does not give it).
std::string host_identity(const Config& config);

}  // namespace kolo
