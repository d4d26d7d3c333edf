// reduce_scatter_perf: kolo_reduce_scatter timed and checked like nccl-tests'
// reduce_scatter_perf.
//
// A row of S bytes reduces every rank's S-byte sendbuf and leaves S/N bytes of the result on each
// rank; the count column is the per-rank count. A ring moves (N-1)/N of S over each link, so
// busbw = algbw * (N-1)/N. In place, recvbuf is this rank's block of sendbuf.
#include "perf_common.hpp"

namespace {

using kolo::bench::Operation;
using kolo::bench::Shape;

double busbw_factor(int ranks) {
  return static_cast<double>(ranks - 1) / ranks;
}

Shape shape(uint64_t bytes, size_t element_size, int rank, int ranks) {
  const uint64_t per_rank = bytes / element_size / static_cast<uint64_t>(ranks);
  return Shape{per_rank, per_rank * static_cast<uint64_t>(ranks), per_rank, 0,
               per_rank * static_cast<uint64_t>(rank)};
}

kolo_status_t run(const Operation& operation, const void* sendbuf, void* recvbuf) {
  return kolo_reduce_scatter(operation.comm, sendbuf, recvbuf, operation.shape.count,
                             operation.dtype, operation.op);
}

void init_input(const Operation& operation, void* sendbuf) {
  kolo::bench::fill_input(operation, operation.rank, sendbuf, operation.shape.send_count, 0);
}

void expected_output(const Operation& operation, void* expected) {
  const uint64_t count = operation.shape.count;
  kolo::bench::fill_reduced(operation, expected, count, count * operation.rank);
}

}  // namespace

int main(int argc, char** argv) {
  const kolo::bench::Collective reduce_scatter = {
      .name = "reduce_scatter",
      .reduces = true,
      .rooted = false,
      .busbw_factor = busbw_factor,
      .shape = shape,
      .run = run,
      .init_input = init_input,
      .expected_output = expected_output,
  };
  return kolo::bench::run_benchmark(argc, argv, reduce_scatter);
}
