#include "grad_fingerprint.h"

namespace fuyou::python {

void AccumulateSumAndSquares(std::span<const float> values, SumAndSquares& total) {
  // Eight independent lanes: the loop is bound by memory, not by the adds'
  // latency, and the compiler keeps the lanes in registers.
  constexpr size_t kLanes = 8;
  double sums[kLanes] = {};
  double squares[kLanes] = {};
  const size_t whole = values.size() / kLanes * kLanes;
  for (size_t i = 0; i < whole; i += kLanes) {
    for (size_t lane = 0; lane < kLanes; ++lane) {
      const double v = values[i + lane];
      sums[lane] += v;
      squares[lane] += v * v;
    }
  }
  for (size_t i = whole; i < values.size(); ++i) {
    const double v = values[i];
    sums[0] += v;
    squares[0] += v * v;
  }
  for (size_t lane = 0; lane < kLanes; ++lane) {
    total.sum += sums[lane];
    total.squares += squares[lane];
  }
}

}  // namespace fuyou::python
