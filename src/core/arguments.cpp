// The argument checks every entry point shares (core/arguments.hpp).
#include "core/arguments.hpp"

#include <fmt/format.h>

#include <cmath>
#include <cstddef>

namespace kolo::arguments {

std::string dtype_problem(DataType dtype) {
  return is_valid(dtype) ? "" : fmt::format("unknown dtype {}", static_cast<int>(dtype));
}

std::string op_problem(ReduceOp op) {
  return is_valid(op) ? "" : fmt::format("unknown reduction op {}", static_cast<int>(op));
}

std::string scale_problem(double prescale, double postscale) {
  if (std::isfinite(prescale) && std::isfinite(postscale)) return "";
  return fmt::format("scale factors must be finite (prescale {}, postscale {})", prescale,
                     postscale);
}

std::string root_problem(int root, int ranks) {
  if (root >= 0 && root < ranks) return "";
  return fmt::format("root {} is not a rank of this communicator (size {})", root, ranks);
}

Error invalid(const char* call, const std::string& problem) {
  return Error(Status::kInvalidArgument, fmt::format("{}: {}", call, problem));
}

namespace {

void require(const std::string& problem, const char* call) {
  if (!problem.empty()) throw invalid(call, problem);
}

}  // namespace

void check_dtype(DataType dtype, const char* call) {
  require(dtype_problem(dtype), call);
}
void check_op(ReduceOp op, const char* call) {
  require(op_problem(op), call);
}
void check_scale_factors(double prescale, double postscale, const char* call) {
  require(scale_problem(prescale, postscale), call);
}
void check_root(int root, int ranks, const char* call) {
  require(root_problem(root, ranks), call);
}

void check_buffer(const void* buffer, uint64_t count, DataType dtype, const char* name, int rank) {
  if (buffer == nullptr && count > 0) {
    throw Error(Status::kInvalidArgument,
                fmt::format("{} is NULL but count is {} (rank {})", name, count, rank));
  }
  if (count > max_count(dtype)) {
    throw Error(Status::kInvalidArgument, fmt::format("count {} of {} is too large (rank {})",
                                                      count, dtype_name(dtype), rank));
  }
}

bool overlap(const void* a, uint64_t a_bytes, const void* b, uint64_t b_bytes) {
  const auto a_begin = reinterpret_cast<uintptr_t>(a);
  const auto b_begin = reinterpret_cast<uintptr_t>(b);
  return a_bytes > 0 && b_bytes > 0 && a_begin < b_begin + b_bytes && b_begin < a_begin + a_bytes;
}

bool partially_overlap(const void* a, const void* b, uint64_t bytes) {
  return a != b && overlap(a, bytes, b, bytes);
}

void check_in_place(const void* part, uint64_t part_bytes, const void* whole, uint64_t whole_bytes,
                    uint64_t offset, const char* call, const char* in_place_rule) {
  if (part == static_cast<const std::byte*>(whole) + offset) return;
  if (overlap(part, part_bytes, whole, whole_bytes)) {
    throw invalid(call, fmt::format("sendbuf and recvbuf overlap without being in place ({})",
                                    in_place_rule));
  }
}

void check_per_rank(const void* data, size_t entries, int ranks, const char* call,
                    const char* name) {
  if (data == nullptr) throw invalid(call, fmt::format("{} is NULL", name));
  if (entries != static_cast<size_t>(ranks)) {
    throw invalid(call, fmt::format("{} has {} entries for {} ranks", name, entries, ranks));
  }
}

uint64_t checked_total(std::span<const uint64_t> counts, size_t element, const char* call,
                       const char* name) {
  const uint64_t limit = kMaxBufferBytes / element;
  uint64_t total = 0;
  for (size_t r = 0; r < counts.size(); ++r) {
    if (counts[r] > limit - total) {
      throw invalid(call, fmt::format("{} add up to more elements than a buffer can hold (at "
                                      "rank {}: {})",
                                      name, r, counts[r]));
    }
    total += counts[r];
  }
  return total;
}

void checked_offsets(std::span<const uint64_t> counts, std::span<const int64_t> displacements,
                     size_t element, const char* call, const char* counts_name,
                     const char* displacements_name, std::vector<uint64_t>& offsets) {
  const uint64_t limit = kMaxBufferBytes / element;
  offsets.resize(counts.size());
  for (size_t p = 0; p < counts.size(); ++p) {
    if (displacements[p] < 0) {
      throw invalid(
          call, fmt::format("{}[{}] is negative ({})", displacements_name, p, displacements[p]));
    }
    const auto displacement = static_cast<uint64_t>(displacements[p]);
    if (counts[p] > limit || displacement > limit - counts[p]) {
      throw invalid(call,
                    fmt::format("{}[{}] + {}[{}] = {} + {} elements overflows a buffer",
                                displacements_name, p, counts_name, p, displacement, counts[p]));
    }
    offsets[p] = displacement;
  }
}

}  // namespace kolo::arguments
