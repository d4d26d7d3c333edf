/*
 * mpi_allreduce_perf: MPI_Allreduce measured the way all_reduce_perf measures kolo_allreduce, with
 * the same flags and the same table, so that compare_mpi.sh can put the two side by side.
 *
 *   mpirun -np 4 --mca btl self,vader mpi_allreduce_perf -b 64K -e 256M -f 4
 *
 * One row: -w untimed calls; then out of place and in place (MPI_IN_PLACE) in turn: MPI_Barrier,
 * -n calls timed with MPI_Wtime, and with -c one more call on fresh input compared element by
 * element with a reference computed on every rank. The per-rank times are averaged across ranks
 * (or, with -a, rank 0's, the minimum or the maximum), as nccl-tests and all_reduce_perf do.
 *
 * MPI has no float16, bfloat16 or average: those rows are skipped with a comment line. The inputs
 * are small integers, so that every reduction is exact (products stay exact up to 6 ranks in
 * int8; beyond that int8 PROD rows may report wrong elements where the MPI library overflows).
 * Plain C on purpose: it is built only where an MPI C compiler is found, and has no other
 * dependency.
 */
#define _GNU_SOURCE
#include <getopt.h>
#include <limits.h>
#include <mpi.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

/* ---- Types and operations -------------------------------------------------------------------- */

enum element_kind {
  KIND_INT8,
  KIND_UINT8,
  KIND_INT32,
  KIND_INT64,
  KIND_HALF,
  KIND_FLOAT,
  KIND_DOUBLE,
  KIND_BFLOAT16,
  KIND_COUNT
};
enum reduction { REDUCE_SUM, REDUCE_PROD, REDUCE_MAX, REDUCE_MIN, REDUCE_AVG, REDUCE_COUNT };

/* In nccl-tests' order, which is the order of "-d all" and "-o all". */
static const char* const kind_names[KIND_COUNT] = {"int8", "uint8", "int32",  "int64",
                                                   "half", "float", "double", "bfloat16"};
static const size_t kind_sizes[KIND_COUNT] = {1, 1, 4, 8, 2, 4, 8, 2};
static const char* const reduction_names[REDUCE_COUNT] = {"sum", "prod", "max", "min", "avg"};

/* MPI_DATATYPE_NULL where MPI has no such type. */
static MPI_Datatype mpi_type(enum element_kind kind) {
  switch (kind) {
    case KIND_INT8:
      return MPI_INT8_T;
    case KIND_UINT8:
      return MPI_UINT8_T;
    case KIND_INT32:
      return MPI_INT32_T;
    case KIND_INT64:
      return MPI_INT64_T;
    case KIND_FLOAT:
      return MPI_FLOAT;
    case KIND_DOUBLE:
      return MPI_DOUBLE;
    default:
      return MPI_DATATYPE_NULL;
  }
}

/* MPI_OP_NULL where MPI has no such operation. */
static MPI_Op mpi_op(enum reduction reduction) {
  switch (reduction) {
    case REDUCE_SUM:
      return MPI_SUM;
    case REDUCE_PROD:
      return MPI_PROD;
    case REDUCE_MAX:
      return MPI_MAX;
    case REDUCE_MIN:
      return MPI_MIN;
    default:
      return MPI_OP_NULL;
  }
}

static int parse_kinds(const char* text, int* chosen) {
  static const struct {
    const char* alias;
    enum element_kind kind;
  } aliases[] = {{"int8", KIND_INT8},        {"char", KIND_INT8},     {"uint8", KIND_UINT8},
                 {"int32", KIND_INT32},      {"int", KIND_INT32},     {"int64", KIND_INT64},
                 {"half", KIND_HALF},        {"float16", KIND_HALF},  {"float", KIND_FLOAT},
                 {"float32", KIND_FLOAT},    {"double", KIND_DOUBLE}, {"float64", KIND_DOUBLE},
                 {"bfloat16", KIND_BFLOAT16}};
  size_t i;
  if (strcmp(text, "all") == 0) {
    for (i = 0; i < KIND_COUNT; ++i) chosen[i] = 1;
    return 1;
  }
  for (i = 0; i < sizeof aliases / sizeof aliases[0]; ++i) {
    if (strcmp(text, aliases[i].alias) == 0) {
      chosen[aliases[i].kind] = 1;
      return 1;
    }
  }
  return 0;
}

static int parse_reductions(const char* text, int* chosen) {
  int i;
  for (i = 0; i < REDUCE_COUNT; ++i) {
    if (strcmp(text, "all") == 0 || strcmp(text, reduction_names[i]) == 0) {
      chosen[i] = 1;
      if (strcmp(text, "all") != 0) return 1;
    }
  }
  return strcmp(text, "all") == 0;
}

/* "8", "64K", "32M", "1G" (powers of 1024); 0 on success. */
static int parse_size(const char* text, uint64_t* bytes) {
  char* end = NULL;
  unsigned long long value;
  if (text[0] < '0' || text[0] > '9') return -1;
  value = strtoull(text, &end, 10);
  switch (*end) {
    case 'k':
    case 'K':
      value <<= 10;
      ++end;
      break;
    case 'm':
    case 'M':
      value <<= 20;
      ++end;
      break;
    case 'g':
    case 'G':
      value <<= 30;
      ++end;
      break;
    default:
      break;
  }
  if (*end == 'B' || *end == 'b') ++end;
  if (*end != '\0') return -1;
  *bytes = value;
  return 0;
}

/* ---- Inputs and the reference ---------------------------------------------------------------- */

static uint64_t input_bits(int rank, uint64_t index) {
  uint64_t bits = index * 0x9e3779b97f4a7c15ull + ((uint64_t)rank + 1) * 0xd1b54a32d192ed03ull;
  bits ^= bits >> 31;
  bits *= 0xbf58476d1ce4e5b9ull;
  bits ^= bits >> 29;
  return bits;
}

static int pick(uint64_t bits, int low, int high) {
  return low + (int)(((bits >> 32) * (uint64_t)(high - low + 1)) >> 32);
}

/* Small integers: sums and products of a few ranks are exact in every type. */
static int input_value(enum element_kind kind, enum reduction reduction, int rank, uint64_t index) {
  const uint64_t bits = input_bits(rank, index);
  const int is_unsigned = kind == KIND_UINT8;
  switch (reduction) {
    case REDUCE_PROD:
      if (is_unsigned) return pick(bits, 1, 2);
      {
        const int choice = pick(bits, 0, 3); /* -2, -1, 1 or 2 */
        return choice < 2 ? choice - 2 : choice - 1;
      }
    case REDUCE_MAX:
    case REDUCE_MIN:
      return is_unsigned ? pick(bits, 0, 200) : pick(bits, -100, 100);
    default:
      return is_unsigned ? pick(bits, 0, 8) : pick(bits, -4, 4);
  }
}

static double reduced_value(enum element_kind kind, enum reduction reduction, int ranks,
                            uint64_t index) {
  double result = input_value(kind, reduction, 0, index);
  int rank;
  for (rank = 1; rank < ranks; ++rank) {
    const double value = input_value(kind, reduction, rank, index);
    switch (reduction) {
      case REDUCE_PROD:
        result *= value;
        break;
      case REDUCE_MAX:
        result = value > result ? value : result;
        break;
      case REDUCE_MIN:
        result = value < result ? value : result;
        break;
      default:
        result += value;
        break;
    }
  }
  return result;
}

#define FOR_EACH_KIND(kind, STATEMENT) \
  switch (kind) {                      \
    case KIND_INT8: {                  \
      typedef int8_t element;          \
      STATEMENT;                       \
    } break;                           \
    case KIND_UINT8: {                 \
      typedef uint8_t element;         \
      STATEMENT;                       \
    } break;                           \
    case KIND_INT32: {                 \
      typedef int32_t element;         \
      STATEMENT;                       \
    } break;                           \
    case KIND_INT64: {                 \
      typedef int64_t element;         \
      STATEMENT;                       \
    } break;                           \
    case KIND_FLOAT: {                 \
      typedef float element;           \
      STATEMENT;                       \
    } break;                           \
    case KIND_DOUBLE: {                \
      typedef double element;          \
      STATEMENT;                       \
    } break;                           \
    default:                           \
      break;                           \
  }

static void fill_input(enum element_kind kind, enum reduction reduction, int rank, void* buffer,
                       uint64_t count) {
  uint64_t i;
  FOR_EACH_KIND(kind, for (i = 0; i < count; ++i)((element*)buffer)[i] =
                          (element)input_value(kind, reduction, rank, i))
}

static void fill_reduced(enum element_kind kind, enum reduction reduction, int ranks, void* buffer,
                         uint64_t count) {
  uint64_t i;
  FOR_EACH_KIND(kind, for (i = 0; i < count; ++i)((element*)buffer)[i] =
                          (element)reduced_value(kind, reduction, ranks, i))
}

static uint64_t count_wrong(enum element_kind kind, const void* got, const void* expected,
                            uint64_t count) {
  uint64_t i, wrong = 0;
  if (count == 0 || memcmp(got, expected, count * kind_sizes[kind]) == 0) return 0;
  FOR_EACH_KIND(kind, for (i = 0; i < count; ++i) wrong +=
                      !(((const element*)got)[i] == ((const element*)expected)[i]))
  return wrong;
}

/* ---- Options --------------------------------------------------------------------------------- */

struct options {
  uint64_t min_bytes, max_bytes, step_bytes;
  long step_factor;
  int iterations, warmup_iterations, check, average;
  int kinds[KIND_COUNT];
  int reductions[REDUCE_COUNT];
};

static void usage(FILE* out) {
  fprintf(out,
          "Usage: mpi_allreduce_perf [-b minbytes] [-e maxbytes] [-i stepbytes] [-f stepfactor]\n"
          "       [-n iters] [-w warmup_iters] [-c 0|1] [-d type|all] [-o sum|prod|max|min|all]\n"
          "       [-a 0|1|2|3] [-r root, ignored] [-z 0|1, ignored] [-t 1] [-g 1]\n"
          "Defaults: -b 32M -e 32M -f 2 -n 20 -w 5 -c 1 -d float -o sum -a 1.\n");
}

/* 0 to go on, otherwise the exit code + 1. */
static int parse_options(int argc, char** argv, struct options* options, int rank) {
  static const struct option long_options[] = {{"minbytes", required_argument, 0, 'b'},
                                               {"maxbytes", required_argument, 0, 'e'},
                                               {"stepbytes", required_argument, 0, 'i'},
                                               {"stepfactor", required_argument, 0, 'f'},
                                               {"iters", required_argument, 0, 'n'},
                                               {"warmup_iters", required_argument, 0, 'w'},
                                               {"check", required_argument, 0, 'c'},
                                               {"datatype", required_argument, 0, 'd'},
                                               {"op", required_argument, 0, 'o'},
                                               {"root", required_argument, 0, 'r'},
                                               {"average", required_argument, 0, 'a'},
                                               {"blocking", required_argument, 0, 'z'},
                                               {"nthreads", required_argument, 0, 't'},
                                               {"ngpus", required_argument, 0, 'g'},
                                               {"help", no_argument, 0, 'h'},
                                               {0, 0, 0, 0}};
  const char *dtype_text = "float", *op_text = "sum";
  int have_step_bytes = 0, have_factor = 0, c;
  memset(options, 0, sizeof *options);
  options->min_bytes = options->max_bytes = 32u << 20;
  options->step_bytes = 1u << 20;
  options->step_factor = 2;
  options->iterations = 20;
  options->warmup_iterations = 5;
  options->check = 1;
  options->average = 1;
  opterr = rank == 0;
  while ((c = getopt_long(argc, argv, "b:e:i:f:n:w:c:d:o:r:a:z:t:g:h", long_options, NULL)) != -1) {
    int bad = 0;
    switch (c) {
      case 'b':
        bad = parse_size(optarg, &options->min_bytes);
        break;
      case 'e':
        bad = parse_size(optarg, &options->max_bytes);
        break;
      case 'i':
        bad = parse_size(optarg, &options->step_bytes);
        have_step_bytes = 1;
        break;
      case 'f':
        options->step_factor = strtol(optarg, NULL, 10);
        have_factor = 1;
        bad = options->step_factor < 1;
        break;
      case 'n':
        options->iterations = atoi(optarg);
        bad = options->iterations < 1;
        break;
      case 'w':
        options->warmup_iterations = atoi(optarg);
        bad = options->warmup_iterations < 0;
        break;
      case 'c':
        options->check = atoi(optarg) != 0;
        break;
      case 'd':
        dtype_text = optarg;
        break;
      case 'o':
        op_text = optarg;
        break;
      case 'a':
        options->average = atoi(optarg);
        bad = options->average < 0 || options->average > 3;
        break;
      case 't':
      case 'g':
        bad = atoi(optarg) != 1;
        break;
      case 'r':
      case 'z':
        break;
      case 'h':
        if (rank == 0) usage(stdout);
        return 1;
      default:
        if (rank == 0) usage(stderr);
        return 2;
    }
    if (bad) {
      if (rank == 0) fprintf(stderr, "mpi_allreduce_perf: bad value for -%c: %s\n", c, optarg);
      return 2;
    }
  }
  if (have_step_bytes && !have_factor) options->step_factor = 1;
  if (!parse_kinds(dtype_text, options->kinds) || !parse_reductions(op_text, options->reductions) ||
      options->min_bytes > options->max_bytes ||
      (options->step_factor <= 1 && options->step_bytes == 0)) {
    if (rank == 0) usage(stderr);
    return 2;
  }
  return 0;
}

/* The next row's size, or 0 past the last one. */
static uint64_t next_size(const struct options* options, uint64_t size) {
  if (options->step_factor > 1) {
    if (size > options->max_bytes / (uint64_t)options->step_factor) return 0;
    return size == 0 ? 1 : size * (uint64_t)options->step_factor;
  }
  if (size > options->max_bytes - options->step_bytes) return 0;
  return size + options->step_bytes;
}

/* ---- Measuring ------------------------------------------------------------------------------- */

static void* allocate_touched(uint64_t bytes) {
  const uint64_t page = 4096, rounded = bytes < page ? page : (bytes + page - 1) / page * page;
  void* memory = aligned_alloc(page, rounded);
  if (memory == NULL) {
    fprintf(stderr, "mpi_allreduce_perf: cannot allocate %llu bytes\n",
            (unsigned long long)rounded);
    MPI_Abort(MPI_COMM_WORLD, 1);
  }
  memset(memory, 0, rounded);
  return memory;
}

static double time_calls(const void* send, void* recv, int count, MPI_Datatype type, MPI_Op op,
                         int calls) {
  double start;
  int call;
  MPI_Barrier(MPI_COMM_WORLD);
  start = MPI_Wtime();
  for (call = 0; call < calls; ++call) MPI_Allreduce(send, recv, count, type, op, MPI_COMM_WORLD);
  return (MPI_Wtime() - start) / calls;
}

static void format_time(char* text, size_t size, double microseconds) {
  if (microseconds >= 10000.0)
    snprintf(text, size, "%7.0f", microseconds);
  else if (microseconds >= 100.0)
    snprintf(text, size, "%7.1f", microseconds);
  else
    snprintf(text, size, "%7.2f", microseconds);
}

static void print_header(const struct options* options, int rank, int ranks) {
  char version[MPI_MAX_LIBRARY_VERSION_STRING], host[64] = {0}, *all_hosts = NULL;
  int length = 0, local_rank = 0, pid = (int)getpid(), *pids = NULL, *local_ranks = NULL, r;
  MPI_Comm node;
  MPI_Get_library_version(version, &length);
  version[strcspn(version, ",\n")] = '\0';
  gethostname(host, sizeof host - 1);
  MPI_Comm_split_type(MPI_COMM_WORLD, MPI_COMM_TYPE_SHARED, rank, MPI_INFO_NULL, &node);
  MPI_Comm_rank(node, &local_rank);
  MPI_Comm_free(&node);
  if (rank == 0) {
    all_hosts = calloc((size_t)ranks, sizeof host);
    pids = calloc((size_t)ranks, sizeof *pids);
    local_ranks = calloc((size_t)ranks, sizeof *local_ranks);
  }
  MPI_Gather(host, (int)sizeof host, MPI_CHAR, all_hosts, (int)sizeof host, MPI_CHAR, 0,
             MPI_COMM_WORLD);
  MPI_Gather(&pid, 1, MPI_INT, pids, 1, MPI_INT, 0, MPI_COMM_WORLD);
  MPI_Gather(&local_rank, 1, MPI_INT, local_ranks, 1, MPI_INT, 0, MPI_COMM_WORLD);
  if (rank != 0) return;
  printf("# MPI_Allreduce (%s)\n", version);
  printf(
      "# nThread 1 nGpus 1 minBytes %llu maxBytes %llu step: %llu(%s) warmup iters: %d iters: %d "
      "agg iters: 1 validation: %d graph: 0\n",
      (unsigned long long)options->min_bytes, (unsigned long long)options->max_bytes,
      options->step_factor > 1 ? (unsigned long long)options->step_factor
                               : (unsigned long long)options->step_bytes,
      options->step_factor > 1 ? "factor" : "bytes", options->warmup_iterations,
      options->iterations, options->check);
  printf("#\n# Using devices\n");
  for (r = 0; r < ranks; ++r) {
    printf("#  Rank %2d Group  0 Pid %6d on %10s device %2d [host] CPU memory\n", r, pids[r],
           all_hosts + r * sizeof host, local_ranks[r]);
  }
  printf("#\n");
  printf(
      "# %10s  %12s  %8s  %6s  %6s           out-of-place                       in-place          "
      "\n",
      "", "", "", "", "");
  printf("# %10s  %12s  %8s  %6s  %6s  %7s  %6s  %6s %6s  %7s  %6s  %6s %6s\n", "size", "count",
         "type", "redop", "root", "time", "algbw", "busbw", "#wrong", "time", "algbw", "busbw",
         "#wrong");
  printf("# %10s  %12s  %8s  %6s  %6s  %7s  %6s  %6s  %5s  %7s  %6s  %6s  %5s\n", "(B)",
         "(elements)", "", "", "", "(us)", "(GB/s)", "(GB/s)", "", "(us)", "(GB/s)", "(GB/s)", "");
  fflush(stdout);
  free(all_hosts);
  free(pids);
  free(local_ranks);
}

/* Combines per-rank values in place as -a asks. */
static void combine_across_ranks(double* values, int count, int average, int ranks) {
  int i;
  switch (average) {
    case 0:
      MPI_Bcast(values, count, MPI_DOUBLE, 0, MPI_COMM_WORLD);
      break;
    case 2:
      MPI_Allreduce(MPI_IN_PLACE, values, count, MPI_DOUBLE, MPI_MIN, MPI_COMM_WORLD);
      break;
    case 3:
      MPI_Allreduce(MPI_IN_PLACE, values, count, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD);
      break;
    default:
      MPI_Allreduce(MPI_IN_PLACE, values, count, MPI_DOUBLE, MPI_SUM, MPI_COMM_WORLD);
      for (i = 0; i < count; ++i) values[i] /= ranks;
      break;
  }
}

int main(int argc, char** argv) {
  struct options options;
  int rank, ranks, kind, reduction, stop;
  uint64_t largest, size, total_wrong = 0, placements = 0;
  double busbw_sum = 0;
  char *send, *recv, *expected = NULL;

  MPI_Init(&argc, &argv);
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &ranks);
  stop = parse_options(argc, argv, &options, rank);
  if (stop) {
    MPI_Finalize();
    return stop - 1;
  }

  largest = options.min_bytes;
  for (size = next_size(&options, largest); size != 0; size = next_size(&options, size))
    largest = size;
  if (largest / kind_sizes[KIND_INT8] > INT_MAX) {
    if (rank == 0) fprintf(stderr, "mpi_allreduce_perf: -e is too large for an int count\n");
    MPI_Finalize();
    return 1;
  }
  send = allocate_touched(largest);
  recv = allocate_touched(largest);
  if (options.check) expected = allocate_touched(largest);
  print_header(&options, rank, ranks);

  for (kind = 0; kind < KIND_COUNT; ++kind) {
    if (!options.kinds[kind]) continue;
    for (reduction = 0; reduction < REDUCE_COUNT; ++reduction) {
      const MPI_Datatype type = mpi_type((enum element_kind)kind);
      const MPI_Op op = mpi_op((enum reduction)reduction);
      const uint64_t element = kind_sizes[kind];
      if (!options.reductions[reduction]) continue;
      if (type == MPI_DATATYPE_NULL || op == MPI_OP_NULL) {
        if (rank == 0) {
          printf("# %s %s: not available in MPI, skipped\n", kind_names[kind],
                 reduction_names[reduction]);
        }
        continue;
      }
      for (size = options.min_bytes;; size = next_size(&options, size)) {
        const uint64_t count = size / element, row_bytes = count * element;
        const int int_count = (int)count; /* MPI counts are int: 2 GiB of elements at most */
        double seconds[2];
        long long wrong[2] = {0, 0};
        int call, placement;
        if (options.check) {
          fill_reduced((enum element_kind)kind, (enum reduction)reduction, ranks, expected, count);
        }
        fill_input((enum element_kind)kind, (enum reduction)reduction, rank, send, count);
        for (call = 0; call < options.warmup_iterations; ++call) {
          MPI_Allreduce(send, recv, int_count, type, op, MPI_COMM_WORLD);
        }
        seconds[0] = time_calls(send, recv, int_count, type, op, options.iterations);
        if (options.check) {
          fill_input((enum element_kind)kind, (enum reduction)reduction, rank, send, count);
          memset(recv, 0xa5, row_bytes);
          MPI_Allreduce(send, recv, int_count, type, op, MPI_COMM_WORLD);
          wrong[0] = (long long)count_wrong((enum element_kind)kind, recv, expected, count);
        }
        fill_input((enum element_kind)kind, (enum reduction)reduction, rank, recv, count);
        seconds[1] = time_calls(MPI_IN_PLACE, recv, int_count, type, op, options.iterations);
        if (options.check) {
          fill_input((enum element_kind)kind, (enum reduction)reduction, rank, recv, count);
          MPI_Allreduce(MPI_IN_PLACE, recv, int_count, type, op, MPI_COMM_WORLD);
          wrong[1] = (long long)count_wrong((enum element_kind)kind, recv, expected, count);
        }
        combine_across_ranks(seconds, 2, options.average, ranks);
        MPI_Allreduce(MPI_IN_PLACE, wrong, 2, MPI_LONG_LONG, MPI_SUM, MPI_COMM_WORLD);

        if (rank == 0) {
          printf("%12llu  %12llu  %8s  %6s  %6i", (unsigned long long)row_bytes,
                 (unsigned long long)count, kind_names[kind], reduction_names[reduction], -1);
          for (placement = 0; placement < 2; ++placement) {
            const double algbw = seconds[placement] > 0 ? row_bytes / seconds[placement] / 1e9 : 0;
            const double busbw = algbw * 2.0 * (ranks - 1) / ranks;
            char time_text[32], wrong_text[32];
            format_time(time_text, sizeof time_text, seconds[placement] * 1e6);
            if (options.check)
              snprintf(wrong_text, sizeof wrong_text, "%lld", wrong[placement]);
            else
              snprintf(wrong_text, sizeof wrong_text, "N/A");
            printf("  %7s  %6.2f  %6.2f  %5s", time_text, algbw, busbw, wrong_text);
            busbw_sum += busbw;
            ++placements;
            total_wrong += (uint64_t)wrong[placement];
          }
          printf("\n");
          fflush(stdout);
        }
        if (next_size(&options, size) == 0) break;
      }
    }
  }
  if (rank == 0) {
    printf("# Out of bounds values : %llu %s\n", (unsigned long long)total_wrong,
           total_wrong == 0 ? "OK" : "FAILED");
    printf("# Avg bus bandwidth    : %g \n", placements == 0 ? 0.0 : busbw_sum / placements);
    printf("#\n");
    fflush(stdout);
  }
  free(send);
  free(recv);
  free(expected);
  MPI_Bcast(&total_wrong, 1, MPI_UINT64_T, 0, MPI_COMM_WORLD);
  MPI_Finalize();
  return total_wrong == 0 ? 0 : 1;
}
