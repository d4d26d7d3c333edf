// all_gather_perf: kolo_allgather timed and checked like nccl-tests' all_gather_perf.
//
// A row of S bytes gathers S/N bytes from every rank into every rank's S-byte recvbuf; the count
// column is the per-rank count, as in nccl-tests. A ring moves (N-1)/N of S over each link, so
// busbw = algbw * (N-1)/N. In place, sendbuf is this rank's block of recvbuf.
#include "perf_common.hpp"

namespace {

using kolo::bench::Operation;
using kolo::bench::Shape;

double busbw_factor(int ranks) {
  return static_cast<double>(ranks - 1) / ranks;
}

Shape shape(uint64_t bytes, size_t element_size, int rank, int ranks) {
  const uint64_t per_rank = bytes / element_size / static_cast<uint64_t>(ranks);
  return Shape{per_rank, per_rank, per_rank * static_cast<uint64_t>(ranks),
               per_rank * static_cast<uint64_t>(rank), 0};
}

kolo_status_t run(const Operation& operation, const void* sendbuf, void* recvbuf) {
  return kolo_allgather(operation.comm, sendbuf, recvbuf, operation.shape.count, operation.dtype);
}

void init_input(const Operation& operation, void* sendbuf) {
  const uint64_t count = operation.shape.count;
  kolo::bench::fill_input(operation, operation.rank, sendbuf, count, count * operation.rank);
}

void expected_output(const Operation& operation, void* expected) {
  const uint64_t count = operation.shape.count;
  auto* out = static_cast<std::byte*>(expected);
  for (int rank = 0; rank < operation.ranks; ++rank) {
    kolo::bench::fill_input(operation, rank, out + count * rank * kolo_dtype_size(operation.dtype),
                            count, count * rank);
  }
}

}  // namespace

int main(int argc, char** argv) {
  const kolo::bench::Collective allgather = {
      .name = "all_gather",
      .reduces = false,
      .rooted = false,
      .busbw_factor = busbw_factor,
      .shape = shape,
      .run = run,
      .init_input = init_input,
      .expected_output = expected_output,
  };
  return kolo::bench::run_benchmark(argc, argv, allgather);
}
