// Gradient journal arithmetic: what a GradReady's grad_ops and JOURNAL_USE_ADD
// do to a chunk's journaled gradients, exactly as torch does on a tensor of the
// gradients' dtype, and the statistics ParamsReady reports of them.
//
// Rounding contract (offload.proto, GradReady.grad_ops): every value is widened
// to fp32 exactly, the operation is one fp32 multiply, divide or add, and the
// result is rounded back to the dtype (round to nearest even; a NaN stays a NaN,
// never becomes an infinity) after each operation. For fp32 gradients the
// rounding is the fp32 operation itself. This is how torch computes mul_, div_
// and AccumulateGrad's add on bf16 and fp16 CPU/GPU tensors.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>

#include "fuyou/dtype.h"

namespace fuyou::optimizer {

// One in-place operation on every element (GradOp in offload.proto).
struct GradOp {
  enum class Kind : uint8_t { kMul, kDiv };
  Kind kind = Kind::kMul;
  float operand = 1.0f;
};

// Applies `ops`, in order, to the `n` elements of `dtype` at `grads`.
// Precondition: `dtype` is valid and `grads` holds n * DTypeSize(dtype) bytes.
void ApplyGradOps(std::byte* grads, DType dtype, uint64_t n, std::span<const GradOp> ops);

// accumulated[i] = accumulated[i] + addend[i] for i in [begin, end): one fp32 add
// of the two widened values, rounded to `dtype`. Both buffers hold elements of
// `dtype`; the ranges must not overlap.
void AddGrads(std::byte* accumulated, const std::byte* addend, DType dtype, uint64_t begin, uint64_t end);

// Sets the elements [begin, end) of `dtype` at `grads` to +0.
void ZeroGrads(std::byte* grads, DType dtype, uint64_t begin, uint64_t end);

// Statistics of a run of gradients: the sum of their squares, each square and
// the sum in fp64, and the largest |x| (NaN when any element is NaN).
struct GradStats {
  double sum_squares = 0;
  float max_abs = 0;
};
GradStats ComputeGradStats(const std::byte* grads, DType dtype, uint64_t begin, uint64_t end);

}  // namespace fuyou::optimizer
