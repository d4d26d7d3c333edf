// One rank of a multi-process test. Uses kolo only through the C ABI, and computes every expected
// result itself, from every rank's input, in double or 64-bit integer arithmetic with its own
// rounding to the half types: nothing here shares code with the library's kernels.
//
//   kolo_test_worker allreduce [quick]   every dtype x op x size, in and out of place, scaled
//   kolo_test_worker broadcast           every root x dtype x size
//   kolo_test_worker barrier             nobody leaves before the last one entered
//   kolo_test_worker mismatch KIND       the last rank calls differently; expects MISMATCH
//   kolo_test_worker badargs             invalid arguments, then a working allreduce
//   kolo_test_worker loop SECONDS        allreduce in a loop; reports the status it ends with
//   kolo_test_worker stall SECONDS       the last rank sleeps before its allreduce; reports status
//
// Exit status 0 means every check passed; a failing check prints what it expected and got.
#include <fmt/format.h>
#include <kolo.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

namespace {

int g_rank = 0;
int g_size = 1;

[[noreturn]] void fail(const std::string& message) {
  fmt::print(stderr, "rank {}: FAILED: {}\n", g_rank, message);
  std::exit(1);
}

void check_status(kolo_comm_t comm, kolo_status_t status, const char* what) {
  if (status != KOLO_SUCCESS) {
    fail(fmt::format("{} returned {}: {}", what, kolo_status_string(status),
                     kolo_comm_last_error(comm)));
  }
}

// ---- independent encodings ---------------------------------------------------------------------

// Rounds x to a binary format with `mantissa_bits` explicit bits and exponent bias `bias`, round
// to nearest even; only for values in the normal range (or zero), which is all the tests produce.
uint16_t encode_small_float(double x, int mantissa_bits, int bias) {
  uint16_t sign = std::signbit(x) ? 0x8000 : 0;
  if (x == 0) return sign;
  int exponent;
  double fraction = std::frexp(std::fabs(x), &exponent);  // |x| = fraction * 2^exponent
  int biased = exponent - 1 + bias;
  double mantissa = std::nearbyint((2 * fraction - 1) * (1 << mantissa_bits));
  if (mantissa == (1 << mantissa_bits)) {
    mantissa = 0;
    ++biased;
  }
  if (biased <= 0 || biased >= (1 << (15 - mantissa_bits)) - 1) {
    fail(fmt::format("test value {} is outside the normal range", x));
  }
  return sign | static_cast<uint16_t>(biased << mantissa_bits) | static_cast<uint16_t>(mantissa);
}

struct TypeInfo {
  kolo_dtype_t dtype;
  const char* name;
  size_t size;
  bool is_float;
  bool is_unsigned;
};

const TypeInfo kTypes[] = {
    {KOLO_FLOAT32, "float32", 4, true, false}, {KOLO_FLOAT64, "float64", 8, true, false},
    {KOLO_FLOAT16, "float16", 2, true, false}, {KOLO_BFLOAT16, "bfloat16", 2, true, false},
    {KOLO_INT8, "int8", 1, false, false},      {KOLO_UINT8, "uint8", 1, false, true},
    {KOLO_INT32, "int32", 4, false, false},    {KOLO_INT64, "int64", 8, false, false},
};
const kolo_op_t kOps[] = {KOLO_SUM, KOLO_AVG, KOLO_MIN, KOLO_MAX, KOLO_PROD};
const char* op_name(kolo_op_t op) {
  static const char* names[] = {"sum", "avg", "min", "max", "prod"};
  return names[op];
}

// Writes value (exactly representable, or to be rounded once) into element i of buffer.
void store(const TypeInfo& type, void* buffer, size_t i, double value) {
  auto* bytes = static_cast<unsigned char*>(buffer) + i * type.size;
  switch (type.dtype) {
    case KOLO_FLOAT32: {
      float v = static_cast<float>(value);
      std::memcpy(bytes, &v, 4);
      break;
    }
    case KOLO_FLOAT64:
      std::memcpy(bytes, &value, 8);
      break;
    case KOLO_FLOAT16: {
      uint16_t v = encode_small_float(value, 10, 15);
      std::memcpy(bytes, &v, 2);
      break;
    }
    case KOLO_BFLOAT16: {
      uint16_t v = encode_small_float(value, 7, 127);
      std::memcpy(bytes, &v, 2);
      break;
    }
    default: {
      // Integers: two's complement wrap of the exact value.
      uint64_t v = static_cast<uint64_t>(static_cast<int64_t>(value));
      std::memcpy(bytes, &v, type.size);  // little-endian: the low bytes
    }
  }
}

// The input of `rank` at element i: small integers, so that every sum, product, minimum and
// maximum is exact in every dtype and the expected result does not depend on the order of
// operations. int8 gets large values so that its sums wrap around.
int64_t input_value(const TypeInfo& type, kolo_op_t op, int rank, uint64_t i) {
  uint64_t mix = (static_cast<uint64_t>(rank) * 7919u + i * 104729u + 13) % 1000003u;
  if (op == KOLO_PROD) {
    static const int64_t signed_factors[] = {1, -1, 2, 1, -1};
    static const int64_t unsigned_factors[] = {1, 3, 2, 1, 1};
    return type.is_unsigned ? unsigned_factors[mix % 5] : signed_factors[mix % 5];
  }
  if (type.dtype == KOLO_INT8) return static_cast<int64_t>(mix % 251) - 125;
  if (type.is_unsigned) return static_cast<int64_t>(mix % 61);
  return static_cast<int64_t>(mix % 17) - 8;
}

// Wraps an exact integer into the range of an integer dtype, as two's complement does.
int64_t wrap(const TypeInfo& type, int64_t value) {
  int bits = static_cast<int>(type.size * 8);
  if (bits == 64) return value;
  uint64_t mask = (uint64_t{1} << bits) - 1;
  uint64_t low = static_cast<uint64_t>(value) & mask;
  if (!type.is_unsigned && (low >> (bits - 1))) return static_cast<int64_t>(low | ~mask);
  return static_cast<int64_t>(low);
}

// The expected element i, computed from every rank's input.
double expected_value(const TypeInfo& type, kolo_op_t op, uint64_t i, double prescale,
                      double postscale) {
  if (type.is_float) {
    double result = 0;
    for (int r = 0; r < g_size; ++r) {
      double v = static_cast<double>(input_value(type, op, r, i)) * prescale;
      if (r == 0)
        result = v;
      else if (op == KOLO_SUM || op == KOLO_AVG)
        result += v;
      else if (op == KOLO_MIN)
        result = std::min(result, v);
      else if (op == KOLO_MAX)
        result = std::max(result, v);
      else
        result *= v;
    }
    if (op == KOLO_AVG) result /= g_size;
    return result * postscale;
  }
  // Integers: exact in int64 (inputs are small), wrapped to the dtype after each operation
  // (wrapping commutes with + and *), scaled inputs truncated toward zero.
  int64_t result = 0;
  for (int r = 0; r < g_size; ++r) {
    int64_t raw = input_value(type, op, r, i);
    int64_t v =
        wrap(type, prescale == 1.0 ? raw : static_cast<int64_t>(std::trunc(raw * prescale)));
    if (r == 0)
      result = v;
    else if (op == KOLO_SUM || op == KOLO_AVG)
      result = wrap(type, result + v);
    else if (op == KOLO_MIN)
      result = std::min(result, v);
    else if (op == KOLO_MAX)
      result = std::max(result, v);
    else
      result = wrap(type, result * v);
  }
  if (op == KOLO_AVG) result /= g_size;
  if (postscale != 1.0) {
    // Scaling an integer truncates toward zero and saturates at the type's limits.
    double scaled = std::trunc(static_cast<double>(result) * postscale);
    int bits = static_cast<int>(type.size * 8);
    double high = type.is_unsigned ? std::ldexp(1.0, bits) - 1 : std::ldexp(1.0, bits - 1) - 1;
    double low = type.is_unsigned ? 0 : -std::ldexp(1.0, bits - 1);
    result = static_cast<int64_t>(std::clamp(scaled, low, high));
  }
  return static_cast<double>(result);
}

// ---- scenarios ---------------------------------------------------------------------------------

struct Buffers {
  std::vector<unsigned char> send, recv, expected, input_copy;
  void reserve(size_t bytes) {
    // Allocated once, at the largest size; first touch of fresh memory is slow.
    if (send.size() < bytes) {
      send.resize(bytes);
      recv.resize(bytes);
      expected.resize(bytes);
      input_copy.resize(bytes);
    }
  }
};

// Test data repeats with a prime period, so that inputs and references for multi-megabyte
// buffers cost a table of kPeriod elements and a few copies. No chunk or segment size used by
// the library is a multiple of it, so misplaced data still shows.
constexpr uint64_t kPeriod = 65521;

// Fills count elements of buffer with value(i) for i < kPeriod, repeated.
template <typename Value>
void fill_periodic(const TypeInfo& type, void* buffer, uint64_t count, Value&& value) {
  uint64_t head = std::min(count, kPeriod);
  for (uint64_t i = 0; i < head; ++i) store(type, buffer, i, value(i));
  auto* bytes = static_cast<unsigned char*>(buffer);
  for (uint64_t done = head; done < count;) {
    uint64_t now = std::min(done, count - done);
    std::memcpy(bytes + done * type.size, bytes, now * type.size);
    done += now;
  }
}

size_t first_difference(const void* a, const void* b, size_t count, size_t element) {
  if (std::memcmp(a, b, count * element) == 0) return count;
  for (size_t i = 0; i < count; ++i) {
    if (std::memcmp(static_cast<const unsigned char*>(a) + i * element,
                    static_cast<const unsigned char*>(b) + i * element, element) != 0) {
      return i;
    }
  }
  return count;
}

std::string element_text(const TypeInfo& type, const void* buffer, size_t i) {
  const auto* p = static_cast<const unsigned char*>(buffer) + i * type.size;
  uint64_t bits = 0;
  std::memcpy(&bits, p, type.size);
  return fmt::format("0x{:0{}x}", bits, type.size * 2);
}

int run_allreduce(kolo_comm_t comm, bool quick) {
  const uint64_t big_bytes = (quick ? 256u : 4096u) * 1024;
  Buffers buffers;
  buffers.reserve(big_bytes + 64);
  int checks = 0;
  struct Scale {
    double pre, post;
  };
  const Scale scales[] = {{1.0, 1.0}, {0.5, 2.0}};
  for (const TypeInfo& type : kTypes) {
    const uint64_t sizes[] = {0, 1, static_cast<uint64_t>(g_size - 1), 7919,
                              big_bytes / type.size + 3};
    for (kolo_op_t op : kOps) {
      for (uint64_t count : sizes) {
        for (const Scale& scale : scales) {
          // Scaled runs on the prime size only: enough to check the factors' placement.
          if ((scale.pre != 1.0) && count != 7919) continue;
          if (scale.pre != 1.0 && op == KOLO_PROD) continue;  // 0.5^N leaves the exact range
          for (int in_place = 0; in_place < 2; ++in_place) {
            fill_periodic(type, buffers.send.data(), count, [&](uint64_t i) {
              return static_cast<double>(input_value(type, op, g_rank, i));
            });
            if (in_place == 0) {  // the reference does not depend on the placement
              fill_periodic(type, buffers.expected.data(), count, [&](uint64_t i) {
                return expected_value(type, op, i, scale.pre, scale.post);
              });
            }
            std::memset(buffers.recv.data(), 0xAB, count * type.size);
            const void* send = buffers.send.data();
            void* recv = in_place ? buffers.send.data() : buffers.recv.data();
            std::memcpy(buffers.input_copy.data(), send, count * type.size);
            kolo_status_t status = kolo_allreduce_scaled(comm, send, recv, count, type.dtype, op,
                                                         scale.pre, scale.post);
            std::string what = fmt::format("allreduce {} {} count {} {}{}", type.name, op_name(op),
                                           count, in_place ? "in place" : "out of place",
                                           scale.pre != 1.0 ? " prescale 0.5 postscale 2" : "");
            check_status(comm, status, what.c_str());
            size_t bad = first_difference(recv, buffers.expected.data(), count, type.size);
            if (bad != count) {
              fail(fmt::format("{}: element {} expected {} got {}", what, bad,
                               element_text(type, buffers.expected.data(), bad),
                               element_text(type, recv, bad)));
            }
            if (!in_place && std::memcmp(buffers.input_copy.data(), send, count * type.size) != 0) {
              fail(what + ": the input buffer was modified");
            }
            ++checks;
          }
        }
      }
    }
  }
  fmt::print("rank {}: {} allreduce checks passed\n", g_rank, checks);
  return 0;
}

int run_broadcast(kolo_comm_t comm) {
  Buffers buffers;
  buffers.reserve(4u << 20);
  int checks = 0;
  for (int root = 0; root < g_size; ++root) {
    for (const TypeInfo& type : kTypes) {
      const uint64_t sizes[] = {0, 1, 7919, (3u << 20) / type.size + 5};
      for (uint64_t count : sizes) {
        auto value = [&](uint64_t i) {
          return static_cast<double>((i * 31 + root * 7) % 200) - 100;
        };
        fill_periodic(type, buffers.expected.data(), count, value);
        if (g_rank == root) {
          std::memcpy(buffers.recv.data(), buffers.expected.data(), count * type.size);
        } else {
          std::memset(buffers.recv.data(), 0xCD, count * type.size);
        }
        std::string what = fmt::format("broadcast {} count {} root {}", type.name, count, root);
        check_status(comm, kolo_broadcast(comm, buffers.recv.data(), count, type.dtype, root),
                     what.c_str());
        size_t bad =
            first_difference(buffers.recv.data(), buffers.expected.data(), count, type.size);
        if (bad != count) {
          fail(fmt::format("{}: element {} expected {} got {}", what, bad,
                           element_text(type, buffers.expected.data(), bad),
                           element_text(type, buffers.recv.data(), bad)));
        }
        ++checks;
      }
    }
  }
  fmt::print("rank {}: {} broadcast checks passed\n", g_rank, checks);
  return 0;
}

double now_seconds() {
  return std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
}

int run_barrier(kolo_comm_t comm) {
  for (int round = 0; round < 3; ++round) {
    // A different rank arrives last in each round.
    int late = round % g_size;
    if (g_rank == late) std::this_thread::sleep_for(std::chrono::milliseconds(300));
    double entered = now_seconds();
    check_status(comm, kolo_barrier(comm), "barrier");
    double left = now_seconds();
    double last_entry = entered;
    double first_exit = left;
    check_status(comm, kolo_allreduce(comm, &last_entry, &last_entry, 1, KOLO_FLOAT64, KOLO_MAX),
                 "allreduce max");
    check_status(comm, kolo_allreduce(comm, &first_exit, &first_exit, 1, KOLO_FLOAT64, KOLO_MIN),
                 "allreduce min");
    if (first_exit < last_entry) {
      fail(
          fmt::format("round {}: a rank left the barrier at {:.6f}, before the last entered at "
                      "{:.6f}",
                      round, first_exit, last_entry));
    }
  }
  fmt::print("rank {}: barrier checks passed\n", g_rank);
  return 0;
}

int run_mismatch(kolo_comm_t comm, const std::string& kind) {
  std::vector<float> data(1000, 1.0f);
  bool odd = g_rank == g_size - 1;
  kolo_status_t status;
  if (kind == "count") {
    status =
        kolo_allreduce(comm, data.data(), data.data(), odd ? 999 : 1000, KOLO_FLOAT32, KOLO_SUM);
  } else if (kind == "dtype") {
    status = kolo_allreduce(comm, data.data(), data.data(), 500, odd ? KOLO_INT32 : KOLO_FLOAT32,
                            KOLO_SUM);
  } else if (kind == "op") {
    status = kolo_allreduce(comm, data.data(), data.data(), 1000, KOLO_FLOAT32,
                            odd ? KOLO_MAX : KOLO_SUM);
  } else if (kind == "collective") {
    status = odd ? kolo_broadcast(comm, data.data(), 1000, KOLO_FLOAT32, 0)
                 : kolo_allreduce(comm, data.data(), data.data(), 1000, KOLO_FLOAT32, KOLO_SUM);
  } else if (kind == "root") {
    status = kolo_broadcast(comm, data.data(), 1000, KOLO_FLOAT32, odd ? 1 % g_size : 0);
  } else if (kind == "scale") {
    status = kolo_allreduce_scaled(comm, data.data(), data.data(), 1000, KOLO_FLOAT32, KOLO_SUM,
                                   odd ? 0.5 : 1.0, 1.0);
  } else {
    fail("unknown mismatch kind " + kind);
  }
  fmt::print("rank {}: status {} message: {}\n", g_rank, kolo_status_string(status),
             kolo_comm_last_error(comm));
  if (status != KOLO_ERR_MISMATCH) fail("expected KOLO_ERR_MISMATCH");
  // The communicator is broken now, and says so again.
  kolo_status_t again = kolo_barrier(comm);
  if (again != KOLO_ERR_MISMATCH) {
    fail(fmt::format("a later call returned {} instead of the same KOLO_ERR_MISMATCH",
                     kolo_status_string(again)));
  }
  return 0;
}

int run_badargs(kolo_comm_t comm) {
  std::vector<float> data(100, 1.0f);
  struct Case {
    const char* what;
    kolo_status_t status;
    const char* must_mention;
  };
  const Case cases[] = {
      {"NULL sendbuf", kolo_allreduce(comm, nullptr, data.data(), 100, KOLO_FLOAT32, KOLO_SUM),
       "sendbuf"},
      {"NULL recvbuf", kolo_allreduce(comm, data.data(), nullptr, 100, KOLO_FLOAT32, KOLO_SUM),
       "recvbuf"},
      {"unknown dtype",
       kolo_allreduce(comm, data.data(), data.data(), 100, static_cast<kolo_dtype_t>(42), KOLO_SUM),
       "dtype"},
      {"unknown op",
       kolo_allreduce(comm, data.data(), data.data(), 100, KOLO_FLOAT32, static_cast<kolo_op_t>(9)),
       "op"},
      {"overlap", kolo_allreduce(comm, data.data(), data.data() + 1, 50, KOLO_FLOAT32, KOLO_SUM),
       "overlap"},
      {"NaN scale",
       kolo_allreduce_scaled(comm, data.data(), data.data(), 100, KOLO_FLOAT32, KOLO_SUM, NAN, 1.0),
       "finite"},
      {"negative root", kolo_broadcast(comm, data.data(), 100, KOLO_FLOAT32, -1), "root"},
      {"root too large", kolo_broadcast(comm, data.data(), 100, KOLO_FLOAT32, g_size), "root"},
      {"NULL broadcast buffer", kolo_broadcast(comm, nullptr, 100, KOLO_FLOAT32, 0), "NULL"},
      {"NULL communicator",
       kolo_allreduce(nullptr, data.data(), data.data(), 100, KOLO_FLOAT32, KOLO_SUM), nullptr},
      {"NULL rank pointer", kolo_comm_rank(comm, nullptr), "NULL"},
  };
  for (const Case& c : cases) {
    if (c.status != KOLO_ERR_INVALID_ARGUMENT) {
      fail(fmt::format("{}: expected KOLO_ERR_INVALID_ARGUMENT, got {}", c.what,
                       kolo_status_string(c.status)));
    }
  }
  // The last error names the problem (checked for the last case with a communicator).
  if (!std::strstr(kolo_comm_last_error(comm), "NULL")) {
    fail(fmt::format("last error does not name the problem: '{}'", kolo_comm_last_error(comm)));
  }
  if (kolo_comm_destroy(nullptr) != KOLO_ERR_INVALID_ARGUMENT) fail("destroy(NULL) accepted");
  // NULL with count 0 is fine.
  check_status(comm, kolo_allreduce(comm, nullptr, nullptr, 0, KOLO_FLOAT32, KOLO_SUM),
               "allreduce of count 0 with NULL buffers");
  // And the communicator still works.
  check_status(comm, kolo_allreduce(comm, data.data(), data.data(), 100, KOLO_FLOAT32, KOLO_SUM),
               "allreduce after invalid arguments");
  for (float v : data) {
    if (v != static_cast<float>(g_size)) fail(fmt::format("allreduce after bad args gave {}", v));
  }
  fmt::print("rank {}: bad-argument checks passed\n", g_rank);
  return 0;
}

// Allreduces 4 MiB in a loop for `seconds` (or until a failure) and reports how it ended:
// "status <NAME> after <t> s since last success: <message>".
int run_loop(kolo_comm_t comm, double seconds) {
  std::vector<float> data(1u << 20, 1.0f);
  auto start = std::chrono::steady_clock::now();
  auto last_success = start;
  long iterations = 0;
  kolo_status_t status = KOLO_SUCCESS;
  fmt::print("rank {}: looping\n", g_rank);
  std::fflush(stdout);
  // Rank 0's clock decides when to stop, so that every rank runs the same number of iterations.
  int32_t keep_going = 1;
  while (keep_going) {
    status = kolo_allreduce(comm, data.data(), data.data(), data.size(), KOLO_FLOAT32, KOLO_AVG);
    if (status != KOLO_SUCCESS) break;
    keep_going = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count() <
                 seconds;
    status = kolo_broadcast(comm, &keep_going, 1, KOLO_INT32, 0);
    if (status != KOLO_SUCCESS) break;
    last_success = std::chrono::steady_clock::now();
    ++iterations;
  }
  double since =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - last_success).count();
  fmt::print("rank {}: status {} after {:.3f} s since last success ({} iterations): {}\n", g_rank,
             kolo_status_string(status), since, iterations, kolo_comm_last_error(comm));
  return status == KOLO_SUCCESS ? 0 : 3;
}

// The last rank arrives `seconds` late; the others report the status their allreduce ended with.
int run_stall(kolo_comm_t comm, double seconds) {
  if (g_rank == g_size - 1) {
    std::this_thread::sleep_for(std::chrono::duration<double>(seconds));
  }
  std::vector<float> data(1000, 1.0f);
  auto start = std::chrono::steady_clock::now();
  kolo_status_t status =
      kolo_allreduce(comm, data.data(), data.data(), data.size(), KOLO_FLOAT32, KOLO_SUM);
  double waited = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  fmt::print("rank {}: status {} after {:.3f} s: {}\n", g_rank, kolo_status_string(status), waited,
             kolo_comm_last_error(comm));
  return status == KOLO_SUCCESS ? 0 : 3;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 2) {
    std::fprintf(stderr, "usage: kolo_test_worker SCENARIO [ARG]\n");
    return 2;
  }
  std::string scenario = argv[1];
  std::string argument = argc > 2 ? argv[2] : "";
  kolo_config_t config = KOLO_CONFIG_INITIALIZER;
  kolo_comm_t comm = nullptr;
  kolo_status_t status = kolo_comm_init(&config, &comm);
  if (status != KOLO_SUCCESS) {
    fmt::print(stderr, "init failed: {}: {}\n", kolo_status_string(status),
               kolo_comm_last_error(nullptr));
    return 4;
  }
  kolo_comm_rank(comm, &g_rank);
  kolo_comm_size(comm, &g_size);
  int result = 0;
  if (scenario == "allreduce")
    result = run_allreduce(comm, argument == "quick");
  else if (scenario == "broadcast")
    result = run_broadcast(comm);
  else if (scenario == "barrier")
    result = run_barrier(comm);
  else if (scenario == "mismatch")
    result = run_mismatch(comm, argument);
  else if (scenario == "badargs")
    result = run_badargs(comm);
  else if (scenario == "stall")
    result = run_stall(comm, std::atof(argument.c_str()));
  else if (scenario == "loop")
    result = run_loop(comm, argument.empty() ? 5.0 : std::atof(argument.c_str()));
  else
    fail("unknown scenario " + scenario);
  if (kolo_comm_destroy(comm) != KOLO_SUCCESS) fail("destroy failed");
  return result;
}
