#include "fusion/spec.hpp"

#include <fmt/format.h>

#include <cmath>
#include <unordered_set>

namespace kolo::fusion {

uint64_t UnitSpec::total_count() const {
  uint64_t total = 0;
  for (const Member& member : members) total += member.count;
  return total;
}

std::string describe(const UnitSpec& spec) {
  constexpr size_t kShownMembers = 4;
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

bool fusable(const UnitSpec& a, const UnitSpec& b) {
  return a.kind == Kind::kAllreduce && b.kind == Kind::kAllreduce && a.dtype == b.dtype &&
         a.op == b.op && a.prescale == b.prescale && a.postscale == b.postscale;
}

std::string check_spec(const UnitSpec& spec, int ranks) {
  if (spec.kind != Kind::kAllreduce && spec.kind != Kind::kBroadcast) {
    return fmt::format("unknown operation kind {}", static_cast<int>(spec.kind));
  }
  if (!is_valid(spec.dtype)) return fmt::format("unknown dtype {}", static_cast<int>(spec.dtype));
  if (!is_valid(spec.op)) return fmt::format("unknown reduction op {}", static_cast<int>(spec.op));
  if (!std::isfinite(spec.prescale) || !std::isfinite(spec.postscale)) {
    return fmt::format("scale factors must be finite (prescale {}, postscale {})", spec.prescale,
                       spec.postscale);
  }
  if (spec.kind == Kind::kBroadcast && (spec.root < 0 || spec.root >= ranks)) {
    return fmt::format("root {} is not a rank of this communicator (size {})", spec.root, ranks);
  }
  if (spec.kind == Kind::kAllreduce && spec.root != -1) return "an allreduce has no root";
  if (spec.members.empty() || spec.members.size() > kMaxGroupMembers) {
    return fmt::format("a group has 1 to {} tensors, not {}", kMaxGroupMembers,
                       spec.members.size());
  }
  const uint64_t max_count = (~uint64_t{0} >> 1) / dtype_size(spec.dtype);
  uint64_t total = 0;
  std::unordered_set<std::string> seen;
  for (const Member& member : spec.members) {
    if (member.name.empty()) return "a tensor name is empty";
    if (member.name.size() > kMaxNameBytes) {
      return fmt::format("the tensor name '{}...' is {} bytes long; at most {} are allowed",
                         member.name.substr(0, 32), member.name.size(), kMaxNameBytes);
    }
    if (member.name.find('\0') != std::string::npos) return "a tensor name contains a NUL byte";
    if (!seen.insert(member.name).second) {
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
