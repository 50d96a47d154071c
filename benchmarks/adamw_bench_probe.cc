// The memory-bandwidth probe of adamw_bench: the same memory traffic as an fp32
// AdamW update (read p, g, m, v; write p, m, v: 28 bytes an element) with trivial
// arithmetic, so its speed is what the memory system allows for that access pattern.
// Compiled with AVX-512 flags; call only when the CPU has AVX-512F.
#include <immintrin.h>

#include <cstddef>

namespace fuyou::bench {

void AdamShapedProbeAvx512(float* p, const float* g, float* m, float* v, size_t begin,
                           size_t end) {
  const __m512 a = _mm512_set1_ps(0.5f);
  size_t i = begin;
  for (; i + 32 <= end; i += 32) {
    __m512 g0 = _mm512_loadu_ps(g + i), g1 = _mm512_loadu_ps(g + i + 16);
    __m512 p0 = _mm512_loadu_ps(p + i), p1 = _mm512_loadu_ps(p + i + 16);
    __m512 m0 = _mm512_loadu_ps(m + i), m1 = _mm512_loadu_ps(m + i + 16);
    __m512 v0 = _mm512_loadu_ps(v + i), v1 = _mm512_loadu_ps(v + i + 16);
    m0 = _mm512_fmadd_ps(m0, a, g0);
    m1 = _mm512_fmadd_ps(m1, a, g1);
    v0 = _mm512_fmadd_ps(v0, a, g0);
    v1 = _mm512_fmadd_ps(v1, a, g1);
    p0 = _mm512_fmadd_ps(p0, a, m0);
    p1 = _mm512_fmadd_ps(p1, a, m1);
    _mm512_storeu_ps(p + i, p0);
    _mm512_storeu_ps(p + i + 16, p1);
    _mm512_storeu_ps(m + i, m0);
    _mm512_storeu_ps(m + i + 16, m1);
    _mm512_storeu_ps(v + i, v0);
    _mm512_storeu_ps(v + i + 16, v1);
  }
  for (; i < end; ++i) {
    m[i] = m[i] * 0.5f + g[i];
    v[i] = v[i] * 0.5f + g[i];
    p[i] = p[i] * 0.5f + m[i];
  }
}

}  // namespace fuyou::bench
