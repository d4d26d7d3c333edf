// reduce_perf: kolo_reduce timed and checked like nccl-tests' reduce_perf.
//
// A row of S bytes reduces every rank's S bytes into the root's recvbuf. A chain moves S over each
// link, so busbw = algbw. Only the root's recvbuf is checked (elsewhere it is not written). In
// place, sendbuf == recvbuf.
#include "perf_common.hpp"

namespace {

using kolo::bench::Operation;
using kolo::bench::Shape;

double busbw_factor(int /*ranks*/) {
  return 1.0;
}

Shape shape(uint64_t bytes, size_t element_size, int /*rank*/, int /*ranks*/) {
  return kolo::bench::same_count_shape(bytes, element_size);
}

kolo_status_t run(const Operation& operation, const void* sendbuf, void* recvbuf) {
  return kolo_reduce(operation.comm, sendbuf, recvbuf, operation.shape.count, operation.dtype,
                     operation.op, operation.root);
}

void init_input(const Operation& operation, void* sendbuf) {
  kolo::bench::fill_input(operation, operation.rank, sendbuf, operation.shape.count, 0);
}

void expected_output(const Operation& operation, void* expected) {
  kolo::bench::fill_reduced(operation, expected, operation.shape.recv_count, 0);
}

}  // namespace

int main(int argc, char** argv) {
  const kolo::bench::Collective reduce = {
      .name = "reduce",
      .reduces = true,
      .rooted = true,
      .busbw_factor = busbw_factor,
      .shape = shape,
      .run = run,
      .init_input = init_input,
      .expected_output = expected_output,
      .output_on_root_only = true,
  };
  return kolo::bench::run_benchmark(argc, argv, reduce);
}
