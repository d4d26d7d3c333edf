#include "transport/transport.hpp"

#include <fmt/format.h>

#include "core/config.hpp"
#include "core/log.hpp"
#include "kolo_build_config.h"
#include "transport/tcp/tcp_transport.hpp"
#ifdef KOLO_HAVE_UCX
#include "transport/ucx/ucx_transport.hpp"
#endif

namespace kolo {

const char* collective_name(Collective collective) {
  switch (collective) {
    case Collective::kAllreduce: return "allreduce";
    case Collective::kBroadcast: return "broadcast";
    case Collective::kBarrier: return "barrier";
    case Collective::kAllgather: return "allgather";
    case Collective::kAllgatherv: return "allgatherv";
    case Collective::kReduceScatter: return "reduce-scatter";
    case Collective::kReduceScatterv: return "reduce-scatterv";
    case Collective::kAlltoall: return "alltoall";
    case Collective::kAlltoallv: return "alltoallv";
    case Collective::kReduce: return "reduce";
    case Collective::kSendRecv: return "send/recv";
    case Collective::kSendRecvReceipt: return "send/recv receipt";
    case Collective::kSplit: return "split";
  }
  return "unknown collective";
}

const char* algorithm_name(Algorithm algorithm) {
  switch (algorithm) {
    case Algorithm::kRing: return "ring";
    case Algorithm::kRecursiveDoubling: return "recursive doubling";
    case Algorithm::kBruck: return "Bruck";
  }
  return "unknown algorithm";
}

std::string describe(const OpDescriptor& op) {
  const Collective kind = op.collective;
  const bool point_to_point =
      kind == Collective::kSendRecv || kind == Collective::kSendRecvReceipt;
  std::string text = fmt::format("{} #{} (", collective_name(kind), op.sequence);
  if (kind == Collective::kAlltoallv) {
    // The call as a whole has no count; each message carries the count of its pair of ranks.
    if (op.detail != 0) text += fmt::format("count {} between these two ranks, ", op.count);
    text += dtype_name(op.dtype);
  } else if (kind != Collective::kBarrier) {
    text += fmt::format("count {}, {}", op.count, dtype_name(op.dtype));
  }
  if (kind == Collective::kAllreduce || kind == Collective::kReduceScatter ||
      kind == Collective::kReduceScatterv || kind == Collective::kReduce) {
    text += fmt::format(", {}", op_name(op.op));
    if (op.prescale != 1.0 || op.postscale != 1.0) {
      text += fmt::format(", prescale {}, postscale {}", op.prescale, op.postscale);
    }
  }
  if (kind == Collective::kAllgatherv || kind == Collective::kReduceScatterv) {
    text += fmt::format(", counts per rank hashed to {:016x}", op.detail);
  }
  if (point_to_point) {
    text += fmt::format(", from rank {}, tag {}", op.root, op.detail);
  } else if (op.root >= 0) {
    text += fmt::format(", root {}", op.root);
  }
  if (op.algorithm != Algorithm::kRing) text += fmt::format(", {}", algorithm_name(op.algorithm));
  return text + ")";
}

std::unique_ptr<Transport> make_transport(const Config& config, StoreClient& store, int rank,
                                          int size, uint64_t context) {
#ifdef KOLO_HAVE_UCX
  if (config.transport == "ucx") return make_ucx_transport(config, store, rank, size, context);
  if (config.transport == "auto") {
    std::string reason;
    bool ucx = ucx_is_faster(config, store, rank, size, context, reason);
    log::info("KOLO_TRANSPORT=auto chose {}: {}", ucx ? "ucx" : "tcp", reason);
    if (ucx) return make_ucx_transport(config, store, rank, size, context);
  }
#else
  if (config.transport == "ucx") {
    throw Error(Status::kUnsupported,
                "KOLO_TRANSPORT=ucx is not available: kolo was built without UCX (install "
                "libucx-dev and rebuild; available: tcp)");
  }
  if (config.transport == "auto") log::info("KOLO_TRANSPORT=auto chose tcp: built without UCX");
#endif
  if (config.transport == "tcp" || config.transport == "auto") {
    return make_tcp_transport(config, store, rank, size, context);
  }
  throw Error(Status::kUnsupported,
              fmt::format("KOLO_TRANSPORT={} is not a transport (tcp, ucx or auto)",
                          config.transport));
}

}  // namespace kolo
