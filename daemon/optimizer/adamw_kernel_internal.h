// Private to the optimizer module: the per-step constants, the exact scalar dtype
// conversions every path agrees with bit for bit, and the per-ISA entry points.
#pragma once

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>

#include "optimizer/adamw_kernel.h"

namespace fuyou::optimizer::internal {

// Everything an update needs that does not depend on the element. Computed once per
// Update in double (as torch does with Python floats) and rounded to float.
struct StepConstants {
  float decay;           // 1 - lr * weight_decay
  float beta1;
  float one_minus_beta1;
  float beta2;
  float one_minus_beta2;
  float step_size;       // lr / (1 - beta1^t)
  float bc2_sqrt;        // sqrt(1 - beta2^t)
  float eps;
  float grad_scale;
  // The SIMD paths fold the two divisions of torch's order into one:
  //   step_size * m / (sqrt(v) / bc2_sqrt + eps)
  //     == (step_size * bc2_sqrt) * m / (sqrt(v) + eps * bc2_sqrt)
  // which differs from torch's order by rounding only (a few ulp of the update).
  float simd_step_size;  // step_size * bc2_sqrt
  float simd_eps;        // eps * bc2_sqrt
  // Key of this step's stochastic rounding of bf16 v (StochasticRoundingKey(step)).
  uint32_t rounding_key;
};

StepConstants MakeStepConstants(const AdamWStepParams& params);

// ---- Exact scalar conversions -------------------------------------------------

inline uint32_t FloatBits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  return u;
}

inline float BitsToFloat(uint32_t u) {
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

inline float BFloat16ToFloat(uint16_t h) { return BitsToFloat(static_cast<uint32_t>(h) << 16); }

// Round to nearest, ties to even. A NaN stays a NaN (quietened, sign and top payload
// bits kept), never rounds up to infinity.
inline uint16_t FloatToBFloat16(float f) {
  const uint32_t u = FloatBits(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x40u);
  const uint32_t lsb = (u >> 16) & 1u;
  return static_cast<uint16_t>((u + 0x7fffu + lsb) >> 16);
}

// ---- bf16 moments: rounding of m (nearest even) and v (stochastic) ----------
//
// The stochastic rounding of v is deterministic: the 16 random bits of an
// element come from a hash of its index in the chunk and of the step's key, so
// every ISA, every split of [0, n) into ranges or threads and every redo of the
// step store the same bits. Indices are taken modulo 2^32 (the noise repeats
// every 4Gi elements of one chunk: harmless).

// lowbias32 (Chris Wellons' integer hash): a bijection of uint32 with good
// avalanche; two multiplies, vectorisable as vpmulld.
inline uint32_t RoundingHash(uint32_t x) {
  x ^= x >> 16;
  x *= 0x7feb352du;
  x ^= x >> 15;
  x *= 0x846ca68bu;
  x ^= x >> 16;
  return x;
}

inline uint32_t StochasticRoundingKey(int64_t step) {
  const auto t = static_cast<uint64_t>(step);
  return RoundingHash(static_cast<uint32_t>(t) ^ (static_cast<uint32_t>(t >> 32) * 0x9e3779b9u) ^ 0x5bd1e995u);
}

// The 16 bits added below the kept bits of element `index`'s v.
inline uint32_t RoundingNoise(uint32_t key, uint64_t index) {
  return RoundingHash(static_cast<uint32_t>(index) ^ key) >> 16;
}

// fp32 -> bf16 rounding up with probability (dropped bits / 2^16): unbiased,
// E[BFloat16ToFloat(r)] == f. A NaN is quietened as FloatToBFloat16 does; an
// infinity stays one; a value within one bf16 ulp of FLT_MAX may round to inf.
inline uint16_t FloatToBFloat16Stochastic(float f, uint32_t noise16) {
  const uint32_t u = FloatBits(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x40u);
  return static_cast<uint16_t>((u + noise16) >> 16);
}

// IEEE binary16 -> binary32, exact. Agrees with F16C's vcvtph2ps bit for bit,
// including subnormals and NaN (a signalling NaN comes back quietened).
inline float HalfToFloat(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t exp = (h >> 10) & 0x1fu;
  uint32_t mant = h & 0x3ffu;
  if (exp == 0x1f) {
    if (mant == 0) return BitsToFloat(sign | 0x7f800000u);
    return BitsToFloat(sign | 0x7fc00000u | (mant << 13));
  }
  if (exp != 0) return BitsToFloat(sign | ((exp + 112u) << 23) | (mant << 13));
  if (mant == 0) return BitsToFloat(sign);
  // Subnormal half: value = mant * 2^-24; normalise.
  int e = 113;  // biased float exponent for 2^-14 once the leading 1 reaches bit 10
  while ((mant & 0x400u) == 0) {
    mant <<= 1;
    --e;
  }
  mant &= 0x3ffu;
  return BitsToFloat(sign | (static_cast<uint32_t>(e) << 23) | (mant << 13));
}

// IEEE binary32 -> binary16, round to nearest even. Agrees with F16C's vcvtps2ph
// (_MM_FROUND_TO_NEAREST_INT) bit for bit: overflow gives infinity, tiny values
// round to subnormals or zero, NaN is quietened with its top payload bits kept.
inline uint16_t FloatToHalf(float f) {
  const uint32_t u = FloatBits(f);
  const uint16_t sign = static_cast<uint16_t>((u >> 16) & 0x8000u);
  const uint32_t abs = u & 0x7fffffffu;
  if (abs >= 0x7f800000u) {
    if (abs == 0x7f800000u) return sign | 0x7c00u;
    return sign | 0x7e00u | static_cast<uint16_t>((abs >> 13) & 0x3ffu);
  }
  if (abs >= 0x477ff000u) return sign | 0x7c00u;  // rounds to >= 65520: infinity
  const uint32_t exp = abs >> 23;
  if (exp >= 113) {  // normal half
    const uint32_t lsb = (abs >> 13) & 1u;
    const uint32_t r = (abs + 0xfffu + lsb) >> 13;  // carry into the exponent is right
    return sign | static_cast<uint16_t>(r - (112u << 10));
  }
  if (exp < 102) return sign;  // below half the smallest subnormal (2^-25): zero
  // Subnormal half: shift the 24-bit significand right, round to nearest even.
  const uint32_t mant = (abs & 0x7fffffu) | 0x800000u;
  const uint32_t shift = 126u - exp;  // 14..24
  const uint32_t half_ulp = 1u << (shift - 1);
  const uint32_t rest = mant & ((1u << shift) - 1u);
  uint32_t r = mant >> shift;
  if (rest > half_ulp || (rest == half_ulp && (r & 1u))) ++r;
  return sign | static_cast<uint16_t>(r);
}

// ---- Scalar loads and stores of gradients and weights --------------------------

template <DType kGrad>
inline float ScalarLoadGrad(const void* grad, size_t i) {
  if constexpr (kGrad == DType::kFloat32) {
    return static_cast<const float*>(grad)[i];
  } else if constexpr (kGrad == DType::kBFloat16) {
    return BFloat16ToFloat(static_cast<const uint16_t*>(grad)[i]);
  } else {
    return HalfToFloat(static_cast<const uint16_t*>(grad)[i]);
  }
}

// kOut == kUnspecified: no weights output.
template <DType kOut>
inline void ScalarStoreWeight(void* out, size_t i, float w) {
  if constexpr (kOut == DType::kFloat32) {
    static_cast<float*>(out)[i] = w;
  } else if constexpr (kOut == DType::kBFloat16) {
    static_cast<uint16_t*>(out)[i] = FloatToBFloat16(w);
  } else if constexpr (kOut == DType::kFloat16) {
    static_cast<uint16_t*>(out)[i] = FloatToHalf(w);
  }
}

// Calls f.template operator()<kGrad, kOut>() with the buffers' gradient dtype
// and weight output dtype (kUnspecified when weights_out is null) as constants:
// the one place the 8-bit kernels' dtype combinations are enumerated. Dtypes are
// validated at registration; anything not fp32 or bf16 is fp16.
template <typename F>
decltype(auto) WithGradAndOutDTypes(const AdamWBuffers& b, F&& f) {
  auto with_out = [&]<DType kGrad>() -> decltype(auto) {
    if (b.weights_out == nullptr) return f.template operator()<kGrad, DType::kUnspecified>();
    switch (b.weight_dtype) {
      case DType::kFloat32: return f.template operator()<kGrad, DType::kFloat32>();
      case DType::kBFloat16: return f.template operator()<kGrad, DType::kBFloat16>();
      default: return f.template operator()<kGrad, DType::kFloat16>();
    }
  };
  switch (b.grad_dtype) {
    case DType::kFloat32: return with_out.template operator()<DType::kFloat32>();
    case DType::kBFloat16: return with_out.template operator()<DType::kBFloat16>();
    default: return with_out.template operator()<DType::kFloat16>();
  }
}

// ---- 8-bit moments: the per-ISA pieces of one block (block8_kernel.cc) -------
//
// The largest |m| and v of some elements, as AbsBits (block8_codec.h).
struct Block8Max {
  uint32_t m = 0;
  uint32_t v = 0;
};
// Updates elements [i, i + len) of `b`, which lie in one block whose scales are
// scale_m and scale_v: decodes their m and v, runs the AdamW step (master and
// weights stored as for other moments), and writes the new m and v to
// m_out[0, len) and v_out[0, len) for encoding; returns their largest.
using Block8UpdateFn = Block8Max (*)(const StepConstants& c, const AdamWBuffers& b, size_t i, size_t len,
                                     float scale_m, float scale_v, float* m_out, float* v_out);
// Encodes len values of m (times inv_m) and v (times inv_v) into codes;
// element k's v noise is VNoise(key, first_index + k).
using Block8EncodeFn = void (*)(const float* m, const float* v, size_t len, float inv_m, float inv_v, uint32_t key,
                                uint64_t first_index, uint8_t* m_codes, uint8_t* v_codes);
// Updates [begin, end) of `b` (8-bit moments) block by block with one ISA's pieces.
void UpdateRangeBlock8(Block8UpdateFn update, Block8EncodeFn encode, const StepConstants& c, const AdamWBuffers& b,
                       size_t begin, size_t end);
Block8Max UpdateBlock8Scalar(const StepConstants& c, const AdamWBuffers& b, size_t i, size_t len, float scale_m,
                             float scale_v, float* m_out, float* v_out);
void EncodeBlock8Scalar(const float* m, const float* v, size_t len, float inv_m, float inv_v, uint32_t key,
                        uint64_t first_index, uint8_t* m_codes, uint8_t* v_codes);

// ---- Per-ISA entry points (defined only where the build compiled them) -------

// Updates [begin, end); the buffers' dtypes are valid.
void UpdateRangeScalar(const StepConstants& c, const AdamWBuffers& b, size_t begin, size_t end);
#if defined(FUYOU_OPTIMIZER_HAVE_AVX2)
void UpdateRangeAvx2(const StepConstants& c, const AdamWBuffers& b, size_t begin, size_t end);
Block8Max UpdateBlock8Avx2(const StepConstants& c, const AdamWBuffers& b, size_t i, size_t len, float scale_m,
                           float scale_v, float* m_out, float* v_out);
void EncodeBlock8Avx2(const float* m, const float* v, size_t len, float inv_m, float inv_v, uint32_t key,
                      uint64_t first_index, uint8_t* m_codes, uint8_t* v_codes);
void ToFloat32Avx2(const void* src, DType src_dtype, float* dst, size_t n);
void FromFloat32Avx2(const float* src, void* dst, DType dst_dtype, size_t n);
#endif
#if defined(FUYOU_OPTIMIZER_HAVE_AVX512)
void UpdateRangeAvx512(const StepConstants& c, const AdamWBuffers& b, size_t begin, size_t end);
Block8Max UpdateBlock8Avx512(const StepConstants& c, const AdamWBuffers& b, size_t i, size_t len, float scale_m,
                             float scale_v, float* m_out, float* v_out);
void EncodeBlock8Avx512(const float* m, const float* v, size_t len, float inv_m, float inv_v, uint32_t key,
                        uint64_t first_index, uint8_t* m_codes, uint8_t* v_codes);
void ToFloat32Avx512(const void* src, DType src_dtype, float* dst, size_t n);
void FromFloat32Avx512(const float* src, void* dst, DType dst_dtype, size_t n);
#endif

}  // namespace fuyou::optimizer::internal
