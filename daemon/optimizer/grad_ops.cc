#include "optimizer/grad_ops.h"

#include <cmath>
#include <cstring>
#include <limits>

#include "optimizer/adamw_kernel_internal.h"

namespace fuyou::optimizer {
namespace {

using internal::BFloat16ToFloat;
using internal::FloatToBFloat16;
using internal::FloatToHalf;
using internal::HalfToFloat;

// One element of `dtype` widened to fp32, and an fp32 value rounded to `dtype`.
// The 2-byte dtypes go through uint16_t copies: the buffers may be unaligned.
inline float Load(const std::byte* data, DType dtype, uint64_t i) {
  if (dtype == DType::kFloat32) {
    float f;
    std::memcpy(&f, data + i * 4, 4);
    return f;
  }
  uint16_t h;
  std::memcpy(&h, data + i * 2, 2);
  return dtype == DType::kBFloat16 ? BFloat16ToFloat(h) : HalfToFloat(h);
}

inline void Store(std::byte* data, DType dtype, uint64_t i, float value) {
  if (dtype == DType::kFloat32) {
    std::memcpy(data + i * 4, &value, 4);
    return;
  }
  const uint16_t h = dtype == DType::kBFloat16 ? FloatToBFloat16(value) : FloatToHalf(value);
  std::memcpy(data + i * 2, &h, 2);
}

// The value after rounding to `dtype`, back in fp32 (identity for fp32).
inline float Round(float value, DType dtype) {
  switch (dtype) {
    case DType::kBFloat16: return BFloat16ToFloat(FloatToBFloat16(value));
    case DType::kFloat16: return HalfToFloat(FloatToHalf(value));
    default: return value;
  }
}

}  // namespace

void ApplyGradOps(std::byte* grads, DType dtype, uint64_t n, std::span<const GradOp> ops) {
  if (ops.empty()) return;
  if (dtype == DType::kFloat32) {
    // One pass per op: the compiler vectorises each; fp32 needs no rounding step.
    auto* values = reinterpret_cast<float*>(grads);  // the journal's buffers are aligned
    for (const GradOp& op : ops) {
      const float f = op.operand;
      if (op.kind == GradOp::Kind::kMul) {
        for (uint64_t i = 0; i < n; ++i) values[i] = values[i] * f;
      } else {
        for (uint64_t i = 0; i < n; ++i) values[i] = values[i] / f;
      }
    }
    return;
  }
  // Element by element, every op rounded to the dtype: the same as one pass per op.
  for (uint64_t i = 0; i < n; ++i) {
    float x = Load(grads, dtype, i);
    for (const GradOp& op : ops) {
      x = Round(op.kind == GradOp::Kind::kMul ? x * op.operand : x / op.operand, dtype);
    }
    Store(grads, dtype, i, x);
  }
}

void AddGrads(std::byte* accumulated, const std::byte* addend, DType dtype, uint64_t begin, uint64_t end) {
  for (uint64_t i = begin; i < end; ++i) {
    Store(accumulated, dtype, i, Load(accumulated, dtype, i) + Load(addend, dtype, i));
  }
}

void ZeroGrads(std::byte* grads, DType dtype, uint64_t begin, uint64_t end) {
  if (end <= begin) return;
  const size_t size = DTypeSize(dtype);
  std::memset(grads + begin * size, 0, (end - begin) * size);
}

GradStats ComputeGradStats(const std::byte* grads, DType dtype, uint64_t begin, uint64_t end) {
  GradStats stats;
  bool nan = false;
  for (uint64_t i = begin; i < end; ++i) {
    const float x = Load(grads, dtype, i);
    if (std::isnan(x)) {
      nan = true;
      continue;
    }
    const double wide = x;
    stats.sum_squares += wide * wide;
    const float magnitude = std::fabs(x);
    if (magnitude > stats.max_abs) stats.max_abs = magnitude;
  }
  if (nan) {
    stats.max_abs = std::numeric_limits<float>::quiet_NaN();
    stats.sum_squares = std::numeric_limits<double>::quiet_NaN();
  }
  return stats;
}

}  // namespace fuyou::optimizer
