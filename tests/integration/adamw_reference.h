// A plain AdamW written for the tests, independent of the daemon's kernel:
// torch.optim.AdamW's formula in float, in torch's order of operations.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "fuyou/client.h"
#include "fuyou/dtype.h"

namespace fuyou::testing {

struct ReferenceChunk {
  std::vector<float> master, m, v;
  int64_t t = 0;

  explicit ReferenceChunk(std::vector<float> initial)
      : master(std::move(initial)), m(master.size(), 0.0f), v(master.size(), 0.0f) {}

  void Step(const std::vector<float>& grad, const AdamWHyper& h) {
    ++t;
    const double bc1 = 1.0 - std::pow(double{h.beta1}, double(t));
    const double bc2 = 1.0 - std::pow(double{h.beta2}, double(t));
    const float step_size = float(double{h.lr} / bc1);
    const float bc2_sqrt = float(std::sqrt(bc2));
    const float decay = float(1.0 - double{h.lr} * double{h.weight_decay});
    for (size_t i = 0; i < master.size(); ++i) {
      const float g = grad[i] * h.grad_scale;
      master[i] *= decay;
      m[i] = m[i] * h.beta1 + g * (1.0f - h.beta1);
      v[i] = v[i] * h.beta2 + g * g * (1.0f - h.beta2);
      const float denom = std::sqrt(v[i]) / bc2_sqrt + h.eps;
      master[i] -= step_size * m[i] / denom;
    }
  }
};

inline uint16_t ToBFloat16(float x) {
  uint32_t bits;
  std::memcpy(&bits, &x, 4);
  bits += 0x7fff + ((bits >> 16) & 1);  // round to nearest even (finite inputs)
  return static_cast<uint16_t>(bits >> 16);
}

inline float FromBFloat16(uint16_t h) {
  uint32_t bits = uint32_t{h} << 16;
  float x;
  std::memcpy(&x, &bits, 4);
  return x;
}

inline uint16_t ToFloat16(float x) {
  _Float16 h = static_cast<_Float16>(x);
  uint16_t bits;
  std::memcpy(&bits, &h, 2);
  return bits;
}

inline float FromFloat16(uint16_t bits) {
  _Float16 h;
  std::memcpy(&h, &bits, 2);
  return static_cast<float>(h);
}

// Encodes floats as `dtype` bytes, and back.
inline std::vector<std::byte> Encode(const std::vector<float>& values, DType dtype) {
  std::vector<std::byte> bytes(values.size() * DTypeSize(dtype));
  for (size_t i = 0; i < values.size(); ++i) {
    if (dtype == DType::kFloat32) {
      std::memcpy(bytes.data() + 4 * i, &values[i], 4);
    } else {
      uint16_t h = dtype == DType::kBFloat16 ? ToBFloat16(values[i]) : ToFloat16(values[i]);
      std::memcpy(bytes.data() + 2 * i, &h, 2);
    }
  }
  return bytes;
}

inline std::vector<float> Decode(const std::vector<std::byte>& bytes, DType dtype) {
  const size_t n = bytes.size() / DTypeSize(dtype);
  std::vector<float> values(n);
  for (size_t i = 0; i < n; ++i) {
    if (dtype == DType::kFloat32) {
      std::memcpy(&values[i], bytes.data() + 4 * i, 4);
    } else {
      uint16_t h;
      std::memcpy(&h, bytes.data() + 2 * i, 2);
      values[i] = dtype == DType::kBFloat16 ? FromBFloat16(h) : FromFloat16(h);
    }
  }
  return values;
}

}  // namespace fuyou::testing
