/*
 * small_latency: the time of one small allreduce, to a tenth of a nanosecond, through kolo
 * (small_latency) or MPI (mpi_small_latency, the same source built with KOLO_BENCH_MPI), so that
 * two libraries within a few percent of each other can be told apart: all_reduce_perf and
 * mpi_allreduce_perf print nccl-tests' table, whose time column has 10 ns steps.
 *
 *   kolorun -np 2 small_latency [BYTES [CALLS [WARMUP]]]        (default 8 200000 20000)
 *   mpirun -np 2 mpi_small_latency [BYTES [CALLS [WARMUP]]]
 *
 * float32 sums: WARMUP calls, then CALLS out of place and CALLS in place (each on the input copied
 * into the buffer afresh), each group timed as a whole. Every rank's input is small integers, so
 * the sum is exact: after each group every rank checks every element of the last result, and rank
 * 0 prints one line with its own times and wrong elements:
 *
 *   BYTES OUT_OF_PLACE_NS IN_PLACE_NS WRONG_ELEMENTS
 *
 * Exit status: 0 every element right, 1 a wrong element or a library error, 2 bad arguments.
 */
#define _POSIX_C_SOURCE 200809L
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

#ifdef KOLO_BENCH_MPI
#include <mpi.h>
#else
#include "kolo.h"
#endif

static double now_ns(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return (double)t.tv_sec * 1e9 + (double)t.tv_nsec;
}

static long argument(int argc, char** argv, int index, long fallback, long least) {
  if (argc <= index) return fallback;
  char* end = NULL;
  const long value = strtol(argv[index], &end, 10);
  if (*argv[index] == '\0' || *end != '\0' || value < least) {
    fprintf(stderr, "small_latency: argument %d is '%s', not an integer >= %ld\n", index,
            argv[index], least);
    exit(2);
  }
  return value;
}

int main(int argc, char** argv) {
  const long bytes = argument(argc, argv, 1, 8, 4);
  const long calls = argument(argc, argv, 2, 200000, 1);
  const long warmup = argument(argc, argv, 3, 20000, 0);
  if (bytes % 4 != 0) {
    fprintf(stderr, "small_latency: %ld bytes is not a whole number of floats\n", bytes);
    return 2;
  }
  const size_t count = (size_t)bytes / 4;
  float* input = malloc(count * sizeof(float));
  float* output = malloc(count * sizeof(float));
  if (!input || !output) return 1;
  int rank = 0;
  int size = 1;
#ifdef KOLO_BENCH_MPI
  MPI_Init(&argc, &argv);
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &size);
#define ALLREDUCE(send, recv)                                                              \
  (MPI_Allreduce((send) == (recv) ? MPI_IN_PLACE : (const void*)(send), (recv), (int)count, \
                 MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD) == MPI_SUCCESS)
#else
  kolo_comm_t comm = NULL;
  if (kolo_comm_init(NULL, &comm) != KOLO_SUCCESS) {
    fprintf(stderr, "small_latency: kolo_comm_init: %s\n", kolo_comm_last_error(NULL));
    return 1;
  }
  kolo_comm_rank(comm, &rank);
  kolo_comm_size(comm, &size);
#define ALLREDUCE(send, recv) \
  (kolo_allreduce(comm, (send), (recv), count, KOLO_FLOAT32, KOLO_SUM) == KOLO_SUCCESS)
#endif
  /* Element i of rank r is (r + i) % 7: the sum over the ranks is exact. */
  for (size_t i = 0; i < count; ++i) input[i] = (float)((rank + i) % 7);
  long wrong = 0;
  int failed = 0;
  double ns[2] = {0, 0};
  for (long i = 0; i < warmup && !failed; ++i) failed = !ALLREDUCE(input, output);
  for (int in_place = 0; in_place < 2 && !failed; ++in_place) {
    const double start = now_ns();
    for (long i = 0; i < calls && !failed; ++i) {
      if (in_place) {
        for (size_t e = 0; e < count; ++e) output[e] = input[e];  /* each call on fresh input */
        failed = !ALLREDUCE(output, output);
      } else {
        failed = !ALLREDUCE(input, output);
      }
    }
    ns[in_place] = (now_ns() - start) / (double)calls;
    for (size_t i = 0; i < count && !failed; ++i) {  /* the last call's result, every element */
      double expected = 0;
      for (int r = 0; r < size; ++r) expected += (double)((r + i) % 7);
      if ((double)output[i] != expected) ++wrong;
    }
  }
  if (failed) {
#ifdef KOLO_BENCH_MPI
    fprintf(stderr, "small_latency: rank %d: MPI_Allreduce failed\n", rank);
#else
    fprintf(stderr, "small_latency: rank %d: %s\n", rank, kolo_comm_last_error(comm));
#endif
  } else if (rank == 0) {
    printf("%ld %.1f %.1f %ld\n", bytes, ns[0], ns[1], wrong);
  }
#ifdef KOLO_BENCH_MPI
  MPI_Finalize();
#else
  kolo_comm_destroy(comm);
#endif
  free(input);
  free(output);
  return failed || wrong ? 1 : 0;
}
