// Test-only helpers of the AdamW kernel tests: deterministic random numbers
// and the instruction sets this CPU runs.
#pragma once

#include <cstdint>
#include <vector>

#include "optimizer/adamw_kernel.h"

namespace fuyou::optimizer::kernel_testing {

// Deterministic, fast pseudo-random numbers (xorshift64; the 20M-element
// cases must stay quick).
class Rng {
 public:
  explicit Rng(uint64_t seed) : s_(seed * 0x9e3779b97f4a7c15ull + 1) {}
  uint64_t Next() {
    s_ ^= s_ << 13;
    s_ ^= s_ >> 7;
    s_ ^= s_ << 17;
    return s_;
  }
  // Uniform in [-1, 1).
  float Uniform() { return static_cast<float>(static_cast<int64_t>(Next() >> 40) - (1 << 23)) * 0x1p-23f; }

 private:
  uint64_t s_;
};

// The paths this CPU runs, scalar first when `with_scalar`.
inline std::vector<Isa> SupportedIsas(bool with_scalar) {
  std::vector<Isa> isas;
  if (with_scalar) isas.push_back(Isa::kScalar);
  for (Isa isa : {Isa::kAvx2, Isa::kAvx512}) {
    if (IsaSupported(isa)) isas.push_back(isa);
  }
  return isas;
}

}  // namespace fuyou::optimizer::kernel_testing
