// The AdamW update with 8-bit moments (DType::kBlock8): the block-by-block
// driver every ISA shares, and the scalar reference of its per-block pieces.
// The SIMD pieces (adamw_kernel_avx2.cc, adamw_kernel_avx512.cc) compute m, v,
// sqrt(v) and the codes with the same operations in the same order (FMA where
// this file calls std::fma), so the stored codes and scales are the same bits on
// every path; the master differs only by the quotient's rounding (AVX-512's is
// a refined reciprocal, within an ulp or so of the division here and in AVX2).
#include <algorithm>
#include <cmath>

#include "optimizer/adamw_kernel_internal.h"
#include "optimizer/block8_codec.h"

namespace fuyou::optimizer::internal {
namespace {

template <DType kGrad, DType kOut>
Block8Max UpdateScalar(const StepConstants& c, const AdamWBuffers& b, size_t i0, size_t len, float scale_m,
                       float scale_v, float* m_out, float* v_out) {
  float* __restrict p = b.master;
  const auto* mc = static_cast<const uint8_t*>(b.exp_avg);
  const auto* vc = static_cast<const uint8_t*>(b.exp_avg_sq);
  Block8Max most;
  for (size_t k = 0; k < len; ++k) {
    const size_t i = i0 + k;
    float g = ScalarLoadGrad<kGrad>(b.grad, i);
    if (c.grad_scale != 1.0f) g = g * c.grad_scale;
    const float pi = p[i] * c.decay;
    const float m = std::fma(DecodeM(mc[i]) * scale_m, c.beta1, c.one_minus_beta1 * g);
    const float v = std::fma(DecodeV(vc[i]) * scale_v, c.beta2, (c.one_minus_beta2 * g) * g);
    p[i] = pi - (c.simd_step_size * m) / (std::sqrt(v) + c.simd_eps);
    ScalarStoreWeight<kOut>(b.weights_out, i, p[i]);
    m_out[k] = m;
    v_out[k] = v;
    most.m = std::max(most.m, AbsBits(m));
    most.v = std::max(most.v, AbsBits(v));
  }
  return most;
}

}  // namespace

Block8Max UpdateBlock8Scalar(const StepConstants& c, const AdamWBuffers& b, size_t i, size_t len, float scale_m,
                             float scale_v, float* m_out, float* v_out) {
  return WithGradAndOutDTypes(b, [&]<DType kGrad, DType kOut>() {
    return UpdateScalar<kGrad, kOut>(c, b, i, len, scale_m, scale_v, m_out, v_out);
  });
}

void EncodeBlock8Scalar(const float* m, const float* v, size_t len, float inv_m, float inv_v, uint32_t key,
                        uint64_t first_index, uint8_t* m_codes, uint8_t* v_codes) {
  for (size_t k = 0; k < len; ++k) {
    m_codes[k] = EncodeM(m[k] * inv_m);
    v_codes[k] = EncodeV(v[k] * inv_v, VNoise(key, first_index + k));
  }
}

// Block by block: a block the range covers whole is decoded, updated and
// re-encoded by `update` and `encode` from two small buffers that stay in L1;
// one it covers in part is decoded whole first (the scalar decode: exact, the
// same on every ISA), its covered elements updated, and encoded whole.
void UpdateRangeBlock8(Block8UpdateFn update, Block8EncodeFn encode, const StepConstants& c, const AdamWBuffers& b,
                       size_t begin, size_t end) {
  alignas(64) float m[kBlock8];
  alignas(64) float v[kBlock8];
  auto* const m_codes = static_cast<uint8_t*>(b.exp_avg);
  auto* const v_codes = static_cast<uint8_t*>(b.exp_avg_sq);
  size_t i = begin;
  while (i < end) {
    const uint64_t element = b.first_element + i;  // in the chunk
    const uint64_t block = element / kBlock8;
    const uint64_t block_begin = block * kBlock8;
    const uint64_t block_end = std::min<uint64_t>(block_begin + kBlock8, b.chunk_elements);
    const size_t stop = static_cast<size_t>(std::min<uint64_t>(end, block_end - b.first_element));
    const size_t len = static_cast<size_t>(block_end - block_begin);
    const size_t offset = static_cast<size_t>(element - block_begin);  // of i in the block
    // The block's codes, from its first element (before element 0 of `b` when
    // the range starts inside a block).
    uint8_t* const mb = m_codes + i - offset;
    uint8_t* const vb = v_codes + i - offset;
    const float scale_m = b.exp_avg_scales[block];
    const float scale_v = b.exp_avg_sq_scales[block];
    Block8Max most;
    if (offset == 0 && stop - i == len) {
      most = update(c, b, i, len, scale_m, scale_v, m, v);
    } else {
      for (size_t k = 0; k < len; ++k) {
        m[k] = DecodeM(mb[k]) * scale_m;
        v[k] = DecodeV(vb[k]) * scale_v;
      }
      update(c, b, i, stop - i, scale_m, scale_v, m + offset, v + offset);
      for (size_t k = 0; k < len; ++k) {
        most.m = std::max(most.m, AbsBits(m[k]));
        most.v = std::max(most.v, AbsBits(v[k]));
      }
    }
    const BlockScale new_m = MakeBlockScale(most.m, kMTop);
    const BlockScale new_v = MakeBlockScale(most.v, kVTop);
    encode(m, v, len, new_m.inverse, new_v.inverse, c.rounding_key, block_begin, mb, vb);
    b.exp_avg_scales[block] = new_m.scale;
    b.exp_avg_sq_scales[block] = new_v.scale;
    i = stop;
  }
}

}  // namespace fuyou::optimizer::internal
