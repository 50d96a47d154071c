// Element types shared by the job and the daemon. Part of the wire contract.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string_view>

namespace fuyou {

// Values equal the proto enum fuyou.v1.DType.
enum class DType : uint8_t {
  kUnspecified = 0,
  kFloat32 = 1,
  kBFloat16 = 2,
  kFloat16 = 3,
};

// Bytes of one element; 0 for kUnspecified or an out-of-range value.
constexpr size_t DTypeSize(DType dtype) {
  switch (dtype) {
    case DType::kFloat32: return 4;
    case DType::kBFloat16: return 2;
    case DType::kFloat16: return 2;
    default: return 0;
  }
}

constexpr std::string_view DTypeName(DType dtype) {
  switch (dtype) {
    case DType::kFloat32: return "float32";
    case DType::kBFloat16: return "bfloat16";
    case DType::kFloat16: return "float16";
    default: return "unspecified";
  }
}

constexpr bool IsValidDType(DType dtype) { return DTypeSize(dtype) != 0; }

}  // namespace fuyou
