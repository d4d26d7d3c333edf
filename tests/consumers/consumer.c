/* A program outside kolo's build that links the installed library: each rank contributes
 * rank + 1 + i at element i, and every rank checks the allreduced sum against the closed form.
 * tests/consumers/run.sh builds it with CMake (find_package(kolo)) and with pkg-config. */
#include <kolo.h>
#include <stdio.h>

enum { COUNT = 1031 };

int main(void) {
  kolo_comm_t comm;
  if (kolo_comm_init(NULL, &comm) != KOLO_SUCCESS) {
    fprintf(stderr, "consumer: kolo_comm_init: %s\n", kolo_comm_last_error(NULL));
    return 1;
  }
  int rank = 0, size = 0;
  kolo_comm_rank(comm, &rank);
  kolo_comm_size(comm, &size);
  static double values[COUNT];
  for (int i = 0; i < COUNT; ++i) values[i] = rank + 1 + i;
  kolo_status_t status = kolo_allreduce(comm, values, values, COUNT, KOLO_FLOAT64, KOLO_SUM);
  if (status != KOLO_SUCCESS) {
    fprintf(stderr, "consumer: %s: %s\n", kolo_status_string(status), kolo_comm_last_error(comm));
    kolo_comm_destroy(comm);
    return 1;
  }
  int wrong = 0;
  for (int i = 0; i < COUNT; ++i) {
    double expected = size * (size + 1) / 2.0 + (double)size * i;
    if (values[i] != expected) {
      if (wrong++ == 0) fprintf(stderr, "consumer: element %d is %g, expected %g\n", i, values[i], expected);
    }
  }
  printf("consumer rank %d of %d, kolo %d: %s\n", rank, size, kolo_version(),
         wrong ? "WRONG" : "ok");
  kolo_comm_destroy(comm);
  return wrong ? 1 : 0;
}
