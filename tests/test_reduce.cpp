// Tests of the reduction kernels (src/core/reduce.hpp) and of the dtype names.
//
// The kernels are compared with a reference written separately from reduce.cpp:
//  - float arithmetic is done in double and rounded back to the accumulator type after every
//    operation. For float32 that gives exactly the float32 result: double has at least
//    2 * 24 + 2 bits, so rounding twice cannot differ from rounding once for +, *, /.
//  - integer arithmetic is done in __int128 (and long double for the scales) and wrapped or
//    saturated explicitly.
//  - half-precision values are decoded from their definition (ldexp) and encoded by searching
//    the ordered list of half values for the nearest one.
// Results are compared bit for bit, except that any NaN equals any NaN where the kernels promise
// only NaN-ness (a sum of two NaNs may keep either payload).

#include <catch2/catch.hpp>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include "core/reduce.hpp"
#include "kolo/dtype.hpp"

namespace {

using kolo::DataType;
using kolo::ReduceOp;
using kolo::ReduceSpec;

uint32_t bits_of(float value) {
  uint32_t bits;
  std::memcpy(&bits, &value, sizeof bits);
  return bits;
}

uint64_t bits_of(double value) {
  uint64_t bits;
  std::memcpy(&bits, &value, sizeof bits);
  return bits;
}

float float_from_bits(uint32_t bits) {
  float value;
  std::memcpy(&value, &bits, sizeof value);
  return value;
}

std::string hex(uint64_t value) {
  std::ostringstream out;
  out << "0x" << std::hex << value;
  return out.str();
}

// ---------------------------------------------------------------------------------------------
// Reference half precision.

// The value of a float16 pattern, from the definition: 2^(e-15) * 1.m, or 2^-14 * 0.m.
double ref_float16_value(uint16_t half) {
  const int exponent = (half >> 10) & 0x1f;
  const int mantissa = half & 0x3ff;
  double magnitude;
  if (exponent == 0x1f) {
    magnitude = mantissa == 0 ? HUGE_VAL : std::numeric_limits<double>::quiet_NaN();
  } else if (exponent == 0) {
    magnitude = std::ldexp(mantissa, -24);
  } else {
    magnitude = std::ldexp(1024 + mantissa, exponent - 25);
  }
  return (half & 0x8000) ? -magnitude : magnitude;
}

// The value of a bfloat16 pattern: 2^(e-127) * 1.m, or 2^-126 * 0.m, with 7 mantissa bits.
double ref_bfloat16_value(uint16_t value) {
  const int exponent = (value >> 7) & 0xff;
  const int mantissa = value & 0x7f;
  double magnitude;
  if (exponent == 0xff) {
    magnitude = mantissa == 0 ? HUGE_VAL : std::numeric_limits<double>::quiet_NaN();
  } else if (exponent == 0) {
    magnitude = std::ldexp(mantissa, -133);
  } else {
    magnitude = std::ldexp(128 + mantissa, exponent - 134);
  }
  return (value & 0x8000) ? -magnitude : magnitude;
}

// The nearest non-negative pattern to `magnitude`. Patterns 0 .. infinity-1 are the finite
// values in increasing order; infinity stands for `beyond`, the power of two after the largest
// finite value, so that rounding to infinity happens from the midpoint up. Ties go to the even
// pattern.
template <typename ValueOf>
uint16_t ref_round(double magnitude, uint16_t infinity, double beyond, ValueOf value_of) {
  auto value = [&](uint32_t pattern) {
    return pattern == infinity ? beyond : value_of(static_cast<uint16_t>(pattern));
  };
  if (magnitude >= beyond) return infinity;
  uint32_t low = 0;  // value(low) <= magnitude < value(high)
  uint32_t high = infinity;
  while (high - low > 1) {
    const uint32_t middle = (low + high) / 2;
    if (value(middle) <= magnitude) {
      low = middle;
    } else {
      high = middle;
    }
  }
  if (value(low) == magnitude) return static_cast<uint16_t>(low);
  const double midpoint = (value(low) + value(high)) / 2;  // exact: few significant bits
  if (magnitude < midpoint) return static_cast<uint16_t>(low);
  if (magnitude > midpoint) return static_cast<uint16_t>(high);
  return static_cast<uint16_t>(low % 2 == 0 ? low : high);
}

uint16_t ref_float_to_half(float value) {
  if (std::isnan(value)) return 0x7e00;
  const uint16_t sign = std::signbit(value) ? 0x8000 : 0;
  return sign |
         ref_round(std::fabs(static_cast<double>(value)), 0x7c00, 65536.0, ref_float16_value);
}

uint16_t ref_float_to_bfloat16(float value) {
  if (std::isnan(value)) return 0x7fc0;
  const uint16_t sign = std::signbit(value) ? 0x8000 : 0;
  return sign | ref_round(std::fabs(static_cast<double>(value)), 0x7f80, std::ldexp(1.0, 128),
                          ref_bfloat16_value);
}

bool is_half_nan(uint16_t half) {
  return (half & 0x7c00) == 0x7c00 && (half & 0x3ff) != 0;
}
bool is_bfloat16_nan(uint16_t value) {
  return (value & 0x7f80) == 0x7f80 && (value & 0x7f) != 0;
}

// ---------------------------------------------------------------------------------------------
// Element types as the tests see them.

template <DataType kType>
struct Type;

template <>
struct Type<DataType::kFloat32> {
  using Element = float;
  using Acc = float;
  static Acc to_acc(Element value) { return value; }
  static Element to_element(Acc value) { return value; }
  static bool same(Element a, Element b) {
    return (std::isnan(a) && std::isnan(b)) || bits_of(a) == bits_of(b);
  }
  static std::string show(Element value) {
    std::ostringstream out;
    out << value << " (" << hex(bits_of(value)) << ")";
    return out.str();
  }
};

template <>
struct Type<DataType::kFloat64> {
  using Element = double;
  using Acc = double;
  static Acc to_acc(Element value) { return value; }
  static Element to_element(Acc value) { return value; }
  static bool same(Element a, Element b) {
    return (std::isnan(a) && std::isnan(b)) || bits_of(a) == bits_of(b);
  }
  static std::string show(Element value) {
    std::ostringstream out;
    out.precision(17);
    out << value << " (" << hex(bits_of(value)) << ")";
    return out.str();
  }
};

template <>
struct Type<DataType::kFloat16> {
  using Element = uint16_t;
  using Acc = float;
  static Acc to_acc(Element value) { return static_cast<float>(ref_float16_value(value)); }
  static Element to_element(Acc value) { return ref_float_to_half(value); }
  static bool same(Element a, Element b) { return (is_half_nan(a) && is_half_nan(b)) || a == b; }
  static std::string show(Element value) {
    std::ostringstream out;
    out << hex(value) << " (" << ref_float16_value(value) << ")";
    return out.str();
  }
};

template <>
struct Type<DataType::kBFloat16> {
  using Element = uint16_t;
  using Acc = float;
  static Acc to_acc(Element value) { return static_cast<float>(ref_bfloat16_value(value)); }
  static Element to_element(Acc value) { return ref_float_to_bfloat16(value); }
  static bool same(Element a, Element b) {
    return (is_bfloat16_nan(a) && is_bfloat16_nan(b)) || a == b;
  }
  static std::string show(Element value) {
    std::ostringstream out;
    out << hex(value) << " (" << ref_bfloat16_value(value) << ")";
    return out.str();
  }
};

template <typename Int>
struct IntegerType {
  using Element = Int;
  using Acc = Int;
  static Acc to_acc(Element value) { return value; }
  static Element to_element(Acc value) { return value; }
  static bool same(Element a, Element b) { return a == b; }
  static std::string show(Element value) { return std::to_string(static_cast<int64_t>(value)); }
};

template <>
struct Type<DataType::kInt8> : IntegerType<int8_t> {};
template <>
struct Type<DataType::kUInt8> : IntegerType<uint8_t> {};
template <>
struct Type<DataType::kInt16> : IntegerType<int16_t> {};
template <>
struct Type<DataType::kInt32> : IntegerType<int32_t> {};
template <>
struct Type<DataType::kInt64> : IntegerType<int64_t> {};

// The accumulator type of a dtype, as a dtype.
template <DataType kType>
constexpr DataType accumulator_of =
    kType == DataType::kFloat16 || kType == DataType::kBFloat16 ? DataType::kFloat32 : kType;

// ---------------------------------------------------------------------------------------------
// Reference arithmetic on accumulator values.

template <typename Acc>
Acc round_to(double value) {
  return static_cast<Acc>(value);  // float: rounds to nearest even; double: nothing to do
}

// Wraps an exact integer into Int, modulo 2^bits.
template <typename Int>
Int wrap(__int128 value) {
  constexpr int kBits = 8 * sizeof(Int);
  const unsigned __int128 modulus = static_cast<unsigned __int128>(1) << kBits;
  unsigned __int128 residue = static_cast<unsigned __int128>(value) & (modulus - 1);
  if (std::is_signed_v<Int> && residue >= modulus / 2) {
    return static_cast<Int>(static_cast<__int128>(residue) - static_cast<__int128>(modulus));
  }
  return static_cast<Int>(residue);
}

template <typename Acc>
Acc ref_scale(Acc value, double factor) {
  if (factor == 1.0) return value;
  if constexpr (std::is_same_v<Acc, float>) {
    // The factor is rounded to float32 first: float accumulators scale in their own type.
    return round_to<float>(static_cast<double>(value) *
                           static_cast<double>(static_cast<float>(factor)));
  } else if constexpr (std::is_same_v<Acc, double>) {
    return value * factor;
  } else {
    const double product = static_cast<double>(value) * factor;
    if (std::isnan(product)) return 0;
    const long double truncated = std::trunc(static_cast<long double>(product));
    if (truncated > static_cast<long double>(std::numeric_limits<Acc>::max())) {
      return std::numeric_limits<Acc>::max();
    }
    if (truncated < static_cast<long double>(std::numeric_limits<Acc>::lowest())) {
      return std::numeric_limits<Acc>::lowest();
    }
    return static_cast<Acc>(static_cast<int64_t>(truncated));
  }
}

template <typename Acc>
Acc ref_combine(ReduceOp op, Acc partial, Acc own) {
  if constexpr (std::is_floating_point_v<Acc>) {
    switch (op) {
      case ReduceOp::kSum:
      case ReduceOp::kAvg:
        return round_to<Acc>(static_cast<double>(partial) + static_cast<double>(own));
      case ReduceOp::kProd:
        return round_to<Acc>(static_cast<double>(partial) * static_cast<double>(own));
      case ReduceOp::kMin:
      case ReduceOp::kMax:
        // NaN wins; equal values (-0 and +0) give own's.
        if (std::isnan(partial)) return partial;
        if (std::isnan(own)) return own;
        if (partial == own) return own;
        return (op == ReduceOp::kMin) == (partial < own) ? partial : own;
    }
  } else {
    switch (op) {
      case ReduceOp::kSum:
      case ReduceOp::kAvg:
        return wrap<Acc>(static_cast<__int128>(partial) + static_cast<__int128>(own));
      case ReduceOp::kProd:
        return wrap<Acc>(static_cast<__int128>(partial) * static_cast<__int128>(own));
      case ReduceOp::kMin:
        return std::min(partial, own);
      case ReduceOp::kMax:
        return std::max(partial, own);
    }
  }
  return Acc{};
}

template <typename Acc>
Acc ref_finish(Acc value, const ReduceSpec& spec) {
  if (spec.op == ReduceOp::kAvg) {
    if constexpr (std::is_floating_point_v<Acc>) {
      value = round_to<Acc>(static_cast<double>(value) / spec.ranks);
    } else {
      value = static_cast<Acc>(static_cast<__int128>(value) / spec.ranks);  // toward zero
    }
  }
  return ref_scale(value, spec.postscale);
}

// ---------------------------------------------------------------------------------------------
// Test data.

template <DataType kType>
typename Type<kType>::Element random_element(std::mt19937_64& rng) {
  using Element = typename Type<kType>::Element;
  const uint64_t r = rng();
  const bool special = r % 16 == 0;
  const bool negative = (r >> 8) & 1;
  const int spread = static_cast<int>((r >> 9) % 21) - 10;  // exponent in [-10, 10]
  if constexpr (kType == DataType::kFloat32 || kType == DataType::kFloat64) {
    if (special) {
      const Element specials[] = {0.0,
                                  -0.0,
                                  std::numeric_limits<Element>::infinity(),
                                  -std::numeric_limits<Element>::infinity(),
                                  std::numeric_limits<Element>::quiet_NaN(),
                                  std::numeric_limits<Element>::denorm_min() * 3,
                                  std::numeric_limits<Element>::max(),
                                  -std::numeric_limits<Element>::min()};
      return specials[(r >> 4) % 8];
    }
    const double mantissa = 1.0 + static_cast<double>(r >> 40) / (1ull << 24);
    return static_cast<Element>((negative ? -1 : 1) * std::ldexp(mantissa, spread));
  } else if constexpr (kType == DataType::kFloat16) {
    if (special) {
      const uint16_t specials[] = {0x0000, 0x8000, 0x7c00, 0xfc00, 0x7e00, 0x0001, 0x83ff, 0x7bff};
      return specials[(r >> 4) % 8];
    }
    const auto exponent = static_cast<uint16_t>(15 + spread);
    return static_cast<uint16_t>((negative ? 0x8000 : 0) | (exponent << 10) | ((r >> 32) & 0x3ff));
  } else if constexpr (kType == DataType::kBFloat16) {
    if (special) {
      const uint16_t specials[] = {0x0000, 0x8000, 0x7f80, 0xff80, 0x7fc0, 0x0001, 0x807f, 0x7f7f};
      return specials[(r >> 4) % 8];
    }
    const auto exponent = static_cast<uint16_t>(127 + spread);
    return static_cast<uint16_t>((negative ? 0x8000 : 0) | (exponent << 7) | ((r >> 32) & 0x7f));
  } else {
    return static_cast<Element>(r >> 3);  // every bit pattern, so sums and products wrap
  }
}

template <typename T>
T random_bits(std::mt19937_64& rng) {
  const uint64_t bits = rng();
  T value;
  std::memcpy(&value, &bits, sizeof value);
  return value;
}

// `count` elements starting `offset` elements into an allocation whose other elements are
// guards: random values that a kernel must not change.
template <typename T>
class Buffer {
 public:
  template <typename Generate>
  Buffer(size_t count, size_t offset, Generate generate)
      : offset_(offset), count_(count), storage_(offset + count + 3) {
    for (T& value : storage_) value = generate();
    guards_ = storage_;
  }
  T* data() { return storage_.data() + offset_; }
  const T* data() const { return storage_.data() + offset_; }
  T& operator[](size_t i) { return data()[i]; }
  const T& operator[](size_t i) const { return data()[i]; }
  bool guards_intact() const {
    const auto bytes = [](const T* p, size_t n) { return n * sizeof(*p); };
    const size_t tail = offset_ + count_;
    return std::memcmp(storage_.data(), guards_.data(), bytes(storage_.data(), offset_)) == 0 &&
           std::memcmp(storage_.data() + tail, guards_.data() + tail,
                       bytes(storage_.data(), storage_.size() - tail)) == 0;
  }

 private:
  size_t offset_;
  size_t count_;
  std::vector<T> storage_;
  std::vector<T> guards_;
};

// Compares `got` with `expected` element by element and describes the first difference.
template <typename T, typename Same, typename Show, typename Describe>
std::string first_difference(const T* got, const std::vector<T>& expected, Same same, Show show,
                             Describe describe_inputs) {
  for (size_t i = 0; i < expected.size(); ++i) {
    if (!same(got[i], expected[i])) {
      std::ostringstream out;
      out << "element " << i << ": expected " << show(expected[i]) << ", got " << show(got[i])
          << "; inputs " << describe_inputs(i);
      return out.str();
    }
  }
  return "";
}

std::string describe(const ReduceSpec& spec, size_t count, size_t offset) {
  std::ostringstream out;
  out << kolo::dtype_name(spec.dtype) << " " << kolo::op_name(spec.op) << " prescale "
      << spec.prescale << " postscale " << spec.postscale << " ranks " << spec.ranks << " count "
      << count << " offset " << offset;
  return out.str();
}

struct Scales {
  double prescale;
  double postscale;
};
constexpr Scales kScales[] = {{1.0, 1.0}, {0.5, 1.0}, {1.0, 0.25}, {-1.75, 3.0}};
constexpr ReduceOp kOps[] = {ReduceOp::kSum, ReduceOp::kAvg, ReduceOp::kMin, ReduceOp::kMax,
                             ReduceOp::kProd};
// Around vector widths, and around the 1024-element blocks of the half types.
constexpr size_t kCounts[] = {1, 2, 7, 8, 9, 31, 33, 1023, 1024, 1025, 3001};

// Every kernel, for every op and scale pair, count and alignment, against the reference; then
// again in place.
template <DataType kType>
void check_against_reference() {
  using T = Type<kType>;
  using Element = typename T::Element;
  using Acc = typename T::Acc;
  std::mt19937_64 rng(1234 + static_cast<int>(kType));
  const auto element = [&] { return random_element<kType>(rng); };
  const auto acc_bits = [&] { return random_bits<Acc>(rng); };
  const auto show = [](Element value) { return T::show(value); };
  const auto show_acc = [](Acc value) { return Type<accumulator_of<kType>>::show(value); };
  const auto same_acc = [](Acc a, Acc b) { return Type<accumulator_of<kType>>::same(a, b); };

  for (ReduceOp op : kOps) {
    for (Scales scales : kScales) {
      for (size_t count : kCounts) {
        for (size_t offset : {0, 1}) {
          const ReduceSpec spec{kType, op, scales.prescale, scales.postscale, 3};
          INFO(describe(spec, count, offset));

          Buffer<Element> own0(count, offset, element);
          Buffer<Element> own1(count, offset, element);
          Buffer<Element> own2(count, offset, element);

          // load
          Buffer<Acc> partial0(count, offset, acc_bits);
          kolo::reduce_load(partial0.data(), own0.data(), count, spec);
          std::vector<Acc> expected_partial0(count);
          for (size_t i = 0; i < count; ++i) {
            expected_partial0[i] = ref_scale(T::to_acc(own0[i]), spec.prescale);
          }
          CHECK(first_difference(partial0.data(), expected_partial0, same_acc, show_acc,
                                 [&](size_t i) { return show(own0[i]); }) == "");
          CHECK(partial0.guards_intact());

          // combine, into a new buffer and in place
          Buffer<Acc> partial1(count, offset, acc_bits);
          kolo::reduce_combine(partial1.data(), partial0.data(), own1.data(), count, spec);
          std::vector<Acc> expected_partial1(count);
          for (size_t i = 0; i < count; ++i) {
            expected_partial1[i] =
                ref_combine(op, partial0[i], ref_scale(T::to_acc(own1[i]), spec.prescale));
          }
          const auto combine_inputs = [&](size_t i) {
            return show_acc(partial0[i]) + " and " + show(own1[i]);
          };
          CHECK(first_difference(partial1.data(), expected_partial1, same_acc, show_acc,
                                 combine_inputs) == "");
          CHECK(partial1.guards_intact());
          Buffer<Acc> in_place = partial0;
          kolo::reduce_combine(in_place.data(), in_place.data(), own1.data(), count, spec);
          CHECK(first_difference(in_place.data(), expected_partial1, same_acc, show_acc,
                                 combine_inputs) == "");
          CHECK(in_place.guards_intact());

          // finish, into a new buffer and in place (out == own)
          Buffer<Element> out(count, offset, element);
          kolo::reduce_finish(out.data(), partial1.data(), own2.data(), count, spec);
          std::vector<Element> expected_out(count);
          for (size_t i = 0; i < count; ++i) {
            const Acc combined =
                ref_combine(op, partial1[i], ref_scale(T::to_acc(own2[i]), spec.prescale));
            expected_out[i] = T::to_element(ref_finish(combined, spec));
          }
          const auto finish_inputs = [&](size_t i) {
            return show_acc(partial1[i]) + " and " + show(own2[i]);
          };
          CHECK(first_difference(out.data(), expected_out, T::same, show, finish_inputs) == "");
          CHECK(out.guards_intact());
          Buffer<Element> own2_in_place = own2;
          kolo::reduce_finish(own2_in_place.data(), partial1.data(), own2_in_place.data(), count,
                              spec);
          CHECK(first_difference(own2_in_place.data(), expected_out, T::same, show,
                                 finish_inputs) == "");
          CHECK(own2_in_place.guards_intact());

          // single, into a new buffer and in place
          Buffer<Element> single(count, offset, element);
          kolo::reduce_single(single.data(), own0.data(), count, spec);
          std::vector<Element> expected_single(count);
          for (size_t i = 0; i < count; ++i) {
            expected_single[i] =
                T::to_element(ref_finish(ref_scale(T::to_acc(own0[i]), spec.prescale), spec));
          }
          const auto single_inputs = [&](size_t i) { return show(own0[i]); };
          CHECK(first_difference(single.data(), expected_single, T::same, show, single_inputs) ==
                "");
          CHECK(single.guards_intact());
          Buffer<Element> own0_in_place = own0;
          kolo::reduce_single(own0_in_place.data(), own0_in_place.data(), count, spec);
          CHECK(first_difference(own0_in_place.data(), expected_single, T::same, show,
                                 single_inputs) == "");
          CHECK(own0_in_place.guards_intact());
        }
      }
    }
  }
}

// A long call (vector loop) gives bitwise the same as one call per element (scalar code).
template <DataType kType>
void check_vector_matches_scalar() {
  using T = Type<kType>;
  using Element = typename T::Element;
  using Acc = typename T::Acc;
  const auto show_acc = [](Acc value) { return Type<accumulator_of<kType>>::show(value); };
  const auto same_acc = [](Acc a, Acc b) { return Type<accumulator_of<kType>>::same(a, b); };
  constexpr size_t kCount = 4099;
  std::mt19937_64 rng(99 + static_cast<int>(kType));
  std::vector<Element> own(kCount);
  std::vector<Acc> partial(kCount);
  for (Element& value : own) value = random_element<kType>(rng);
  kolo::reduce_load(partial.data(), own.data(), kCount, ReduceSpec{kType});
  // "expected" below is the result of the count-1 call, "got" that of the long one.
  const auto inputs = [&](size_t i) {
    return "partial " + show_acc(partial[i]) + ", own " + T::show(own[i]);
  };

  for (ReduceOp op : kOps) {
    for (Scales scales : kScales) {
      const ReduceSpec spec{kType, op, scales.prescale, scales.postscale, 5};
      INFO(describe(spec, kCount, 0));
      std::vector<Acc> loaded(kCount), loaded_one(kCount);
      std::vector<Acc> combined(kCount), combined_one(kCount);
      std::vector<Element> finished(kCount), finished_one(kCount);
      std::vector<Element> single(kCount), single_one(kCount);
      kolo::reduce_load(loaded.data(), own.data(), kCount, spec);
      kolo::reduce_combine(combined.data(), partial.data(), own.data(), kCount, spec);
      kolo::reduce_finish(finished.data(), partial.data(), own.data(), kCount, spec);
      kolo::reduce_single(single.data(), own.data(), kCount, spec);
      for (size_t i = 0; i < kCount; ++i) {
        kolo::reduce_load(&loaded_one[i], &own[i], 1, spec);
        kolo::reduce_combine(&combined_one[i], &partial[i], &own[i], 1, spec);
        kolo::reduce_finish(&finished_one[i], &partial[i], &own[i], 1, spec);
        kolo::reduce_single(&single_one[i], &own[i], 1, spec);
      }
      CHECK(first_difference(loaded.data(), loaded_one, same_acc, show_acc, inputs) == "");
      CHECK(first_difference(combined.data(), combined_one, same_acc, show_acc, inputs) == "");
      CHECK(first_difference(finished.data(), finished_one, T::same, T::show, inputs) == "");
      CHECK(first_difference(single.data(), single_one, T::same, T::show, inputs) == "");
    }
  }
}

template <DataType kType>
typename Type<kType>::Element finish_one(typename Type<kType>::Acc partial,
                                         typename Type<kType>::Element own,
                                         const ReduceSpec& spec) {
  typename Type<kType>::Element out{};
  kolo::reduce_finish(&out, &partial, &own, 1, spec);
  return out;
}

template <DataType kType>
typename Type<kType>::Element single_one(typename Type<kType>::Element own,
                                         const ReduceSpec& spec) {
  typename Type<kType>::Element out{};
  kolo::reduce_single(&out, &own, 1, spec);
  return out;
}

}  // namespace

// ---------------------------------------------------------------------------------------------

TEST_CASE("dtype names, sizes and parsing", "[dtype]") {
  struct Expected {
    DataType dtype;
    const char* name;
    size_t size;
  };
  const Expected all[] = {{DataType::kFloat32, "float32", 4}, {DataType::kFloat64, "float64", 8},
                          {DataType::kFloat16, "float16", 2}, {DataType::kBFloat16, "bfloat16", 2},
                          {DataType::kInt8, "int8", 1},       {DataType::kUInt8, "uint8", 1},
                          {DataType::kInt32, "int32", 4},     {DataType::kInt64, "int64", 8},
                          {DataType::kInt16, "int16", 2}};
  for (const Expected& e : all) {
    INFO(e.name);
    CHECK(kolo::dtype_name(e.dtype) == e.name);
    CHECK(kolo::dtype_size(e.dtype) == e.size);
    CHECK(kolo::parse_dtype(e.name) == e.dtype);
  }
  CHECK(kolo::parse_dtype("float") == DataType::kFloat32);
  CHECK(kolo::parse_dtype("double") == DataType::kFloat64);
  CHECK(kolo::parse_dtype("half") == DataType::kFloat16);
  CHECK(kolo::parse_dtype("bf16") == DataType::kBFloat16);
  CHECK(kolo::parse_dtype("int") == DataType::kInt32);
  CHECK(kolo::parse_dtype("char") == DataType::kInt8);
  CHECK(kolo::parse_dtype("long") == DataType::kInt64);
  CHECK(kolo::parse_dtype("short") == DataType::kInt16);
  CHECK_FALSE(kolo::parse_dtype("float128").has_value());
  CHECK_FALSE(kolo::parse_dtype("").has_value());
  CHECK_FALSE(kolo::parse_dtype("Float32").has_value());

  const auto invalid_dtype = static_cast<DataType>(kolo::kDataTypeCount);
  CHECK(kolo::dtype_name(invalid_dtype) == "unknown");
  CHECK(kolo::dtype_size(invalid_dtype) == 0);
  CHECK_FALSE(kolo::is_valid(invalid_dtype));

  const std::pair<ReduceOp, const char*> ops[] = {{ReduceOp::kSum, "sum"},
                                                  {ReduceOp::kAvg, "avg"},
                                                  {ReduceOp::kMin, "min"},
                                                  {ReduceOp::kMax, "max"},
                                                  {ReduceOp::kProd, "prod"}};
  for (const auto& [op, name] : ops) {
    INFO(name);
    CHECK(kolo::op_name(op) == name);
    CHECK(kolo::parse_op(name) == op);
  }
  CHECK_FALSE(kolo::parse_op("all").has_value());
  CHECK_FALSE(kolo::parse_op("mean").has_value());
  CHECK(kolo::op_name(static_cast<ReduceOp>(kolo::kReduceOpCount)) == "unknown");
}

TEST_CASE("accumulator types", "[reduce]") {
  CHECK(kolo::accumulator_type(DataType::kFloat16) == DataType::kFloat32);
  CHECK(kolo::accumulator_type(DataType::kBFloat16) == DataType::kFloat32);
  CHECK(kolo::accumulator_size(DataType::kFloat16) == 4);
  for (DataType dtype : {DataType::kFloat32, DataType::kFloat64, DataType::kInt8, DataType::kUInt8,
                         DataType::kInt16, DataType::kInt32, DataType::kInt64}) {
    CHECK(kolo::accumulator_type(dtype) == dtype);
  }
}

TEST_CASE("every kernel matches the reference, for every dtype and op", "[reduce]") {
  SECTION("float32") {
    check_against_reference<DataType::kFloat32>();
  }
  SECTION("float64") {
    check_against_reference<DataType::kFloat64>();
  }
  SECTION("float16") {
    check_against_reference<DataType::kFloat16>();
  }
  SECTION("bfloat16") {
    check_against_reference<DataType::kBFloat16>();
  }
  SECTION("int8") {
    check_against_reference<DataType::kInt8>();
  }
  SECTION("uint8") {
    check_against_reference<DataType::kUInt8>();
  }
  SECTION("int16") {
    check_against_reference<DataType::kInt16>();
  }
  SECTION("int32") {
    check_against_reference<DataType::kInt32>();
  }
  SECTION("int64") {
    check_against_reference<DataType::kInt64>();
  }
}

TEST_CASE("vector loops agree bitwise with element-by-element calls (NaN payloads aside)",
          "[reduce]") {
  SECTION("float32") {
    check_vector_matches_scalar<DataType::kFloat32>();
  }
  SECTION("float64") {
    check_vector_matches_scalar<DataType::kFloat64>();
  }
  SECTION("float16") {
    check_vector_matches_scalar<DataType::kFloat16>();
  }
  SECTION("bfloat16") {
    check_vector_matches_scalar<DataType::kBFloat16>();
  }
  SECTION("int8") {
    check_vector_matches_scalar<DataType::kInt8>();
  }
  SECTION("uint8") {
    check_vector_matches_scalar<DataType::kUInt8>();
  }
  SECTION("int16") {
    check_vector_matches_scalar<DataType::kInt16>();
  }
  SECTION("int32") {
    check_vector_matches_scalar<DataType::kInt32>();
  }
  SECTION("int64") {
    check_vector_matches_scalar<DataType::kInt64>();
  }
}

TEST_CASE("count 0 touches nothing", "[reduce]") {
  for (int d = 0; d < kolo::kDataTypeCount; ++d) {
    for (ReduceOp op : kOps) {
      const ReduceSpec spec{static_cast<DataType>(d), op, 2.0, 3.0, 4};
      INFO(describe(spec, 0, 0));
      kolo::reduce_load(nullptr, nullptr, 0, spec);
      kolo::reduce_combine(nullptr, nullptr, nullptr, 0, spec);
      kolo::reduce_finish(nullptr, nullptr, nullptr, 0, spec);
      kolo::reduce_single(nullptr, nullptr, 0, spec);
      uint64_t sentinel = 0x0123456789abcdef;
      const uint64_t own = 0;
      kolo::reduce_finish(&sentinel, &own, &own, 0, spec);
      kolo::reduce_single(&sentinel, &own, 0, spec);
      CHECK(sentinel == 0x0123456789abcdef);
    }
  }
}

TEST_CASE("integer arithmetic wraps, truncates and saturates", "[reduce]") {
  SECTION("SUM and PROD wrap around") {
    const ReduceSpec sum8{DataType::kInt8, ReduceOp::kSum};
    CHECK(finish_one<DataType::kInt8>(127, 1, sum8) == -128);
    CHECK(finish_one<DataType::kInt8>(-128, -1, sum8) == 127);
    const ReduceSpec sum_u8{DataType::kUInt8, ReduceOp::kSum};
    CHECK(finish_one<DataType::kUInt8>(200, 100, sum_u8) == 44);
    const ReduceSpec prod_u8{DataType::kUInt8, ReduceOp::kProd};
    CHECK(finish_one<DataType::kUInt8>(16, 17, prod_u8) == 16);  // 272 mod 256
    const ReduceSpec sum16{DataType::kInt16, ReduceOp::kSum};
    CHECK(finish_one<DataType::kInt16>(INT16_MAX, 1, sum16) == INT16_MIN);
    CHECK(finish_one<DataType::kInt16>(-30000, -30000, sum16) == 5536);  // -60000 + 65536
    const ReduceSpec prod16{DataType::kInt16, ReduceOp::kProd};
    // -1 * -1 as unsigned 16-bit values is 65535², which overflows a promoted (signed) int.
    CHECK(finish_one<DataType::kInt16>(-1, -1, prod16) == 1);
    CHECK(finish_one<DataType::kInt16>(300, 300, prod16) == 24464);  // 90000 - 65536
    CHECK(finish_one<DataType::kInt16>(INT16_MIN, -1, prod16) == INT16_MIN);
    const ReduceSpec min16{DataType::kInt16, ReduceOp::kMin};
    CHECK(finish_one<DataType::kInt16>(-7, 5, min16) == -7);
    const ReduceSpec max16{DataType::kInt16, ReduceOp::kMax};
    CHECK(finish_one<DataType::kInt16>(INT16_MIN, INT16_MAX, max16) == INT16_MAX);
    const ReduceSpec sum32{DataType::kInt32, ReduceOp::kSum};
    CHECK(finish_one<DataType::kInt32>(INT32_MAX, 1, sum32) == INT32_MIN);
    const ReduceSpec prod32{DataType::kInt32, ReduceOp::kProd};
    CHECK(finish_one<DataType::kInt32>(65536, 65536, prod32) == 0);
    CHECK(finish_one<DataType::kInt32>(-65536, 32769, prod32) == -2147549184LL + 4294967296LL);
    const ReduceSpec sum64{DataType::kInt64, ReduceOp::kSum};
    CHECK(finish_one<DataType::kInt64>(INT64_MAX, 2, sum64) == INT64_MIN + 1);
    const ReduceSpec prod64{DataType::kInt64, ReduceOp::kProd};
    CHECK(finish_one<DataType::kInt64>(INT64_MIN, -1, prod64) == INT64_MIN);
  }

  SECTION("AVG truncates toward zero, negative sums included") {
    const ReduceSpec avg32{DataType::kInt32, ReduceOp::kAvg, 1.0, 1.0, 2};
    CHECK(finish_one<DataType::kInt32>(-4, -3, avg32) == -3);  // -7 / 2 = -3.5
    CHECK(finish_one<DataType::kInt32>(4, 3, avg32) == 3);
    const ReduceSpec avg8{DataType::kInt8, ReduceOp::kAvg, 1.0, 1.0, 3};
    CHECK(finish_one<DataType::kInt8>(-100, -100, avg8) == 18);  // -200 wraps to 56; 56 / 3
    CHECK(finish_one<DataType::kInt8>(-60, -40, avg8) == -33);   // -100 / 3 = -33.3
    const ReduceSpec avg16{DataType::kInt16, ReduceOp::kAvg, 1.0, 1.0, 3};
    CHECK(finish_one<DataType::kInt16>(-20000, -10001, avg16) == -10000);  // -30001 / 3
    CHECK(finish_one<DataType::kInt16>(30000, 30000, avg16) == -1845);     // wraps to -5536
    const ReduceSpec avg64{DataType::kInt64, ReduceOp::kAvg, 1.0, 1.0, 4};
    CHECK(finish_one<DataType::kInt64>(-9, 0, avg64) == -2);
    CHECK(finish_one<DataType::kInt64>(INT64_MIN, 0, avg64) == INT64_MIN / 4);
    const ReduceSpec avg_u8{DataType::kUInt8, ReduceOp::kAvg, 1.0, 1.0, 7};
    CHECK(finish_one<DataType::kUInt8>(250, 3, avg_u8) == 36);
    // Large ranks: the double division of 32-bit sums stays exact.
    const ReduceSpec avg_many{DataType::kInt32, ReduceOp::kAvg, 1.0, 1.0, 2147483647};
    CHECK(finish_one<DataType::kInt32>(INT32_MAX, 0, avg_many) == 1);
    CHECK(finish_one<DataType::kInt32>(INT32_MAX - 1, 0, avg_many) == 0);
    CHECK(finish_one<DataType::kInt32>(INT32_MIN, 0, avg_many) == -1);
    const ReduceSpec avg_odd{DataType::kInt32, ReduceOp::kAvg, 1.0, 1.0, 46341};
    CHECK(finish_one<DataType::kInt32>(46341 * 46340 - 1, 0, avg_odd) == 46339);
    CHECK(finish_one<DataType::kInt32>(-(46341 * 46340), 0, avg_odd) == -46340);
  }

  SECTION("scales truncate toward zero and saturate") {
    const ReduceSpec half_scale{DataType::kInt32, ReduceOp::kSum, 0.5};
    CHECK(single_one<DataType::kInt32>(7, half_scale) == 3);
    CHECK(single_one<DataType::kInt32>(-7, half_scale) == -3);
    const ReduceSpec big{DataType::kInt32, ReduceOp::kSum, 1e10};
    CHECK(single_one<DataType::kInt32>(3, big) == INT32_MAX);
    CHECK(single_one<DataType::kInt32>(-3, big) == INT32_MIN);
    CHECK(single_one<DataType::kInt32>(0, big) == 0);
    const ReduceSpec infinite{DataType::kInt8, ReduceOp::kSum, HUGE_VAL};
    CHECK(single_one<DataType::kInt8>(1, infinite) == 127);
    CHECK(single_one<DataType::kInt8>(-1, infinite) == -128);
    CHECK(single_one<DataType::kInt8>(0, infinite) == 0);  // 0 * inf is NaN, which gives 0
    const ReduceSpec nan_scale{DataType::kUInt8, ReduceOp::kSum,
                               std::numeric_limits<double>::quiet_NaN()};
    CHECK(single_one<DataType::kUInt8>(9, nan_scale) == 0);
    const ReduceSpec negative_u8{DataType::kUInt8, ReduceOp::kMax, -1.0};
    CHECK(single_one<DataType::kUInt8>(9, negative_u8) == 0);
    const ReduceSpec big16{DataType::kInt16, ReduceOp::kSum, 1000.0};
    CHECK(single_one<DataType::kInt16>(33, big16) == INT16_MAX);
    CHECK(single_one<DataType::kInt16>(-33, big16) == INT16_MIN);
    CHECK(single_one<DataType::kInt16>(32, big16) == 32000);
    const ReduceSpec big64{DataType::kInt64, ReduceOp::kSum, 4.0};
    CHECK(single_one<DataType::kInt64>(INT64_MAX / 2, big64) == INT64_MAX);
    CHECK(single_one<DataType::kInt64>(INT64_MIN / 2, big64) == INT64_MIN);
    CHECK(single_one<DataType::kInt64>(-(int64_t{1} << 61), big64) == INT64_MIN);
    // prescale applies to own, postscale after AVG's division.
    const ReduceSpec both{DataType::kInt32, ReduceOp::kAvg, 3.0, 0.5, 2};
    CHECK(finish_one<DataType::kInt32>(5, 3, both) == 3);  // (5 + 9) / 2 = 7; 7 * 0.5 = 3.5
  }
}

TEST_CASE("float MIN and MAX propagate NaN", "[reduce]") {
  const float nan = std::numeric_limits<float>::quiet_NaN();
  for (ReduceOp op : {ReduceOp::kMin, ReduceOp::kMax}) {
    INFO(kolo::op_name(op));
    const ReduceSpec spec32{DataType::kFloat32, op};
    CHECK(std::isnan(finish_one<DataType::kFloat32>(nan, 1.0f, spec32)));
    CHECK(std::isnan(finish_one<DataType::kFloat32>(1.0f, nan, spec32)));
    CHECK(std::isnan(finish_one<DataType::kFloat32>(-HUGE_VALF, nan, spec32)));
    const ReduceSpec spec64{DataType::kFloat64, op};
    CHECK(std::isnan(finish_one<DataType::kFloat64>(std::nan(""), -1.0, spec64)));
    CHECK(std::isnan(finish_one<DataType::kFloat64>(-1.0, std::nan(""), spec64)));
    const ReduceSpec spec16{DataType::kFloat16, op};
    CHECK(is_half_nan(finish_one<DataType::kFloat16>(nan, 0x3c00, spec16)));
    CHECK(is_half_nan(finish_one<DataType::kFloat16>(2.0f, 0x7e00, spec16)));
    const ReduceSpec spec_bf16{DataType::kBFloat16, op};
    CHECK(is_bfloat16_nan(finish_one<DataType::kBFloat16>(nan, 0x3f80, spec_bf16)));
    CHECK(is_bfloat16_nan(finish_one<DataType::kBFloat16>(2.0f, 0x7fc0, spec_bf16)));

    // A NaN in the middle of a long array, and in a chain of three ranks.
    std::vector<float> partial(1000, 1.0f), own(1000, 2.0f), out(1000);
    own[517] = nan;
    kolo::reduce_combine(partial.data(), partial.data(), own.data(), own.size(), spec32);
    own[517] = 0.0f;
    partial[3] = nan;
    kolo::reduce_finish(out.data(), partial.data(), own.data(), own.size(), spec32);
    CHECK(std::isnan(out[3]));
    CHECK(std::isnan(out[517]));
    CHECK(out[4] == (op == ReduceOp::kMin ? 1.0f : 2.0f));
  }
  // Equal values give own's: min(partial -0, own +0) is +0, min(partial +0, own -0) is -0.
  const ReduceSpec min32{DataType::kFloat32, ReduceOp::kMin};
  CHECK(bits_of(finish_one<DataType::kFloat32>(-0.0f, 0.0f, min32)) == 0u);
  CHECK(bits_of(finish_one<DataType::kFloat32>(0.0f, -0.0f, min32)) == 0x80000000u);
}

TEST_CASE("float scales and AVG", "[reduce]") {
  // AVG divides: 1/3 is rounded once, not as 1 * (1/3) rounded twice.
  const ReduceSpec avg{DataType::kFloat32, ReduceOp::kAvg, 1.0, 1.0, 3};
  CHECK(finish_one<DataType::kFloat32>(0.5f, 0.5f, avg) == 1.0f / 3.0f);
  const ReduceSpec avg49{DataType::kFloat64, ReduceOp::kAvg, 1.0, 1.0, 49};
  CHECK(finish_one<DataType::kFloat64>(48.0, 1.0, avg49) == 1.0);  // 49 * (1/49) != 1
  // prescale multiplies each own value, postscale the finished result.
  const ReduceSpec scaled{DataType::kFloat32, ReduceOp::kAvg, 2.0, 10.0, 2};
  CHECK(finish_one<DataType::kFloat32>(1.0f, 3.0f, scaled) == 35.0f);  // (1 + 6) / 2 * 10
  const ReduceSpec single_scaled{DataType::kFloat16, ReduceOp::kAvg, 0.5, 3.0, 4};
  CHECK(single_one<DataType::kFloat16>(0x4800, single_scaled) == 0x4200);  // 8*.5/4*3 = 3
  // No contraction into a fused multiply-add: partial + own * prescale rounds twice.
  const float third = 1.0f / 3.0f;
  const ReduceSpec pre{DataType::kFloat32, ReduceOp::kSum, 3.0};
  std::vector<float> partial{-1.0f}, own{third}, out(1);
  kolo::reduce_combine(out.data(), partial.data(), own.data(), 1, pre);
  const volatile float product = third * 3.0f;  // volatile: rounded to float on its own
  CHECK(out[0] == product - 1.0f);
}

TEST_CASE("float16 conversions", "[reduce][half]") {
  SECTION("half_to_float of every pattern matches the definition") {
    int mismatches = 0;
    std::string first;
    for (uint32_t h = 0; h < 65536; ++h) {
      const auto half = static_cast<uint16_t>(h);
      const float got = kolo::half_to_float(half);
      const double expected = ref_float16_value(half);
      bool ok;
      if (std::isnan(expected)) {
        // Quiet NaN, sign and payload kept: what vcvtph2ps gives.
        const uint32_t quiet = ((h & 0x8000u) << 16) | 0x7fc00000u | ((h & 0x3ffu) << 13);
        ok = bits_of(got) == quiet;
      } else {
        ok = bits_of(got) == bits_of(static_cast<float>(expected));
      }
      if (!ok && mismatches++ == 0) {
        first = hex(h) + ": expected " + std::to_string(expected) + ", got " + hex(bits_of(got));
      }
    }
    INFO(first);
    CHECK(mismatches == 0);
  }

  SECTION("every half survives a round trip") {
    int mismatches = 0;
    std::string first;
    for (uint32_t h = 0; h < 65536; ++h) {
      const auto half = static_cast<uint16_t>(h);
      // A signalling NaN comes back quiet: the quiet bit (0x200) is set, the rest kept.
      const uint16_t expected = is_half_nan(half) ? static_cast<uint16_t>(half | 0x200) : half;
      const uint16_t got = kolo::float_to_half(kolo::half_to_float(half));
      if (got != expected && mismatches++ == 0) {
        first = hex(h) + ": expected " + hex(expected) + ", got " + hex(got);
      }
    }
    INFO(first);
    CHECK(mismatches == 0);
  }

  SECTION("float_to_half rounds to the nearest half, ties to even") {
    // Every midpoint between neighbouring halves, a float ulp either side of it, and a spread
    // of all float patterns.
    std::vector<float> values;
    for (uint32_t h = 0; h < 0x7c00; ++h) {
      const double low = ref_float16_value(static_cast<uint16_t>(h));
      const double high =
          h + 1 == 0x7c00 ? 65536.0 : ref_float16_value(static_cast<uint16_t>(h + 1));
      const float midpoint = static_cast<float>((low + high) / 2);  // exact in float
      values.push_back(midpoint);
      values.push_back(std::nextafter(midpoint, 0.0f));
      values.push_back(std::nextafter(midpoint, HUGE_VALF));
      values.push_back(static_cast<float>(low));
    }
    for (uint64_t bits = 0; bits < (uint64_t{1} << 32); bits += 4099) {
      values.push_back(float_from_bits(static_cast<uint32_t>(bits)));
    }
    int mismatches = 0;
    std::string first;
    for (float magnitude : values) {
      for (float value : {magnitude, -magnitude}) {
        const uint16_t got = kolo::float_to_half(value);
        const uint16_t expected = ref_float_to_half(value);
        const bool ok = std::isnan(value) ? is_half_nan(got) : got == expected;
        if (!ok && mismatches++ == 0) {
          first = hex(bits_of(value)) + ": expected " + hex(expected) + ", got " + hex(got);
        }
      }
    }
    INFO(first);
    CHECK(mismatches == 0);
  }

  SECTION("chosen values") {
    CHECK(kolo::float_to_half(1.0f) == 0x3c00);
    CHECK(kolo::float_to_half(1.0f + 0x1p-11f) == 0x3c00);      // tie, down to even
    CHECK(kolo::float_to_half(1.0f + 3 * 0x1p-11f) == 0x3c02);  // tie, up to even
    CHECK(kolo::float_to_half(1.0f + 0x1p-11f + 0x1p-20f) == 0x3c01);
    CHECK(kolo::float_to_half(2049.0f) == 0x6800);  // tie between 2048 and 2050
    CHECK(kolo::float_to_half(2051.0f) == 0x6802);  // tie between 2050 and 2052
    CHECK(kolo::float_to_half(-2.0f) == 0xc000);
    CHECK(kolo::float_to_half(-0.0f) == 0x8000);
    // Overflow.
    CHECK(kolo::float_to_half(65504.0f) == 0x7bff);
    CHECK(kolo::float_to_half(65519.996f) == 0x7bff);
    CHECK(kolo::float_to_half(65520.0f) == 0x7c00);  // midpoint to 65536: rounds to infinity
    CHECK(kolo::float_to_half(1e10f) == 0x7c00);
    CHECK(kolo::float_to_half(-1e10f) == 0xfc00);
    CHECK(kolo::float_to_half(HUGE_VALF) == 0x7c00);
    CHECK(kolo::float_to_half(-HUGE_VALF) == 0xfc00);
    // Subnormals.
    CHECK(kolo::float_to_half(0x1p-24f) == 0x0001);
    CHECK(kolo::float_to_half(0x1p-25f) == 0x0000);  // tie, to even 0
    CHECK(kolo::float_to_half(0x1p-25f + 0x1p-40f) == 0x0001);
    CHECK(kolo::float_to_half(3 * 0x1p-25f) == 0x0002);         // tie, to even 2
    CHECK(kolo::float_to_half(0x1p-14f - 0x1p-25f) == 0x0400);  // tie, up to the least normal
    CHECK(kolo::float_to_half(0x1p-14f - 0x1p-24f) == 0x03ff);
    CHECK(kolo::float_to_half(-0x3ffp-24f) == 0x83ff);
    CHECK(kolo::float_to_half(1e-45f) == 0x0000);  // float32 subnormal
    CHECK(kolo::float_to_half(-1e-45f) == 0x8000);
    CHECK(kolo::half_to_float(0x0001) == 0x1p-24f);
    CHECK(kolo::half_to_float(0x03ff) == 0x3ffp-24f);
    CHECK(kolo::half_to_float(0x8200) == -0x1p-15f);
    // NaN: quiet, sign and top payload bits kept (what vcvtps2ph does).
    CHECK(kolo::float_to_half(float_from_bits(0x7fc00000)) == 0x7e00);
    CHECK(kolo::float_to_half(float_from_bits(0x7f800001)) == 0x7e00);  // signalling
    CHECK(kolo::float_to_half(float_from_bits(0xff812345)) == 0xfe09);
    CHECK(bits_of(kolo::half_to_float(0x7c01)) == 0x7fc02000u);
  }
}

TEST_CASE("bfloat16 conversions", "[reduce][half]") {
  SECTION("bfloat16_to_float of every pattern matches the definition") {
    int mismatches = 0;
    std::string first;
    for (uint32_t b = 0; b < 65536; ++b) {
      const auto value = static_cast<uint16_t>(b);
      const float got = kolo::bfloat16_to_float(value);
      const double expected = ref_bfloat16_value(value);
      const bool ok = std::isnan(expected) ? bits_of(got) == ((b << 16) | 0x400000u)  // made quiet
                                           : bits_of(got) == bits_of(static_cast<float>(expected));
      if (!ok && mismatches++ == 0) {
        first = hex(b) + ": expected " + std::to_string(expected) + ", got " + hex(bits_of(got));
      }
    }
    INFO(first);
    CHECK(mismatches == 0);
  }

  SECTION("every bfloat16 survives a round trip") {
    int mismatches = 0;
    std::string first;
    for (uint32_t b = 0; b < 65536; ++b) {
      const auto value = static_cast<uint16_t>(b);
      const uint16_t expected =
          is_bfloat16_nan(value) ? static_cast<uint16_t>(value | 0x40) : value;
      const uint16_t got = kolo::float_to_bfloat16(kolo::bfloat16_to_float(value));
      if (got != expected && mismatches++ == 0) {
        first = hex(b) + ": expected " + hex(expected) + ", got " + hex(got);
      }
    }
    INFO(first);
    CHECK(mismatches == 0);
  }

  SECTION("float_to_bfloat16 rounds to the nearest, ties to even") {
    int mismatches = 0;
    std::string first;
    const auto check = [&](float value) {
      const uint16_t got = kolo::float_to_bfloat16(value);
      const uint16_t expected = ref_float_to_bfloat16(value);
      const bool ok = std::isnan(value) ? is_bfloat16_nan(got) : got == expected;
      if (!ok && mismatches++ == 0) {
        first = hex(bits_of(value)) + ": expected " + hex(expected) + ", got " + hex(got);
      }
    };
    for (uint32_t high = 0; high < 65536; ++high) {
      for (uint32_t low : {0x0000u, 0x0001u, 0x7fffu, 0x8000u, 0x8001u, 0xffffu}) {
        check(float_from_bits((high << 16) | low));
      }
    }
    for (uint64_t bits = 0; bits < (uint64_t{1} << 32); bits += 65537) {
      check(float_from_bits(static_cast<uint32_t>(bits)));
    }
    INFO(first);
    CHECK(mismatches == 0);
  }

  SECTION("chosen values") {
    CHECK(kolo::float_to_bfloat16(1.0f) == 0x3f80);
    CHECK(kolo::float_to_bfloat16(1.0f + 0x1p-8f) == 0x3f80);      // tie, down to even
    CHECK(kolo::float_to_bfloat16(1.0f + 3 * 0x1p-8f) == 0x3f82);  // tie, up to even
    CHECK(kolo::float_to_bfloat16(std::numeric_limits<float>::max()) == 0x7f80);  // overflow
    CHECK(kolo::float_to_bfloat16(float_from_bits(0x7f7f7fff)) == 0x7f7f);
    CHECK(kolo::float_to_bfloat16(float_from_bits(0xff7f8000)) == 0xff80);  // tie to -infinity
    CHECK(kolo::float_to_bfloat16(float_from_bits(0x00008000)) == 0x0000);  // subnormal tie
    CHECK(kolo::float_to_bfloat16(float_from_bits(0x00018000)) == 0x0002);
    CHECK(kolo::float_to_bfloat16(float_from_bits(0x00008001)) == 0x0001);
    CHECK(kolo::float_to_bfloat16(float_from_bits(0x7f800001)) == 0x7fc0);  // quiet NaN
    CHECK(kolo::float_to_bfloat16(float_from_bits(0xffc12345)) == 0xffc1);
    CHECK(kolo::bfloat16_to_float(0x0001) == 0x1p-133f);
  }
}

TEST_CASE("half conversions inside the kernels agree with the scalar functions", "[reduce][half]") {
  // The kernels may convert with F16C instructions; the scalar functions are portable C++.
  std::vector<uint16_t> every(65536);
  for (uint32_t h = 0; h < 65536; ++h) every[h] = static_cast<uint16_t>(h);

  for (DataType dtype : {DataType::kFloat16, DataType::kBFloat16}) {
    INFO(kolo::dtype_name(dtype));
    const bool float16 = dtype == DataType::kFloat16;
    const auto to_float = float16 ? kolo::half_to_float : kolo::bfloat16_to_float;
    const auto to_half = float16 ? kolo::float_to_half : kolo::float_to_bfloat16;

    // Widening: load every pattern.
    std::vector<float> widened(every.size());
    kolo::reduce_load(widened.data(), every.data(), every.size(), ReduceSpec{dtype});
    size_t widen_mismatches = 0;
    for (uint32_t h = 0; h < 65536; ++h) {
      widen_mismatches += bits_of(widened[h]) != bits_of(to_float(every[h]));
    }
    CHECK(widen_mismatches == 0);

    // Narrowing: finish partials of many float patterns with a +0 own value. p + 0 is p, except
    // that -0 becomes +0 and a signalling NaN becomes quiet, as the expectation does too.
    constexpr size_t kCount = size_t{1} << 22;
    std::vector<float> partial(kCount);
    std::mt19937_64 rng(7);
    for (size_t i = 0; i < kCount; ++i) {
      partial[i] = float_from_bits(static_cast<uint32_t>((i << 10) ^ (rng() & 0x3ff)));
    }
    for (float value : {65519.996f, 65520.0f, 0x1p-25f, 3 * 0x1p-25f, 1.0f + 0x1p-11f}) {
      partial[rng() % kCount] = value;
    }
    const std::vector<uint16_t> zeros(kCount, 0);
    std::vector<uint16_t> narrowed(kCount);
    kolo::reduce_finish(narrowed.data(), partial.data(), zeros.data(), kCount, ReduceSpec{dtype});
    size_t narrow_mismatches = 0;
    std::string first;
    for (size_t i = 0; i < kCount; ++i) {
      const uint16_t expected = to_half(partial[i] + 0.0f);
      if (narrowed[i] != expected && narrow_mismatches++ == 0) {
        first =
            hex(bits_of(partial[i])) + ": expected " + hex(expected) + ", got " + hex(narrowed[i]);
      }
    }
    INFO(first);
    CHECK(narrow_mismatches == 0);
  }
}

TEST_CASE("a float16 reduction rounds once, at the end", "[reduce][half]") {
  // 1 + 2^-11 + 2^-11 = 1 + 2^-10, a half. Rounding each partial sum to half would give 1:
  // 1 + 2^-11 is a tie, which goes to the even 1.0.
  const uint16_t one = 0x3c00;
  const uint16_t tiny = kolo::float_to_half(0x1p-11f);
  REQUIRE(kolo::half_to_float(tiny) == 0x1p-11f);
  const uint16_t rounded_per_hop =
      kolo::float_to_half(kolo::half_to_float(kolo::float_to_half(1.0f + 0x1p-11f)) + 0x1p-11f);
  REQUIRE(rounded_per_hop == one);

  const ReduceSpec spec{DataType::kFloat16, ReduceOp::kSum, 1.0, 1.0, 3};
  for (size_t count : {1, 17, 1500}) {
    INFO("count " << count);
    const std::vector<uint16_t> rank0(count, one), rank1(count, tiny), rank2(count, tiny);
    std::vector<float> partial(count);
    std::vector<uint16_t> out(count);
    kolo::reduce_load(partial.data(), rank0.data(), count, spec);
    kolo::reduce_combine(partial.data(), partial.data(), rank1.data(), count, spec);
    CHECK(partial[count - 1] == 1.0f + 0x1p-11f);  // kept in float32
    kolo::reduce_finish(out.data(), partial.data(), rank2.data(), count, spec);
    CHECK(out[0] == 0x3c01);  // 1 + 2^-10
    CHECK(out[count - 1] == 0x3c01);
  }

  // The same for bfloat16: 1 + 2^-8 + 2^-8 = 1 + 2^-7.
  const ReduceSpec bf16{DataType::kBFloat16, ReduceOp::kSum, 1.0, 1.0, 3};
  const uint16_t bf_one = 0x3f80;
  const uint16_t bf_tiny = kolo::float_to_bfloat16(0x1p-8f);
  float partial = 0;
  uint16_t out = 0;
  kolo::reduce_load(&partial, &bf_one, 1, bf16);
  kolo::reduce_combine(&partial, &partial, &bf_tiny, 1, bf16);
  kolo::reduce_finish(&out, &partial, &bf_tiny, 1, bf16);
  CHECK(out == 0x3f81);
}
