// sendrecv_perf: kolo_send and kolo_recv timed and checked like nccl-tests' sendrecv_perf.
//
// A row of S bytes: every rank sends S bytes to the next rank and receives S bytes from the
// previous one, a shift around the ring. Each link carries S, so busbw = algbw.
//
// kolo_send is synchronous (it returns once the receiver has taken the data), so the shift is
// ordered to make progress: even ranks send first and then receive, odd ranks receive first. The
// chain that this makes always ends at an even rank whose receive is posted after its send
// completes, so it cannot deadlock, whether N is even or odd. In place (one buffer), an odd rank
// would overwrite its input before sending it, so it sends from a copy taken first; that copy is
// inside the timed call. One rank alone sends to itself, which kolo_send refuses: it copies.
#include <cstring>
#include <vector>

#include "perf_common.hpp"

namespace {

using kolo::bench::Operation;
using kolo::bench::Shape;

constexpr int kTag = 0;

double busbw_factor(int /*ranks*/) {
  return 1.0;
}

Shape shape(uint64_t bytes, size_t element_size, int /*rank*/, int /*ranks*/) {
  return kolo::bench::same_count_shape(bytes, element_size);
}

int next_rank(const Operation& operation) {
  return (operation.rank + 1) % operation.ranks;
}

int previous_rank(const Operation& operation) {
  return (operation.rank + operation.ranks - 1) % operation.ranks;
}

kolo_status_t run(const Operation& operation, const void* sendbuf, void* recvbuf) {
  const uint64_t count = operation.shape.count;
  const size_t bytes = count * kolo_dtype_size(operation.dtype);
  if (operation.ranks == 1) {
    if (sendbuf != recvbuf && bytes > 0) std::memcpy(recvbuf, sendbuf, bytes);
    return KOLO_SUCCESS;
  }
  const kolo_dtype_t dtype = operation.dtype;
  if (operation.rank % 2 == 0) {
    if (kolo_status_t status =
            kolo_send(operation.comm, sendbuf, count, dtype, next_rank(operation), kTag)) {
      return status;
    }
    return kolo_recv(operation.comm, recvbuf, count, dtype, previous_rank(operation), kTag);
  }
  const void* source = sendbuf;
  static thread_local std::vector<std::byte> copy;
  if (sendbuf == recvbuf) {
    copy.resize(bytes);
    if (bytes > 0) std::memcpy(copy.data(), sendbuf, bytes);
    source = copy.data();
  }
  if (kolo_status_t status =
          kolo_recv(operation.comm, recvbuf, count, dtype, previous_rank(operation), kTag)) {
    return status;
  }
  return kolo_send(operation.comm, source, count, dtype, next_rank(operation), kTag);
}

void init_input(const Operation& operation, void* sendbuf) {
  kolo::bench::fill_input(operation, operation.rank, sendbuf, operation.shape.count, 0);
}

// What the previous rank sent.
void expected_output(const Operation& operation, void* expected) {
  kolo::bench::fill_input(operation, previous_rank(operation), expected, operation.shape.count, 0);
}

}  // namespace

int main(int argc, char** argv) {
  const kolo::bench::Collective sendrecv = {
      .name = "sendrecv",
      .reduces = false,
      .rooted = false,
      .busbw_factor = busbw_factor,
      .shape = shape,
      .run = run,
      .init_input = init_input,
      .expected_output = expected_output,
  };
  return kolo::bench::run_benchmark(argc, argv, sendrecv);
}
