// The 8-bit codes of Adam's moments with DType::kBlock8 (state_dtype "8bit"):
// the exact scalar encode and decode that every ISA's kernel agrees with bit
// for bit. Private to the optimizer module (block8_moments.h is the public side).
//
// Moments are quantized in blocks of kMomentBlockElements consecutive elements
// of a chunk, each block with one fp32 scale: a code c stands for
// Value(c) * scale. The codes are small floating-point numbers (as torchao's
// FP8 AdamW's, with a per-block absmax scale), with a code of their own for
// zero:
//   m: sign bit | 4-bit exponent e | 3-bit mantissa f: magnitude c = 8e + f,
//      Value(c) = 2^(e - 15) * (1 + f / 8), Value(0) = 0; the largest, 1.875,
//      stands for the block's largest |m|. 16 binades: |m| below about 2^-16
//      of the block's largest is stored as 0. To nearest (ties to even): a
//      step of 1/8 to 1/16 of the value.
//   v: 4-bit exponent e, 4-bit mantissa f: c = 16e + f, Value(c) = 2^(e - 15)
//      * (1 + f / 16), Value(0) = 0, largest 1.9375: 16 binades of v (8 of
//      sqrt(v), the range of a square-root code with the same step, 1/16 to
//      1/32). Rounded stochastically (v's per-step change, 0.1%, is far below
//      a code step, so rounding to nearest would freeze it, as for bf16 v:
//      adamw_kernel.h), keyed like bf16 v's rounding by (step, element index
//      in the chunk): unbiased in v. (A square-root code rounded
//      stochastically is unbiased in sqrt(v), so biased up in v by the
//      rounding's variance, up to (1/16)^2 / 4 = 0.1% of v a step: as much as
//      v's own decay.) And never to zero unless v is zero: a nonzero v below
//      the smallest code (about 2^-16 of the block's largest) is stored as the
//      smallest (an underestimated v would blow the update up; an
//      overestimate only shrinks it).
// Chosen by measurement (benchmarks/state_dtype_error.py, RESULTS.md), on a
// tiny GPT's gradients: v's mantissa matters most (4 bits instead of 3 cut the
// update error by a third); m keeps 16 binades rather than a fourth mantissa
// bit, because a block can hold the end of one parameter and the start of the
// next (blocks are the chunk's, and a chunk packs parameters back to back), and
// with 8 binades a LayerNorm's m next to a weight matrix's was stored as 0 (its
// parameters stopped training). bitsandbytes' dynamic tree code (a decimal
// exponent and up to 7 fraction bits, 7 decades) is lower still in error, but
// needs a table lookup to decode and a search to encode, where these are
// shifts and adds on the float's bits.
// A code's float bits are (c << shift) + (112 << 23) for c > 0 (shift 20 for
// m, 19 for v), so decoding is a shift, an add and a multiply, and encoding is
// integer rounding on the float's bits, as for bf16.
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
// Float bits of Value(c) less c << shift: the exponent of the lowest binade.
inline constexpr uint32_t kMBias = 112u << 23;
inline constexpr uint32_t kVBias = 112u << 23;
inline constexpr int kMShift = 20;  // 23 - 3 mantissa bits
inline constexpr int kVShift = 19;  // 23 - 4 mantissa bits
// Added to m's bits (with the kept bits' lowest) before the shift: to nearest, ties to even.
inline constexpr uint32_t kMHalfStep = (1u << (kMShift - 1)) - 1;
inline constexpr float kMTop = 1.875f;
inline constexpr float kVTop = 1.9375f;
// Bits of noise added below v's kept bits (stochastic rounding).
inline constexpr int kVNoiseBits = kVShift;

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
  return BitsToFloat(sign | (c == 0 ? 0u : (c << kMShift) + kMBias));
}

inline float DecodeV(uint8_t code) { return BitsToFloat(code == 0 ? 0u : (uint32_t{code} << kVShift) + kVBias); }

// x = m / scale (|x| <= kMTop up to rounding): nearest code, ties to even.
inline uint8_t EncodeM(float x) {
  const uint32_t u = FloatBits(x);
  const uint32_t a = u & 0x7fffffffu;
  int32_t c = static_cast<int32_t>((a + kMHalfStep + ((a >> kMShift) & 1u)) >> kMShift) -
              static_cast<int32_t>(kMBias >> kMShift);
  c = c < 0 ? 0 : (c > 127 ? 127 : c);
  return static_cast<uint8_t>(((u >> 24) & 0x80u) | static_cast<uint32_t>(c));
}

// x = v / scale (0 <= x <= kVTop up to rounding): rounded up with
// probability (dropped bits / 2^19), given `noise` < 2^19; at least code 1
// when x > 0.
inline uint8_t EncodeV(float x, uint32_t noise) {
  const uint32_t a = AbsBits(x);
  if (a == 0) return 0;
  int32_t c = static_cast<int32_t>((a + noise) >> kVShift) - static_cast<int32_t>(kVBias >> kVShift);
  c = c < 1 ? 1 : (c > 255 ? 255 : c);
  return static_cast<uint8_t>(c);
}

// The noise of element `index` of a chunk (its index in the chunk) at the
// step whose key is `key` (StochasticRoundingKey): kVNoiseBits bits.
inline uint32_t VNoise(uint32_t key, uint64_t index) {
  return RoundingHash(static_cast<uint32_t>(index) ^ key) >> (32 - kVNoiseBits);
}

}  // namespace fuyou::optimizer::internal
