/*
 * tcp_reduce_floor: the least CPU time the reduction of a large ring allreduce can take on this
 * machine, the number bench/tcp_ceiling.sh's CPU per byte is set beside (docs/performance.md,
 * "What sets kolo's rate against the loopback's").
 *
 *   tcp_reduce_floor [BYTES [PASSES]]
 *
 * A ring allreduce combines, at every rank, (N-1)/N of its input with partials that arrive from
 * its neighbour, while it sends 2(N-1)/N of the buffer: half a byte of input per byte sent, at
 * any N. For an input larger than the caches (BYTES, default 64 MiB; a buffer of four times that
 * is cycled through so that each pass finds its part out of the caches) the input comes from
 * memory. Timed in this thread's CPU time, float32 sums:
 *   read     the input alone, summed (no arithmetic of note: the memory's streaming rate);
 *   combine  as kolo combines: a 1 MiB partial that stays in the cache, plus the input, into the
 *            partial.
 * Prints seconds per 10^9 bytes of input for each, and what that is per 10^9 bytes a rank sends.
 */
#define _POSIX_C_SOURCE 200809L
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

static double cpu_now(void) {
  struct timespec t;
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &t);
  return (double)t.tv_sec + (double)t.tv_nsec * 1e-9;
}

int main(int argc, char** argv) {
  const size_t bytes = argc > 1 ? strtoull(argv[1], NULL, 0) : (size_t)64 << 20;
  const int passes = argc > 2 ? atoi(argv[2]) : 8;
  const size_t slot_bytes = (size_t)1 << 20;
  if (argc > 3 || bytes < slot_bytes || bytes % slot_bytes != 0 || passes < 1 || passes > 1000) {
    fprintf(stderr, "usage: %s [BYTES (a multiple of 1 MiB) [PASSES (1..1000)]]\n", argv[0]);
    return 2;
  }
  const size_t count = bytes / sizeof(float), slot_count = slot_bytes / sizeof(float);
  float* input = aligned_alloc(4096, 4 * bytes);
  float* slot = aligned_alloc(4096, slot_bytes);
  if (!input || !slot) {
    fprintf(stderr, "tcp_reduce_floor: cannot allocate %zu bytes\n", 4 * bytes);
    return 1;
  }
  for (size_t i = 0; i < 4 * count; ++i) input[i] = (float)(i & 7);
  memset(slot, 0, slot_bytes);

  double read_seconds = 0, combine_seconds = 0;
  volatile float keep = 0;
  for (int pass = 0; pass < passes; ++pass) {
    const float* own = input + (size_t)(2 * pass % 4) * count;
    float sums[16] = {0};  // independent lanes, so that the adds need not wait on each other
    double start = cpu_now();
    for (size_t i = 0; i < count; i += 16) {
      for (size_t lane = 0; lane < 16; ++lane) sums[lane] += own[i + lane];
    }
    read_seconds += cpu_now() - start;
    for (size_t lane = 0; lane < 16; ++lane) keep = keep + sums[lane];

    own = input + (size_t)((2 * pass + 1) % 4) * count;
    start = cpu_now();
    for (size_t begin = 0; begin < count; begin += slot_count) {
      for (size_t i = 0; i < slot_count; ++i) slot[i] += own[begin + i];
    }
    combine_seconds += cpu_now() - start;
  }
  keep = keep + slot[0];

  const double gigabytes = (double)passes * (double)bytes * 1e-9;
  printf("read:    %.3f s per GB of input (%.1f GB/s), %.3f s per GB sent\n",
         read_seconds / gigabytes, gigabytes / read_seconds, 0.5 * read_seconds / gigabytes);
  printf("combine: %.3f s per GB of input, %.3f s per GB sent\n", combine_seconds / gigabytes,
         0.5 * combine_seconds / gigabytes);
  free(input);
  free(slot);
  return 0;
}
