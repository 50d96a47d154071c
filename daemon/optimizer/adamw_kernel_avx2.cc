// AVX2 path (AVX2 + FMA + F16C). Compiled with those flags; called only after a
// run-time check. 16 elements per iteration; the tail goes through the same vector
// code via a small padded stack buffer, so every element sees the same arithmetic.
#include <immintrin.h>

#include <cstring>

#include "optimizer/adamw_kernel_internal.h"
#include "optimizer/block8_codec.h"

namespace fuyou::optimizer::internal {
namespace {

struct Consts {
  __m256 decay, beta1, omb1, beta2, omb2, step_size, eps, grad_scale;
  bool scale;
  explicit Consts(const StepConstants& c)
      : decay(_mm256_set1_ps(c.decay)),
        beta1(_mm256_set1_ps(c.beta1)),
        omb1(_mm256_set1_ps(c.one_minus_beta1)),
        beta2(_mm256_set1_ps(c.beta2)),
        omb2(_mm256_set1_ps(c.one_minus_beta2)),
        step_size(_mm256_set1_ps(c.simd_step_size)),
        eps(_mm256_set1_ps(c.simd_eps)),
        grad_scale(_mm256_set1_ps(c.grad_scale)),
        scale(c.grad_scale != 1.0f) {}
};

template <DType kGrad>
inline __m256 LoadGrad(const void* grad, size_t i) {
  if constexpr (kGrad == DType::kFloat32) {
    return _mm256_loadu_ps(static_cast<const float*>(grad) + i);
  } else {
    const __m128i h =
        _mm_loadu_si128(reinterpret_cast<const __m128i*>(static_cast<const uint16_t*>(grad) + i));
    if constexpr (kGrad == DType::kBFloat16) {
      return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
    } else {
      return _mm256_cvtph_ps(h);
    }
  }
}

// 8 floats -> 8 bfloat16, round to nearest even, NaN quietened.
inline __m128i ToBFloat16(__m256 x) {
  const __m256i u = _mm256_castps_si256(x);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
  const __m256i rounded =
      _mm256_srli_epi32(_mm256_add_epi32(_mm256_add_epi32(u, _mm256_set1_epi32(0x7fff)), lsb), 16);
  const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(x, x, _CMP_UNORD_Q));
  const __m256i quiet = _mm256_or_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(0x40));
  const __m256i r = _mm256_blendv_epi8(rounded, quiet, nan);
  // Pack 8 x 32-bit (values <= 0xffff) into 8 x 16-bit in order.
  const __m256i packed = _mm256_packus_epi32(r, r);  // [r0..r3 r0..r3 | r4..r7 r4..r7]
  return _mm256_castsi256_si128(_mm256_permute4x64_epi64(packed, 0x08));
}

template <DType kOut>
inline void StoreWeights(void* out, size_t i, __m256 w) {
  if constexpr (kOut == DType::kFloat32) {
    _mm256_storeu_ps(static_cast<float*>(out) + i, w);
  } else if constexpr (kOut == DType::kBFloat16) {
    _mm_storeu_si128(reinterpret_cast<__m128i*>(static_cast<uint16_t*>(out) + i), ToBFloat16(w));
  } else if constexpr (kOut == DType::kFloat16) {
    _mm_storeu_si128(reinterpret_cast<__m128i*>(static_cast<uint16_t*>(out) + i),
                     _mm256_cvtps_ph(w, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
  }
}

inline __m256 Step(const Consts& k, __m256 g, __m256 p, __m256& m, __m256& v) {
  if (k.scale) g = _mm256_mul_ps(g, k.grad_scale);
  p = _mm256_mul_ps(p, k.decay);
  m = _mm256_fmadd_ps(m, k.beta1, _mm256_mul_ps(k.omb1, g));
  v = _mm256_fmadd_ps(v, k.beta2, _mm256_mul_ps(_mm256_mul_ps(k.omb2, g), g));
  const __m256 denom = _mm256_add_ps(_mm256_sqrt_ps(v), k.eps);
  return _mm256_sub_ps(p, _mm256_div_ps(_mm256_mul_ps(k.step_size, m), denom));
}

template <DType kGrad, DType kOut>
void Loop(const StepConstants& c, const AdamWBuffers& b, size_t begin, size_t end) {
  const Consts k(c);
  float* __restrict pp = b.master;
  float* __restrict mp = static_cast<float*>(b.exp_avg);
  float* __restrict vp = static_cast<float*>(b.exp_avg_sq);
  const void* grad = b.grad;
  void* out = b.weights_out;
  size_t i = begin;
  for (; i + 16 <= end; i += 16) {
    __m256 g0 = LoadGrad<kGrad>(grad, i);
    __m256 g1 = LoadGrad<kGrad>(grad, i + 8);
    __m256 m0 = _mm256_loadu_ps(mp + i);
    __m256 m1 = _mm256_loadu_ps(mp + i + 8);
    __m256 v0 = _mm256_loadu_ps(vp + i);
    __m256 v1 = _mm256_loadu_ps(vp + i + 8);
    __m256 p0 = Step(k, g0, _mm256_loadu_ps(pp + i), m0, v0);
    __m256 p1 = Step(k, g1, _mm256_loadu_ps(pp + i + 8), m1, v1);
    _mm256_storeu_ps(pp + i, p0);
    _mm256_storeu_ps(pp + i + 8, p1);
    _mm256_storeu_ps(mp + i, m0);
    _mm256_storeu_ps(mp + i + 8, m1);
    _mm256_storeu_ps(vp + i, v0);
    _mm256_storeu_ps(vp + i + 8, v1);
    StoreWeights<kOut>(out, i, p0);
    StoreWeights<kOut>(out, i + 8, p1);
  }
  for (; i < end; i += 8) {
    const size_t len = end - i < 8 ? end - i : 8;
    const size_t gsize = DTypeSize(kGrad);
    alignas(32) float pt[8] = {}, mt[8] = {}, vt[8] = {}, gt[8] = {}, ot[8] = {};
    std::memcpy(pt, pp + i, len * 4);
    std::memcpy(mt, mp + i, len * 4);
    std::memcpy(vt, vp + i, len * 4);
    std::memcpy(gt, static_cast<const char*>(grad) + i * gsize, len * gsize);
    __m256 m = _mm256_load_ps(mt);
    __m256 v = _mm256_load_ps(vt);
    __m256 p = Step(k, LoadGrad<kGrad>(gt, 0), _mm256_load_ps(pt), m, v);
    _mm256_store_ps(pt, p);
    _mm256_store_ps(mt, m);
    _mm256_store_ps(vt, v);
    std::memcpy(pp + i, pt, len * 4);
    std::memcpy(mp + i, mt, len * 4);
    std::memcpy(vp + i, vt, len * 4);
    if constexpr (kOut != DType::kUnspecified) {
      StoreWeights<kOut>(ot, 0, p);
      std::memcpy(static_cast<char*>(out) + i * DTypeSize(kOut), ot, len * DTypeSize(kOut));
    }
  }
}

// ---- bf16 moments ---------------------------------------------------------------
// m and v as bf16: widened on load (a shift, exact), rounded on store with the
// scalar FloatToBFloat16 (m) and FloatToBFloat16Stochastic (v) arithmetic, so the
// stored bits equal the scalar rounding of this path's fp32 results. 8 elements
// per iteration; the tail through a padded stack buffer, as above.

inline __m256 LoadBFloat16(const uint16_t* src) {
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

// 8 x 32-bit lanes (values <= 0xffff) -> 8 x 16-bit, in order.
inline __m128i PackLanes(__m256i r) {
  const __m256i packed = _mm256_packus_epi32(r, r);
  return _mm256_castsi256_si128(_mm256_permute4x64_epi64(packed, 0x08));
}

inline __m256i RoundingNoise8(__m256i key, __m256i index) {
  __m256i x = _mm256_xor_si256(index, key);
  x = _mm256_xor_si256(x, _mm256_srli_epi32(x, 16));
  x = _mm256_mullo_epi32(x, _mm256_set1_epi32(0x7feb352d));
  x = _mm256_xor_si256(x, _mm256_srli_epi32(x, 15));
  x = _mm256_mullo_epi32(x, _mm256_set1_epi32(static_cast<int>(0x846ca68bu)));
  x = _mm256_xor_si256(x, _mm256_srli_epi32(x, 16));
  return _mm256_srli_epi32(x, 16);
}

// FloatToBFloat16Stochastic on 8 lanes.
inline __m128i ToBFloat16Stochastic(__m256 x, __m256i noise) {
  const __m256i u = _mm256_castps_si256(x);
  const __m256i rounded = _mm256_srli_epi32(_mm256_add_epi32(u, noise), 16);
  const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(x, x, _CMP_UNORD_Q));
  const __m256i quiet = _mm256_or_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(0x40));
  return PackLanes(_mm256_blendv_epi8(rounded, quiet, nan));
}

template <DType kGrad, DType kOut>
void LoopBf16Moments(const StepConstants& c, const AdamWBuffers& b, size_t begin, size_t end) {
  const Consts k(c);
  float* __restrict pp = b.master;
  uint16_t* __restrict mp = static_cast<uint16_t*>(b.exp_avg);
  uint16_t* __restrict vp = static_cast<uint16_t*>(b.exp_avg_sq);
  const void* grad = b.grad;
  void* out = b.weights_out;
  const __m256i key = _mm256_set1_epi32(static_cast<int>(c.rounding_key));
  const __m256i lanes = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  auto indices = [&](size_t i) {
    return _mm256_add_epi32(_mm256_set1_epi32(static_cast<int>(static_cast<uint32_t>(b.first_element + i))), lanes);
  };
  size_t i = begin;
  for (; i + 8 <= end; i += 8) {
    __m256 m = LoadBFloat16(mp + i);
    __m256 v = LoadBFloat16(vp + i);
    const __m256 p = Step(k, LoadGrad<kGrad>(grad, i), _mm256_loadu_ps(pp + i), m, v);
    _mm256_storeu_ps(pp + i, p);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(mp + i), ToBFloat16(m));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(vp + i), ToBFloat16Stochastic(v, RoundingNoise8(key, indices(i))));
    StoreWeights<kOut>(out, i, p);
  }
  if (i < end) {
    const size_t len = end - i;
    const size_t gsize = DTypeSize(kGrad);
    alignas(32) float pt[8] = {}, gt[8] = {}, ot[8] = {};
    alignas(16) uint16_t mt[8] = {}, vt[8] = {};
    std::memcpy(pt, pp + i, len * 4);
    std::memcpy(mt, mp + i, len * 2);
    std::memcpy(vt, vp + i, len * 2);
    std::memcpy(gt, static_cast<const char*>(grad) + i * gsize, len * gsize);
    __m256 m = LoadBFloat16(mt);
    __m256 v = LoadBFloat16(vt);
    const __m256 p = Step(k, LoadGrad<kGrad>(gt, 0), _mm256_load_ps(pt), m, v);
    _mm256_store_ps(pt, p);
    _mm_store_si128(reinterpret_cast<__m128i*>(mt), ToBFloat16(m));
    _mm_store_si128(reinterpret_cast<__m128i*>(vt), ToBFloat16Stochastic(v, RoundingNoise8(key, indices(i))));
    std::memcpy(pp + i, pt, len * 4);
    std::memcpy(mp + i, mt, len * 2);
    std::memcpy(vp + i, vt, len * 2);
    if constexpr (kOut != DType::kUnspecified) {
      StoreWeights<kOut>(ot, 0, p);
      std::memcpy(static_cast<char*>(out) + i * DTypeSize(kOut), ot, len * DTypeSize(kOut));
    }
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

void UpdateRangeAvx2(const StepConstants& c, const AdamWBuffers& b, size_t begin,
                     size_t end) {
  switch (b.grad_dtype) {
    case DType::kFloat32: return DispatchOut<DType::kFloat32>(c, b, begin, end);
    case DType::kBFloat16: return DispatchOut<DType::kBFloat16>(c, b, begin, end);
    case DType::kFloat16: return DispatchOut<DType::kFloat16>(c, b, begin, end);
    default: return;
  }
}

void ToFloat32Avx2(const void* src, DType src_dtype, float* dst, size_t n) {
  size_t i = 0;
  switch (src_dtype) {
    case DType::kFloat32:
      std::memcpy(dst, src, n * sizeof(float));
      return;
    case DType::kBFloat16:
      for (; i + 8 <= n; i += 8) _mm256_storeu_ps(dst + i, LoadGrad<DType::kBFloat16>(src, i));
      for (; i < n; ++i) dst[i] = BFloat16ToFloat(static_cast<const uint16_t*>(src)[i]);
      return;
    case DType::kFloat16:
      for (; i + 8 <= n; i += 8) _mm256_storeu_ps(dst + i, LoadGrad<DType::kFloat16>(src, i));
      for (; i < n; ++i) dst[i] = HalfToFloat(static_cast<const uint16_t*>(src)[i]);
      return;
    default: return;
  }
}

void FromFloat32Avx2(const float* src, void* dst, DType dst_dtype, size_t n) {
  size_t i = 0;
  switch (dst_dtype) {
    case DType::kFloat32:
      std::memcpy(dst, src, n * sizeof(float));
      return;
    case DType::kBFloat16:
      for (; i + 8 <= n; i += 8) StoreWeights<DType::kBFloat16>(dst, i, _mm256_loadu_ps(src + i));
      for (; i < n; ++i) static_cast<uint16_t*>(dst)[i] = FloatToBFloat16(src[i]);
      return;
    case DType::kFloat16:
      for (; i + 8 <= n; i += 8) StoreWeights<DType::kFloat16>(dst, i, _mm256_loadu_ps(src + i));
      for (; i < n; ++i) static_cast<uint16_t*>(dst)[i] = FloatToHalf(src[i]);
      return;
    default: return;
  }
}

}  // namespace fuyou::optimizer::internal

// ---- 8-bit moments: the pieces of one block (block8_kernel.cc) -------------------
// 8 elements at a time, the same operations as the scalar reference
// (block8_codec.h) in every lane; a tail of fewer than 8 through padded stack
// buffers, as the loops above.
namespace fuyou::optimizer::internal {
namespace {

inline __m256i Lanes8(uint32_t x) { return _mm256_set1_epi32(static_cast<int>(x)); }

inline __m256i Codes8(const uint8_t* codes) {
  return _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(codes)));
}

// 8 x 32-bit lanes (values <= 0xff) -> 8 bytes, in order.
inline void StoreCodes8(uint8_t* dst, __m256i c) {
  const __m256i bytes = _mm256_packus_epi16(_mm256_packus_epi32(c, c), _mm256_setzero_si256());
  const uint32_t lo = static_cast<uint32_t>(_mm_cvtsi128_si32(_mm256_castsi256_si128(bytes)));
  const uint32_t hi = static_cast<uint32_t>(_mm_cvtsi128_si32(_mm256_extracti128_si256(bytes, 1)));
  std::memcpy(dst, &lo, 4);
  std::memcpy(dst + 4, &hi, 4);
}

// Zero where `c` is zero, else `bits`.
inline __m256i UnlessZero(__m256i c, __m256i bits) {
  return _mm256_andnot_si256(_mm256_cmpeq_epi32(c, _mm256_setzero_si256()), bits);
}

inline __m256 DecodeM8(__m256i c) {
  const __m256i magnitude = _mm256_and_si256(c, Lanes8(0x7f));
  const __m256i sign = _mm256_slli_epi32(_mm256_and_si256(c, Lanes8(0x80)), 24);
  const __m256i bits = _mm256_add_epi32(_mm256_slli_epi32(magnitude, kMShift), Lanes8(kMBias));
  return _mm256_castsi256_ps(_mm256_or_si256(UnlessZero(magnitude, bits), sign));
}

inline __m256 DecodeV8(__m256i c) {
  return _mm256_castsi256_ps(UnlessZero(c, _mm256_add_epi32(_mm256_slli_epi32(c, kVShift), Lanes8(kVBias))));
}

template <DType kGrad, DType kOut>
Block8Max UpdateBlock8(const StepConstants& c, const AdamWBuffers& b, size_t i0, size_t len, float scale_m,
                       float scale_v, float* m_out, float* v_out) {
  const Consts k(c);
  const __m256 sm = _mm256_set1_ps(scale_m);
  const __m256 sv = _mm256_set1_ps(scale_v);
  const __m256i abs_mask = Lanes8(0x7fffffffu);
  __m256i most_m = _mm256_setzero_si256();
  __m256i most_v = _mm256_setzero_si256();
  // 8 elements whose inputs are at mc, vc, g, p and outputs at p, out, m_o, s_o.
  auto eight = [&](const uint8_t* mc, const uint8_t* vc, const void* g, float* p, void* out, float* m_o, float* v_o) {
    __m256 m = _mm256_mul_ps(DecodeM8(Codes8(mc)), sm);
    __m256 v = _mm256_mul_ps(DecodeV8(Codes8(vc)), sv);
    const __m256 w = Step(k, LoadGrad<kGrad>(g, 0), _mm256_loadu_ps(p), m, v);
    _mm256_storeu_ps(p, w);
    StoreWeights<kOut>(out, 0, w);
    _mm256_storeu_ps(m_o, m);
    _mm256_storeu_ps(v_o, v);
    most_m = _mm256_max_epu32(most_m, _mm256_and_si256(_mm256_castps_si256(m), abs_mask));
    most_v = _mm256_max_epu32(most_v, _mm256_and_si256(_mm256_castps_si256(v), abs_mask));
  };
  const auto* mc = static_cast<const uint8_t*>(b.exp_avg);
  const auto* vc = static_cast<const uint8_t*>(b.exp_avg_sq);
  constexpr size_t kGradSize = DTypeSize(kGrad);
  constexpr size_t kOutSize = kOut == DType::kUnspecified ? 0 : DTypeSize(kOut);
  size_t j = 0;
  for (; j + 8 <= len; j += 8) {
    const size_t i = i0 + j;
    eight(mc + i, vc + i, static_cast<const char*>(b.grad) + i * kGradSize, b.master + i,
          static_cast<char*>(b.weights_out) + i * kOutSize, m_out + j, v_out + j);
  }
  if (j < len) {
    // Zero padding decodes to m = v = 0 with a zero gradient: adds nothing to the largest.
    const size_t rest = len - j;
    const size_t i = i0 + j;
    alignas(32) uint8_t mt[8] = {}, vt[8] = {};
    alignas(32) float pt[8] = {}, gt[8] = {}, ot[8] = {}, m_o[8] = {}, v_o[8] = {};
    std::memcpy(mt, mc + i, rest);
    std::memcpy(vt, vc + i, rest);
    std::memcpy(gt, static_cast<const char*>(b.grad) + i * kGradSize, rest * kGradSize);
    std::memcpy(pt, b.master + i, rest * 4);
    eight(mt, vt, gt, pt, ot, m_o, v_o);
    std::memcpy(b.master + i, pt, rest * 4);
    if constexpr (kOut != DType::kUnspecified) {
      std::memcpy(static_cast<char*>(b.weights_out) + i * kOutSize, ot, rest * kOutSize);
    }
    std::memcpy(m_out + j, m_o, rest * 4);
    std::memcpy(v_out + j, v_o, rest * 4);
  }
  alignas(32) uint32_t lanes_m[8], lanes_v[8];
  _mm256_store_si256(reinterpret_cast<__m256i*>(lanes_m), most_m);
  _mm256_store_si256(reinterpret_cast<__m256i*>(lanes_v), most_v);
  Block8Max most;
  for (int l = 0; l < 8; ++l) {
    most.m = lanes_m[l] > most.m ? lanes_m[l] : most.m;
    most.v = lanes_v[l] > most.v ? lanes_v[l] : most.v;
  }
  return most;
}

// EncodeM and EncodeV (with VNoise) on 8 lanes.
inline void Encode8(const float* m, const float* v, __m256 im, __m256 iv, __m256i key, uint32_t first_index,
                    uint8_t* m_codes, uint8_t* v_codes) {
  const __m256i abs_mask = Lanes8(0x7fffffffu);
  const __m256i u = _mm256_castps_si256(_mm256_mul_ps(_mm256_loadu_ps(m), im));
  const __m256i a = _mm256_and_si256(u, abs_mask);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(a, kMShift), Lanes8(1));
  __m256i cm = _mm256_sub_epi32(_mm256_srli_epi32(_mm256_add_epi32(_mm256_add_epi32(a, Lanes8(kMHalfStep)), lsb), kMShift),
                                Lanes8(kMBias >> kMShift));
  cm = _mm256_min_epi32(_mm256_max_epi32(cm, _mm256_setzero_si256()), Lanes8(127));
  StoreCodes8(m_codes, _mm256_or_si256(cm, _mm256_and_si256(_mm256_srli_epi32(u, 24), Lanes8(0x80))));
  const __m256i sa = _mm256_and_si256(_mm256_castps_si256(_mm256_mul_ps(_mm256_loadu_ps(v), iv)), abs_mask);
  const __m256i index = _mm256_add_epi32(Lanes8(first_index), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
  __m256i x = _mm256_xor_si256(index, key);
  x = _mm256_xor_si256(x, _mm256_srli_epi32(x, 16));
  x = _mm256_mullo_epi32(x, Lanes8(0x7feb352du));
  x = _mm256_xor_si256(x, _mm256_srli_epi32(x, 15));
  x = _mm256_mullo_epi32(x, Lanes8(0x846ca68bu));
  x = _mm256_xor_si256(x, _mm256_srli_epi32(x, 16));
  __m256i cv = _mm256_sub_epi32(_mm256_srli_epi32(_mm256_add_epi32(sa, _mm256_srli_epi32(x, 32 - kVNoiseBits)), kVShift),
                                Lanes8(kVBias >> kVShift));
  cv = _mm256_min_epi32(_mm256_max_epi32(cv, Lanes8(1)), Lanes8(255));
  StoreCodes8(v_codes, UnlessZero(sa, cv));
}

}  // namespace

Block8Max UpdateBlock8Avx2(const StepConstants& c, const AdamWBuffers& b, size_t i, size_t len, float scale_m,
                           float scale_v, float* m_out, float* v_out) {
  return WithGradAndOutDTypes(b, [&]<DType kGrad, DType kOut>() {
    return UpdateBlock8<kGrad, kOut>(c, b, i, len, scale_m, scale_v, m_out, v_out);
  });
}

void EncodeBlock8Avx2(const float* m, const float* v, size_t len, float inv_m, float inv_v, uint32_t key,
                      uint64_t first_index, uint8_t* m_codes, uint8_t* v_codes) {
  const __m256 im = _mm256_set1_ps(inv_m);
  const __m256 iv = _mm256_set1_ps(inv_v);
  const __m256i key_lanes = Lanes8(key);
  size_t j = 0;
  for (; j + 8 <= len; j += 8) {
    Encode8(m + j, v + j, im, iv, key_lanes, static_cast<uint32_t>(first_index + j), m_codes + j, v_codes + j);
  }
  if (j < len) {
    const size_t rest = len - j;
    alignas(32) float mt[8] = {}, st[8] = {};
    alignas(32) uint8_t mc[8], vc[8];
    std::memcpy(mt, m + j, rest * 4);
    std::memcpy(st, v + j, rest * 4);
    Encode8(mt, st, im, iv, key_lanes, static_cast<uint32_t>(first_index + j), mc, vc);
    std::memcpy(m_codes + j, mc, rest);
    std::memcpy(v_codes + j, vc, rest);
  }
}

}  // namespace fuyou::optimizer::internal
