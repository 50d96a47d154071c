// Small helpers shared by the integration tests.
#pragma once

#include <cstdint>
#include <random>
#include <string>
#include <vector>

#include "absl/status/status.h"

namespace fuyou::testing {

// A Status's message as a std::string (Debian's abseil has its own string_view).
inline std::string Text(const absl::Status& status) { return std::string(status.message()); }

// Deterministic values in +-[0.1, 1] * scale: no value near zero, so relative
// errors mean something.
inline std::vector<float> Values(uint64_t seed, size_t n, float scale = 1.0f) {
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<float> magnitude(0.1f, 1.0f);
  std::vector<float> values(n);
  for (float& x : values) x = (rng() & 1 ? 1.0f : -1.0f) * magnitude(rng) * scale;
  return values;
}

}  // namespace fuyou::testing
