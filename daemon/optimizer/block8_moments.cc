#include "optimizer/block8_moments.h"

#include <algorithm>
#include <cmath>

#include "optimizer/block8_codec.h"

namespace fuyou::optimizer {

using internal::kBlock8;

void DecodeBlock8(Moment which, const uint8_t* codes, const float* scales, uint64_t first, std::span<float> out) {
  for (size_t k = 0; k < out.size(); ++k) {
    const uint64_t i = first + k;
    const float scale = scales[i / kBlock8];
    if (which == Moment::kExpAvg) {
      out[k] = internal::DecodeM(codes[i]) * scale;
    } else {
      out[k] = internal::DecodeV(codes[i]) * scale;
    }
  }
}

void EncodeBlock8(Moment which, uint8_t* codes, float* scales, uint64_t chunk_elements, uint64_t first,
                  std::span<const float> values) {
  const uint64_t end = first + values.size();
  float block[kBlock8];
  for (uint64_t b = first / kBlock8; b * kBlock8 < end; ++b) {
    const uint64_t begin = b * kBlock8;
    const size_t len = static_cast<size_t>(std::min<uint64_t>(kBlock8, chunk_elements - begin));
    uint32_t most = 0;
    for (size_t k = 0; k < len; ++k) {
      const uint64_t i = begin + k;
      float x;
      if (i >= first && i < end) {
        x = values[i - first];
      } else {
        x = which == Moment::kExpAvg ? internal::DecodeM(codes[i]) * scales[b]
                                     : internal::DecodeV(codes[i]) * scales[b];
      }
      block[k] = x;
      most = std::max(most, internal::AbsBits(x));
    }
    const internal::BlockScale scale =
        internal::MakeBlockScale(most, which == Moment::kExpAvg ? internal::kMTop : internal::kVTop);
    for (size_t k = 0; k < len; ++k) {
      codes[begin + k] = which == Moment::kExpAvg
                             ? internal::EncodeM(block[k] * scale.inverse)
                             : internal::EncodeV(block[k] * scale.inverse, uint32_t{1} << (internal::kVShift - 1));
    }
    scales[b] = scale.scale;
  }
}

}  // namespace fuyou::optimizer
