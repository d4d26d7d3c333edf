// What the harness's own files share, and the benchmarks do not see (theirs is perf_common.hpp):
//   perf_reference.cpp  the element types, the inputs, the reference, and count_wrong()
//   perf_options.cpp    the dtype and op names, the flags (Options) and the row sizes
//   perf_table.cpp      nccl-tests' table: parameters, ranks, column headers, rows, summary
//   perf_common.cpp     the runner: buffers, measuring, run_benchmark()
#pragma once

#include <fmt/core.h>

#include <cstdint>
#include <cstdio>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "kolo.h"
#include "perf_common.hpp"

namespace kolo::bench::detail {

// ---- perf_reference.cpp -------------------------------------------------------------------------

// The number of elements of got that differ in value from expected (so NaN never matches, and
// +0 matches -0).
uint64_t count_wrong(kolo_dtype_t dtype, const void* got, const void* expected, uint64_t count);

// ---- perf_options.cpp ---------------------------------------------------------------------------

// As nccl-tests prints them: "float", "bfloat16", ...; "sum", "avg", ...
const char* dtype_name(kolo_dtype_t dtype);
const char* op_name(kolo_op_t op);

// -a: which rank's time a row shows, or how the ranks' times are combined.
enum class Combine { kRankZero = 0, kAverage = 1, kMinimum = 2, kMaximum = 3 };

struct Options {
  uint64_t min_bytes = 32u << 20;
  uint64_t max_bytes = 32u << 20;
  uint64_t step_bytes = 1u << 20;  // used when step_factor is 1
  int step_factor = 2;
  int iterations = 20;
  int warmup_iterations = 5;
  int first_calls = 0;       // --first: calls timed one by one at the start of each row
  // --later_warmup_iters: the -w of the cycles after the first (-N); -1: -w for every cycle
  int later_warmup_iterations = -1;
  int agg_iterations = 1;    // -m: calls per timed iteration; a row's time is per call
  int run_cycles = 1;        // -N: how many times the whole table is measured; 0: until killed
  int check_iterations = 1;  // -c: checked calls per placement; 0: no check
  bool check = true;         // check_iterations > 0
  std::vector<kolo_dtype_t> dtypes = {KOLO_FLOAT32};
  std::vector<kolo_op_t> ops = {KOLO_SUM};
  int root = 0;
  Combine combine = Combine::kAverage;
  bool blocking = false;           // -z 1: with GPU buffers, wait for the stream after each call
  bool report_cputime = false;     // -C 1: the time columns say "cputime"
  bool report_timestamps = false;  // -S 1: a timestamp column after each row
  bool memory_report = false;      // -M 1: the buffers' memory, per rank, before the table
  double timeout_s = 0;            // -T: the communicator's timeout; 0: KOLO_TIMEOUT's
  std::string json_path;           // -J: the table also written to this JSON file
  // The GPU flags. gpu_requested is -g 1 (or -g alone); gpu says whether the buffers really are
  // in GPU memory, which run_benchmark() decides once it knows whether a device is usable.
  bool gpu_requested = false;
  bool gpu = false;
  bool null_stream = false;       // -y 1: CUDA's default (null) stream instead of a new one
  int cuda_graph_launches = 0;    // -G
  int local_register = 0;         // -R
  int cta_policy = -1;            // -x; -1: not set
  int device_implementation = 0;  // -D
};

// The exit code of a command line that cannot run (a bad flag, a bad value, a flag this host
// cannot honour): 2, as kolorun's usage errors.
inline constexpr int kUsageExitCode = 2;

// The launchers' rank variables, read before the communicator exists so that a refused command
// line is explained once and not once per rank.
bool probably_rank_zero();

// Parses argv into options; on --help or a bad flag returns the exit code to end with.
std::optional<int> parse_options(int argc, char** argv, const Collective& collective,
                                 Options& options);

// Where the run cannot honour a GPU flag, the sentence that says so; empty when every flag given
// can be honoured. gpu_usable: the build has CUDA, a device is visible and the benchmark has a GPU
// mode (otherwise reason says why not).
std::string gpu_flag_problem(const Options& options, bool gpu_usable, const std::string& reason);

// The sizes of the rows in bytes, from -b to -e by -f (or by -i).
std::vector<uint64_t> row_sizes(const Options& options);

// ---- perf_table.cpp -----------------------------------------------------------------------------

// Rank 0 prints; every line is flushed so that progress shows through a launcher's pipe.
class Printer {
 public:
  explicit Printer(bool active) : active_(active) {}
  template <class... Args>
  void line(fmt::format_string<Args...> format, Args&&... args) {
    if (!active_) return;
    fmt::print(format, std::forward<Args>(args)...);
    std::fputc('\n', stdout);
    std::fflush(stdout);
  }

 private:
  bool active_;
};

// One placement (out of place or in place) of a row, combined across ranks.
struct Placement {
  double seconds = 0;  // per call, combined across ranks
  double algbw = 0;    // GB/s
  double busbw = 0;    // GB/s
  uint64_t wrong = 0;  // summed across ranks
};

// One row of the table.
struct Row {
  uint64_t bytes = 0;  // the larger of the operation's two buffers
  uint64_t count = 0;  // the count argument of the call
  kolo_dtype_t dtype = KOLO_FLOAT32;
  std::optional<kolo_op_t> op;  // empty for a collective that does not reduce: "none"
  int root = -1;
  Placement placements[2];  // out of place, in place
  bool checked = true;      // false: #wrong says N/A
};

// The table's head: the flags, the ranks (every rank calls print_ranks: it gathers), with -M the
// buffer memory of every rank (every rank calls it too), the columns.
void print_parameters(Printer& out, const Options& options);
void print_ranks(Printer& out, kolo_comm_t comm, int ranks, bool gpu);
void print_memory(Printer& out, kolo_comm_t comm, int ranks, uint64_t bytes, bool gpu);
void print_column_headers(Printer& out, const Options& options);

void print_row(Printer& out, const Row& row, const Options& options);

// --first: after a row, the times of its first calls (per call, combined across ranks): the
// first alone, then the median of calls 2-10, 11-100, 101-1000, ... as far as there are calls,
// and the ratio of each to the row's timed out-of-place time.
void print_first_calls(Printer& out, uint64_t bytes, const std::vector<double>& seconds,
                       double steady_seconds);

// The table's foot: the wrong elements of all rows, the average busbw of all placements, and the
// program's name, as nccl-tests ends.
void print_summary(Printer& out, uint64_t total_wrong, double average_busbw,
                   const std::string& program);

}  // namespace kolo::bench::detail
