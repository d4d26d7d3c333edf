// The inputs and the reference: the element types (float16 and bfloat16 are stored as bits and
// accumulated in float32), every rank's deterministic input, the reduction computed here element
// by element, and count_wrong(), which compares a result with it. perf_common.hpp says why these
// inputs make every reduction exact.
#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include "perf_internal.hpp"

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
    case KOLO_INT16:
      return function(std::type_identity<int16_t>{});
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

}  // namespace

namespace detail {

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

}  // namespace detail

// ---- Public -------------------------------------------------------------------------------------

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

}  // namespace kolo::bench
