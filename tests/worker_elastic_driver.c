/*
 * The worker of test_kolorun_elastic: a rank of a job under `kolorun --elastic
 * --host-discovery-script`, written against the C ABI alone.
 *
 *   kolo_test_elastic_driver STOP_FILE EVERY [STEP_MS]
 *
 * Each step allreduces (rank + 1) * (step + 1) as int64 and checks the sum against
 * (step + 1) * size * (size + 1) / 2; a wrong sum exits 3. Every EVERY steps the ranks agree
 * (allreduce max) whether STOP_FILE exists, and stop together (exit 0) if it does; otherwise they
 * call kolo_elastic_update: a leaving rank destroys its communicator and exits 0, the others go
 * on with the new one, on which rank 0 broadcasts the step so that newcomers continue from it.
 * A call that fails with a lost peer, a timeout or a cancelled communicator makes the ranks
 * shrink (kolo_comm_shrink) and agree on the step to redo (allreduce min). Newcomers (started
 * with KOLO_INVITATION) join in kolo_comm_init and then take the step from rank 0.
 *
 * With ELASTIC_DIE_FILE set to a file that exists, a newcomer removes the file and kills itself
 * while it joins (after ELASTIC_DIE_MS milliseconds, 20 by default): the test of a newcomer that
 * dies while joining.
 *
 * After each change of its communicator (an update, a shrink) it prints the wall-clock time at
 * which the first allreduce on the new one succeeded (bench/elastic_driver_times.py reads it).
 *
 * Every line it prints starts with "slot <its KOLO_ELASTIC_SLOT>:".
 */
#include <errno.h>
#include <pthread.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "kolo.h"

static const char* slot = "?";
/* Set by a change of the communicator: the next allreduce that succeeds says when it ended. */
static const char* changed_by = NULL;

static double wall_seconds(void) {
  struct timespec now;
  clock_gettime(CLOCK_REALTIME, &now);
  return (double)now.tv_sec + now.tv_nsec / 1e9;
}

static void sleep_ms(long ms) {
  struct timespec delay = {ms / 1000, (ms % 1000) * 1000000L};
  while (nanosleep(&delay, &delay) != 0 && errno == EINTR) {
  }
}

static void* die_soon(void* arg) {
  sleep_ms(*(long*)arg);
  printf("slot %s: dying while joining\n", slot);
  fflush(stdout);
  raise(SIGKILL);
  return NULL;
}

static int recoverable(kolo_status_t status) {
  return status == KOLO_ERR_PEER_LOST || status == KOLO_ERR_TIMEOUT || status == KOLO_ERR_CANCELLED;
}

/* Shrinks *comm after a failure on it; the survivors agree on the step to redo. */
static int recover(kolo_comm_t* comm, int64_t* step, kolo_status_t status, const char* what) {
  printf("slot %s: %s failed at step %lld: %s (%s); shrinking\n", slot, what, (long long)*step,
         kolo_status_string(status), kolo_comm_last_error(*comm));
  kolo_comm_t shrunk = NULL;
  kolo_status_t shrink_status = kolo_comm_shrink(*comm, &shrunk);
  if (shrink_status != KOLO_SUCCESS) {
    printf("slot %s: FAILED: kolo_comm_shrink: %s: %s\n", slot, kolo_status_string(shrink_status),
           kolo_comm_last_error(*comm));
    return 0;
  }
  kolo_comm_destroy(*comm);
  *comm = shrunk;
  int64_t agreed = 0;
  if (kolo_allreduce(*comm, step, &agreed, 1, KOLO_INT64, KOLO_MIN) != KOLO_SUCCESS) {
    printf("slot %s: FAILED: allreduce after shrink: %s\n", slot, kolo_comm_last_error(*comm));
    return 0;
  }
  *step = agreed;
  int size = 0;
  kolo_comm_size(*comm, &size);
  printf("slot %s: shrank to size %d at step %lld\n", slot, size, (long long)*step);
  changed_by = "shrink";
  return 1;
}

int main(int argc, char** argv) {
  if (argc < 3) {
    fprintf(stderr, "usage: %s STOP_FILE EVERY [STEP_MS]\n", argv[0]);
    return 2;
  }
  const char* stop_file = argv[1];
  const int every = atoi(argv[2]);
  const long step_ms = argc > 3 ? atol(argv[3]) : 10;
  setvbuf(stdout, NULL, _IOLBF, 0);
  if (getenv("KOLO_ELASTIC_SLOT")) slot = getenv("KOLO_ELASTIC_SLOT");
  const int newcomer = getenv("KOLO_INVITATION") != NULL;
  const char* die_file = getenv("ELASTIC_DIE_FILE");
  static long die_ms = 20;
  if (newcomer && die_file && unlink(die_file) == 0) {
    if (getenv("ELASTIC_DIE_MS")) die_ms = atol(getenv("ELASTIC_DIE_MS"));
    pthread_t thread;
    pthread_create(&thread, NULL, die_soon, &die_ms);
  }

  kolo_comm_t comm = NULL;
  kolo_status_t status = kolo_comm_init(NULL, &comm);
  if (status != KOLO_SUCCESS) {
    printf("slot %s: FAILED: kolo_comm_init: %s: %s\n", slot, kolo_status_string(status),
           kolo_comm_last_error(NULL));
    return 1;
  }
  /* Bad arguments: refused before anything is sent, the communicator still usable. */
  kolo_comm_t unused = NULL;
  kolo_elastic_update_t unused_update;
  if (kolo_elastic_update(comm, NULL, &unused) != KOLO_ERR_INVALID_ARGUMENT ||
      kolo_elastic_update(comm, &unused_update, NULL) != KOLO_ERR_INVALID_ARGUMENT ||
      kolo_elastic_update(NULL, &unused_update, &unused) != KOLO_ERR_INVALID_ARGUMENT ||
      strstr(kolo_comm_last_error(comm), "newcomm is NULL") == NULL) {
    printf("slot %s: FAILED: kolo_elastic_update took a NULL argument\n", slot);
    return 1;
  }
  int64_t step = 0;
  if (newcomer && kolo_broadcast(comm, &step, 1, KOLO_INT64, 0) != KOLO_SUCCESS) {
    printf("slot %s: FAILED: the step from rank 0: %s\n", slot, kolo_comm_last_error(comm));
    return 1;
  }
  int rank = 0, size = 0;
  kolo_comm_rank(comm, &rank);
  kolo_comm_size(comm, &size);
  printf("slot %s: rank %d of %d %s at step %lld, pid %ld\n", slot, rank, size,
         newcomer ? "joined" : "started", (long long)step, (long)getpid());

  for (;;) {
    kolo_comm_rank(comm, &rank);
    kolo_comm_size(comm, &size);
    int64_t value = (int64_t)(rank + 1) * (step + 1), sum = 0;
    status = kolo_allreduce(comm, &value, &sum, 1, KOLO_INT64, KOLO_SUM);
    if (status != KOLO_SUCCESS) {
      if (!recoverable(status) || !recover(&comm, &step, status, "allreduce")) return 1;
      continue;
    }
    int64_t expected = (step + 1) * size * (size + 1) / 2;
    if (sum != expected) {
      printf("slot %s: FAILED: step %lld on %d ranks: sum %lld, expected %lld\n", slot,
             (long long)step, size, (long long)sum, (long long)expected);
      return 3;
    }
    if (changed_by) {
      printf("slot %s: first allreduce of %d ranks after the %s at %.6f\n", slot, size, changed_by,
             wall_seconds());
      changed_by = NULL;
    }
    ++step;
    sleep_ms(step_ms);
    if (step % every != 0) continue;

    int32_t stop = access(stop_file, F_OK) == 0, any_stop = 0;
    status = kolo_allreduce(comm, &stop, &any_stop, 1, KOLO_INT32, KOLO_MAX);
    if (status != KOLO_SUCCESS) {
      if (!recoverable(status) || !recover(&comm, &step, status, "stop vote")) return 1;
      continue;
    }
    if (any_stop) break;

    kolo_elastic_update_t update;
    kolo_comm_t grown = NULL;
    status = kolo_elastic_update(comm, &update, &grown);
    if (status != KOLO_SUCCESS) {
      if (!recoverable(status) || !recover(&comm, &step, status, "kolo_elastic_update")) {
        printf("slot %s: FAILED: kolo_elastic_update: %s: %s\n", slot, kolo_status_string(status),
               kolo_comm_last_error(comm));
        return 1;
      }
      continue;
    }
    if (!update.changed) continue;
    if (update.leaving) {
      printf("slot %s: leaving at step %lld (size %d, %d left, %d joined)\n", slot, (long long)step,
             update.old_size, update.left, update.joined);
      kolo_comm_destroy(comm);
      return 0;
    }
    kolo_comm_destroy(comm);
    comm = grown;
    if (kolo_broadcast(comm, &step, 1, KOLO_INT64, 0) != KOLO_SUCCESS) {
      printf("slot %s: FAILED: broadcasting the step: %s\n", slot, kolo_comm_last_error(comm));
      return 1;
    }
    printf("slot %s: update at step %lld: size %d -> %d (%d joined, %d left)\n", slot,
           (long long)step, update.old_size, update.new_size, update.joined, update.left);
    changed_by = "update";
  }
  kolo_comm_rank(comm, &rank);
  kolo_comm_size(comm, &size);
  printf("slot %s: rank %d of %d done at step %lld\n", slot, rank, size, (long long)step);
  kolo_comm_destroy(comm);
  return 0;
}
