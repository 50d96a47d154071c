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
  // Adam moments only (ChunkSpec.moments_dtype, state_dtype "8bit"): 8-bit codes
  // in blocks of kMomentBlockElements with an fp32 scale each (see
  // daemon/optimizer/block8_codec.h). Not an element type: DTypeSize is 0 and
  // IsValidDType false, so it can never name weights or gradients.
  kBlock8 = 4,
};

// Elements per block of a kBlock8 moment (one fp32 scale each): torchao's
// block size for its 8-bit optimizers; 4 / 256 = 1.6% bytes of scales.
inline constexpr size_t kMomentBlockElements = 256;

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
    case DType::kBlock8: return "8-bit blocks";
    default: return "unspecified";
  }
}

constexpr bool IsValidDType(DType dtype) { return DTypeSize(dtype) != 0; }

// Bytes of one element of an Adam moment where its values (or codes) lie:
// DTypeSize, or 1 (the code) for kBlock8, whose block scales lie after them.
constexpr size_t MomentCodeBytes(DType dtype) { return dtype == DType::kBlock8 ? 1 : DTypeSize(dtype); }

}  // namespace fuyou
