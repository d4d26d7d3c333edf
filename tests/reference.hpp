// The independent reference of the multi-process tests (tests/worker.cpp and
// tests/worker_collectives.cpp): inputs as exact small integers, their reductions computed in
// double or 64-bit integer arithmetic with this file's own rounding to the half types, and
// buffer helpers. Nothing here shares code with the library's kernels; it uses kolo.h only for
// the enums.
#pragma once

#include <fmt/format.h>
#include <kolo.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>

namespace kolo::test::reference {

// A reference that cannot be computed is a bug in the test: say so and stop.
[[noreturn]] inline void reference_failure(const std::string& message) {
  fmt::print(stderr, "FAILED: test reference: {}\n", message);
  std::exit(1);
}

// ---- independent encodings ---------------------------------------------------------------------

// Rounds x to a binary format with `mantissa_bits` explicit bits and exponent bias `bias`, round
// to nearest even; only for values in the normal range (or zero), which is all the tests produce.
inline uint16_t encode_small_float(double x, int mantissa_bits, int bias) {
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
    reference_failure(fmt::format("test value {} is outside the normal range", x));
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

inline const TypeInfo kTypes[] = {
    {KOLO_FLOAT32, "float32", 4, true, false}, {KOLO_FLOAT64, "float64", 8, true, false},
    {KOLO_FLOAT16, "float16", 2, true, false}, {KOLO_BFLOAT16, "bfloat16", 2, true, false},
    {KOLO_INT8, "int8", 1, false, false},      {KOLO_UINT8, "uint8", 1, false, true},
    {KOLO_INT32, "int32", 4, false, false},    {KOLO_INT64, "int64", 8, false, false},
    {KOLO_INT16, "int16", 2, false, false},
};
inline const kolo_op_t kOps[] = {KOLO_SUM, KOLO_AVG, KOLO_MIN, KOLO_MAX, KOLO_PROD};
inline const char* op_name(kolo_op_t op) {
  static const char* names[] = {"sum", "avg", "min", "max", "prod"};
  return names[op];
}

// Writes value (exactly representable, or to be rounded once) into element i of buffer.
inline void store(const TypeInfo& type, void* buffer, size_t i, double value) {
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
// operations. int8 and int16 get large values so that their sums wrap around.
inline int64_t input_value(const TypeInfo& type, kolo_op_t op, int rank, uint64_t i) {
  uint64_t mix = (static_cast<uint64_t>(rank) * 7919u + i * 104729u + 13) % 1000003u;
  if (op == KOLO_PROD) {
    static const int64_t signed_factors[] = {1, -1, 2, 1, -1};
    static const int64_t unsigned_factors[] = {1, 3, 2, 1, 1};
    return type.is_unsigned ? unsigned_factors[mix % 5] : signed_factors[mix % 5];
  }
  if (type.dtype == KOLO_INT8) return static_cast<int64_t>(mix % 251) - 125;
  if (type.dtype == KOLO_INT16) return static_cast<int64_t>(mix % 60001) - 30000;
  if (type.is_unsigned) return static_cast<int64_t>(mix % 61);
  return static_cast<int64_t>(mix % 17) - 8;
}

// Wraps an exact integer into the range of an integer dtype, as two's complement does.
inline int64_t wrap(const TypeInfo& type, int64_t value) {
  int bits = static_cast<int>(type.size * 8);
  if (bits == 64) return value;
  uint64_t mask = (uint64_t{1} << bits) - 1;
  uint64_t low = static_cast<uint64_t>(value) & mask;
  if (!type.is_unsigned && (low >> (bits - 1))) return static_cast<int64_t>(low | ~mask);
  return static_cast<int64_t>(low);
}

// The expected element i of a reduction over `ranks` ranks, computed from every rank's input.
inline double expected_value(const TypeInfo& type, kolo_op_t op, uint64_t i, double prescale,
                             double postscale, int ranks) {
  if (type.is_float) {
    double result = 0;
    for (int r = 0; r < ranks; ++r) {
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
    if (op == KOLO_AVG) result /= ranks;
    return result * postscale;
  }
  // Integers: exact in int64 (inputs are small), wrapped to the dtype after each operation
  // (wrapping commutes with + and *), scaled inputs truncated toward zero.
  int64_t result = 0;
  for (int r = 0; r < ranks; ++r) {
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
  if (op == KOLO_AVG) result /= ranks;
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

// ---- buffers -----------------------------------------------------------------------------------

// Test data repeats with a prime period, so that inputs and references for multi-megabyte
// buffers cost a table of kPeriod elements and a few copies. No chunk or segment size used by
// the library is a multiple of it, so misplaced data still shows.
inline constexpr uint64_t kPeriod = 65521;

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

inline size_t first_difference(const void* a, const void* b, size_t count, size_t element) {
  if (std::memcmp(a, b, count * element) == 0) return count;
  for (size_t i = 0; i < count; ++i) {
    if (std::memcmp(static_cast<const unsigned char*>(a) + i * element,
                    static_cast<const unsigned char*>(b) + i * element, element) != 0) {
      return i;
    }
  }
  return count;
}

inline std::string element_text(const TypeInfo& type, const void* buffer, size_t i) {
  const auto* p = static_cast<const unsigned char*>(buffer) + i * type.size;
  uint64_t bits = 0;
  std::memcpy(&bits, p, type.size);
  return fmt::format("0x{:0{}x}", bits, type.size * 2);
}

}  // namespace kolo::test::reference
