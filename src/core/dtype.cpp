#include "kolo/dtype.hpp"

#include <array>

namespace kolo {

namespace {

struct DataTypeName {
  std::string_view name;
  DataType dtype;
};

// Canonical names first (dtype_name returns them), then the aliases nccl-tests and the
// frameworks use on their command lines.
constexpr std::array kDataTypeNames = {
    DataTypeName{"float32", DataType::kFloat32}, DataTypeName{"float64", DataType::kFloat64},
    DataTypeName{"float16", DataType::kFloat16}, DataTypeName{"bfloat16", DataType::kBFloat16},
    DataTypeName{"int8", DataType::kInt8},       DataTypeName{"uint8", DataType::kUInt8},
    DataTypeName{"int32", DataType::kInt32},     DataTypeName{"int64", DataType::kInt64},
    DataTypeName{"int16", DataType::kInt16},     DataTypeName{"float", DataType::kFloat32},
    DataTypeName{"double", DataType::kFloat64},  DataTypeName{"half", DataType::kFloat16},
    DataTypeName{"bf16", DataType::kBFloat16},   DataTypeName{"char", DataType::kInt8},
    DataTypeName{"int", DataType::kInt32},       DataTypeName{"long", DataType::kInt64},
    DataTypeName{"short", DataType::kInt16},
};

constexpr bool canonical_names_in_enum_order() {
  for (int i = 0; i < kDataTypeCount; ++i) {
    if (static_cast<int>(kDataTypeNames[i].dtype) != i) return false;
  }
  return true;
}
static_assert(canonical_names_in_enum_order(), "dtype_name indexes kDataTypeNames by enum value");

constexpr std::array<std::string_view, kReduceOpCount> kReduceOpNames = {"sum", "avg", "min", "max",
                                                                         "prod"};

}  // namespace

size_t dtype_size(DataType dtype) {
  switch (dtype) {
    case DataType::kFloat32:
    case DataType::kInt32:
      return 4;
    case DataType::kFloat64:
    case DataType::kInt64:
      return 8;
    case DataType::kFloat16:
    case DataType::kBFloat16:
    case DataType::kInt16:
      return 2;
    case DataType::kInt8:
    case DataType::kUInt8:
      return 1;
  }
  return 0;
}

std::string_view dtype_name(DataType dtype) {
  // The first kDataTypeCount entries are the canonical names, in enum order.
  if (!is_valid(dtype)) return "unknown";
  return kDataTypeNames[static_cast<size_t>(dtype)].name;
}

std::string_view op_name(ReduceOp op) {
  if (!is_valid(op)) return "unknown";
  return kReduceOpNames[static_cast<size_t>(op)];
}

std::optional<DataType> parse_dtype(std::string_view name) {
  for (const DataTypeName& entry : kDataTypeNames) {
    if (entry.name == name) return entry.dtype;
  }
  return std::nullopt;
}

std::optional<ReduceOp> parse_op(std::string_view name) {
  for (size_t i = 0; i < kReduceOpNames.size(); ++i) {
    if (kReduceOpNames[i] == name) return static_cast<ReduceOp>(i);
  }
  return std::nullopt;
}

}  // namespace kolo
