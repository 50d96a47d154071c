// AVX-512 path (F, BW, VL, DQ + F16C, FMA). Compiled with those flags; called only
// after a run-time check. One pass over memory, 64 elements per iteration (four
// independent vectors), software prefetch ahead on the four input streams, masked
// tail. The division is a reciprocal estimate refined by Newton-Raphson plus one
// correction of the quotient (no vdivps: its unit is a throughput bottleneck).
#include <immintrin.h>

#include <cfloat>
#include <cstdint>
#include <type_traits>

#include "optimizer/adamw_kernel_internal.h"
#include "optimizer/block8_codec.h"

namespace fuyou::optimizer::internal {
namespace {

struct Consts {
  __m512 decay, beta1, omb1, beta2, omb2, step_size, eps, grad_scale;
  bool scale;
  explicit Consts(const StepConstants& c)
      : decay(_mm512_set1_ps(c.decay)),
        beta1(_mm512_set1_ps(c.beta1)),
        omb1(_mm512_set1_ps(c.one_minus_beta1)),
        beta2(_mm512_set1_ps(c.beta2)),
        omb2(_mm512_set1_ps(c.one_minus_beta2)),
        step_size(_mm512_set1_ps(c.simd_step_size)),
        eps(_mm512_set1_ps(c.simd_eps)),
        grad_scale(_mm512_set1_ps(c.grad_scale)),
        scale(c.grad_scale != 1.0f) {}
};

template <DType kGrad>
inline __m512 LoadGrad(const void* grad, size_t i) {
  if constexpr (kGrad == DType::kFloat32) {
    return _mm512_loadu_ps(static_cast<const float*>(grad) + i);
  } else {
    const __m256i h =
        _mm256_loadu_si256(reinterpret_cast<const __m256i*>(static_cast<const uint16_t*>(grad) + i));
    if constexpr (kGrad == DType::kBFloat16) {
      return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
    } else {
      return _mm512_cvtph_ps(h);
    }
  }
}

template <DType kGrad>
inline __m512 LoadGradMasked(const void* grad, size_t i, __mmask16 k) {
  if constexpr (kGrad == DType::kFloat32) {
    return _mm512_maskz_loadu_ps(k, static_cast<const float*>(grad) + i);
  } else {
    const __m256i h = _mm256_maskz_loadu_epi16(k, static_cast<const uint16_t*>(grad) + i);
    if constexpr (kGrad == DType::kBFloat16) {
      return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
    } else {
      return _mm512_cvtph_ps(h);
    }
  }
}

// 16 floats -> 16 bfloat16 in the low halves of 32-bit lanes, round to nearest even,
// NaN quietened (same bits as FloatToBFloat16).
inline __m512i ToBFloat16Lanes(__m512 x) {
  const __m512i u = _mm512_castps_si512(x);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  const __m512i rounded =
      _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7fff)), lsb), 16);
  const __mmask16 nan = _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q);
  const __m512i quiet = _mm512_or_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(0x40));
  return _mm512_mask_blend_epi32(nan, rounded, quiet);
}

template <DType kOut>
inline void StoreWeights(void* out, size_t i, __m512 w) {
  if constexpr (kOut == DType::kFloat32) {
    _mm512_storeu_ps(static_cast<float*>(out) + i, w);
  } else if constexpr (kOut == DType::kBFloat16) {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(static_cast<uint16_t*>(out) + i),
                        _mm512_cvtepi32_epi16(ToBFloat16Lanes(w)));
  } else if constexpr (kOut == DType::kFloat16) {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(static_cast<uint16_t*>(out) + i),
                        _mm512_cvtps_ph(w, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
  }
}

template <DType kOut>
inline void StoreWeightsMasked(void* out, size_t i, __m512 w, __mmask16 k) {
  if constexpr (kOut == DType::kFloat32) {
    _mm512_mask_storeu_ps(static_cast<float*>(out) + i, k, w);
  } else if constexpr (kOut == DType::kBFloat16) {
    _mm512_mask_cvtepi32_storeu_epi16(static_cast<uint16_t*>(out) + i, k, ToBFloat16Lanes(w));
  } else if constexpr (kOut == DType::kFloat16) {
    _mm256_mask_storeu_epi16(static_cast<uint16_t*>(out) + i, k,
                             _mm512_cvtps_ph(w, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
  }
}

// The arithmetic on one vector: returns the new master weights, updates m and v.
// The quotient num / denom is computed without the divider: r ~ 1/denom from
// vrcp14ps (relative error < 2^-14), one Newton-Raphson step (r' = r + r(1 - denom r),
// error ~2^-28), q = num r', then one correction q += r' (num - q denom), which
// leaves q within about one ulp of the correctly rounded quotient. denom is clamped
// to FLT_MAX first so that an infinite v (an overflowed g*g) still gives a zero
// update as num / inf does (rcp14 of a value that large is 0, and 1 - inf*0 would be
// a NaN); a NaN denom stays NaN (vminps returns its second operand on a NaN).
// Differs from vdivps only when eps == 0 and v == 0 (0 denom: NaN instead of inf).
inline __m512 Step(const Consts& k, __m512 g, __m512 p, __m512& m, __m512& v) {
  if (k.scale) g = _mm512_mul_ps(g, k.grad_scale);
  p = _mm512_mul_ps(p, k.decay);
  m = _mm512_fmadd_ps(m, k.beta1, _mm512_mul_ps(k.omb1, g));
  v = _mm512_fmadd_ps(v, k.beta2, _mm512_mul_ps(_mm512_mul_ps(k.omb2, g), g));
  const __m512 denom =
      _mm512_min_ps(_mm512_set1_ps(FLT_MAX), _mm512_add_ps(_mm512_sqrt_ps(v), k.eps));
  const __m512 num = _mm512_mul_ps(k.step_size, m);
  __m512 r = _mm512_rcp14_ps(denom);
  r = _mm512_fmadd_ps(r, _mm512_fnmadd_ps(denom, r, _mm512_set1_ps(1.0f)), r);
  __m512 q = _mm512_mul_ps(num, r);
  q = _mm512_fmadd_ps(_mm512_fnmadd_ps(q, denom, num), r, q);
  return _mm512_sub_ps(p, q);
}

// Stores of the weights output that bypass the caches (the output is write-only
// here and is next read by a copy to the job or a DMA): saves the read-for-ownership
// of every output line. `out` + i must be 64-byte aligned.
template <DType kOut>
inline void StreamWeights(void* out, size_t i, __m512 w0, __m512 w1) {
  if constexpr (kOut == DType::kFloat32) {
    _mm512_stream_ps(static_cast<float*>(out) + i, w0);
    _mm512_stream_ps(static_cast<float*>(out) + i + 16, w1);
  } else if constexpr (kOut == DType::kBFloat16) {
    const __m512i both = _mm512_inserti64x4(
        _mm512_castsi256_si512(_mm512_cvtepi32_epi16(ToBFloat16Lanes(w0))),
        _mm512_cvtepi32_epi16(ToBFloat16Lanes(w1)), 1);
    _mm512_stream_si512(reinterpret_cast<__m512i*>(static_cast<uint16_t*>(out) + i), both);
  } else if constexpr (kOut == DType::kFloat16) {
    constexpr int kRound = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
    const __m512i both = _mm512_inserti64x4(_mm512_castsi256_si512(_mm512_cvtps_ph(w0, kRound)),
                                            _mm512_cvtps_ph(w1, kRound), 1);
    _mm512_stream_si512(reinterpret_cast<__m512i*>(static_cast<uint16_t*>(out) + i), both);
  }
}

// Ranges at least this long stream their weights output past the caches.
constexpr size_t kStreamMinElements = size_t{1} << 16;

// Elements per iteration of the main loop (independent vectors of 16).
constexpr size_t kUnroll = 64;
// How far ahead the main loop prefetches, in elements: 2 KiB of fp32 state (1 KiB
// of a 16-bit gradient). The hardware prefetchers alone leave a single core short of
// the memory system's concurrency on these seven streams; measured on a Xeon with
// AVX-512: 1-2 KiB ahead lifts the loop from ~82% to ~90-100% of an Adam-shaped
// bandwidth probe, 8 KiB is worse again. Prefetches never fault, so running past
// the end of a buffer is harmless.
constexpr size_t kPrefetchElements = 512;

template <DType kGrad, DType kOut>
void Loop(const StepConstants& c, const AdamWBuffers& b, size_t begin, size_t end) {
  const Consts k(c);
  float* __restrict pp = b.master;
  float* __restrict mp = static_cast<float*>(b.exp_avg);
  float* __restrict vp = static_cast<float*>(b.exp_avg_sq);
  const void* grad = b.grad;
  void* out = b.weights_out;

  // Up to 16 elements at [i, i + count) with masks.
  auto masked = [&](size_t i, size_t count) {
    const __mmask16 mask = count >= 16 ? __mmask16(0xffff) : __mmask16((1u << count) - 1u);
    __m512 g = LoadGradMasked<kGrad>(grad, i, mask);
    __m512 m = _mm512_maskz_loadu_ps(mask, mp + i);
    __m512 v = _mm512_maskz_loadu_ps(mask, vp + i);
    __m512 p = Step(k, g, _mm512_maskz_loadu_ps(mask, pp + i), m, v);
    _mm512_mask_storeu_ps(pp + i, mask, p);
    _mm512_mask_storeu_ps(mp + i, mask, m);
    _mm512_mask_storeu_ps(vp + i, mask, v);
    StoreWeightsMasked<kOut>(out, i, p, mask);
  };

  size_t i = begin;
  bool stream = false;
  if constexpr (kOut != DType::kUnspecified) {
    constexpr size_t kSize = DTypeSize(kOut);
    const auto addr = reinterpret_cast<uintptr_t>(static_cast<char*>(out) + begin * kSize);
    if (end - begin >= kStreamMinElements && addr % kSize == 0) {
      stream = true;
      size_t head = ((64 - addr % 64) % 64) / kSize;  // elements until `out` is aligned
      while (head > 0) {
        const size_t count = head < 16 ? head : 16;
        masked(i, count);
        i += count;
        head -= count;
      }
    }
  }

  auto body = [&](auto streaming) {
    constexpr size_t kV = kUnroll / 16;
    constexpr size_t kGradSize = DTypeSize(kGrad);
    for (; i + kUnroll <= end; i += kUnroll) {
      // One prefetch per 64-byte line of each input stream, kPrefetchElements ahead.
#pragma GCC unroll 4
      for (size_t l = 0; l < kUnroll; l += 16) {
        _mm_prefetch(reinterpret_cast<const char*>(pp + i + kPrefetchElements + l), _MM_HINT_T0);
        _mm_prefetch(reinterpret_cast<const char*>(mp + i + kPrefetchElements + l), _MM_HINT_T0);
        _mm_prefetch(reinterpret_cast<const char*>(vp + i + kPrefetchElements + l), _MM_HINT_T0);
      }
#pragma GCC unroll 4
      for (size_t l = 0; l < kUnroll * kGradSize; l += 64) {
        _mm_prefetch(static_cast<const char*>(grad) + (i + kPrefetchElements) * kGradSize + l,
                     _MM_HINT_T0);
      }
      __m512 g[kV], m[kV], v[kV], p[kV];
#pragma GCC unroll 4
      for (size_t j = 0; j < kV; ++j) {
        g[j] = LoadGrad<kGrad>(grad, i + 16 * j);
        m[j] = _mm512_loadu_ps(mp + i + 16 * j);
        v[j] = _mm512_loadu_ps(vp + i + 16 * j);
        p[j] = _mm512_loadu_ps(pp + i + 16 * j);
      }
#pragma GCC unroll 4
      for (size_t j = 0; j < kV; ++j) p[j] = Step(k, g[j], p[j], m[j], v[j]);
#pragma GCC unroll 4
      for (size_t j = 0; j < kV; ++j) {
        _mm512_storeu_ps(pp + i + 16 * j, p[j]);
        _mm512_storeu_ps(mp + i + 16 * j, m[j]);
        _mm512_storeu_ps(vp + i + 16 * j, v[j]);
      }
#pragma GCC unroll 4
      for (size_t j = 0; j < kV; j += 2) {
        if constexpr (decltype(streaming)::value) {
          StreamWeights<kOut>(out, i + 16 * j, p[j], p[j + 1]);
        } else {
          StoreWeights<kOut>(out, i + 16 * j, p[j]);
          StoreWeights<kOut>(out, i + 16 * j + 16, p[j + 1]);
        }
      }
    }
  };
  if (stream) {
    body(std::true_type{});
    _mm_sfence();  // order the streaming stores before whatever signals completion
  } else {
    body(std::false_type{});
  }
  for (; i < end; i += 16) masked(i, end - i);
}

// ---- bf16 moments ---------------------------------------------------------------
// m and v as bf16: widened on load (a shift, exact), rounded on store with the
// same integer arithmetic as the scalar FloatToBFloat16 (m) and
// FloatToBFloat16Stochastic (v), so the stored bits equal the scalar rounding of
// this path's fp32 results. Not vcvtneps2bf16 (AVX512_BF16): it flushes
// subnormal inputs and outputs to zero, which a small m would hit. One pass,
// 32 elements per iteration with the fp32 loop's software prefetch, masked
// tail; no streaming stores of the weights output.

inline __m512 LoadBFloat16(const uint16_t* src) {
  const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

inline __m512 LoadBFloat16Masked(const uint16_t* src, __mmask16 k) {
  const __m256i h = _mm256_maskz_loadu_epi16(k, src);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

// RoundingNoise for the 16 elements whose indices are `index` (32-bit lanes).
inline __m512i RoundingNoise16(__m512i key, __m512i index) {
  __m512i x = _mm512_xor_si512(index, key);
  x = _mm512_xor_si512(x, _mm512_srli_epi32(x, 16));
  x = _mm512_mullo_epi32(x, _mm512_set1_epi32(0x7feb352d));
  x = _mm512_xor_si512(x, _mm512_srli_epi32(x, 15));
  x = _mm512_mullo_epi32(x, _mm512_set1_epi32(static_cast<int>(0x846ca68bu)));
  x = _mm512_xor_si512(x, _mm512_srli_epi32(x, 16));
  return _mm512_srli_epi32(x, 16);
}

// FloatToBFloat16Stochastic on 16 lanes (results in the low halves).
inline __m512i ToBFloat16StochasticLanes(__m512 x, __m512i noise) {
  const __m512i u = _mm512_castps_si512(x);
  const __m512i rounded = _mm512_srli_epi32(_mm512_add_epi32(u, noise), 16);
  const __mmask16 nan = _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q);
  const __m512i quiet = _mm512_or_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(0x40));
  return _mm512_mask_blend_epi32(nan, rounded, quiet);
}

template <DType kGrad, DType kOut>
void LoopBf16Moments(const StepConstants& c, const AdamWBuffers& b, size_t begin, size_t end) {
  const Consts k(c);
  float* __restrict pp = b.master;
  uint16_t* __restrict mp = static_cast<uint16_t*>(b.exp_avg);
  uint16_t* __restrict vp = static_cast<uint16_t*>(b.exp_avg_sq);
  const void* grad = b.grad;
  void* out = b.weights_out;
  const __m512i key = _mm512_set1_epi32(static_cast<int>(c.rounding_key));
  const __m512i lanes = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  auto indices = [&](size_t i) {
    return _mm512_add_epi32(_mm512_set1_epi32(static_cast<int>(static_cast<uint32_t>(b.first_element + i))), lanes);
  };
  auto one = [&](size_t i) {
    __m512 m = LoadBFloat16(mp + i);
    __m512 v = LoadBFloat16(vp + i);
    const __m512 p = Step(k, LoadGrad<kGrad>(grad, i), _mm512_loadu_ps(pp + i), m, v);
    _mm512_storeu_ps(pp + i, p);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(mp + i), _mm512_cvtepi32_epi16(ToBFloat16Lanes(m)));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(vp + i),
                        _mm512_cvtepi32_epi16(ToBFloat16StochasticLanes(v, RoundingNoise16(key, indices(i)))));
    StoreWeights<kOut>(out, i, p);
  };
  constexpr size_t kGradSize = DTypeSize(kGrad);
  size_t i = begin;
  for (; i + 32 <= end; i += 32) {
    // As the fp32 loop: one prefetch per 64-byte line of each input stream,
    // kPrefetchElements ahead (master: 2 lines, m and v: 1 each, grad: 1 or 2).
    const size_t ahead = i + kPrefetchElements;
    _mm_prefetch(reinterpret_cast<const char*>(pp + ahead), _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(pp + ahead + 16), _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(mp + ahead), _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(vp + ahead), _MM_HINT_T0);
    for (size_t l = 0; l < 32 * kGradSize; l += 64) {
      _mm_prefetch(static_cast<const char*>(grad) + ahead * kGradSize + l, _MM_HINT_T0);
    }
    one(i);
    one(i + 16);
  }
  for (; i < end; i += 16) {
    const size_t count = end - i;
    const __mmask16 mask = count >= 16 ? __mmask16(0xffff) : __mmask16((1u << count) - 1u);
    __m512 m = LoadBFloat16Masked(mp + i, mask);
    __m512 v = LoadBFloat16Masked(vp + i, mask);
    const __m512 p = Step(k, LoadGradMasked<kGrad>(grad, i, mask), _mm512_maskz_loadu_ps(mask, pp + i), m, v);
    _mm512_mask_storeu_ps(pp + i, mask, p);
    _mm512_mask_cvtepi32_storeu_epi16(mp + i, mask, ToBFloat16Lanes(m));
    _mm512_mask_cvtepi32_storeu_epi16(vp + i, mask, ToBFloat16StochasticLanes(v, RoundingNoise16(key, indices(i))));
    StoreWeightsMasked<kOut>(out, i, p, mask);
  }
}

template <DType kGrad, DType kOut>
void DispatchMoments(const StepConstants& c, const AdamWBuffers& b, size_t begin, size_t end) {
  if (b.moments_dtype == DType::kBFloat16) return LoopBf16Moments<kGrad, kOut>(c, b, begin, end);
  return Loop<kGrad, kOut>(c, b, begin, end);
}

template <DType kGrad>
void DispatchOut(const StepConstants& c, const AdamWBuffers& b, size_t begin, size_t end) {
  if (b.weights_out == nullptr) return DispatchMoments<kGrad, DType::kUnspecified>(c, b, begin, end);
  switch (b.weight_dtype) {
    case DType::kFloat32: return DispatchMoments<kGrad, DType::kFloat32>(c, b, begin, end);
    case DType::kBFloat16: return DispatchMoments<kGrad, DType::kBFloat16>(c, b, begin, end);
    case DType::kFloat16: return DispatchMoments<kGrad, DType::kFloat16>(c, b, begin, end);
    default: return;
  }
}

}  // namespace

void UpdateRangeAvx512(const StepConstants& c, const AdamWBuffers& b, size_t begin,
                       size_t end) {
  switch (b.grad_dtype) {
    case DType::kFloat32: return DispatchOut<DType::kFloat32>(c, b, begin, end);
    case DType::kBFloat16: return DispatchOut<DType::kBFloat16>(c, b, begin, end);
    case DType::kFloat16: return DispatchOut<DType::kFloat16>(c, b, begin, end);
    default: return;
  }
}

void ToFloat32Avx512(const void* src, DType src_dtype, float* dst, size_t n) {
  size_t i = 0;
  switch (src_dtype) {
    case DType::kFloat32: {
      const auto* s = static_cast<const float*>(src);
      for (; i + 16 <= n; i += 16) _mm512_storeu_ps(dst + i, _mm512_loadu_ps(s + i));
      for (; i < n; ++i) dst[i] = s[i];
      return;
    }
    case DType::kBFloat16:
      for (; i + 16 <= n; i += 16) _mm512_storeu_ps(dst + i, LoadGrad<DType::kBFloat16>(src, i));
      for (; i < n; ++i) dst[i] = BFloat16ToFloat(static_cast<const uint16_t*>(src)[i]);
      return;
    case DType::kFloat16:
      for (; i + 16 <= n; i += 16) _mm512_storeu_ps(dst + i, LoadGrad<DType::kFloat16>(src, i));
      for (; i < n; ++i) dst[i] = HalfToFloat(static_cast<const uint16_t*>(src)[i]);
      return;
    default: return;
  }
}

void FromFloat32Avx512(const float* src, void* dst, DType dst_dtype, size_t n) {
  size_t i = 0;
  switch (dst_dtype) {
    case DType::kFloat32:
      for (; i + 16 <= n; i += 16) StoreWeights<DType::kFloat32>(dst, i, _mm512_loadu_ps(src + i));
      for (; i < n; ++i) static_cast<float*>(dst)[i] = src[i];
      return;
    case DType::kBFloat16:
      for (; i + 16 <= n; i += 16) StoreWeights<DType::kBFloat16>(dst, i, _mm512_loadu_ps(src + i));
      for (; i < n; ++i) static_cast<uint16_t*>(dst)[i] = FloatToBFloat16(src[i]);
      return;
    case DType::kFloat16:
      for (; i + 16 <= n; i += 16) StoreWeights<DType::kFloat16>(dst, i, _mm512_loadu_ps(src + i));
      for (; i < n; ++i) static_cast<uint16_t*>(dst)[i] = FloatToHalf(src[i]);
      return;
    default: return;
  }
}

}  // namespace fuyou::optimizer::internal

// ---- 8-bit moments: the pieces of one block (block8_kernel.cc) -------------------
// 16 elements at a time with masks, the same operations as the scalar
// reference (block8_codec.h) in every lane.
namespace fuyou::optimizer::internal {
namespace {

inline __m512i Lanes(uint32_t x) { return _mm512_set1_epi32(static_cast<int>(x)); }

inline __m512 DecodeM16(__m128i codes) {
  const __m512i c = _mm512_cvtepu8_epi32(codes);
  const __m512i magnitude = _mm512_and_si512(c, Lanes(0x7f));
  const __m512i sign = _mm512_slli_epi32(_mm512_and_si512(c, Lanes(0x80)), 24);
  const __m512i bits = _mm512_maskz_mov_epi32(_mm512_test_epi32_mask(magnitude, magnitude),
                                              _mm512_add_epi32(_mm512_slli_epi32(magnitude, kMShift), Lanes(kMBias)));
  return _mm512_castsi512_ps(_mm512_or_si512(bits, sign));
}

inline __m512 DecodeV16(__m128i codes) {
  const __m512i c = _mm512_cvtepu8_epi32(codes);
  return _mm512_castsi512_ps(
      _mm512_maskz_mov_epi32(_mm512_test_epi32_mask(c, c), _mm512_add_epi32(_mm512_slli_epi32(c, kVShift), Lanes(kVBias))));
}

template <DType kGrad, DType kOut>
Block8Max UpdateBlock8(const StepConstants& c, const AdamWBuffers& b, size_t i0, size_t len, float scale_m,
                       float scale_v, float* m_out, float* v_out) {
  const Consts k(c);
  float* __restrict pp = b.master;
  const auto* mc = static_cast<const uint8_t*>(b.exp_avg);
  const auto* vc = static_cast<const uint8_t*>(b.exp_avg_sq);
  const __m512 sm = _mm512_set1_ps(scale_m);
  const __m512 sv = _mm512_set1_ps(scale_v);
  const __m512i abs_mask = Lanes(0x7fffffffu);
  __m512i most_m = _mm512_setzero_si512();
  __m512i most_v = _mm512_setzero_si512();
  // 16 elements at j; all 16 (unmasked loads and stores: a masked vpmovdw or
  // vpmovdb to memory costs several times the unmasked one) or the tail.
  auto sixteen = [&](size_t j, auto full) {
    constexpr bool kFull = decltype(full)::value;
    const size_t i = i0 + j;
    const size_t count = len - j;
    const __mmask16 mask = kFull || count >= 16 ? __mmask16(0xffff) : __mmask16((1u << count) - 1u);
    const __m128i m_codes = kFull ? _mm_loadu_si128(reinterpret_cast<const __m128i*>(mc + i))
                                  : _mm_maskz_loadu_epi8(mask, mc + i);
    const __m128i v_codes = kFull ? _mm_loadu_si128(reinterpret_cast<const __m128i*>(vc + i))
                                  : _mm_maskz_loadu_epi8(mask, vc + i);
    __m512 m = _mm512_mul_ps(DecodeM16(m_codes), sm);
    __m512 v = _mm512_mul_ps(DecodeV16(v_codes), sv);
    __m512 p;
    if constexpr (kFull) {
      p = Step(k, LoadGrad<kGrad>(b.grad, i), _mm512_loadu_ps(pp + i), m, v);
      _mm512_storeu_ps(pp + i, p);
      StoreWeights<kOut>(b.weights_out, i, p);
      _mm512_storeu_ps(m_out + j, m);
      _mm512_storeu_ps(v_out + j, v);
    } else {
      p = Step(k, LoadGradMasked<kGrad>(b.grad, i, mask), _mm512_maskz_loadu_ps(mask, pp + i), m, v);
      _mm512_mask_storeu_ps(pp + i, mask, p);
      StoreWeightsMasked<kOut>(b.weights_out, i, p, mask);
      _mm512_mask_storeu_ps(m_out + j, mask, m);
      _mm512_mask_storeu_ps(v_out + j, mask, v);
    }
    most_m = _mm512_mask_max_epu32(most_m, mask, most_m, _mm512_and_si512(_mm512_castps_si512(m), abs_mask));
    most_v = _mm512_mask_max_epu32(most_v, mask, most_v, _mm512_and_si512(_mm512_castps_si512(v), abs_mask));
  };
  size_t j = 0;
  for (; j + 16 <= len; j += 16) sixteen(j, std::true_type{});
  if (j < len) sixteen(j, std::false_type{});
  // Not _mm512_reduce_max_epu32: GCC 12's expansion warns (-Wuninitialized).
  alignas(64) uint32_t lanes_m[16], lanes_v[16];
  _mm512_store_si512(lanes_m, most_m);
  _mm512_store_si512(lanes_v, most_v);
  Block8Max most;
  for (int l = 0; l < 16; ++l) {
    most.m = lanes_m[l] > most.m ? lanes_m[l] : most.m;
    most.v = lanes_v[l] > most.v ? lanes_v[l] : most.v;
  }
  return most;
}

}  // namespace

Block8Max UpdateBlock8Avx512(const StepConstants& c, const AdamWBuffers& b, size_t i, size_t len, float scale_m,
                             float scale_v, float* m_out, float* v_out) {
  return WithGradAndOutDTypes(b, [&]<DType kGrad, DType kOut>() {
    return UpdateBlock8<kGrad, kOut>(c, b, i, len, scale_m, scale_v, m_out, v_out);
  });
}

void EncodeBlock8Avx512(const float* m, const float* v, size_t len, float inv_m, float inv_v, uint32_t key,
                        uint64_t first_index, uint8_t* m_codes, uint8_t* v_codes) {
  const __m512 im = _mm512_set1_ps(inv_m);
  const __m512 iv = _mm512_set1_ps(inv_v);
  const __m512i key_lanes = Lanes(key);
  const __m512i lanes = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  const __m512i abs_mask = Lanes(0x7fffffffu);
  const __m512i m_bias = Lanes(kMBias >> kMShift);
  const __m512i v_bias = Lanes(kVBias >> kVShift);
  for (size_t j = 0; j < len; j += 16) {
    const size_t count = len - j;
    const __mmask16 mask = count >= 16 ? __mmask16(0xffff) : __mmask16((1u << count) - 1u);
    // m: nearest code, ties to even (EncodeM).
    const __m512i u = _mm512_castps_si512(_mm512_mul_ps(_mm512_maskz_loadu_ps(mask, m + j), im));
    const __m512i a = _mm512_and_si512(u, abs_mask);
    const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(a, kMShift), Lanes(1));
    __m512i cm =
        _mm512_sub_epi32(_mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(a, Lanes(kMHalfStep)), lsb), kMShift), m_bias);
    cm = _mm512_min_epi32(_mm512_max_epi32(cm, _mm512_setzero_si512()), Lanes(127));
    cm = _mm512_or_si512(cm, _mm512_and_si512(_mm512_srli_epi32(u, 24), Lanes(0x80)));
    if (count >= 16) {
      _mm_storeu_si128(reinterpret_cast<__m128i*>(m_codes + j), _mm512_cvtepi32_epi8(cm));
    } else {
      _mm512_mask_cvtepi32_storeu_epi8(m_codes + j, mask, cm);
    }
    // v: stochastic, at least code 1 unless zero (EncodeV, VNoise).
    const __m512i sa =
        _mm512_and_si512(_mm512_castps_si512(_mm512_mul_ps(_mm512_maskz_loadu_ps(mask, v + j), iv)), abs_mask);
    const __m512i index = _mm512_add_epi32(Lanes(static_cast<uint32_t>(first_index + j)), lanes);
    __m512i x = _mm512_xor_si512(index, key_lanes);
    x = _mm512_xor_si512(x, _mm512_srli_epi32(x, 16));
    x = _mm512_mullo_epi32(x, Lanes(0x7feb352du));
    x = _mm512_xor_si512(x, _mm512_srli_epi32(x, 15));
    x = _mm512_mullo_epi32(x, Lanes(0x846ca68bu));
    x = _mm512_xor_si512(x, _mm512_srli_epi32(x, 16));
    const __m512i noise = _mm512_srli_epi32(x, 32 - kVNoiseBits);
    __m512i cv = _mm512_sub_epi32(_mm512_srli_epi32(_mm512_add_epi32(sa, noise), kVShift), v_bias);
    cv = _mm512_min_epi32(_mm512_max_epi32(cv, Lanes(1)), Lanes(255));
    cv = _mm512_maskz_mov_epi32(_mm512_test_epi32_mask(sa, sa), cv);
    if (count >= 16) {
      _mm_storeu_si128(reinterpret_cast<__m128i*>(v_codes + j), _mm512_cvtepi32_epi8(cv));
    } else {
      _mm512_mask_cvtepi32_storeu_epi8(v_codes + j, mask, cv);
    }
  }
}

}  // namespace fuyou::optimizer::internal
