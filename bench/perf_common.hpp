// The harness shared by kolo's benchmarks (all_reduce_perf, all_gather_perf, reduce_scatter_perf,
// alltoall_perf, broadcast_perf, reduce_perf, nccl_allreduce_perf). They take nccl-tests' flags and
// print nccl-tests' table, so that their figures can be read next to NCCL's, MPI's and Gloo's.
//
// A benchmark describes its collective in one Collective value and passes it to run_benchmark(),
// which does everything else: it parses the flags, joins the job (kolo_comm_init with the
// environment that `kolorun -np N` or mpirun provides), allocates the largest buffers once (first
// touch of fresh memory is far slower than a copy, so no size allocates its own), and then, for
// every dtype, op and size: warms up, times -n calls out of place and -n calls in place, checks one
// call of each against a reference computed independently on every rank, and prints a row on
// rank 0.
//
// The inputs are deterministic functions of (rank, element index) chosen so that every reduction
// is exact in every dtype: small integers for floating types (sums stay exact in bfloat16 up to 64
// ranks, products are powers of two), all 64 bits of a hash for integer SUM, PROD, MIN and MAX
// (integer arithmetic wraps, and the reference wraps the same way). A correct result is therefore
// bitwise equal to the reference, and #wrong counts every element that is not.
//
// perf_internal.hpp lists the files that implement it: the runner, the flags, the reference and
// the table.
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>

#include "kolo.h"

namespace kolo::bench {

// The buffers of one operation, in elements of the operation's dtype.
struct Shape {
  uint64_t count = 0;       // the count argument passed to the collective
  uint64_t send_count = 0;  // elements the operation reads from sendbuf
  uint64_t recv_count = 0;  // elements the operation writes to recvbuf
  // In place, sendbuf and recvbuf point into one buffer at these offsets (for an allgather in
  // place, for example, sendbuf is recvbuf + rank * count).
  uint64_t in_place_send_offset = 0;
  uint64_t in_place_recv_offset = 0;
};

// Everything one measured operation depends on.
struct Operation {
  kolo_comm_t comm = nullptr;
  int rank = 0;
  int ranks = 1;
  kolo_dtype_t dtype = KOLO_FLOAT32;
  kolo_op_t op = KOLO_SUM;  // KOLO_SUM for collectives that do not reduce
  int root = -1;            // -1 for collectives without a root
  Shape shape;
  // With -g: the cudaStream_t to enqueue on (the buffers are in GPU memory, and the harness waits
  // for the stream with kolo_stream_synchronize after each batch). nullptr: host buffers.
  void* stream = nullptr;
};

// What a benchmark tells the harness about its collective.
struct Collective {
  const char* name;  // "allreduce": shown in --help
  bool reduces;      // -o applies; otherwise only KOLO_SUM is run and the redop column says "none"
  bool rooted;       // -r applies; otherwise the root column says -1
  // busbw = algbw * busbw_factor(ranks): the bandwidth a ring would need on its busiest link.
  double (*busbw_factor)(int ranks);
  // The buffers for a row of `bytes` bytes (the -b ... -e sizes) with elements of element_size.
  Shape (*shape)(uint64_t bytes, size_t element_size, int rank, int ranks);
  // Runs one operation. In place, sendbuf and recvbuf point into one buffer at the shape's offsets.
  kolo_status_t (*run)(const Operation& operation, const void* sendbuf, void* recvbuf);
  // Writes this rank's input: shape.send_count elements.
  void (*init_input)(const Operation& operation, void* sendbuf);
  // Writes what recvbuf must hold afterwards on this rank: shape.recv_count elements.
  void (*expected_output)(const Operation& operation, void* expected);
  // Only the root's recvbuf holds a result (reduce): elsewhere recv_count is 0, nothing is checked.
  bool output_on_root_only = false;
  // Runs with -g (buffers in GPU memory): run() enqueues on operation.stream.
  bool gpu = false;
};

// Parses the flags, runs every row and prints the table on rank 0. Returns the process exit code:
// 0, or 1 when some element was wrong (a library error exits at once, after printing
// "kolo error: <status>: <message>" on stderr).
int run_benchmark(int argc, char** argv, const Collective& collective);

// ---- Building blocks for Collective's functions -------------------------------------------------

// count = bytes / element_size elements sent and received, in place at offset 0 (allreduce,
// broadcast).
Shape same_count_shape(uint64_t bytes, size_t element_size);

// Writes source_rank's input elements [first_index, first_index + count) to buffer. The element
// at global index i is the same whichever first_index it is written from, so an allgather's
// expected output is fill_input for every rank in turn.
void fill_input(const Operation& operation, int source_rank, void* buffer, uint64_t count,
                uint64_t first_index);

// Writes the reduction with operation.op over all ranks' inputs of elements
// [first_index, first_index + count), computed here element by element the way kolo specifies it:
// float16 and bfloat16 accumulate in float32 and round once, integers wrap, AVG divides the
// finished sum (truncating for integers).
void fill_reduced(const Operation& operation, void* buffer, uint64_t count, uint64_t first_index);

// Prints "kolo error: <status string>: <kolo_comm_last_error(comm)>" on stderr and exits with 1
// unless status is KOLO_SUCCESS.
void check(kolo_comm_t comm, kolo_status_t status);

// "8", "64K", "32M", "1G" (powers of 1024, as nccl-tests), optionally followed by "B" or "iB";
// nothing else, so "1X" or "64Kb!" are refused rather than read as a prefix.
std::optional<uint64_t> parse_size(const std::string& text);

// A flag validator: "" where text is a size, else what was expected and what came.
std::string size_error(const std::string& text);

}  // namespace kolo::bench
