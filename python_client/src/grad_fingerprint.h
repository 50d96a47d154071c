// The resident mode's gradient fingerprint on the CPU: the sum and the sum of
// squares of a chunk's float32 gradient pieces, read once, in double.
//
// Contract: the result depends only on the values and the order of the pieces
// (a fixed summation order, no threads), so the same gradients give the same
// bits at send time and at step() — which is all a fingerprint promises. It is
// more precise than the fp32 sums torch takes, and it is also the chunk's sum of
// squares for max_grad_norm.
#pragma once

#include <cstddef>
#include <span>

namespace fuyou::python {

struct SumAndSquares {
  double sum = 0;
  double squares = 0;
};

// Adds `values` to `total` (a chunk's pieces in order).
void AccumulateSumAndSquares(std::span<const float> values, SumAndSquares& total);

}  // namespace fuyou::python
