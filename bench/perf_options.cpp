// The flags: nccl-tests' names of the dtypes and ops, parse_options() (CLI11) and the row sizes it
// implies, and parse_size(), which reads every size flag of the harness and of fusion_perf.
#include <fmt/core.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "perf_internal.hpp"

namespace kolo::bench {
namespace {

// ---- Names --------------------------------------------------------------------------------------

struct DtypeName {
  kolo_dtype_t dtype;
  const char* name;  // as nccl-tests prints it
  std::vector<std::string_view> aliases;
};

// In nccl-tests' order for "-d all".
const std::vector<DtypeName>& dtype_names() {
  static const std::vector<DtypeName> names = {
      {KOLO_INT8, "int8", {"int8", "char"}},
      {KOLO_UINT8, "uint8", {"uint8"}},
      {KOLO_INT32, "int32", {"int32", "int"}},
      {KOLO_INT64, "int64", {"int64"}},
      {KOLO_FLOAT16, "half", {"half", "float16", "fp16"}},
      {KOLO_FLOAT32, "float", {"float", "float32", "fp32"}},
      {KOLO_FLOAT64, "double", {"double", "float64", "fp64"}},
      {KOLO_BFLOAT16, "bfloat16", {"bfloat16", "bf16"}},
  };
  return names;
}

// In nccl-tests' order for "-o all".
constexpr std::pair<kolo_op_t, const char*> kOpNames[] = {
    {KOLO_SUM, "sum"}, {KOLO_PROD, "prod"}, {KOLO_MAX, "max"}, {KOLO_MIN, "min"}, {KOLO_AVG, "avg"},
};

std::optional<std::vector<kolo_dtype_t>> parse_dtypes(const std::string& text) {
  std::vector<kolo_dtype_t> dtypes;
  for (const auto& entry : dtype_names()) {
    if (text == "all") {
      dtypes.push_back(entry.dtype);
    } else if (std::find(entry.aliases.begin(), entry.aliases.end(), text) != entry.aliases.end()) {
      return std::vector<kolo_dtype_t>{entry.dtype};
    }
  }
  if (dtypes.empty()) return std::nullopt;
  return dtypes;
}

std::optional<std::vector<kolo_op_t>> parse_ops(const std::string& text) {
  std::vector<kolo_op_t> ops;
  for (const auto& [op, name] : kOpNames) {
    if (text == "all") {
      ops.push_back(op);
    } else if (text == name) {
      return std::vector<kolo_op_t>{op};
    }
  }
  if (ops.empty()) return std::nullopt;
  return ops;
}

// ---- Flags --------------------------------------------------------------------------------------

}  // namespace

namespace detail {

bool probably_rank_zero() {
  for (const char* name :
       {"KOLO_RANK", "OMPI_COMM_WORLD_RANK", "PMI_RANK", "SLURM_PROCID", "PMIX_RANK", "RANK"}) {
    if (const char* value = std::getenv(name)) return std::atoi(value) == 0;
  }
  return true;  // no launcher: a world of one
}

const char* dtype_name(kolo_dtype_t dtype) {
  for (const auto& entry : dtype_names()) {
    if (entry.dtype == dtype) return entry.name;
  }
  return "unknown";
}

const char* op_name(kolo_op_t op) {
  for (const auto& [value, name] : kOpNames) {
    if (value == op) return name;
  }
  return "unknown";
}

std::optional<int> parse_options(int argc, char** argv, const Collective& collective,
                                 Options& options) {
  const std::string program = std::string(collective.name) + "_perf";
  CLI::App app{fmt::format(
      "{}: kolo's {} benchmark, with the flags and the table of nccl-tests' {}.\n"
      "Alone it is a world of one; under a launcher every process is a rank, and rank 0 prints "
      "the table:\n"
      "  {} -b 8 -e 128M -f 2 -g 1\n"
      "  kolorun -np 4 {} -b 8 -e 128M -f 2 -g 1\n"
      "  mpirun -np 4 -x KOLO_ADDR=$(hostname):29500 {} -b 8 -e 128M -f 2\n"
      "Exit status: 0 every element right, 1 a wrong element or a kolo error, 2 a command line "
      "that cannot run here.",
      program, collective.name, program, program, program, program)};
  app.get_formatter()->column_width(34);
  std::string min_text = "32M", max_text = "32M", step_text = "1M";
  std::string dtype_text = "float", op_text = "sum";
  int average = 1, blocking = 0, threads = 1, parallel_init = 0, null_stream = 0;
  int cputime = 0, timestamps = 0, memory_report = 0, device_cta_count = 16;
  std::string gpus_text;
  app.add_option("-t,--nthreads", threads,
                 "threads per process: 1 (kolo has one communicator per process; start more "
                 "processes instead)")
      ->check(CLI::PositiveNumber)
      ->capture_default_str();
  // nccl-tests' -g is GPUs per thread, 1 by default. Here 1 (or -g alone) puts the buffers in GPU
  // memory where a GPU is usable, and says in the header when none is; 0 or no -g: host memory.
  auto* gpu_option =
      app.add_option("-g,--ngpus,--gpu", gpus_text,
                     "0: buffers in host memory (the default); 1 or -g alone: in "
                     "GPU memory where a GPU is usable (device: local rank modulo "
                     "the device count), else in host memory, said in the header")
          ->expected(0, 1)
          ->check([](const std::string& text) -> std::string {
            const bool digits = !text.empty() && text.size() < 9 &&
                                text.find_first_not_of("0123456789") == std::string::npos;
            return text.empty() || digits
                       ? ""
                       : "expected a number of GPUs (0 or 1) or nothing, got " + text;
          });
  app.add_option("-b,--minbytes", min_text, "smallest size in bytes (K, M, G suffixes)")
      ->check(size_error)
      ->capture_default_str();
  app.add_option("-e,--maxbytes", max_text, "largest size in bytes")
      ->check(size_error)
      ->capture_default_str();
  auto* step_option = app.add_option("-i,--stepbytes", step_text,
                                     "increment between sizes, used when the step factor is 1")
                          ->check(size_error)
                          ->capture_default_str();
  auto* factor_option = app.add_option("-f,--stepfactor", options.step_factor,
                                       "multiply the size by this from one row to the next")
                            ->check(CLI::PositiveNumber)
                            ->capture_default_str();
  app.add_option("-n,--iters", options.iterations, "timed iterations per row and placement")
      ->check(CLI::PositiveNumber)
      ->capture_default_str();
  app.add_option("-m,--agg_iters", options.agg_iterations,
                 "calls per timed iteration (the time column is per call)")
      ->check(CLI::PositiveNumber)
      ->capture_default_str();
  app.add_option("-w,--warmup_iters", options.warmup_iterations, "untimed calls before each row")
      ->check(CLI::NonNegativeNumber)
      ->capture_default_str();
  app.add_option("--first", options.first_calls,
                 "time each row's first K calls one by one, before its -w warm-up calls, and "
                 "print them after the row (the warm-up cliff); 0: none")
      ->check(CLI::NonNegativeNumber)
      ->capture_default_str();
  app.add_option("--later_warmup_iters", options.later_warmup_iterations,
                 "untimed calls before each row of the cycles after the first (-N), so that one "
                 "job shows its first rows beside rows after long warm-ups; default: -w")
      ->check(CLI::NonNegativeNumber);
  app.add_option("-N,--run_cycles", options.run_cycles,
                 "measure and print the rows this many times; 0: until interrupted")
      ->check(CLI::NonNegativeNumber)
      ->capture_default_str();
  app.add_option("-p,--parallel_init", parallel_init,
                 "0 or 1; no effect: each process makes one communicator")
      ->check(CLI::Range(0, 1))
      ->capture_default_str();
  app.add_option("-c,--check", options.check_iterations,
                 "checked calls per row and placement, each on fresh input; 0: no check")
      ->check(CLI::NonNegativeNumber)
      ->capture_default_str();
  app.add_option("-o,--op", op_text,
                 collective.reduces ? "sum, prod, max, min, avg or all"
                                    : "accepted, as by nccl-tests; this collective does not reduce")
      ->check([](const std::string& text) -> std::string {
        return parse_ops(text)
                   ? ""
                   : "kolo has no reduction " + text + ": sum, prod, max, min, avg or all";
      })
      ->capture_default_str();
  app.add_option("-d,--datatype", dtype_text,
                 "int8, uint8, int32, int64, half, float, double, bfloat16 or all")
      ->check([](const std::string& text) -> std::string {
        return parse_dtypes(text) ? ""
                                  : "kolo has no data type " + text +
                                        ": int8, uint8, int32, int64, half, float, double, "
                                        "bfloat16 or all";
      })
      ->capture_default_str();
  app.add_option("-r,--root", options.root,
                 collective.rooted ? "root rank"
                                   : "accepted, as by nccl-tests; this collective has no root")
      ->check(CLI::NonNegativeNumber)
      ->capture_default_str();
  app.add_option("-z,--blocking", blocking,
                 "1: wait for each call to finish (kolo's host calls always do; with GPU "
                 "buffers the stream is synchronized after each call)")
      ->check(CLI::Range(0, 1))
      ->capture_default_str();
  app.add_option("-y,--stream_null", null_stream,
                 "1: enqueue on CUDA's default stream (needs GPU buffers)")
      ->check(CLI::Range(0, 1))
      ->capture_default_str();
  app.add_option("-T,--timeout", options.timeout_s,
                 "seconds: the bound on every wait of the run (kolo_config_t.timeout_s); 0: "
                 "KOLO_TIMEOUT")
      ->check(CLI::NonNegativeNumber)
      ->capture_default_str();
  app.add_option("-G,--cudagraph", options.cuda_graph_launches,
                 "CUDA graph replays: only 0 (needs GPU buffers, and kolo's calls cannot be "
                 "captured in a graph)")
      ->check(CLI::NonNegativeNumber)
      ->capture_default_str();
  app.add_option("-C,--report_cputime", cputime,
                 "1: label the time columns cputime (kolo times on the host either way)")
      ->check(CLI::Range(0, 1))
      ->capture_default_str();
  app.add_option("-S,--report_timestamps", timestamps, "1: a timestamp column after each row")
      ->check(CLI::Range(0, 1))
      ->capture_default_str();
  app.add_option("-J,--output_file", options.json_path,
                 "also write the table to this JSON file (rank 0; the suffix must be .json)")
      ->check([](const std::string& text) -> std::string {
        return text.size() > 5 && text.substr(text.size() - 5) == ".json"
                   ? ""
                   : "only JSON output is supported: name a file ending in .json, got " + text;
      });
  app.add_option(
         "-a,--average", average,
         "time reported: 0 rank 0's, 1 the average over ranks, 2 the minimum, 3 the maximum")
      ->check(CLI::Range(0, 3))
      ->capture_default_str();
  app.add_option("-R,--local_register", options.local_register,
                 "NCCL buffer registration: only 0 (1 and 2 need GPU buffers and NCCL)")
      ->check(CLI::Range(0, 2))
      ->capture_default_str();
  app.add_option("-x,--cta_policy", options.cta_policy,
                 "NCCL's CTA policy: not available (needs GPU buffers and NCCL's device API)")
      ->check(CLI::Range(0, 2));
  app.add_option("-D,--device_implementation", options.device_implementation,
                 "NCCL's device API: only 0 (needs GPU buffers and NCCL's device API)")
      ->check(CLI::NonNegativeNumber)
      ->capture_default_str();
  app.add_option("-V,--device_cta_count", device_cta_count,
                 "CTAs of a device implementation; no effect with -D 0")
      ->check(CLI::Range(1, 128))
      ->capture_default_str();
  app.add_option("-M,--memory_report", memory_report,
                 "1: each rank's buffer memory before the table")
      ->check(CLI::Range(0, 1))
      ->capture_default_str();

  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& error) {
    // --help is a success; every other parse error is a usage error, with kolorun's status.
    const bool help = error.get_exit_code() == static_cast<int>(CLI::ExitCodes::Success);
    if (probably_rank_zero()) app.exit(error);
    return help ? 0 : kUsageExitCode;
  }
  options.min_bytes = *parse_size(min_text);
  options.max_bytes = *parse_size(max_text);
  options.step_bytes = *parse_size(step_text);
  // As nccl-tests: a factor above 1 wins; -i alone means steps of -i bytes.
  if (step_option->count() > 0 && factor_option->count() == 0) options.step_factor = 1;
  options.check = options.check_iterations > 0;
  options.dtypes = *parse_dtypes(dtype_text);
  options.ops = collective.reduces ? *parse_ops(op_text) : std::vector<kolo_op_t>{KOLO_SUM};
  options.combine = static_cast<Combine>(average);
  options.blocking = blocking != 0;
  options.null_stream = null_stream != 0;
  options.report_cputime = cputime != 0;
  options.report_timestamps = timestamps != 0;
  options.memory_report = memory_report != 0;
  options.gpu_requested = gpu_option->count() > 0 && gpus_text != "0";
  if (!collective.rooted) options.root = -1;

  std::string problem;
  if (threads != 1) {
    problem = fmt::format(
        "-t {}: kolo runs one communicator per process, so one thread: start {} times as many "
        "processes instead (kolorun -np, mpirun -np)",
        threads, threads);
  } else if (gpu_option->count() > 0 && gpus_text != "" && std::stoi(gpus_text) > 1) {
    problem = fmt::format(
        "-g {}: kolo drives one GPU per process: start one process per GPU (kolorun -np, mpirun "
        "-np) with -g 1",
        gpus_text);
  } else if (options.min_bytes > options.max_bytes) {
    problem = "-b must not be larger than -e";
  } else if (options.step_factor <= 1 && options.step_bytes == 0) {
    problem = "-i must be positive";
  }
  if (!problem.empty()) {
    if (probably_rank_zero()) fmt::print(stderr, "{}: {}\n", program, problem);
    return kUsageExitCode;
  }
  return std::nullopt;
}

std::string gpu_flag_problem(const Options& options, bool gpu_usable, const std::string& reason) {
  // What each flag needs, said once; the host-only sentence adds why this run has no GPU.
  const std::string host_only = fmt::format("this run has no GPU buffers ({})", reason);
  if (options.cuda_graph_launches > 0) {
    return fmt::format(
        "-G {} replays the timed calls as a CUDA graph, which needs GPU buffers, and kolo's calls "
        "cannot be captured in one (they wait on the host): {}",
        options.cuda_graph_launches, gpu_usable ? "use -G 0" : host_only + "; use -G 0");
  }
  if (options.local_register > 0) {
    return fmt::format(
        "-R {} registers the GPU buffers with NCCL, which kolo's benchmarks do not do: {}",
        options.local_register, gpu_usable ? "use -R 0" : host_only + "; use -R 0");
  }
  if (options.cta_policy >= 0 || options.device_implementation > 0) {
    return fmt::format(
        "{} sets an option of NCCL's device API, which needs GPU buffers and which kolo does not "
        "use: {}",
        options.cta_policy >= 0 ? "-x" : "-D",
        gpu_usable ? "leave it out" : host_only + "; leave it out");
  }
  if (options.null_stream && !gpu_usable) {
    return "-y 1 enqueues the calls on CUDA's default stream, which needs GPU buffers (-g 1 on a "
           "host with a usable GPU): " +
           host_only;
  }
  return "";
}

std::vector<uint64_t> row_sizes(const Options& options) {
  std::vector<uint64_t> sizes;
  uint64_t size = options.min_bytes;
  while (size <= options.max_bytes) {
    sizes.push_back(size);
    uint64_t next = 0;
    if (options.step_factor > 1) {
      if (size > options.max_bytes / static_cast<uint64_t>(options.step_factor)) break;
      next = std::max<uint64_t>(size * static_cast<uint64_t>(options.step_factor), 1);
    } else {
      if (size > options.max_bytes - options.step_bytes) break;
      next = size + options.step_bytes;
    }
    size = next;
  }
  return sizes;
}

}  // namespace detail

// ---- Sizes --------------------------------------------------------------------------------------

std::optional<uint64_t> parse_size(const std::string& text) {
  size_t digits = 0;
  while (digits < text.size() && text[digits] >= '0' && text[digits] <= '9') ++digits;
  if (digits == 0 || digits > 18) return std::nullopt;
  uint64_t value = std::stoull(text.substr(0, digits));
  std::string_view unit = std::string_view(text).substr(digits);
  int shift = 0;
  if (!unit.empty()) {
    switch (unit.front()) {
      case 'k':
      case 'K':
        shift = 10;
        break;
      case 'm':
      case 'M':
        shift = 20;
        break;
      case 'g':
      case 'G':
        shift = 30;
        break;
      case 'b':
      case 'B':
        break;
      default:
        return std::nullopt;
    }
    if (shift != 0) unit.remove_prefix(1);
    if (unit != "" && unit != "B" && unit != "b" && unit != "iB") return std::nullopt;
  }
  if (value > (UINT64_MAX >> shift)) return std::nullopt;
  return value << shift;
}

std::string size_error(const std::string& text) {
  return parse_size(text) ? "" : "expected a size such as 8, 64K, 32M or 1G, got " + text;
}

}  // namespace kolo::bench
