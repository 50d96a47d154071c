// The 8-bit codes of Adam's moments with DType::kBlock8 (state_dtype "8bit"):
// the exact scalar encode and decode that every ISA's kernel agrees with bit
// for bit. Private to the optimizer module (block8_moments.h is the public side).
//
// Moments are quantized in blocks of kMomentBlockElements consecutive elements
// of a chunk, each block with one fp32 scale: a code c stands for
// Value(c) * scale. The codes are small floating-point numbers (as torchao's
// FP8 AdamW's E4M3 with a per-block absmax scale), with a code of their own for
// zero:
//   m: sign bit | 4-bit exponent e | 3-bit mantissa f: magnitude c = 8e + f,
//      Value(c) = 2^(e - 15) * (1 + f / 8), Value(0) = 0; the largest, 1.875,
//      stands for the block's largest |m|. Relative error <= 1/16, 16 binades
//      below the block's largest; rounded to nearest (ties to even).
//   v: 5-bit exponent e, 3-bit mantissa f: c = 8e + f, Value(c) = 2^(e - 31) *
//      (1 + f / 8), Value(0) = 0, largest 1.875: 32 binades of v, which are
//      the 16 binades of sqrt(v) with a step of 1/16 in sqrt(v), the range and
//      precision of a 4-bit-mantissa square-root code, but rounded in v itself.
//      Rounded stochastically (v's per-step change, 0.1%, is far below a code
//      step, so rounding to nearest would freeze it, as for bf16 v:
//      adamw_kernel.h), keyed like bf16 v's rounding by (step, element index
//      in the chunk): unbiased in v. (A square-root code rounded
//      stochastically is unbiased in sqrt(v), so biased up in v by the
//      rounding's variance, up to (1/16)^2 / 4 = 0.1% of v a step: as much as
//      v's own decay of 0.1% a step.) And never to zero unless v is zero: a nonzero v
//      below the smallest code is stored as the smallest (an underestimated v
//      would blow the update up; an overestimate only shrinks it).
// A code's float bits are (c << 20) + bias (m: 112 << 23, v: 96 << 23) for c > 0, so
// decoding is a shift, an add and a multiply, and encoding is integer rounding
// on the float's bits, as for bf16.
//
// A block's scale is its largest |m| (largest v) divided by the largest
// Value. A block whose largest is below FLT_MIN is stored as zeros (scale 0). A
// NaN or infinite m or v in a block makes the block's scale, and so every m
// (or v) of the block, non-finite: like an fp32 NaN, it spreads no further than
// the update it came from, but to the whole block.
#pragma once

#include <cfloat>
#include <cstddef>
#include <cstdint>

#include "fuyou/dtype.h"
#include "optimizer/adamw_kernel_internal.h"

namespace fuyou::optimizer::internal {

inline constexpr size_t kBlock8 = kMomentBlockElements;
// Float bits of Value(c) less c << kCodeShift: the exponent of the lowest binade.
inline constexpr uint32_t kMBias = 112u << 23;
inline constexpr uint32_t kVBias = 96u << 23;
inline constexpr int kCodeShift = 20;  // 23 - 3 mantissa bits
inline constexpr float kMTop = 1.875f;
inline constexpr float kVTop = 1.875f;
// Bits of noise added below v's kept bits (stochastic rounding).
inline constexpr int kVNoiseBits = kCodeShift;

// |x|'s bits: integer order is float order for |x|, with inf above every
// finite value and NaN above inf; so the integer maximum is exact and
// independent of the order, NaN included.
inline uint32_t AbsBits(float x) { return FloatBits(x) & 0x7fffffffu; }

// The block scale of a block whose largest |value| has bits `abs_max_bits`,
// for a code whose largest Value is `top`; and its inverse for encoding (0 for
// a block stored as zeros or with a non-finite largest value).
struct BlockScale {
  float scale;
  float inverse;
};
inline BlockScale MakeBlockScale(uint32_t abs_max_bits, float top) {
  const float abs_max = BitsToFloat(abs_max_bits);
  if (abs_max_bits < FloatBits(FLT_MIN)) return {0.0f, 0.0f};
  if (abs_max_bits >= 0x7f800000u) return {abs_max, 0.0f};  // inf or NaN: the block is lost
  return {abs_max / top, top / abs_max};
}

inline float DecodeM(uint8_t code) {
  const uint32_t c = code & 0x7fu;
  const uint32_t sign = static_cast<uint32_t>(code & 0x80u) << 24;
  return BitsToFloat(sign | (c == 0 ? 0u : (c << kCodeShift) + kMBias));
}

inline float DecodeV(uint8_t code) { return BitsToFloat(code == 0 ? 0u : (uint32_t{code} << kCodeShift) + kVBias); }

// x = m / scale (|x| <= kMTop up to rounding): nearest code, ties to even.
inline uint8_t EncodeM(float x) {
  const uint32_t u = FloatBits(x);
  const uint32_t a = u & 0x7fffffffu;
  int32_t c = static_cast<int32_t>((a + 0x7ffffu + ((a >> kCodeShift) & 1u)) >> kCodeShift) -
              static_cast<int32_t>(kMBias >> kCodeShift);
  c = c < 0 ? 0 : (c > 127 ? 127 : c);
  return static_cast<uint8_t>(((u >> 24) & 0x80u) | static_cast<uint32_t>(c));
}

// x = v / scale (0 <= x <= kVTop up to rounding): rounded up with
// probability (dropped bits / 2^20), given `noise` < 2^20; at least code 1
// when x > 0.
inline uint8_t EncodeV(float x, uint32_t noise) {
  const uint32_t a = AbsBits(x);
  if (a == 0) return 0;
  int32_t c = static_cast<int32_t>((a + noise) >> kCodeShift) - static_cast<int32_t>(kVBias >> kCodeShift);
  c = c < 1 ? 1 : (c > 255 ? 255 : c);
  return static_cast<uint8_t>(c);
}

// The noise of element `index` of a chunk (its index in the chunk) at the
// step whose key is `key` (StochasticRoundingKey): kVNoiseBits bits.
inline uint32_t VNoise(uint32_t key, uint64_t index) {
  return RoundingHash(static_cast<uint32_t>(index) ^ key) >> (32 - kVNoiseBits);
}

}  // namespace fuyou::optimizer::internal
