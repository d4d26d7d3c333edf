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

// The launchers' rank variables, read before the communicator exists so that a bad flag or
// --help prints once and not once per rank.
bool probably_rank_zero() {
  for (const char* name :
       {"KOLO_RANK", "OMPI_COMM_WORLD_RANK", "PMI_RANK", "SLURM_PROCID", "RANK"}) {
    if (const char* value = std::getenv(name)) return std::atoi(value) == 0;
  }
  return true;
}

}  // namespace

namespace detail {

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
  CLI::App app{
      fmt::format("{}_perf: kolo's {} benchmark, with the flags and the table of nccl-tests.\n"
                  "Run it under a launcher, for example: kolorun -np 4 {}_perf -b 8 -e 128M -f 2",
                  collective.name, collective.name, collective.name)};
  std::string min_text = "32M", max_text = "32M", step_text = "1M";
  std::string dtype_text = "float", op_text = "sum";
  int check = 1, average = 1, blocking = 0, threads = 1;
  std::string gpus_text;
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
  app.add_option("-n,--iters", options.iterations, "timed calls per row and placement")
      ->check(CLI::PositiveNumber)
      ->capture_default_str();
  app.add_option("-w,--warmup_iters", options.warmup_iterations, "untimed calls before each row")
      ->check(CLI::NonNegativeNumber)
      ->capture_default_str();
  app.add_option("-c,--check", check, "check the results (0 or 1)")
      ->check(CLI::NonNegativeNumber)
      ->capture_default_str();
  app.add_option("-d,--datatype", dtype_text,
                 "int8, uint8, int32, int64, half, float, double, bfloat16 or all")
      ->check([](const std::string& text) -> std::string {
        return parse_dtypes(text) ? "" : "unknown data type " + text;
      })
      ->capture_default_str();
  // -o and -r are accepted by every benchmark, as by nccl-tests, so that one command line can
  // drive them all; a collective that does not reduce, or has no root, ignores them.
  app.add_option("-o,--op", op_text,
                 collective.reduces ? "sum, prod, max, min, avg or all" : "ignored: no reduction")
      ->check([](const std::string& text) -> std::string {
        return parse_ops(text) ? "" : "unknown reduction " + text;
      })
      ->capture_default_str();
  app.add_option("-r,--root", options.root, collective.rooted ? "root rank" : "ignored: no root")
      ->check(CLI::NonNegativeNumber)
      ->capture_default_str();
  app.add_option(
         "-a,--average", average,
         "time reported: 0 rank 0's, 1 the average over ranks, 2 the minimum, 3 the maximum")
      ->check(CLI::Range(0, 3))
      ->capture_default_str();
  app.add_option("-z,--blocking", blocking, "accepted for nccl-tests; kolo's collectives block")
      ->check(CLI::Range(0, 1));
  app.add_option("-t,--nthreads", threads, "threads per process (only 1)")->check(CLI::Range(1, 1));
  // nccl-tests' -g (GPUs per thread, here 1) puts the buffers in GPU memory, as there; "-g" alone
  // too. Without it (or with -g 0) they are in host memory.
  auto* gpu_option =
      app.add_option("-g,--ngpus,--gpu", gpus_text,
                     "1 or nothing: buffers in GPU memory (device: local rank modulo the device "
                     "count); 0 or absent: host memory")
          ->expected(0, 1)
          ->check(CLI::IsMember({"", "0", "1"}));

  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& error) {
    if (!probably_rank_zero()) return error.get_exit_code();
    return app.exit(error);
  }
  options.min_bytes = *parse_size(min_text);
  options.max_bytes = *parse_size(max_text);
  options.step_bytes = *parse_size(step_text);
  // As nccl-tests: a factor above 1 wins; -i alone means steps of -i bytes.
  if (step_option->count() > 0 && factor_option->count() == 0) options.step_factor = 1;
  options.check = check != 0;
  options.dtypes = *parse_dtypes(dtype_text);
  options.ops = collective.reduces ? *parse_ops(op_text) : std::vector<kolo_op_t>{KOLO_SUM};
  options.combine = static_cast<Combine>(average);
  options.gpu = gpu_option->count() > 0 && gpus_text != "0";
  if (!collective.rooted) options.root = -1;

  std::string problem;
  if (options.min_bytes > options.max_bytes) problem = "-b must not be larger than -e";
  if (options.step_factor <= 1 && options.step_bytes == 0) problem = "-i must be positive";
  if (!problem.empty()) {
    if (probably_rank_zero()) fmt::print(stderr, "{}\n", problem);
    return 1;
  }
  return std::nullopt;
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
