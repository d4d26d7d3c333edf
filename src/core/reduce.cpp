// Reduction kernels: what they compute is specified in reduce.hpp; this is how.
//
// Layers. Three primitive kernels do the arithmetic, over arrays of one accumulator type
// (float32, float64, int8, uint8, int16, int32, int64):
//   load      partial = prescale(own)
//   combine   out = in OP prescale(own)
//   finalize  values = postscale(values / ranks), in place: AVG's division and the postscale
// and two convert between a half type and float32 (widen, narrow). The public functions compose
// them over blocks of 1024 elements, which stay in L1 from one step to the next:
//   finish = combine, then finalize        single = load, then finalize
// For float16 and bfloat16 a block of `own` is first widened to float32, and finish/single
// narrow the float32 result, so a half reduction does exactly the arithmetic of a float32 one
// and rounds to half once. Doing finish in two steps changes no result: the intermediate is
// stored in the accumulator type it was computed in.
//
// Dispatch. Each primitive switches on dtype, op, and whether prescale and postscale are 1.0,
// and runs a loop instantiated for that combination: nothing is decided inside a loop. The loops
// are plain element-wise loops that GCC auto-vectorises (all but the int64 ones that convert to
// double, and int64 AVG: x86 before AVX-512 has no vector instruction for them). They use only
// operations whose vector and scalar forms give the same bits (IEEE +, *, /, compare-and-select,
// integer arithmetic, conversions with one defined result) and never reorder an element's
// operations, so the vector body and the scalar tail of a loop agree exactly. (One liberty: when
// two NaNs meet in + or *, x86 returns the first operand's payload, and which operand is first
// is the compiler's choice. The result is NaN either way.)
//
// Multiversioning. The primitives are always_inline templates, expanded twice: into entry
// functions compiled for the build's baseline (x86-64-v2 in kolo), and into entry functions with
// __attribute__((target("avx2,f16c"))). The public functions pick one set from cpuid, once: what
// target_clones does, except that it can require F16C as well. The AVX2 set converts float16
// with vcvtph2ps/vcvtps2ph, which round exactly like decode_float16/encode_float16 below
// (tests/test_reduce.cpp compares them). Neither set enables FMA, and contraction is off for
// this file, so a multiply followed by an add always rounds twice.
//
// Aliasing. partial_out may equal partial_in, and out may equal own, so the loops take no
// __restrict pointers: GCC's run-time overlap check accepts two equal pointers and keeps the
// vector loop, and falls back to the scalar loop for a partial overlap, which stays correct.

#include "core/reduce.hpp"

#include <algorithm>
#include <bit>
#include <cstddef>
#include <limits>
#include <type_traits>

#if defined(__x86_64__)
#include <cpuid.h>
#include <immintrin.h>
#define KOLO_REDUCE_X86 1
#else
#define KOLO_REDUCE_X86 0
#endif

// Two settings that the results and the speed of this file must not depend on:
//  - contraction: GCC's default for C++ is -ffp-contract=fast, even with -std=c++20; where FMA is
//    available it would fuse a*b+c into one rounding, and results would depend on -march.
//  - vectorisation: at -O2 (Meson's debugoptimized) GCC 12 vectorises only loops that need no
//    run-time checks or scalar tails, which is none of these.
#if defined(__clang__)
#pragma clang fp contract(off)
#elif defined(__GNUC__)
#pragma GCC optimize("fp-contract=off", "tree-vectorize", "vect-cost-model=dynamic")
#endif

#define KOLO_INLINE __attribute__((always_inline)) inline
#define KOLO_TARGET_AVX2 __attribute__((target("avx2,f16c")))

namespace kolo {
namespace {

// ---------------------------------------------------------------------------------------------
// Half-precision conversions, portable. They are integer-only and written as selects, not
// branches, with shifts by constants: GCC will not if-convert a floating-point operation (it
// might trap) and SSE has no per-lane variable shift, so these are forms that vectorise on every
// target.

// float16 -> float32 is exact. NaN is made quiet (payload kept), as vcvtph2ps does.
KOLO_INLINE float decode_float16(uint16_t half) {
  const uint32_t sign = static_cast<uint32_t>(half & 0x8000u) << 16;
  const uint32_t exponent = (half >> 10) & 0x1fu;
  const uint32_t mantissa = half & 0x3ffu;

  // Normal: rebias the exponent from 15 to 127.
  const uint32_t normal = ((exponent + 112u) << 23) | (mantissa << 13);

  // Subnormal, mantissa * 2^-24: a normal float32. Shift the mantissa left by `lead` until its
  // leading one reaches bit 10 (the implicit bit), in steps of 8, 4, 2, 1.
  uint32_t shifted = mantissa;
  uint32_t lead = 0;
  lead = shifted < (1u << 3) ? lead + 8u : lead;
  shifted = shifted < (1u << 3) ? shifted << 8 : shifted;
  lead = shifted < (1u << 7) ? lead + 4u : lead;
  shifted = shifted < (1u << 7) ? shifted << 4 : shifted;
  lead = shifted < (1u << 9) ? lead + 2u : lead;
  shifted = shifted < (1u << 9) ? shifted << 2 : shifted;
  lead = shifted < (1u << 10) ? lead + 1u : lead;
  shifted = shifted < (1u << 10) ? shifted << 1 : shifted;
  const uint32_t subnormal =
      mantissa == 0 ? 0u : ((113u - lead) << 23) | ((shifted & 0x3ffu) << 13);

  // Infinity, or NaN with the quiet bit set.
  const uint32_t special = 0x7f800000u | (mantissa << 13) | (mantissa != 0 ? 0x400000u : 0u);

  uint32_t magnitude = exponent == 0 ? subnormal : normal;
  magnitude = exponent == 0x1f ? special : magnitude;
  return std::bit_cast<float>(sign | magnitude);
}

// float32 -> float16, rounding to nearest even. Overflow gives infinity; NaN stays NaN, made
// quiet with the top payload bits kept, as vcvtps2ph does.
KOLO_INLINE uint16_t encode_float16(float value) {
  const uint32_t bits = std::bit_cast<uint32_t>(value);
  const uint32_t sign = (bits >> 16) & 0x8000u;
  const uint32_t magnitude = bits & 0x7fffffffu;

  // |value| >= 2^-14: rebias the exponent (127 -> 15) and round away the 13 low bits, to
  // nearest even (adding 0xfff plus the lowest kept bit carries exactly when the dropped bits
  // are above half, or at half with an odd result). A carry out of the mantissa moves into the
  // exponent, as it should; from 65520 up it reaches 0x7c00, infinity. Larger values are first
  // clamped to 2^16, which gives infinity too.
  const uint32_t clamped = magnitude < 0x47800000u ? magnitude : 0x47800000u;
  const uint32_t normal = (clamped - (112u << 23) + 0xfffu + ((clamped >> 13) & 1u)) >> 13;

  // |value| < 2^-14: subnormal or zero. The significand (with its implicit bit) is shifted right
  // by 14 + extra, extra = 112 - exponent, and rounded to nearest even. The `extra` part goes in
  // steps of 8, 4, 2, 1, collecting the bits shifted out into a sticky bit; at 15 everything is
  // gone anyway (float32 zeros and subnormals included). Rounding up to 0x400 gives the smallest
  // normal half, which is right.
  const uint32_t exponent = magnitude >> 23;
  uint32_t extra = 112u - (exponent < 112u ? exponent : 112u);
  extra = extra < 15u ? extra : 15u;
  uint32_t significand = (magnitude & 0x7fffffu) | 0x800000u;
  uint32_t sticky = 0;
  sticky |= (extra & 8u) ? significand & 0xffu : 0u;
  significand = (extra & 8u) ? significand >> 8 : significand;
  sticky |= (extra & 4u) ? significand & 0xfu : 0u;
  significand = (extra & 4u) ? significand >> 4 : significand;
  sticky |= (extra & 2u) ? significand & 0x3u : 0u;
  significand = (extra & 2u) ? significand >> 2 : significand;
  sticky |= (extra & 1u) ? significand & 0x1u : 0u;
  significand = (extra & 1u) ? significand >> 1 : significand;
  significand |= sticky != 0 ? 1u : 0u;
  const uint32_t subnormal = (significand + 0x1fffu + ((significand >> 14) & 1u)) >> 14;

  const uint32_t nan = 0x7e00u | ((magnitude >> 13) & 0x3ffu);

  uint32_t result = magnitude < 0x38800000u ? subnormal : normal;
  result = magnitude > 0x7f800000u ? nan : result;
  return static_cast<uint16_t>(sign | result);
}

// bfloat16 -> float32 is exact; NaN is made quiet, like float16's.
KOLO_INLINE float decode_bfloat16(uint16_t value) {
  uint32_t bits = static_cast<uint32_t>(value) << 16;
  bits |= (bits & 0x7fffffffu) > 0x7f800000u ? 0x400000u : 0u;
  return std::bit_cast<float>(bits);
}

// float32 -> bfloat16: round the low 16 bits away, to nearest even; a carry moves into the
// exponent, up to infinity. NaN is made quiet.
KOLO_INLINE uint16_t encode_bfloat16(float value) {
  const uint32_t bits = std::bit_cast<uint32_t>(value);
  const uint32_t rounded = (bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16;
  const uint32_t nan = (bits >> 16) | 0x40u;
  return static_cast<uint16_t>((bits & 0x7fffffffu) > 0x7f800000u ? nan : rounded);
}

// ---------------------------------------------------------------------------------------------
// How one value is scaled, combined and finished.

// Floats scale in their own type (the factor is rounded to it once); integers scale in double.
// AVG divides floats in their own type; integers are divided exactly, truncating toward zero.
template <typename Acc>
struct Factors {
  static constexpr bool kFloat = std::is_floating_point_v<Acc>;
  using Scale = std::conditional_t<kFloat, Acc, double>;
  using Divisor = std::conditional_t<kFloat, Acc, int64_t>;

  Scale prescale;
  Scale postscale;
  Divisor ranks;
};

template <typename Acc>
Factors<Acc> make_factors(const ReduceSpec& spec) {
  using F = Factors<Acc>;
  // A reduction has at least one contribution; a nonsensical count must not divide by zero.
  const int ranks = spec.ranks < 1 ? 1 : spec.ranks;
  return F{static_cast<typename F::Scale>(spec.prescale),
           static_cast<typename F::Scale>(spec.postscale), static_cast<typename F::Divisor>(ranks)};
}

// value * factor computed in double, truncated toward zero, saturated to Int's range (a cast of
// an out-of-range double is undefined behaviour). A NaN product (0 * infinity) gives 0.
template <typename Int>
KOLO_INLINE Int scale_integer(Int value, double factor) {
  constexpr Int kLowest = std::numeric_limits<Int>::lowest();
  constexpr Int kHighest = std::numeric_limits<Int>::max();
  const double scaled = static_cast<double>(value) * factor;
  if constexpr (sizeof(Int) < sizeof(int64_t)) {
    // Every Int is exactly a double. Only an in-range value is converted, and the saturated
    // ones are merged in with masks: branch-free code that GCC keeps branch-free, so it
    // vectorises (with plain selects it threads the constants into branches).
    using Unsigned = std::make_unsigned_t<Int>;
    const bool below = scaled < static_cast<double>(kLowest);
    const bool above = scaled > static_cast<double>(kHighest);
    const bool in_range = !(below | above | (scaled != scaled));
    const auto converted = static_cast<Unsigned>(static_cast<Int>(in_range ? scaled : 0.0));
    const auto below_mask = static_cast<Unsigned>(Unsigned{0} - static_cast<Unsigned>(below));
    const auto above_mask = static_cast<Unsigned>(Unsigned{0} - static_cast<Unsigned>(above));
    return static_cast<Int>(converted | (below_mask & static_cast<Unsigned>(kLowest)) |
                            (above_mask & static_cast<Unsigned>(kHighest)));
  } else {
    static_assert(std::is_signed_v<Int>);
    // INT64_MAX is not a double; 2^63 is the first double out of range.
    if (scaled != scaled) return 0;
    if (scaled >= 0x1p63) return kHighest;
    if (scaled < -0x1p63) return kLowest;
    return static_cast<Int>(scaled);
  }
}

template <typename Acc>
KOLO_INLINE Acc scale_value(Acc value, typename Factors<Acc>::Scale factor) {
  if constexpr (std::is_floating_point_v<Acc>) {
    return value * factor;
  } else {
    return scale_integer(value, factor);
  }
}

template <bool kPrescale, typename Acc>
KOLO_INLINE Acc prescaled(Acc value, typename Factors<Acc>::Scale factor) {
  if constexpr (kPrescale) {
    return scale_value(value, factor);
  } else {
    return value;
  }
}

// partial OP own. Integer SUM and PROD wrap around: the arithmetic is done in unsigned arithmetic
// of at least the width of unsigned int and converted back modulo 2^n.
//
// Float MIN and MAX propagate NaN: if either operand is NaN the result is NaN (the partial's
// when both are), so a NaN anywhere makes the reduction NaN, whatever the order of ranks. Two
// equal values (such as -0 and +0) give `own`, so the result depends only on the order of
// combination, which the algorithm fixes.
template <ReduceOp kOp, typename Acc>
KOLO_INLINE Acc combine_values(Acc partial, Acc own) {
  if constexpr (kOp == ReduceOp::kMin) {
    if constexpr (std::is_floating_point_v<Acc>) {
      return (partial < own || partial != partial) ? partial : own;
    } else {
      return partial < own ? partial : own;
    }
  } else if constexpr (kOp == ReduceOp::kMax) {
    if constexpr (std::is_floating_point_v<Acc>) {
      return (partial > own || partial != partial) ? partial : own;
    } else {
      return partial > own ? partial : own;
    }
  } else if constexpr (std::is_floating_point_v<Acc>) {
    return kOp == ReduceOp::kProd ? partial * own : partial + own;
  } else {
    // Narrow types are widened to unsigned int: promoted to (signed) int, the product of two
    // 16-bit values could overflow.
    using Unsigned = std::make_unsigned_t<Acc>;
    using Wide = std::conditional_t<(sizeof(Acc) < sizeof(unsigned)), unsigned, Unsigned>;
    const Wide a = static_cast<Unsigned>(partial);
    const Wide b = static_cast<Unsigned>(own);
    return static_cast<Acc>(static_cast<Unsigned>(kOp == ReduceOp::kProd ? a * b : a + b));
  }
}

// AVG's division, then the postscale.
template <bool kAvg, bool kPostscale, typename Acc>
KOLO_INLINE Acc finish_value(Acc value, const Factors<Acc>& factors) {
  if constexpr (kAvg) {
    if constexpr (std::is_floating_point_v<Acc>) {
      value = value / factors.ranks;
    } else if constexpr (sizeof(Acc) < sizeof(int64_t)) {
      // Truncating double division equals integer division here, and vectorises: the quotient
      // of |value| < 2^31 by ranks is either an exact integer or at least 1/ranks away from
      // one, while its rounding error is under 2^-22/ranks.
      value = static_cast<Acc>(static_cast<double>(value) / static_cast<double>(factors.ranks));
    } else {
      value = static_cast<Acc>(value / factors.ranks);  // truncates toward zero
    }
  }
  if constexpr (kPostscale) value = scale_value(value, factors.postscale);
  return value;
}

// ---------------------------------------------------------------------------------------------
// The loops. Factors come by value: a local copy cannot alias the arrays, so nothing is
// reloaded inside a loop.

template <bool kPrescale, typename Acc>
KOLO_INLINE void load_loop(Acc* partial, const Acc* own, size_t count, Factors<Acc> factors) {
  for (size_t i = 0; i < count; ++i) partial[i] = prescaled<kPrescale>(own[i], factors.prescale);
}

template <ReduceOp kOp, bool kPrescale, typename Acc>
KOLO_INLINE void combine_loop(Acc* out, const Acc* in, const Acc* own, size_t count,
                              Factors<Acc> factors) {
  for (size_t i = 0; i < count; ++i) {
    out[i] = combine_values<kOp>(in[i], prescaled<kPrescale>(own[i], factors.prescale));
  }
}

template <bool kAvg, bool kPostscale, typename Acc>
KOLO_INLINE void finalize_loop(Acc* values, size_t count, Factors<Acc> factors) {
  for (size_t i = 0; i < count; ++i) values[i] = finish_value<kAvg, kPostscale>(values[i], factors);
}

// ---------------------------------------------------------------------------------------------
// Run-time flags and op to template arguments.

struct Flags {
  bool prescale;   // prescale != 1.0
  bool avg;        // op == AVG
  bool postscale;  // postscale != 1.0
  bool finalize() const { return avg || postscale; }
};

Flags make_flags(const ReduceSpec& spec) {
  return {spec.prescale != 1.0, spec.op == ReduceOp::kAvg, spec.postscale != 1.0};
}

template <typename Acc>
KOLO_INLINE void load_acc(void* partial, const void* own, size_t count, const ReduceSpec& spec) {
  auto* partial_acc = static_cast<Acc*>(partial);
  const auto* own_acc = static_cast<const Acc*>(own);
  if (make_flags(spec).prescale) {
    load_loop<true>(partial_acc, own_acc, count, make_factors<Acc>(spec));
  } else {
    load_loop<false>(partial_acc, own_acc, count, make_factors<Acc>(spec));
  }
}

template <ReduceOp kOp, typename Acc>
KOLO_INLINE void combine_acc_op(Acc* out, const Acc* in, const Acc* own, size_t count,
                                const ReduceSpec& spec) {
  if (make_flags(spec).prescale) {
    combine_loop<kOp, true>(out, in, own, count, make_factors<Acc>(spec));
  } else {
    combine_loop<kOp, false>(out, in, own, count, make_factors<Acc>(spec));
  }
}

// AVG combines like SUM; an invalid op does nothing (callers validate specs first).
template <typename Acc>
KOLO_INLINE void combine_acc(void* out, const void* in, const void* own, size_t count,
                             const ReduceSpec& spec) {
  auto* out_acc = static_cast<Acc*>(out);
  const auto* in_acc = static_cast<const Acc*>(in);
  const auto* own_acc = static_cast<const Acc*>(own);
  switch (spec.op) {
    case ReduceOp::kSum:
    case ReduceOp::kAvg:
      return combine_acc_op<ReduceOp::kSum>(out_acc, in_acc, own_acc, count, spec);
    case ReduceOp::kMin:
      return combine_acc_op<ReduceOp::kMin>(out_acc, in_acc, own_acc, count, spec);
    case ReduceOp::kMax:
      return combine_acc_op<ReduceOp::kMax>(out_acc, in_acc, own_acc, count, spec);
    case ReduceOp::kProd:
      return combine_acc_op<ReduceOp::kProd>(out_acc, in_acc, own_acc, count, spec);
  }
}

template <typename Acc>
KOLO_INLINE void finalize_acc(void* values, size_t count, const ReduceSpec& spec) {
  auto* values_acc = static_cast<Acc*>(values);
  const Factors<Acc> factors = make_factors<Acc>(spec);
  const Flags flags = make_flags(spec);
  if (flags.avg && flags.postscale) {
    finalize_loop<true, true>(values_acc, count, factors);
  } else if (flags.avg) {
    finalize_loop<true, false>(values_acc, count, factors);
  } else if (flags.postscale) {
    finalize_loop<false, true>(values_acc, count, factors);
  }
}

// Calls Primitive::run<Acc>(args...) for an accumulator dtype.
template <typename Primitive, typename... Args>
KOLO_INLINE void for_acc_type(DataType acc_type, Args&&... args) {
  switch (acc_type) {
    case DataType::kFloat32:
      return Primitive::template run<float>(args...);
    case DataType::kFloat64:
      return Primitive::template run<double>(args...);
    case DataType::kInt8:
      return Primitive::template run<int8_t>(args...);
    case DataType::kUInt8:
      return Primitive::template run<uint8_t>(args...);
    case DataType::kInt16:
      return Primitive::template run<int16_t>(args...);
    case DataType::kInt32:
      return Primitive::template run<int32_t>(args...);
    case DataType::kInt64:
      return Primitive::template run<int64_t>(args...);
    case DataType::kFloat16:
    case DataType::kBFloat16:
      return;  // not an accumulator type
  }
}

struct Load {
  template <typename Acc>
  KOLO_INLINE static void run(void* partial, const void* own, size_t count,
                              const ReduceSpec& spec) {
    load_acc<Acc>(partial, own, count, spec);
  }
};
struct Combine {
  template <typename Acc>
  KOLO_INLINE static void run(void* out, const void* in, const void* own, size_t count,
                              const ReduceSpec& spec) {
    combine_acc<Acc>(out, in, own, count, spec);
  }
};
struct Finalize {
  template <typename Acc>
  KOLO_INLINE static void run(void* values, size_t count, const ReduceSpec& spec) {
    finalize_acc<Acc>(values, count, spec);
  }
};

// ---------------------------------------------------------------------------------------------
// Half conversions of blocks.

enum class Isa { kPortable, kAvx2 };

#if KOLO_REDUCE_X86
KOLO_TARGET_AVX2 void widen_float16_f16c(float* out, const uint16_t* in, size_t count) {
  size_t i = 0;
  for (; i + 8 <= count; i += 8) {
    const __m128i halves = _mm_loadu_si128(reinterpret_cast<const __m128i*>(in + i));
    _mm256_storeu_ps(out + i, _mm256_cvtph_ps(halves));
  }
  for (; i < count; ++i) out[i] = decode_float16(in[i]);
}

KOLO_TARGET_AVX2 void narrow_float16_f16c(uint16_t* out, const float* in, size_t count) {
  size_t i = 0;
  for (; i + 8 <= count; i += 8) {
    const __m128i halves = _mm256_cvtps_ph(_mm256_loadu_ps(in + i), _MM_FROUND_TO_NEAREST_INT);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(out + i), halves);
  }
  for (; i < count; ++i) out[i] = encode_float16(in[i]);
}
#endif

template <Isa kIsa>
KOLO_INLINE void widen_halves(DataType dtype, float* __restrict out, const uint16_t* __restrict in,
                              size_t count) {
  if (dtype == DataType::kBFloat16) {
    for (size_t i = 0; i < count; ++i) out[i] = decode_bfloat16(in[i]);
    return;
  }
#if KOLO_REDUCE_X86
  if constexpr (kIsa == Isa::kAvx2) {
    widen_float16_f16c(out, in, count);
    return;
  }
#endif
  for (size_t i = 0; i < count; ++i) out[i] = decode_float16(in[i]);
}

template <Isa kIsa>
KOLO_INLINE void narrow_halves(DataType dtype, uint16_t* __restrict out, const float* __restrict in,
                               size_t count) {
  if (dtype == DataType::kBFloat16) {
    for (size_t i = 0; i < count; ++i) out[i] = encode_bfloat16(in[i]);
    return;
  }
#if KOLO_REDUCE_X86
  if constexpr (kIsa == Isa::kAvx2) {
    narrow_float16_f16c(out, in, count);
    return;
  }
#endif
  for (size_t i = 0; i < count; ++i) out[i] = encode_float16(in[i]);
}

// ---------------------------------------------------------------------------------------------
// The primitives of each instruction set: the always_inline code above is expanded into these
// bodies and compiled for their target. Their dtype is an accumulator type.

template <Isa kIsa>
struct IsaTag {};

void load_entry(IsaTag<Isa::kPortable>, void* partial, const void* own, size_t count,
                const ReduceSpec& spec) {
  for_acc_type<Load>(spec.dtype, partial, own, count, spec);
}
void combine_entry(IsaTag<Isa::kPortable>, void* out, const void* in, const void* own, size_t count,
                   const ReduceSpec& spec) {
  for_acc_type<Combine>(spec.dtype, out, in, own, count, spec);
}
void finalize_entry(IsaTag<Isa::kPortable>, void* values, size_t count, const ReduceSpec& spec) {
  for_acc_type<Finalize>(spec.dtype, values, count, spec);
}
void widen_entry(IsaTag<Isa::kPortable>, DataType dtype, float* out, const uint16_t* in,
                 size_t count) {
  widen_halves<Isa::kPortable>(dtype, out, in, count);
}
void narrow_entry(IsaTag<Isa::kPortable>, DataType dtype, uint16_t* out, const float* in,
                  size_t count) {
  narrow_halves<Isa::kPortable>(dtype, out, in, count);
}

#if KOLO_REDUCE_X86
KOLO_TARGET_AVX2 void load_entry(IsaTag<Isa::kAvx2>, void* partial, const void* own, size_t count,
                                 const ReduceSpec& spec) {
  for_acc_type<Load>(spec.dtype, partial, own, count, spec);
}
KOLO_TARGET_AVX2 void combine_entry(IsaTag<Isa::kAvx2>, void* out, const void* in, const void* own,
                                    size_t count, const ReduceSpec& spec) {
  for_acc_type<Combine>(spec.dtype, out, in, own, count, spec);
}
KOLO_TARGET_AVX2 void finalize_entry(IsaTag<Isa::kAvx2>, void* values, size_t count,
                                     const ReduceSpec& spec) {
  for_acc_type<Finalize>(spec.dtype, values, count, spec);
}
KOLO_TARGET_AVX2 void widen_entry(IsaTag<Isa::kAvx2>, DataType dtype, float* out,
                                  const uint16_t* in, size_t count) {
  widen_halves<Isa::kAvx2>(dtype, out, in, count);
}
KOLO_TARGET_AVX2 void narrow_entry(IsaTag<Isa::kAvx2>, DataType dtype, uint16_t* out,
                                   const float* in, size_t count) {
  narrow_halves<Isa::kAvx2>(dtype, out, in, count);
}
#endif

// ---------------------------------------------------------------------------------------------
// The public operations, composed of the primitives of one instruction set.

constexpr size_t kBlock = 1024;

bool is_half(DataType dtype) {
  return dtype == DataType::kFloat16 || dtype == DataType::kBFloat16;
}

ReduceSpec as_float32(const ReduceSpec& spec) {
  ReduceSpec float_spec = spec;
  float_spec.dtype = DataType::kFloat32;
  return float_spec;
}

// Address of element `index` of an array of `element_size`-byte elements.
template <typename Void>
auto element_at(Void* array, size_t index, size_t element_size) {
  using Byte = std::conditional_t<std::is_const_v<Void>, const std::byte, std::byte>;
  return static_cast<Void*>(static_cast<Byte*>(array) + index * element_size);
}

template <Isa kIsa>
void load_with(IsaTag<kIsa> isa, void* partial, const void* own, size_t count,
               const ReduceSpec& spec) {
  if (!is_half(spec.dtype)) return load_entry(isa, partial, own, count, spec);
  const ReduceSpec float_spec = as_float32(spec);
  auto* partial_floats = static_cast<float*>(partial);
  const auto* own_halves = static_cast<const uint16_t*>(own);
  for (size_t start = 0; start < count; start += kBlock) {
    const size_t n = std::min(kBlock, count - start);
    widen_entry(isa, spec.dtype, partial_floats + start, own_halves + start, n);
    if (make_flags(spec).prescale) {
      load_entry(isa, partial_floats + start, partial_floats + start, n, float_spec);
    }
  }
}

template <Isa kIsa>
void combine_with(IsaTag<kIsa> isa, void* partial_out, const void* partial_in, const void* own,
                  size_t count, const ReduceSpec& spec) {
  if (!is_half(spec.dtype)) return combine_entry(isa, partial_out, partial_in, own, count, spec);
  const ReduceSpec float_spec = as_float32(spec);
  auto* out_floats = static_cast<float*>(partial_out);
  const auto* in_floats = static_cast<const float*>(partial_in);
  const auto* own_halves = static_cast<const uint16_t*>(own);
  alignas(32) float own_block[kBlock];
  for (size_t start = 0; start < count; start += kBlock) {
    const size_t n = std::min(kBlock, count - start);
    widen_entry(isa, spec.dtype, own_block, own_halves + start, n);
    combine_entry(isa, out_floats + start, in_floats + start, own_block, n, float_spec);
  }
}

// out may equal own: each block of own is read in full before that block of out is written.
template <Isa kIsa>
void finish_with(IsaTag<kIsa> isa, void* out, const void* partial_in, const void* own, size_t count,
                 const ReduceSpec& spec) {
  const bool finalize = make_flags(spec).finalize();
  if (is_half(spec.dtype)) {
    const ReduceSpec float_spec = as_float32(spec);
    auto* out_halves = static_cast<uint16_t*>(out);
    const auto* in_floats = static_cast<const float*>(partial_in);
    const auto* own_halves = static_cast<const uint16_t*>(own);
    alignas(32) float block[kBlock];
    for (size_t start = 0; start < count; start += kBlock) {
      const size_t n = std::min(kBlock, count - start);
      widen_entry(isa, spec.dtype, block, own_halves + start, n);
      combine_entry(isa, block, in_floats + start, block, n, float_spec);
      if (finalize) finalize_entry(isa, block, n, float_spec);
      narrow_entry(isa, spec.dtype, out_halves + start, block, n);
    }
    return;
  }
  if (!finalize) return combine_entry(isa, out, partial_in, own, count, spec);
  const size_t size = dtype_size(spec.dtype);
  for (size_t start = 0; start < count; start += kBlock) {
    const size_t n = std::min(kBlock, count - start);
    void* out_block = element_at(out, start, size);
    combine_entry(isa, out_block, element_at(partial_in, start, size), element_at(own, start, size),
                  n, spec);
    finalize_entry(isa, out_block, n, spec);
  }
}

template <Isa kIsa>
void single_with(IsaTag<kIsa> isa, void* out, const void* own, size_t count,
                 const ReduceSpec& spec) {
  const Flags flags = make_flags(spec);
  if (is_half(spec.dtype)) {
    const ReduceSpec float_spec = as_float32(spec);
    auto* out_halves = static_cast<uint16_t*>(out);
    const auto* own_halves = static_cast<const uint16_t*>(own);
    alignas(32) float block[kBlock];
    for (size_t start = 0; start < count; start += kBlock) {
      const size_t n = std::min(kBlock, count - start);
      widen_entry(isa, spec.dtype, block, own_halves + start, n);
      if (flags.prescale) load_entry(isa, block, block, n, float_spec);
      if (flags.finalize()) finalize_entry(isa, block, n, float_spec);
      narrow_entry(isa, spec.dtype, out_halves + start, block, n);
    }
    return;
  }
  if (!flags.finalize()) return load_entry(isa, out, own, count, spec);
  const size_t size = dtype_size(spec.dtype);
  for (size_t start = 0; start < count; start += kBlock) {
    const size_t n = std::min(kBlock, count - start);
    void* out_block = element_at(out, start, size);
    load_entry(isa, out_block, element_at(own, start, size), n, spec);
    finalize_entry(isa, out_block, n, spec);
  }
}

constexpr IsaTag<Isa::kPortable> kPortable;

#if KOLO_REDUCE_X86
constexpr IsaTag<Isa::kAvx2> kAvx2;

// Building with -DKOLO_REDUCE_PORTABLE_ONLY keeps to the portable primitives, so that the tests
// can check both sets on one machine.
bool use_avx2() {
#if defined(KOLO_REDUCE_PORTABLE_ONLY)
  return false;
#else
  static const bool supported = [] {
    // "avx2" includes the operating system's support for the AVX registers, which F16C needs
    // too; F16C itself is read from cpuid (clang's __builtin_cpu_supports does not know it).
    __builtin_cpu_init();
    unsigned eax, ebx, ecx, edx;
    const bool f16c = __get_cpuid(1, &eax, &ebx, &ecx, &edx) && (ecx & bit_F16C) != 0;
    return __builtin_cpu_supports("avx2") && f16c;
  }();
  return supported;
#endif
}
#endif

}  // namespace

DataType accumulator_type(DataType dtype) {
  return is_half(dtype) ? DataType::kFloat32 : dtype;
}

void reduce_load(void* partial, const void* own, size_t count, const ReduceSpec& spec) {
  if (count == 0) return;
#if KOLO_REDUCE_X86
  if (use_avx2()) return load_with(kAvx2, partial, own, count, spec);
#endif
  load_with(kPortable, partial, own, count, spec);
}

void reduce_combine(void* partial_out, const void* partial_in, const void* own, size_t count,
                    const ReduceSpec& spec) {
  if (count == 0) return;
#if KOLO_REDUCE_X86
  if (use_avx2()) return combine_with(kAvx2, partial_out, partial_in, own, count, spec);
#endif
  combine_with(kPortable, partial_out, partial_in, own, count, spec);
}

void reduce_finish(void* out, const void* partial_in, const void* own, size_t count,
                   const ReduceSpec& spec) {
  if (count == 0) return;
#if KOLO_REDUCE_X86
  if (use_avx2()) return finish_with(kAvx2, out, partial_in, own, count, spec);
#endif
  finish_with(kPortable, out, partial_in, own, count, spec);
}

void reduce_single(void* out, const void* own, size_t count, const ReduceSpec& spec) {
  if (count == 0) return;
#if KOLO_REDUCE_X86
  if (use_avx2()) return single_with(kAvx2, out, own, count, spec);
#endif
  single_with(kPortable, out, own, count, spec);
}

float half_to_float(uint16_t h) {
  return decode_float16(h);
}
uint16_t float_to_half(float f) {
  return encode_float16(f);
}
float bfloat16_to_float(uint16_t b) {
  return decode_bfloat16(b);
}
uint16_t float_to_bfloat16(float f) {
  return encode_bfloat16(f);
}

}  // namespace kolo
