/*
 * cache_pingpong: the round-trip time of one cache line between two CPUs, a thread pinned to
 * each, handing a flag back and forth.
 *
 *   cache_pingpong [CPU_A CPU_B]      (default 0 1)
 *
 * kolo's shared-memory rings move every byte from one core's cache to another's, so they are
 * fast when the two cores share a last-level cache and slow when they do not. On a virtual
 * machine that can change while a job runs; docs/benchmarks.md lists it among the ceilings kolo's
 * transports work under.
 */
#define _GNU_SOURCE
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

enum { kRounds = 200000 };

static _Alignas(64) atomic_int flag;

static int pin(int cpu) {
  cpu_set_t set;
  CPU_ZERO(&set);
  CPU_SET(cpu, &set);
  return pthread_setaffinity_np(pthread_self(), sizeof(set), &set);
}

static void* answer(void* cpu) {
  pin(*(int*)cpu);  /* main() made sure it can */
  for (int i = 0; i < kRounds; ++i) {
    while (atomic_load(&flag) != 1) {
    }
    atomic_store(&flag, 0);
  }
  return NULL;
}

int main(int argc, char** argv) {
  int cpus[2] = {0, 1};
  if (argc == 3) {
    cpus[0] = atoi(argv[1]);
    cpus[1] = atoi(argv[2]);
  } else if (argc != 1) {
    fprintf(stderr, "usage: cache_pingpong [CPU_A CPU_B]\n");
    return 2;
  }
  for (int k = 1; k >= 0; --k) {  /* ends pinned to CPU_A */
    if (pin(cpus[k]) != 0) {
      fprintf(stderr, "cache_pingpong: cannot run on CPU %d\n", cpus[k]);
      return 1;
    }
  }
  pthread_t thread;
  if (pthread_create(&thread, NULL, answer, &cpus[1]) != 0) return 1;
  struct timespec start, end;
  clock_gettime(CLOCK_MONOTONIC, &start);
  for (int i = 0; i < kRounds; ++i) {
    atomic_store(&flag, 1);
    while (atomic_load(&flag) != 0) {
    }
  }
  clock_gettime(CLOCK_MONOTONIC, &end);
  pthread_join(thread, NULL);
  double ns = (end.tv_sec - start.tv_sec) * 1e9 + (end.tv_nsec - start.tv_nsec);
  printf("CPU %d <-> CPU %d: %.0f ns per round trip\n", cpus[0], cpus[1], ns / kRounds);
  return 0;
}
