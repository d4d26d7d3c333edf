// all_reduce_perf: kolo_allreduce timed and checked like nccl-tests' all_reduce_perf (the same
// name, so that its command lines run unchanged).
//
// Every rank sends and receives count elements; a ring moves 2(N-1)/N of the buffer over each
// link, so busbw = algbw * 2(N-1)/N, which is what a link must carry for the measured time.
#include "perf_common.hpp"

namespace {

using kolo::bench::Operation;
using kolo::bench::Shape;

double busbw_factor(int ranks) {
  return 2.0 * (ranks - 1) / ranks;
}

Shape shape(uint64_t bytes, size_t element_size, int /*rank*/, int /*ranks*/) {
  return kolo::bench::same_count_shape(bytes, element_size);
}

kolo_status_t run(const Operation& operation, const void* sendbuf, void* recvbuf) {
  if (operation.stream) {  // -g: device buffers, enqueued as NCCL's calls are
    return kolo_allreduce_on_stream(operation.comm, sendbuf, recvbuf, operation.shape.count,
                                    operation.dtype, operation.op, operation.stream);
  }
  return kolo_allreduce(operation.comm, sendbuf, recvbuf, operation.shape.count, operation.dtype,
                        operation.op);
}

void init_input(const Operation& operation, void* sendbuf) {
  kolo::bench::fill_input(operation, operation.rank, sendbuf, operation.shape.count, 0);
}

void expected_output(const Operation& operation, void* expected) {
  kolo::bench::fill_reduced(operation, expected, operation.shape.count, 0);
}

}  // namespace

int main(int argc, char** argv) {
  const kolo::bench::Collective allreduce = {
      .name = "all_reduce",
      .reduces = true,
      .rooted = false,
      .busbw_factor = busbw_factor,
      .shape = shape,
      .run = run,
      .init_input = init_input,
      .expected_output = expected_output,
      .gpu = true,
  };
  return kolo::bench::run_benchmark(argc, argv, allreduce);
}
