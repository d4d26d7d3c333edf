// broadcast_perf: kolo_broadcast timed and checked like nccl-tests' broadcast_perf.
//
// A row of S bytes copies the root's S bytes to every rank. A chain moves S over each link, so
// busbw = algbw. kolo_broadcast has one buffer: in place it is used as it is; out of place the
// root first copies sendbuf into recvbuf (as NCCL does) and every rank then broadcasts recvbuf.
#include <cstring>

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
  const uint64_t count = operation.shape.count;
  if (operation.rank == operation.root && sendbuf != recvbuf && count > 0) {
    std::memcpy(recvbuf, sendbuf, count * kolo_dtype_size(operation.dtype));
  }
  return kolo_broadcast(operation.comm, recvbuf, count, operation.dtype, operation.root);
}

// Every rank starts with its own data, so a rank that receives nothing shows in #wrong.
void init_input(const Operation& operation, void* sendbuf) {
  kolo::bench::fill_input(operation, operation.rank, sendbuf, operation.shape.count, 0);
}

void expected_output(const Operation& operation, void* expected) {
  kolo::bench::fill_input(operation, operation.root, expected, operation.shape.count, 0);
}

}  // namespace

int main(int argc, char** argv) {
  const kolo::bench::Collective broadcast = {
      .name = "broadcast",
      .reduces = false,
      .rooted = true,
      .busbw_factor = busbw_factor,
      .shape = shape,
      .run = run,
      .init_input = init_input,
      .expected_output = expected_output,
  };
  return kolo::bench::run_benchmark(argc, argv, broadcast);
}
