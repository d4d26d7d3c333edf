/* The C ABI from a C11 program, compiled as C with -pedantic -Werror: start-up through the
 * environment (kolorun), rank queries, allreduce, broadcast, a named allgather and barrier with
 * checked results, the versioned config struct, and error reporting. Exits 0 only if every check
 * passed. */
#include <kolo.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static int failures = 0;

#define CHECK(condition, ...)                        \
  do {                                               \
    if (!(condition)) {                              \
      fprintf(stderr, "FAILED %s: ", #condition);    \
      fprintf(stderr, __VA_ARGS__);                  \
      fputc('\n', stderr);                           \
      ++failures;                                    \
    }                                                \
  } while (0)

int main(void) {
  kolo_config_t bad = KOLO_CONFIG_INITIALIZER;
  kolo_config_t config = KOLO_CONFIG_INITIALIZER;
  kolo_comm_t comm = NULL;
  kolo_status_t status;
  int rank = -1, size = -1, local_rank = -1, local_size = -1;
  double values[1000];
  int64_t weights[257];
  int16_t shorts[100];
  size_t i;

  CHECK(kolo_version() == KOLO_VERSION, "library %d, header %d", kolo_version(), KOLO_VERSION);
  CHECK(strstr(kolo_status_string(KOLO_ERR_PEER_LOST), "PEER_LOST") != NULL, "%s",
        kolo_status_string(KOLO_ERR_PEER_LOST));
  CHECK(kolo_dtype_size(KOLO_BFLOAT16) == 2, "bfloat16 size %zu", kolo_dtype_size(KOLO_BFLOAT16));
  CHECK(KOLO_INT64 == 7 && KOLO_INT16 == 8, "int64 is %d, int16 %d", (int)KOLO_INT64,
        (int)KOLO_INT16);
  CHECK(kolo_dtype_size(KOLO_INT16) == 2, "int16 size %zu", kolo_dtype_size(KOLO_INT16));
  CHECK(kolo_dtype_size((kolo_dtype_t)256) == 0, "dtype 256 size %zu",
        kolo_dtype_size((kolo_dtype_t)256));
  CHECK(kolo_dtype_size((kolo_dtype_t)-1) == 0, "dtype -1 size %zu", kolo_dtype_size((kolo_dtype_t)-1));

  bad.magic = 0;
  status = kolo_comm_init(&bad, &comm);
  CHECK(status == KOLO_ERR_INVALID_ARGUMENT && comm == NULL, "bad magic gave %s",
        kolo_status_string(status));
  CHECK(strstr(kolo_comm_last_error(NULL), "magic") != NULL, "message: %s",
        kolo_comm_last_error(NULL));

  config.timeout_s = 60.0;
  status = kolo_comm_init(&config, &comm);
  if (status != KOLO_SUCCESS) {
    fprintf(stderr, "init: %s: %s\n", kolo_status_string(status), kolo_comm_last_error(NULL));
    return 1;
  }
  CHECK(kolo_comm_rank(comm, &rank) == KOLO_SUCCESS, "rank");
  CHECK(kolo_comm_size(comm, &size) == KOLO_SUCCESS, "size");
  CHECK(kolo_comm_local_rank(comm, &local_rank) == KOLO_SUCCESS, "local rank");
  CHECK(kolo_comm_local_size(comm, &local_size) == KOLO_SUCCESS, "local size");
  CHECK(rank >= 0 && rank < size, "rank %d size %d", rank, size);
  CHECK(local_rank == rank && local_size == size, "one machine: local %d/%d", local_rank,
        local_size);

  /* Every rank contributes rank + i; the sum is size * i + size * (size - 1) / 2. */
  for (i = 0; i < 1000; ++i) values[i] = (double)rank + (double)i;
  status = kolo_allreduce(comm, values, values, 1000, KOLO_FLOAT64, KOLO_SUM);
  CHECK(status == KOLO_SUCCESS, "allreduce: %s", kolo_comm_last_error(comm));
  for (i = 0; i < 1000; ++i) {
    double expected = (double)size * (double)i + (double)(size * (size - 1) / 2);
    if (fabs(values[i] - expected) != 0.0) {
      CHECK(0, "element %zu: expected %g got %g", i, expected, values[i]);
      break;
    }
  }

  /* int16: every rank contributes 20000 + i; the sum wraps around modulo 2^16. */
  for (i = 0; i < 100; ++i) shorts[i] = (int16_t)(20000 + (int)i);
  status = kolo_allreduce(comm, shorts, shorts, 100, KOLO_INT16, KOLO_SUM);
  CHECK(status == KOLO_SUCCESS, "int16 allreduce: %s", kolo_comm_last_error(comm));
  for (i = 0; i < 100; ++i) {
    int32_t exact = size * (20000 + (int32_t)i);
    int16_t expected = (int16_t)(uint16_t)((uint32_t)exact & 0xffffu);
    if (shorts[i] != expected) {
      CHECK(0, "int16 element %zu: expected %d got %d", i, expected, shorts[i]);
      break;
    }
  }

  for (i = 0; i < 257; ++i) weights[i] = rank == size - 1 ? (int64_t)(i * i) : -1;
  status = kolo_broadcast(comm, weights, 257, KOLO_INT64, size - 1);
  CHECK(status == KOLO_SUCCESS, "broadcast: %s", kolo_comm_last_error(comm));
  for (i = 0; i < 257; ++i) {
    if (weights[i] != (int64_t)(i * i)) {
      CHECK(0, "weight %zu: expected %lld got %lld", i, (long long)(i * i), (long long)weights[i]);
      break;
    }
  }

  status = kolo_broadcast(comm, weights, 257, KOLO_INT64, size);
  CHECK(status == KOLO_ERR_INVALID_ARGUMENT, "bad root gave %s", kolo_status_string(status));
  CHECK(strstr(kolo_comm_last_error(comm), "root") != NULL, "message: %s",
        kolo_comm_last_error(comm));

  /* A named allgather from C: rank r sends r + 1 values r * 100 + i. */
  {
    int32_t mine[8], all[64];
    uint64_t counts[8] = {0};
    uint64_t at = 0;
    int r;
    kolo_request_t request = NULL;
    for (i = 0; i < (size_t)rank + 1; ++i) mine[i] = rank * 100 + (int32_t)i;
    status = kolo_allgather_async(comm, "c.gather", mine, (uint64_t)rank + 1, all, 64, KOLO_INT32,
                                  NULL, &request);
    CHECK(status == KOLO_SUCCESS, "allgather_async: %s", kolo_comm_last_error(comm));
    if (status == KOLO_SUCCESS) {
      status = kolo_request_wait(request);
      CHECK(status == KOLO_SUCCESS, "allgather wait: %s", kolo_request_last_error(request));
      status = kolo_request_counts(request, counts, 8);
      CHECK(status == KOLO_SUCCESS, "request_counts: %s", kolo_request_last_error(request));
      for (r = 0; r < size && size <= 8; ++r) {
        CHECK(counts[r] == (uint64_t)r + 1, "count of rank %d is %llu", r,
              (unsigned long long)counts[r]);
        for (i = 0; i < (size_t)r + 1; ++i, ++at) {
          CHECK(all[at] == r * 100 + (int32_t)i, "gathered element %llu is %d",
                (unsigned long long)at, (int)all[at]);
        }
      }
      CHECK(kolo_request_free(request) == KOLO_SUCCESS, "request_free");
    }
  }

  CHECK(kolo_barrier(comm) == KOLO_SUCCESS, "barrier: %s", kolo_comm_last_error(comm));
  CHECK(kolo_comm_destroy(comm) == KOLO_SUCCESS, "destroy");
  if (failures == 0) printf("rank %d: C ABI checks passed\n", rank);
  return failures == 0 ? 0 : 1;
}
