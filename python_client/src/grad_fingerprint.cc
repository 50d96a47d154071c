#include "grad_fingerprint.h"

#include <immintrin.h>

namespace fuyou::python {
namespace {

// Either path: a fixed order of adds for given values, so one machine always
// gives the same bits (the process picks its path once).
__attribute__((target("avx2,fma"))) SumAndSquares Avx2(const float* values, size_t count) {
  __m256d sum_low = _mm256_setzero_pd(), sum_high = _mm256_setzero_pd();
  __m256d squares_low = _mm256_setzero_pd(), squares_high = _mm256_setzero_pd();
  size_t i = 0;
  for (; i + 8 <= count; i += 8) {
    const __m256 v = _mm256_loadu_ps(values + i);
    const __m256d low = _mm256_cvtps_pd(_mm256_castps256_ps128(v));
    const __m256d high = _mm256_cvtps_pd(_mm256_extractf128_ps(v, 1));
    sum_low = _mm256_add_pd(sum_low, low);
    sum_high = _mm256_add_pd(sum_high, high);
    squares_low = _mm256_fmadd_pd(low, low, squares_low);
    squares_high = _mm256_fmadd_pd(high, high, squares_high);
  }
  alignas(32) double sums[4], squares[4];
  _mm256_store_pd(sums, _mm256_add_pd(sum_low, sum_high));
  _mm256_store_pd(squares, _mm256_add_pd(squares_low, squares_high));
  SumAndSquares total{.sum = (sums[0] + sums[1]) + (sums[2] + sums[3]),
                      .squares = (squares[0] + squares[1]) + (squares[2] + squares[3])};
  for (; i < count; ++i) {
    const double v = values[i];
    total.sum += v;
    total.squares += v * v;
  }
  return total;
}

SumAndSquares Portable(const float* values, size_t count) {
  double s0 = 0, s1 = 0, s2 = 0, s3 = 0, q0 = 0, q1 = 0, q2 = 0, q3 = 0;
  size_t i = 0;
  for (; i + 4 <= count; i += 4) {
    const double a = values[i], b = values[i + 1], c = values[i + 2], d = values[i + 3];
    s0 += a, s1 += b, s2 += c, s3 += d;
    q0 += a * a, q1 += b * b, q2 += c * c, q3 += d * d;
  }
  SumAndSquares total{.sum = (s0 + s1) + (s2 + s3), .squares = (q0 + q1) + (q2 + q3)};
  for (; i < count; ++i) {
    const double v = values[i];
    total.sum += v;
    total.squares += v * v;
  }
  return total;
}

const bool kHasAvx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");

}  // namespace

void AccumulateSumAndSquares(std::span<const float> values, SumAndSquares& total, bool portable) {
  const SumAndSquares piece = kHasAvx2 && !portable ? Avx2(values.data(), values.size()) : Portable(values.data(), values.size());
  total.sum += piece.sum;
  total.squares += piece.squares;
}

}  // namespace fuyou::python
