/*
 * intra_host_copy: how fast two processes on one host can move a buffer to each other, both
 * directions at once, by the two single-host mechanisms open to kolo without kernel modules:
 *
 *   cma  each process reads the peer's buffer into its own with process_vm_readv, in pieces
 *        (what UCX's rendezvous protocol does within a host, and Open MPI's shared memory);
 *   shm  each process copies its buffer into a ring of 8 slots in memory shared with the peer,
 *        and copies the peer's ring into its own buffer (a staged path kolo could manage).
 *
 *   intra_host_copy cma|shm BYTES PIECE ITERATIONS
 *
 * Prints the best time of ITERATIONS and the bandwidth each way. docs/benchmarks.md lists it:
 * it bounds what an intra-host allreduce can reach on a machine.
 */
#define _GNU_SOURCE
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/uio.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

enum { kSlots = 8, kMaxIterations = 1000 };

struct shared {
  _Atomic uint64_t address[2];               /* each process's buffer, for cma */
  _Atomic uint64_t arrived[kMaxIterations + 2]; /* barriers: before each iteration, and the end */
  _Atomic uint64_t head[2], tail[2];         /* ring of process i: i writes head, the peer tail */
};

static double now(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return (double)t.tv_sec + (double)t.tv_nsec * 1e-9;
}

static void barrier(struct shared* shared, int which) {
  atomic_fetch_add(&shared->arrived[which], 1);
  while (atomic_load(&shared->arrived[which]) < 2) {
  }
}

int main(int argc, char** argv) {
  if (argc != 5 || (strcmp(argv[1], "cma") != 0 && strcmp(argv[1], "shm") != 0)) {
    fprintf(stderr, "usage: %s cma|shm BYTES PIECE ITERATIONS\n", argv[0]);
    return 2;
  }
  const int cma = strcmp(argv[1], "cma") == 0;
  const size_t bytes = strtoull(argv[2], NULL, 0), piece = strtoull(argv[3], NULL, 0);
  const int iterations = atoi(argv[4]);
  if (piece == 0 || bytes % piece != 0 || iterations < 1 || iterations > kMaxIterations) {
    fprintf(stderr, "BYTES must be a multiple of PIECE > 0; 1 <= ITERATIONS <= %d\n",
            kMaxIterations);
    return 2;
  }
  struct shared* shared = mmap(NULL, sizeof *shared, PROT_READ | PROT_WRITE,
                               MAP_SHARED | MAP_ANONYMOUS, -1, 0);
  char* slots = mmap(NULL, 2 * kSlots * piece, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS,
                     -1, 0);
  if (shared == MAP_FAILED || slots == MAP_FAILED) {
    perror("mmap");
    return 1;
  }
  memset(shared, 0, sizeof *shared);
  memset(slots, 0, 2 * kSlots * piece);
  const pid_t parent = getpid();
  const pid_t child = fork();
  if (child < 0) {
    perror("fork");
    return 1;
  }
  const int me = child == 0;
  const pid_t peer = me ? parent : child;
  char* mine = malloc(bytes);
  char* theirs = malloc(bytes);
  if (!mine || !theirs) {
    fprintf(stderr, "out of memory\n");
    return 1;
  }
  memset(mine, me + 1, bytes);
  memset(theirs, 0, bytes);
  atomic_store(&shared->address[me], (uint64_t)(uintptr_t)mine);
  double best = 1e30;
  for (int iteration = 0; iteration < iterations; ++iteration) {
    barrier(shared, iteration);
    const double start = now();
    if (cma) {
      const uint64_t remote = atomic_load(&shared->address[1 - me]);
      for (size_t offset = 0; offset < bytes; offset += piece) {
        struct iovec local = {theirs + offset, piece};
        struct iovec far = {(void*)(uintptr_t)(remote + offset), piece};
        if (process_vm_readv(peer, &local, 1, &far, 1, 0) != (ssize_t)piece) {
          perror("process_vm_readv");
          return 1;
        }
      }
    } else {
      char* out = slots + (size_t)me * kSlots * piece;
      const char* in = slots + (size_t)(1 - me) * kSlots * piece;
      const uint64_t pieces = bytes / piece;
      uint64_t sent = 0, received = 0;
      while (sent < pieces || received < pieces) {
        const uint64_t head = atomic_load_explicit(&shared->head[me], memory_order_relaxed);
        if (sent < pieces &&
            head - atomic_load_explicit(&shared->tail[me], memory_order_acquire) < kSlots) {
          memcpy(out + head % kSlots * piece, mine + sent * piece, piece);
          atomic_store_explicit(&shared->head[me], head + 1, memory_order_release);
          ++sent;
        }
        const uint64_t tail = atomic_load_explicit(&shared->tail[1 - me], memory_order_relaxed);
        if (received < pieces &&
            atomic_load_explicit(&shared->head[1 - me], memory_order_acquire) > tail) {
          memcpy(theirs + received * piece, in + tail % kSlots * piece, piece);
          atomic_store_explicit(&shared->tail[1 - me], tail + 1, memory_order_release);
          ++received;
        }
      }
    }
    const double elapsed = now() - start;
    if (elapsed < best) best = elapsed;
  }
  barrier(shared, iterations); /* neither exits while the other may still read from it */
  for (size_t i = 0; i < bytes; i += 4096) {
    if (theirs[i] != (char)(2 - me)) {
      fprintf(stderr, "byte %zu is wrong\n", i);
      return 1;
    }
  }
  if (me) return 0;
  int status = 0;
  waitpid(child, &status, 0);
  printf("%s bytes %zu piece %zu: best %.2f ms, %.2f GB/s each way\n", argv[1], bytes, piece,
         best * 1e3, (double)bytes / best / 1e9);
  return WIFEXITED(status) && WEXITSTATUS(status) == 0 ? 0 : 1;
}
