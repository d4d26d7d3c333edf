#include "transport/transport.hpp"

#include <fmt/format.h>

#include "core/config.hpp"
#include "transport/tcp/tcp_transport.hpp"

namespace kolo {

const char* collective_name(Collective collective) {
  switch (collective) {
    case Collective::kAllreduce: return "allreduce";
    case Collective::kBroadcast: return "broadcast";
    case Collective::kBarrier: return "barrier";
  }
  return "unknown collective";
}

std::string describe(const OpDescriptor& op) {
  std::string text = fmt::format("{} #{} (", collective_name(op.collective), op.sequence);
  if (op.collective != Collective::kBarrier) {
    text += fmt::format("count {}, {}", op.count, dtype_name(op.dtype));
  }
  if (op.collective == Collective::kAllreduce) {
    text += fmt::format(", {}", op_name(op.op));
    if (op.prescale != 1.0 || op.postscale != 1.0) {
      text += fmt::format(", prescale {}, postscale {}", op.prescale, op.postscale);
    }
  }
  if (op.root >= 0) text += fmt::format(", root {}", op.root);
  return text + ")";
}

std::unique_ptr<Transport> make_transport(const Config& config, StoreClient& store, int rank,
                                          int size, uint64_t context) {
  if (config.transport == "tcp" || config.transport == "auto") {
    return make_tcp_transport(config, store, rank, size, context);
  }
  throw Error(Status::kUnsupported,
              fmt::format("KOLO_TRANSPORT={} is not available in this build (available: tcp)",
                          config.transport));
}

}  // namespace kolo
