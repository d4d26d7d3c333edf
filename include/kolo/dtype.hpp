// Element types and reduction operations, with the same numbering as kolo_dtype_t / kolo_op_t.
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <string_view>

namespace kolo {

enum class DataType : uint8_t {
  kFloat32 = 0,
  kFloat64 = 1,
  kFloat16 = 2,
  kBFloat16 = 3,
  kInt8 = 4,
  kUInt8 = 5,
  kInt32 = 6,
  kInt64 = 7,
  kInt16 = 8,
};
inline constexpr int kDataTypeCount = 9;

enum class ReduceOp : uint8_t {
  kSum = 0,
  kAvg = 1,
  kMin = 2,
  kMax = 3,
  kProd = 4,
};
inline constexpr int kReduceOpCount = 5;

// Size in bytes of one element; 0 for a value outside the enum.
size_t dtype_size(DataType dtype);
// "float32", "bfloat16", ... ; "unknown" outside the enum.
std::string_view dtype_name(DataType dtype);
// "sum", "avg", ... ; "unknown" outside the enum.
std::string_view op_name(ReduceOp op);
// Parses the names above (and nccl-tests' aliases: "float", "half", "double", "int", ...).
std::optional<DataType> parse_dtype(std::string_view name);
std::optional<ReduceOp> parse_op(std::string_view name);

inline bool is_valid(DataType dtype) { return static_cast<int>(dtype) < kDataTypeCount; }
inline bool is_valid(ReduceOp op) { return static_cast<int>(op) < kReduceOpCount; }

}  // namespace kolo
