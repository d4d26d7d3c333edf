// Named operations as the fusion engine sees them (fusion/spec.hpp): how they are described in
// messages, and the check of a spec's fields.
#include "fusion/spec.hpp"

#include <fmt/format.h>

#include <string_view>
#include <unordered_set>

#include "core/arguments.hpp"
#include "ring/algorithms.hpp"

namespace kolo::fusion {

uint64_t UnitSpec::total_count() const {
  uint64_t total = 0;
  for (const Member& member : members) total += member.count;
  return total;
}

std::string describe(const UnitSpec& spec) {
  constexpr size_t kShownMembers = 4;
  if (spec.kind == Kind::kAllgather) {
    // Counts differ between ranks by design: they are not part of what ranks must agree on.
    return fmt::format("allgather '{}' ({})", spec.key(), dtype_name(spec.dtype));
  }
  std::string text = spec.kind == Kind::kBroadcast ? "broadcast " : "allreduce ";
  if (spec.members.size() > 1) text += "group ";
  for (size_t i = 0; i < spec.members.size() && i < kShownMembers; ++i) {
    if (i > 0) text += ", ";
    text += fmt::format("'{}'", spec.members[i].name);
    if (spec.members.size() > 1) text += fmt::format(" (count {})", spec.members[i].count);
  }
  if (spec.members.size() > kShownMembers) {
    text += fmt::format(" and {} more", spec.members.size() - kShownMembers);
  }
  text += " (";
  if (spec.members.size() == 1) text += fmt::format("count {}, ", spec.members[0].count);
  text += dtype_name(spec.dtype);
  if (spec.kind == Kind::kAllreduce) {
    text += fmt::format(", {}", op_name(spec.op));
    if (spec.prescale != 1.0) text += fmt::format(", prescale {}", spec.prescale);
    if (spec.postscale != 1.0) text += fmt::format(", postscale {}", spec.postscale);
  } else {
    text += fmt::format(", root {}", spec.root);
  }
  return text + ")";
}

UnitSpec agreed_part(const UnitSpec& spec) {
  if (spec.kind != Kind::kAllgather) return spec;
  UnitSpec agreed = spec;
  for (Member& member : agreed.members) member.count = 0;
  agreed.recv_capacity = 0;
  agreed.gather_counts.clear();
  return agreed;
}

std::optional<uint64_t> gathered_total(const std::vector<uint64_t>& counts, DataType dtype) {
  const uint64_t max_count = (~uint64_t{0} >> 1) / dtype_size(dtype);
  uint64_t total = 0;
  for (uint64_t count : counts) {
    if (count > max_count - total) return std::nullopt;
    total += count;
  }
  return total;
}

bool matches_submission(const UnitSpec& submitted, const UnitSpec& scheduled, int rank) {
  if (scheduled.kind != Kind::kAllgather) return submitted == scheduled;
  if (submitted.kind != Kind::kAllgather || !(agreed_part(submitted) == agreed_part(scheduled)) ||
      rank < 0 || static_cast<size_t>(rank) >= scheduled.gather_counts.size() ||
      scheduled.gather_counts[rank] != submitted.members.front().count) {
    return false;
  }
  std::optional<uint64_t> total = gathered_total(scheduled.gather_counts, scheduled.dtype);
  return total && *total <= submitted.recv_capacity;
}

Algorithm engine_algorithm(const UnitSpec& spec, int ranks) {
  return flat_allreduce_algorithm(spec.total_bytes(), ranks);
}

bool fusable(const UnitSpec& a, const UnitSpec& b, int ranks) {
  return a.kind == Kind::kAllreduce && b.kind == Kind::kAllreduce && a.dtype == b.dtype &&
         a.op == b.op && a.prescale == b.prescale && a.postscale == b.postscale &&
         engine_algorithm(a, ranks) == engine_algorithm(b, ranks);
}

std::string group_size_problem(int64_t members) {
  if (members >= 1 && members <= static_cast<int64_t>(kMaxGroupMembers)) return "";
  return fmt::format("a group has 1 to {} tensors, not {}", kMaxGroupMembers, members);
}

std::string check_spec(const UnitSpec& spec, int ranks) {
  if (spec.kind != Kind::kAllreduce && spec.kind != Kind::kBroadcast &&
      spec.kind != Kind::kAllgather) {
    return fmt::format("unknown operation kind {}", static_cast<int>(spec.kind));
  }
  for (const std::string& problem :
       {arguments::dtype_problem(spec.dtype), arguments::op_problem(spec.op),
        arguments::scale_problem(spec.prescale, spec.postscale),
        spec.kind == Kind::kBroadcast ? arguments::root_problem(spec.root, ranks) : ""}) {
    if (!problem.empty()) return problem;
  }
  if (spec.kind == Kind::kAllreduce && spec.root != -1) return "an allreduce has no root";
  const uint64_t max_count = arguments::max_count(spec.dtype);
  if (spec.kind == Kind::kAllgather) {
    if (spec.root != -1 || spec.op != ReduceOp::kSum || spec.prescale != 1.0 ||
        spec.postscale != 1.0) {
      return "an allgather has no root, reduction op or scale factors";
    }
    if (spec.members.size() != 1) {
      return fmt::format("an allgather has one tensor, not {}", spec.members.size());
    }
    if (spec.recv_capacity > max_count) {
      return fmt::format("the recv_capacity of '{}' ({}) is too large", spec.key(),
                         spec.recv_capacity);
    }
    if (!spec.gather_counts.empty()) {
      if (spec.gather_counts.size() != static_cast<size_t>(ranks)) {
        return fmt::format("an allgather has {} gathered counts for {} ranks",
                           spec.gather_counts.size(), ranks);
      }
      if (spec.members.front().count != 0 || spec.recv_capacity != 0) {
        return "a scheduled allgather carries a rank's own count or capacity";
      }
      if (!gathered_total(spec.gather_counts, spec.dtype)) {
        return fmt::format("the gathered counts of '{}' add up to too many elements", spec.key());
      }
    }
  } else if (spec.recv_capacity != 0 || !spec.gather_counts.empty()) {
    return "only an allgather has a receive capacity and gathered counts";
  }
  if (std::string problem = group_size_problem(static_cast<int64_t>(spec.members.size()));
      !problem.empty()) {
    return problem;
  }
  uint64_t total = 0;
  std::unordered_set<std::string_view> seen;  // names repeat only in a group
  for (const Member& member : spec.members) {
    if (member.name.empty()) return "a tensor name is empty";
    if (member.name.size() > kMaxNameBytes) {
      return fmt::format("the tensor name '{}...' is {} bytes long; at most {} are allowed",
                         member.name.substr(0, 32), member.name.size(), kMaxNameBytes);
    }
    if (member.name.find('\0') != std::string::npos) return "a tensor name contains a NUL byte";
    if (spec.members.size() > 1 && !seen.insert(member.name).second) {
      return fmt::format("the tensor name '{}' appears twice in one group", member.name);
    }
    if (member.count > max_count || total + member.count > max_count) {
      return fmt::format("the count of '{}' ({}) is too large", member.name, member.count);
    }
    total += member.count;
  }
  return "";
}

}  // namespace kolo::fusion
