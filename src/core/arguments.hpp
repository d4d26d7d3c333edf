// Argument checks, written once for every entry point: the communicator's ordered calls
// (src/comm/), the fusion engine's named ones (src/fusion/) and the C ABI (capi/).
//
// Contract: a check looks at this rank's arguments only and sends nothing; a bad argument is
// kolo::Error(kInvalidArgument) with a message "<call>: <problem>", and the caller's state is left
// as it was. The *_problem functions return the problem alone ("" when there is none), for
// callers that word the message themselves (the fusion engine adds the rank).
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "kolo/dtype.hpp"
#include "kolo/status.hpp"

namespace kolo::arguments {

// Bytes a buffer may span: what a signed 64-bit offset can address.
inline constexpr uint64_t kMaxBufferBytes = ~uint64_t{0} >> 1;

// The most elements of dtype (a valid one) that a buffer may hold.
inline uint64_t max_count(DataType dtype) {
  return kMaxBufferBytes / dtype_size(dtype);
}

std::string dtype_problem(DataType dtype);                     // "unknown dtype 9"
std::string op_problem(ReduceOp op);                           // "unknown reduction op 9"
std::string scale_problem(double prescale, double postscale);  // not finite
std::string root_problem(int root, int ranks);                 // not a rank

// kolo::Error(kInvalidArgument, "<call>: <problem>").
Error invalid(const char* call, const std::string& problem);

void check_dtype(DataType dtype, const char* call);
void check_op(ReduceOp op, const char* call);
void check_scale_factors(double prescale, double postscale, const char* call);
void check_root(int root, int ranks, const char* call);

// A buffer of count elements: present unless empty, and not larger than a buffer can be. `name`
// is the whole prefix of the message ("allreduce: sendbuf").
void check_buffer(const void* buffer, uint64_t count, DataType dtype, const char* name, int rank);

// Whether two byte ranges share a byte; whether two buffers of the same length overlap without
// being the same buffer (in place is allowed where the call says so).
bool overlap(const void* a, uint64_t a_bytes, const void* b, uint64_t b_bytes);
bool partially_overlap(const void* a, const void* b, uint64_t bytes);

// `part` is either exactly the block at byte `offset` of `whole` (in place) or apart from all of
// `whole`; `in_place_rule` says which in place the call allows.
void check_in_place(const void* part, uint64_t part_bytes, const void* whole, uint64_t whole_bytes,
                    uint64_t offset, const char* call, const char* in_place_rule);

// Arrays of one entry per rank: present, and of `ranks` entries (a C caller's NULL array arrives
// as a span with a null data()).
void check_per_rank(const void* data, size_t entries, int ranks, const char* call,
                    const char* name);
// The sum of counts, refusing sums whose bytes do not fit in a buffer.
uint64_t checked_total(std::span<const uint64_t> counts, size_t element, const char* call,
                       const char* name);
// Per-peer counts and displacements (alltoallv) as offsets, refusing negative or overflowing
// displacements and counts that do not fit.
void checked_offsets(std::span<const uint64_t> counts, std::span<const int64_t> displacements,
                     size_t element, const char* call, const char* counts_name,
                     const char* displacements_name, std::vector<uint64_t>& offsets);

}  // namespace kolo::arguments
