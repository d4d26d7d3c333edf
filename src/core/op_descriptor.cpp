// The names and the one-line description of an OpDescriptor (core/op_descriptor.hpp), used in
// every error message about a collective call.
#include "core/op_descriptor.hpp"

#include <fmt/format.h>

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
    case Collective::kNegotiation: return "fusion negotiation";
    case Collective::kGrow: return "grow";
  }
  return "unknown collective";
}

const char* algorithm_name(Algorithm algorithm) {
  switch (algorithm) {
    case Algorithm::kRing: return "ring";
    case Algorithm::kRecursiveDoubling: return "recursive doubling";
    case Algorithm::kBruck: return "Bruck";
    case Algorithm::kHierarchical: return "hierarchical";
    case Algorithm::kHierarchicalShards:
      return "hierarchical by shards";
    case Algorithm::kOneShot:
      return "recursive doubling in one shot";
  }
  return "unknown algorithm";
}

std::string describe(const OpDescriptor& op) {
  const Collective kind = op.collective;
  const bool point_to_point =
      kind == Collective::kSendRecv || kind == Collective::kSendRecvReceipt;
  if (kind == Collective::kNegotiation) {
    return fmt::format("{} cycle {} (message kind {})", collective_name(kind), op.sequence,
                       op.detail);
  }
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

}  // namespace kolo
