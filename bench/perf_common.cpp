// The benchmark harness: flags, buffers, timing, the reference results and nccl-tests' table.
// See perf_common.hpp for what a benchmark provides and what the harness does with it.
//
// One row is measured like this, on every rank:
//   warm up          -w calls out of place
//   out of place     barrier, -n calls, time / n;  then, with -c, one call on fresh input, compared
//   in place         barrier, -n calls, time / n;  then, with -c, one call on fresh input, compared
// The per-rank times are then combined across ranks (-a: the average by default, as nccl-tests),
// and the #wrong counts summed. Inputs are written before each timed batch so that floating-point
// timing never runs on denormal leftovers; the repeated in-place calls change the values (sums
// grow to infinity, which costs nothing extra), which is why each check starts from fresh input.
#include "perf_common.hpp"

#include <fmt/core.h>
#include <unistd.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <bit>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <type_traits>
#include <utility>
#include <vector>

#include "gpu_memory.hpp"

namespace kolo::bench {
namespace {

// ---- Element types ------------------------------------------------------------------------------

// The two 16-bit floating types are stored as bits; these tags let templates tell them apart.
struct Half {
  uint16_t bits;
};
struct BFloat16 {
  uint16_t bits;
};

float half_to_float(uint16_t half) {
  const uint32_t sign = static_cast<uint32_t>(half & 0x8000u) << 16;
  const uint32_t exponent = (half >> 10) & 0x1fu;
  const uint32_t mantissa = half & 0x3ffu;
  if (exponent == 0) {  // zero or subnormal: mantissa * 2^-24
    const float magnitude = std::ldexp(static_cast<float>(mantissa), -24);
    return sign ? -magnitude : magnitude;
  }
  if (exponent == 31) return std::bit_cast<float>(sign | 0x7f800000u | (mantissa << 13));
  return std::bit_cast<float>(sign | ((exponent + 112) << 23) | (mantissa << 13));
}

// Round to nearest, ties to even; NaN stays NaN and anything from 65520 up becomes infinity.
uint16_t float_to_half(float value) {
  const uint32_t bits = std::bit_cast<uint32_t>(value);
  const auto sign = static_cast<uint16_t>((bits >> 16) & 0x8000u);
  uint32_t magnitude = bits & 0x7fffffffu;
  if (magnitude > 0x7f800000u) return sign | 0x7e00u;   // NaN
  if (magnitude >= 0x477ff000u) return sign | 0x7c00u;  // 65520 and above round to infinity
  if (magnitude >= 0x38800000u) {                       // a normal half (2^-14 and above)
    magnitude += 0xfffu + ((magnitude >> 13) & 1u);     // round the 13 dropped bits to even
    return static_cast<uint16_t>(sign | ((magnitude - 0x38000000u) >> 13));
  }
  // Subnormal or zero: the result is magnitude * 2^24 rounded to an integer (exact scaling, then
  // the default rounding mode, which is to nearest even). 1024 is the smallest normal, correctly.
  const float scaled = std::bit_cast<float>(magnitude) * 16777216.0f;
  return static_cast<uint16_t>(sign | static_cast<uint16_t>(std::nearbyint(scaled)));
}

float bfloat16_to_float(uint16_t value) {
  return std::bit_cast<float>(static_cast<uint32_t>(value) << 16);
}

uint16_t float_to_bfloat16(float value) {
  const uint32_t bits = std::bit_cast<uint32_t>(value);
  if ((bits & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((bits >> 16) | 0x40u);
  return static_cast<uint16_t>((bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16);
}

// How the reference computes with an element type: in Accumulator, converting on the way in
// (widen) and out (narrow), as kolo's kernels do.
template <class Element>
struct Arithmetic {
  using Accumulator = Element;
  static Accumulator widen(Element value) { return value; }
  static Element narrow(Accumulator value) { return value; }
};
template <>
struct Arithmetic<Half> {
  using Accumulator = float;
  static float widen(Half value) { return half_to_float(value.bits); }
  static Half narrow(float value) { return Half{float_to_half(value)}; }
};
template <>
struct Arithmetic<BFloat16> {
  using Accumulator = float;
  static float widen(BFloat16 value) { return bfloat16_to_float(value.bits); }
  static BFloat16 narrow(float value) { return BFloat16{float_to_bfloat16(value)}; }
};

// Calls function(std::type_identity<Element>{}) with the element type of dtype.
template <class Function>
decltype(auto) with_element_type(kolo_dtype_t dtype, Function&& function) {
  switch (dtype) {
    case KOLO_FLOAT64:
      return function(std::type_identity<double>{});
    case KOLO_FLOAT16:
      return function(std::type_identity<Half>{});
    case KOLO_BFLOAT16:
      return function(std::type_identity<BFloat16>{});
    case KOLO_INT8:
      return function(std::type_identity<int8_t>{});
    case KOLO_UINT8:
      return function(std::type_identity<uint8_t>{});
    case KOLO_INT32:
      return function(std::type_identity<int32_t>{});
    case KOLO_INT64:
      return function(std::type_identity<int64_t>{});
    case KOLO_FLOAT32:
      break;
  }
  return function(std::type_identity<float>{});
}

// Calls function(std::integral_constant<kolo_op_t, op>{}), so that loops are compiled per op.
template <class Function>
decltype(auto) with_op(kolo_op_t op, Function&& function) {
  switch (op) {
    case KOLO_AVG:
      return function(std::integral_constant<kolo_op_t, KOLO_AVG>{});
    case KOLO_MIN:
      return function(std::integral_constant<kolo_op_t, KOLO_MIN>{});
    case KOLO_MAX:
      return function(std::integral_constant<kolo_op_t, KOLO_MAX>{});
    case KOLO_PROD:
      return function(std::integral_constant<kolo_op_t, KOLO_PROD>{});
    case KOLO_SUM:
      break;
  }
  return function(std::integral_constant<kolo_op_t, KOLO_SUM>{});
}

// ---- Inputs and the reference -------------------------------------------------------------------

// 64 well-mixed bits for (rank, index): the inputs look random to the algorithm under test, so a
// misplaced segment or a rank's contribution counted twice shows up in #wrong.
uint64_t input_bits(int rank, uint64_t index) {
  uint64_t bits =
      index * 0x9e3779b97f4a7c15ull + (static_cast<uint64_t>(rank) + 1) * 0xd1b54a32d192ed03ull;
  bits ^= bits >> 31;
  bits *= 0xbf58476d1ce4e5b9ull;
  bits ^= bits >> 29;
  return bits;
}

// An integer in [low, high] taken from the top bits (a multiply, not a division: this runs for
// every element of every rank).
int pick(uint64_t bits, int low, int high) {
  const uint64_t range = static_cast<uint64_t>(high - low + 1);
  return low + static_cast<int>(((bits >> 32) * range) >> 32);
}

// The input of `rank` at element `index`. Floating types get small integers, so that sums of
// a few ranks are exact even in bfloat16 (8 significant bits) and every product is a power of
// two; integer AVG gets small values too (its sum must not wrap before the division), and the
// other integer ops get all the bits (PROD odd ones, so that products do not collapse to zero).
template <class Element, kolo_op_t kOp>
Element input_value(int rank, uint64_t index) {
  const uint64_t bits = input_bits(rank, index);
  if constexpr (std::is_integral_v<Element>) {
    if constexpr (kOp == KOLO_AVG) {
      return static_cast<Element>(std::is_signed_v<Element> ? pick(bits, -4, 4) : pick(bits, 0, 8));
    } else if constexpr (kOp == KOLO_PROD) {
      return static_cast<Element>(bits | 1u);
    } else {
      return static_cast<Element>(bits);
    }
  } else {
    float value = 0.0f;
    if constexpr (kOp == KOLO_SUM || kOp == KOLO_AVG) {
      value = static_cast<float>(pick(bits, -4, 4));
    } else if constexpr (kOp == KOLO_MIN || kOp == KOLO_MAX) {
      value = static_cast<float>(pick(bits, -100, 100));
    } else {
      static constexpr float kFactors[4] = {-2.0f, -1.0f, 1.0f, 2.0f};
      value = kFactors[pick(bits, 0, 3)];
    }
    return Arithmetic<Element>::narrow(
        static_cast<typename Arithmetic<Element>::Accumulator>(value));
  }
}

// a OP b in the accumulator type; integer SUM and PROD wrap around (computed unsigned, then
// converted back, which C++20 defines as modular).
template <class Accumulator, kolo_op_t kOp>
Accumulator combine(Accumulator a, Accumulator b) {
  if constexpr (kOp == KOLO_MIN) {
    return std::min(a, b);
  } else if constexpr (kOp == KOLO_MAX) {
    return std::max(a, b);
  } else if constexpr (std::is_integral_v<Accumulator>) {
    const auto x = static_cast<uint64_t>(a);
    const auto y = static_cast<uint64_t>(b);
    return static_cast<Accumulator>(kOp == KOLO_PROD ? x * y : x + y);
  } else {
    return kOp == KOLO_PROD ? a * b : a + b;
  }
}

template <class Element, kolo_op_t kOp>
void reduce_reference(Element* out, uint64_t count, uint64_t first_index, int ranks) {
  using Math = Arithmetic<Element>;
  using Accumulator = typename Math::Accumulator;
  for (uint64_t i = 0; i < count; ++i) {
    const uint64_t index = first_index + i;
    Accumulator accumulator = Math::widen(input_value<Element, kOp>(0, index));
    for (int rank = 1; rank < ranks; ++rank) {
      accumulator = combine<Accumulator, kOp>(accumulator,
                                              Math::widen(input_value<Element, kOp>(rank, index)));
    }
    if constexpr (kOp == KOLO_AVG && std::is_integral_v<Accumulator>) {
      accumulator = static_cast<Accumulator>(static_cast<int64_t>(accumulator) / ranks);
    } else if constexpr (kOp == KOLO_AVG) {
      accumulator = accumulator / static_cast<Accumulator>(ranks);
    }
    out[i] = Math::narrow(accumulator);
  }
}

// The number of elements of got that differ in value from expected (so NaN never matches, and
// +0 matches -0).
uint64_t count_wrong(kolo_dtype_t dtype, const void* got, const void* expected, uint64_t count) {
  const size_t bytes = count * kolo_dtype_size(dtype);
  if (bytes == 0 || std::memcmp(got, expected, bytes) == 0) return 0;
  return with_element_type(dtype, [&]<class Element>(std::type_identity<Element>) {
    const auto* a = static_cast<const Element*>(got);
    const auto* b = static_cast<const Element*>(expected);
    uint64_t wrong = 0;
    for (uint64_t i = 0; i < count; ++i) {
      if (!(Arithmetic<Element>::widen(a[i]) == Arithmetic<Element>::widen(b[i]))) ++wrong;
    }
    return wrong;
  });
}

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

const char* dtype_name(kolo_dtype_t dtype) {
  for (const auto& entry : dtype_names()) {
    if (entry.dtype == dtype) return entry.name;
  }
  return "unknown";
}

// In nccl-tests' order for "-o all".
constexpr std::pair<kolo_op_t, const char*> kOpNames[] = {
    {KOLO_SUM, "sum"}, {KOLO_PROD, "prod"}, {KOLO_MAX, "max"}, {KOLO_MIN, "min"}, {KOLO_AVG, "avg"},
};

const char* op_name(kolo_op_t op) {
  for (const auto& [value, name] : kOpNames) {
    if (value == op) return name;
  }
  return "unknown";
}

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

enum class Combine { kRankZero = 0, kAverage = 1, kMinimum = 2, kMaximum = 3 };

struct Options {
  uint64_t min_bytes = 32u << 20;
  uint64_t max_bytes = 32u << 20;
  uint64_t step_bytes = 1u << 20;  // used when step_factor is 1
  int step_factor = 2;
  int iterations = 20;
  int warmup_iterations = 5;
  bool check = true;
  std::vector<kolo_dtype_t> dtypes = {KOLO_FLOAT32};
  std::vector<kolo_op_t> ops = {KOLO_SUM};
  int root = 0;
  Combine combine = Combine::kAverage;
  bool gpu = false;  // -g: buffers in GPU memory
};

// The launchers' rank variables, read before the communicator exists so that a bad flag or
// --help prints once and not once per rank.
bool probably_rank_zero() {
  for (const char* name :
       {"KOLO_RANK", "OMPI_COMM_WORLD_RANK", "PMI_RANK", "SLURM_PROCID", "RANK"}) {
    if (const char* value = std::getenv(name)) return std::atoi(value) == 0;
  }
  return true;
}

// Parses argv into options; on --help or a bad flag returns the exit code to end with.
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

// ---- Buffers ------------------------------------------------------------------------------------

struct FreeDeleter {
  void operator()(void* pointer) const { std::free(pointer); }
};
using Buffer = std::unique_ptr<std::byte, FreeDeleter>;

// Page-aligned, and touched once here so that no timed call pays for first-touch page faults.
Buffer allocate_touched(uint64_t bytes) {
  constexpr uint64_t kPage = 4096;
  const uint64_t rounded = std::max<uint64_t>((bytes + kPage - 1) / kPage * kPage, kPage);
  auto* memory = static_cast<std::byte*>(std::aligned_alloc(kPage, rounded));
  if (memory == nullptr) {
    fmt::print(stderr, "cannot allocate {} bytes of benchmark buffers\n", rounded);
    std::exit(1);
  }
  std::memset(memory, 0, rounded);
  return Buffer(memory);
}

struct DeviceDeleter {
  void operator()(std::byte* pointer) const { gpu::release(pointer); }
};
using DeviceBuffer = std::unique_ptr<std::byte, DeviceDeleter>;

struct Buffers {
  Buffer send;      // out of place: sendbuf
  Buffer recv;      // out of place: recvbuf; in place: the one buffer
  Buffer expected;  // the reference result
  // With -g, what the collective sees instead of send and recv; inputs are written to the host
  // buffers and copied over, results copied back, at the same offsets.
  DeviceBuffer device_send;
  DeviceBuffer device_recv;
};

Buffers allocate_buffers(const Options& options, const Collective& collective, int rank,
                         int ranks) {
  uint64_t send_bytes = 0, recv_bytes = 0, expected_bytes = 0;
  const std::vector<uint64_t> sizes = row_sizes(options);
  for (kolo_dtype_t dtype : options.dtypes) {
    const size_t element = kolo_dtype_size(dtype);
    for (uint64_t bytes : sizes) {
      const Shape shape = collective.shape(bytes, element, rank, ranks);
      const uint64_t in_place = std::max(shape.in_place_send_offset + shape.send_count,
                                         shape.in_place_recv_offset + shape.recv_count);
      send_bytes = std::max(send_bytes, shape.send_count * element);
      recv_bytes = std::max(recv_bytes, std::max(shape.recv_count, in_place) * element);
      expected_bytes = std::max(expected_bytes, shape.recv_count * element);
    }
  }
  Buffers buffers;
  buffers.send = allocate_touched(send_bytes);
  buffers.recv = allocate_touched(recv_bytes);
  if (options.check) buffers.expected = allocate_touched(expected_bytes);
  if (options.gpu) {
    buffers.device_send.reset(static_cast<std::byte*>(gpu::allocate(send_bytes)));
    buffers.device_recv.reset(static_cast<std::byte*>(gpu::allocate(recv_bytes)));
  }
  return buffers;
}

// ---- Output -------------------------------------------------------------------------------------

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

void print_parameters(Printer& out, const Options& options) {
  const bool by_factor = options.step_factor > 1;
  out.line(
      "# nThread 1 nGpus 1 minBytes {} maxBytes {} step: {}({}) warmup iters: {} iters: {} "
      "agg iters: 1 validation: {} graph: 0",
      options.min_bytes, options.max_bytes,
      by_factor ? static_cast<uint64_t>(options.step_factor) : options.step_bytes,
      by_factor ? "factor" : "bytes", options.warmup_iterations, options.iterations,
      options.check ? 1 : 0);
  out.line("#");
}

// Lists every rank with its pid and host, gathered with two allgathers.
void print_ranks(Printer& out, kolo_comm_t comm, int ranks, bool gpu) {
  constexpr size_t kHostBytes = 64;
  int local_rank = 0;
  check(comm, kolo_comm_local_rank(comm, &local_rank));
  const int64_t mine[2] = {static_cast<int64_t>(getpid()), local_rank};
  std::vector<int64_t> numbers(2 * static_cast<size_t>(ranks));
  check(comm, kolo_allgather(comm, mine, numbers.data(), 2, KOLO_INT64));
  char host[kHostBytes] = {};
  gethostname(host, kHostBytes - 1);
  std::vector<uint8_t> hosts(kHostBytes * static_cast<size_t>(ranks));
  check(comm, kolo_allgather(comm, host, hosts.data(), kHostBytes, KOLO_UINT8));

  out.line("# Using devices");
  for (int r = 0; r < ranks; ++r) {
    const std::string host_name(reinterpret_cast<const char*>(&hosts[kHostBytes * r]));
    out.line("#  Rank {:2} Group  0 Pid {:6} on {:>10} device {:2} {}", r, numbers[2 * r],
             host_name, numbers[2 * r + 1], gpu ? "[gpu] GPU memory" : "[host] CPU memory");
  }
  out.line("#");
}

void print_column_headers(Printer& out) {
  out.line(
      "# {:>10}  {:>12}  {:>8}  {:>6}  {:>6}           out-of-place                       "
      "in-place          ",
      "", "", "", "", "");
  out.line(
      "# {:>10}  {:>12}  {:>8}  {:>6}  {:>6}  {:>7}  {:>6}  {:>6} {:>6}  {:>7}  {:>6}  {:>6} {:>6}",
      "size", "count", "type", "redop", "root", "time", "algbw", "busbw", "#wrong", "time", "algbw",
      "busbw", "#wrong");
  out.line(
      "# {:>10}  {:>12}  {:>8}  {:>6}  {:>6}  {:>7}  {:>6}  {:>6}  {:>5}  {:>7}  {:>6}  {:>6}  "
      "{:>5}",
      "(B)", "(elements)", "", "", "", "(us)", "(GB/s)", "(GB/s)", "", "(us)", "(GB/s)", "(GB/s)",
      "");
}

// nccl-tests' time column: fewer decimals as the time grows, always 7 characters wide.
std::string format_time(double microseconds) {
  if (microseconds >= 10000.0) return fmt::format("{:7.0f}", microseconds);
  if (microseconds >= 100.0) return fmt::format("{:7.1f}", microseconds);
  return fmt::format("{:7.2f}", microseconds);
}

// ---- Measuring ----------------------------------------------------------------------------------

struct Placement {
  double seconds = 0;  // per call, combined across ranks
  uint64_t wrong = 0;  // summed across ranks
};

// Seconds per call of this rank, over a batch that every rank starts together.
double time_calls(const Collective& collective, const Operation& operation, const void* sendbuf,
                  void* recvbuf, int calls) {
  // With -g the calls are enqueued on a stream: the batch starts on an idle stream and ends when
  // the stream has run it, as nccl-tests times it.
  if (operation.stream) {
    check(operation.comm, kolo_stream_synchronize(operation.comm, operation.stream));
  }
  check(operation.comm, kolo_barrier(operation.comm));
  const auto start = std::chrono::steady_clock::now();
  for (int call = 0; call < calls; ++call) {
    check(operation.comm, collective.run(operation, sendbuf, recvbuf));
  }
  if (operation.stream) {
    check(operation.comm, kolo_stream_synchronize(operation.comm, operation.stream));
  }
  const std::chrono::duration<double> elapsed = std::chrono::steady_clock::now() - start;
  return elapsed.count() / calls;
}

// Combines per-rank values as -a asks: rank 0's, or their average, minimum or maximum.
void combine_across_ranks(kolo_comm_t comm, Combine combine, double* values, uint64_t count) {
  switch (combine) {
    case Combine::kRankZero:
      check(comm, kolo_broadcast(comm, values, count, KOLO_FLOAT64, 0));
      return;
    case Combine::kAverage:
      check(comm, kolo_allreduce(comm, values, values, count, KOLO_FLOAT64, KOLO_AVG));
      return;
    case Combine::kMinimum:
      check(comm, kolo_allreduce(comm, values, values, count, KOLO_FLOAT64, KOLO_MIN));
      return;
    case Combine::kMaximum:
      check(comm, kolo_allreduce(comm, values, values, count, KOLO_FLOAT64, KOLO_MAX));
      return;
  }
}

class Runner {
 public:
  Runner(const Collective& collective, const Options& options, kolo_comm_t comm, int rank,
         int ranks, void* stream)
      : collective_(collective),
        options_(options),
        comm_(comm),
        rank_(rank),
        ranks_(ranks),
        out_(rank == 0),
        buffers_(allocate_buffers(options, collective, rank, ranks)),
        stream_(stream) {}

  int run() {
    print_parameters(out_, options_);
    print_ranks(out_, comm_, ranks_, options_.gpu);
    print_column_headers(out_);
    const std::vector<uint64_t> sizes = row_sizes(options_);
    for (kolo_dtype_t dtype : options_.dtypes) {
      for (kolo_op_t op : options_.ops) {
        for (uint64_t bytes : sizes) run_row(dtype, op, bytes);
      }
    }
    out_.line("# Out of bounds values : {} {}", total_wrong_, total_wrong_ == 0 ? "OK" : "FAILED");
    out_.line("# Avg bus bandwidth    : {:g} ", placements_ == 0 ? 0.0 : busbw_sum_ / placements_);
    out_.line("#");
    return total_wrong_ == 0 ? 0 : 1;
  }

 private:
  void run_row(kolo_dtype_t dtype, kolo_op_t op, uint64_t bytes) {
    const size_t element = kolo_dtype_size(dtype);
    Operation operation{comm_,
                        rank_,
                        ranks_,
                        dtype,
                        op,
                        options_.root,
                        collective_.shape(bytes, element, rank_, ranks_)};
    if (collective_.output_on_root_only && rank_ != options_.root) operation.shape.recv_count = 0;
    operation.stream = stream_;
    const Shape& shape = operation.shape;
    const uint64_t send_bytes = shape.send_count * element;
    const uint64_t recv_bytes = shape.recv_count * element;
    std::byte* send = buffers_.send.get();
    std::byte* recv = buffers_.recv.get();
    std::byte* in_place_send = recv + shape.in_place_send_offset * element;
    std::byte* in_place_recv = recv + shape.in_place_recv_offset * element;
    // What the collective sees: the host buffers, or with -g their device twins.
    std::byte* run_send = stream_ ? buffers_.device_send.get() : send;
    std::byte* run_recv = stream_ ? buffers_.device_recv.get() : recv;
    std::byte* run_in_place_send = run_recv + shape.in_place_send_offset * element;
    std::byte* run_in_place_recv = run_recv + shape.in_place_recv_offset * element;
    if (options_.check) collective_.expected_output(operation, buffers_.expected.get());

    collective_.init_input(operation, send);
    upload(run_send, send, send_bytes);
    for (int call = 0; call < options_.warmup_iterations; ++call) {
      check(comm_, collective_.run(operation, run_send, run_recv));
    }

    double seconds[2] = {0, 0};
    int64_t wrong[2] = {0, 0};
    seconds[0] = time_calls(collective_, operation, run_send, run_recv, options_.iterations);
    if (options_.check) {
      collective_.init_input(operation, send);
      upload(run_send, send, send_bytes);
      // Unwritten elements show as wrong.
      std::memset(recv, 0xa5, recv_bytes);
      if (stream_) gpu::fill(run_recv, 0xa5, recv_bytes, stream_);
      check(comm_, collective_.run(operation, run_send, run_recv));
      download(recv, run_recv, recv_bytes);
      wrong[0] =
          static_cast<int64_t>(count_wrong(dtype, recv, buffers_.expected.get(), shape.recv_count));
    }

    collective_.init_input(operation, in_place_send);
    upload(run_in_place_send, in_place_send, send_bytes);
    seconds[1] = time_calls(collective_, operation, run_in_place_send, run_in_place_recv,
                            options_.iterations);
    if (options_.check) {
      collective_.init_input(operation, in_place_send);
      upload(run_in_place_send, in_place_send, send_bytes);
      check(comm_, collective_.run(operation, run_in_place_send, run_in_place_recv));
      download(in_place_recv, run_in_place_recv, recv_bytes);
      wrong[1] = static_cast<int64_t>(
          count_wrong(dtype, in_place_recv, buffers_.expected.get(), shape.recv_count));
    }

    combine_across_ranks(comm_, options_.combine, seconds, 2);
    check(comm_, kolo_allreduce(comm_, wrong, wrong, 2, KOLO_INT64, KOLO_SUM));

    const uint64_t row_bytes = std::max(shape.send_count, shape.recv_count) * element;
    std::string line =
        fmt::format("{:12}  {:12}  {:>8}  {:>6}  {:6}", row_bytes, shape.count, dtype_name(dtype),
                    collective_.reduces ? op_name(op) : "none", operation.root);
    for (int placement = 0; placement < 2; ++placement) {
      const double algbw = seconds[placement] > 0 ? row_bytes / seconds[placement] / 1e9 : 0.0;
      const double busbw = algbw * collective_.busbw_factor(ranks_);
      busbw_sum_ += busbw;
      ++placements_;
      total_wrong_ += static_cast<uint64_t>(wrong[placement]);
      line += fmt::format("  {}  {:6.2f}  {:6.2f}  {:>5}", format_time(seconds[placement] * 1e6),
                          algbw, busbw,
                          options_.check ? std::to_string(wrong[placement]) : std::string("N/A"));
    }
    out_.line("{}", line);
  }

  // With -g: host to device before a call (on the stream the calls use, so in order with them),
  // and device to host once the stream has run the call. Nothing to do with host buffers.
  void upload(std::byte* device, const std::byte* host, uint64_t bytes) {
    if (stream_) gpu::copy_to_device(device, host, bytes, stream_);
  }
  void download(std::byte* host, const std::byte* device, uint64_t bytes) {
    if (!stream_) return;
    check(comm_, kolo_stream_synchronize(comm_, stream_));
    gpu::copy_to_host(host, device, bytes, stream_);
  }

  const Collective& collective_;
  const Options& options_;
  kolo_comm_t comm_;
  int rank_;
  int ranks_;
  Printer out_;
  Buffers buffers_;
  void* stream_;  // with -g; nullptr otherwise
  double busbw_sum_ = 0;
  uint64_t placements_ = 0;
  uint64_t total_wrong_ = 0;
};

}  // namespace

// ---- Public -------------------------------------------------------------------------------------

void check(kolo_comm_t comm, kolo_status_t status) {
  if (status == KOLO_SUCCESS) return;
  std::fprintf(stderr, "kolo error: %s: %s\n", kolo_status_string(status),
               kolo_comm_last_error(comm));
  std::exit(1);
}

Shape same_count_shape(uint64_t bytes, size_t element_size) {
  const uint64_t count = bytes / element_size;
  return Shape{count, count, count, 0, 0};
}

void fill_input(const Operation& operation, int source_rank, void* buffer, uint64_t count,
                uint64_t first_index) {
  with_element_type(operation.dtype, [&]<class Element>(std::type_identity<Element>) {
    with_op(operation.op, [&]<kolo_op_t kOp>(std::integral_constant<kolo_op_t, kOp>) {
      auto* out = static_cast<Element*>(buffer);
      for (uint64_t i = 0; i < count; ++i)
        out[i] = input_value<Element, kOp>(source_rank, first_index + i);
    });
  });
}

void fill_reduced(const Operation& operation, void* buffer, uint64_t count, uint64_t first_index) {
  with_element_type(operation.dtype, [&]<class Element>(std::type_identity<Element>) {
    with_op(operation.op, [&]<kolo_op_t kOp>(std::integral_constant<kolo_op_t, kOp>) {
      reduce_reference<Element, kOp>(static_cast<Element*>(buffer), count, first_index,
                                     operation.ranks);
    });
  });
}

int run_benchmark(int argc, char** argv, const Collective& collective) {
  Options options;
  if (const std::optional<int> exit_code = parse_options(argc, argv, collective, options)) {
    return *exit_code;
  }
  kolo_comm_t comm = nullptr;
  check(nullptr, kolo_comm_init(nullptr, &comm));
  int rank = 0, ranks = 1;
  check(comm, kolo_comm_rank(comm, &rank));
  check(comm, kolo_comm_size(comm, &ranks));
  if (collective.rooted && options.root >= ranks) {
    if (rank == 0)
      fmt::print(stderr, "-r {} is not a rank: there are {} ranks\n", options.root, ranks);
    kolo_comm_destroy(comm);
    return 1;
  }
  void* stream = nullptr;
  if (options.gpu) {
    std::string reason;
    if (!collective.gpu || !gpu::available(&reason)) {
      if (rank == 0) {
        fmt::print(stderr, "-g: {}\n",
                   collective.gpu ? reason
                                  : fmt::format("{}_perf has no GPU mode", collective.name));
      }
      kolo_comm_destroy(comm);
      return 1;
    }
    int local_rank = 0;
    check(comm, kolo_comm_local_rank(comm, &local_rank));
    const std::string device = gpu::select_device(local_rank);
    if (rank == 0) fmt::print("# GPU buffers: rank 0 on {}\n", device);
    stream = gpu::create_stream();
  }
  int exit_code = 0;
  {
    Runner runner(collective, options, comm, rank, ranks, stream);
    exit_code = runner.run();
  }
  if (stream) gpu::destroy_stream(stream);
  if (const kolo_status_t status = kolo_comm_destroy(comm); status != KOLO_SUCCESS) {
    std::fprintf(stderr, "kolo error: %s: kolo_comm_destroy failed\n", kolo_status_string(status));
    return 1;
  }
  return exit_code;
}

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
