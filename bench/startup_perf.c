/*
 * startup_perf: how long kolo_comm_init takes, from the call to its return. Every rank times its
 * own call; an allreduce (max) then gives the slowest rank's time, which is when the job can
 * start, and rank 0 prints it:
 *
 *   init_max_s 0.0123 ranks 8
 *
 * and every rank prints its own time ("rank R init_s T"). Started by any launcher, as every kolo
 * program is. bench/startup_perf.sh runs it on the simulated cluster and reads, beside these
 * lines, the number of store requests each rank made from its KOLO_DEBUG=INFO start-up line.
 * Exits non-zero, with kolo's message, when a call fails.
 */
#define _POSIX_C_SOURCE 200809L
#include <stdio.h>
#include <time.h>

#include "kolo.h"

static double now_s(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

int main(void) {
  kolo_comm_t comm = NULL;
  const double start = now_s();
  kolo_status_t status = kolo_comm_init(NULL, &comm);
  const double took = now_s() - start;
  if (status != KOLO_SUCCESS) {
    fprintf(stderr, "startup_perf: kolo_comm_init: %s\n", kolo_comm_last_error(NULL));
    return 1;
  }
  int rank = 0;
  int size = 0;
  kolo_comm_rank(comm, &rank);
  kolo_comm_size(comm, &size);
  double slowest = 0;
  status = kolo_allreduce(comm, &took, &slowest, 1, KOLO_FLOAT64, KOLO_MAX);
  if (status != KOLO_SUCCESS) {
    fprintf(stderr, "startup_perf: kolo_allreduce: %s\n", kolo_comm_last_error(comm));
    kolo_comm_destroy(comm);
    return 1;
  }
  printf("rank %d init_s %.4f\n", rank, took);
  if (rank == 0) printf("init_max_s %.4f ranks %d\n", slowest, size);
  fflush(stdout);
  kolo_comm_destroy(comm);
  return 0;
}
