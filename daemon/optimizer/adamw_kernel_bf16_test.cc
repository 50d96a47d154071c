// The AdamW kernel with bf16 moments (AdamWBuffers::moments_dtype), on every path
// this CPU runs: the rounding helpers, the update against the same path's fp32
// update rounded by the scalar helpers (bit for bit), the paths against the
// scalar reference, splits and threads, and v's decay under stochastic rounding.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

#include "optimizer/adamw_kernel.h"
#include "optimizer/adamw_kernel_internal.h"
#include "optimizer/kernel_test_support.h"
#include "optimizer/segmented_update.h"

namespace fuyou::optimizer {
namespace {

using internal::BFloat16ToFloat;
using internal::BitsToFloat;
using internal::FloatBits;
using internal::FloatToBFloat16;
using internal::FloatToBFloat16Stochastic;
using internal::FloatToHalf;
using internal::RoundingNoise;

using kernel_testing::Rng;

std::vector<Isa> AllIsas() { return kernel_testing::SupportedIsas(/*with_scalar=*/true); }

// One chunk's states with bf16 moments, and its gradient and output.
struct Bf16State {
  std::vector<float> p;
  std::vector<uint16_t> m, v;
  std::vector<uint8_t> grad, out;
};

Bf16State MakeBf16State(size_t n, DType grad_dtype, DType weight_dtype, Rng& rng) {
  Bf16State s;
  s.p.resize(n);
  s.m.resize(n);
  s.v.resize(n);
  s.grad.resize(n * DTypeSize(grad_dtype));
  for (size_t i = 0; i < n; ++i) {
    s.p[i] = rng.Uniform();
    s.m[i] = FloatToBFloat16(0.01f * rng.Uniform());
    const float r = 0.01f * rng.Uniform();
    s.v[i] = FloatToBFloat16(r * r);
    float g = 0.05f * rng.Uniform();
    if (i % 97 == 3) g = 0.0f;
    if (i % 89 == 7) s.m[i] = FloatToBFloat16(1e-39f);  // a subnormal m
    if (grad_dtype == DType::kFloat32) {
      std::memcpy(&s.grad[i * 4], &g, 4);
    } else {
      const uint16_t h = grad_dtype == DType::kBFloat16 ? FloatToBFloat16(g) : FloatToHalf(g);
      std::memcpy(&s.grad[i * 2], &h, 2);
    }
  }
  s.out.assign(n * DTypeSize(weight_dtype), 0xcd);
  return s;
}

AdamWBuffers Bf16Buffers(Bf16State& s, DType grad_dtype, DType weight_dtype, uint64_t first_element) {
  AdamWBuffers b;
  b.master = s.p.data();
  b.exp_avg = s.m.data();
  b.exp_avg_sq = s.v.data();
  b.moments_dtype = DType::kBFloat16;
  b.first_element = first_element;
  b.grad = s.grad.data();
  b.grad_dtype = grad_dtype;
  b.weights_out = s.out.data();
  b.weight_dtype = weight_dtype;
  b.n = s.p.size();
  return b;
}

AdamWStepParams Params(int64_t step) {
  AdamWStepParams params;
  params.lr = 3e-3f;
  params.weight_decay = 0.1f;
  params.grad_scale = 0.5f;
  params.step = step;
  return params;
}

TEST(Bf16RoundingTest, StochasticRoundsUpWithProbabilityOfTheDroppedBits) {
  // Over all 2^16 noise values, a value rounds up exactly (its low 16 bits) times:
  // the rounding is unbiased. A bf16 value is kept as it is for every noise.
  for (float f : {1.0f + 0x1p-9f, 0.3f, -2.7e-5f, 1e-39f, 3.0e38f, 0.001f * 0.999f}) {
    const uint32_t u = FloatBits(f);
    uint32_t up = 0;
    for (uint32_t noise = 0; noise < 0x10000; ++noise) {
      const uint16_t r = FloatToBFloat16Stochastic(f, noise);
      ASSERT_TRUE(r == (u >> 16) || r == (u >> 16) + 1) << f;
      up += r == (u >> 16) + 1;
    }
    EXPECT_EQ(up, u & 0xffffu) << f;
    const float exact = BFloat16ToFloat(static_cast<uint16_t>(u >> 16));
    for (uint32_t noise : {0u, 1u, 0x8000u, 0xffffu}) {
      EXPECT_EQ(FloatToBFloat16Stochastic(exact, noise), u >> 16) << f;
    }
  }
  const float inf = std::numeric_limits<float>::infinity();
  EXPECT_EQ(FloatToBFloat16Stochastic(inf, 0xffffu), 0x7f80u);
  EXPECT_EQ(FloatToBFloat16Stochastic(-inf, 0xffffu), 0xff80u);
  const float nan = BitsToFloat(0x7f800001u);  // signalling, payload only in low bits
  EXPECT_EQ(FloatToBFloat16Stochastic(nan, 0xffffu), FloatToBFloat16(nan));
  EXPECT_TRUE(std::isnan(BFloat16ToFloat(FloatToBFloat16Stochastic(nan, 0))));
}

TEST(Bf16RoundingTest, NoiseDependsOnStepAndIndex) {
  const uint32_t k1 = internal::StochasticRoundingKey(1);
  const uint32_t k2 = internal::StochasticRoundingKey(2);
  EXPECT_NE(k1, k2);
  size_t same_index = 0, same_step = 0;
  for (uint64_t i = 0; i < 1000; ++i) {
    EXPECT_LT(RoundingNoise(k1, i), 0x10000u);
    same_step += RoundingNoise(k1, i) == RoundingNoise(k2, i);
    same_index += RoundingNoise(k1, i) == RoundingNoise(k1, i + 1);
  }
  EXPECT_LT(same_step, 5u);
  EXPECT_LT(same_index, 5u);
}

// Each path's update with bf16 moments is, bit for bit, the same path's update on
// the widened (fp32) moments, with m rounded to nearest even and v rounded
// stochastically by the scalar helpers; master and weights identical.
TEST(AdamWBf16MomentsTest, EachPathEqualsItsFp32UpdateRoundedByTheScalarHelpers) {
  const DType dtypes[] = {DType::kFloat32, DType::kBFloat16, DType::kFloat16};
  for (Isa isa : AllIsas()) {
    for (DType grad_dtype : dtypes) {
      for (DType weight_dtype : dtypes) {
        for (size_t n : {1u, 7u, 15u, 16u, 17u, 31u, 33u, 64u, 100u, 1027u}) {
          SCOPED_TRACE(std::string(IsaName(isa)) + " grad=" + std::string(DTypeName(grad_dtype)) +
                       " weights=" + std::string(DTypeName(weight_dtype)) + " n=" + std::to_string(n));
          Rng rng(n * 31 + static_cast<int>(grad_dtype) * 7 + static_cast<int>(weight_dtype));
          Bf16State bf = MakeBf16State(n, grad_dtype, weight_dtype, rng);
          std::vector<float> p32 = bf.p, m32(n), v32(n);
          for (size_t i = 0; i < n; ++i) {
            m32[i] = BFloat16ToFloat(bf.m[i]);
            v32[i] = BFloat16ToFloat(bf.v[i]);
          }
          std::vector<uint8_t> out32(bf.out.size(), 0xcd);
          const uint64_t first = 1000003;  // a sub-range deep in a chunk
          const AdamWStepParams params = Params(7);
          AdamWUpdateRange(isa, params, Bf16Buffers(bf, grad_dtype, weight_dtype, first), 0, n);
          AdamWBuffers b32;
          b32.master = p32.data();
          b32.exp_avg = m32.data();
          b32.exp_avg_sq = v32.data();
          b32.grad = bf.grad.data();
          b32.grad_dtype = grad_dtype;
          b32.weights_out = out32.data();
          b32.weight_dtype = weight_dtype;
          b32.n = n;
          AdamWUpdateRange(isa, params, b32, 0, n);
          const uint32_t key = internal::MakeStepConstants(params).rounding_key;
          size_t failures = 0;
          for (size_t i = 0; i < n && failures < 5; ++i) {
            const bool ok = FloatBits(bf.p[i]) == FloatBits(p32[i]) && bf.m[i] == FloatToBFloat16(m32[i]) &&
                            bf.v[i] == FloatToBFloat16Stochastic(v32[i], RoundingNoise(key, first + i));
            if (!ok) {
              ++failures;
              ADD_FAILURE() << "i=" << i << " p " << bf.p[i] << " vs " << p32[i] << ", m " << bf.m[i] << " vs "
                            << m32[i] << ", v " << bf.v[i] << " vs " << v32[i];
            }
          }
          EXPECT_EQ(bf.out, out32);
        }
      }
    }
  }
}

// The SIMD paths against the scalar reference: the master as close as with fp32
// moments; m and v at most one bf16 step apart (the fp32 values a few ulp apart
// can straddle a rounding boundary), and equal for nearly every element.
TEST(AdamWBf16MomentsTest, SimdPathsMatchTheScalarReference) {
  const size_t n = 20000;
  for (Isa isa : AllIsas()) {
    if (isa == Isa::kScalar) continue;
    SCOPED_TRACE(std::string(IsaName(isa)));
    Rng rng(5);
    Bf16State ref = MakeBf16State(n, DType::kBFloat16, DType::kBFloat16, rng);
    for (int64_t t = 1; t <= 3; ++t) {
      Bf16State simd = ref;
      const Bf16State before = ref;
      AdamWUpdateRange(Isa::kScalar, Params(t), Bf16Buffers(ref, DType::kBFloat16, DType::kBFloat16, 0), 0, n);
      AdamWUpdateRange(isa, Params(t), Bf16Buffers(simd, DType::kBFloat16, DType::kBFloat16, 0), 0, n);
      size_t m_differ = 0, v_differ = 0;
      for (size_t i = 0; i < n; ++i) {
        const double update = std::fabs(static_cast<double>(before.p[i]) * (1 - 3e-4) - ref.p[i]);
        ASSERT_NEAR(simd.p[i], ref.p[i], 1e-6 * (std::fabs(ref.p[i]) + update) + 1e-3 * update + 1e-38) << i;
        // m = beta1 m + (1 - beta1) g can cancel: its fp32 values differ by a few
        // ulp of the terms (as with fp32 moments), then by one bf16 step (<= 2^-7 of m).
        float g;
        std::memcpy(&g, &before.grad[i * 2], 2);
        g = BFloat16ToFloat(static_cast<uint16_t>(FloatBits(g))) * 0.5f;
        const double terms = 0.9 * std::fabs(BFloat16ToFloat(before.m[i])) + 0.1 * std::fabs(g);
        ASSERT_LE(std::fabs(BFloat16ToFloat(simd.m[i]) - BFloat16ToFloat(ref.m[i])),
                  0x1p-7 * std::fabs(BFloat16ToFloat(ref.m[i])) + 1e-5 * terms + 1e-38)
            << i;
        ASSERT_LE(std::abs(int{simd.v[i]} - int{ref.v[i]}), 1) << i;
        m_differ += simd.m[i] != ref.m[i];
        v_differ += simd.v[i] != ref.v[i];
      }
      EXPECT_LT(m_differ, n / 100);
      EXPECT_LT(v_differ, n / 100);
      ref = simd;  // the next step from the same state on both
    }
  }
}

// Stored bits do not depend on how the chunk was split: ranges, sub-buffers with
// their first_element (as SegmentedUpdate passes them), the thread pool.
TEST(AdamWBf16MomentsTest, ResultDoesNotDependOnSplitsOrThreads) {
  const size_t n = 200000;
  for (Isa isa : AllIsas()) {
    SCOPED_TRACE(std::string(IsaName(isa)));
    Rng rng(9);
    const Bf16State start = MakeBf16State(n, DType::kFloat32, DType::kBFloat16, rng);
    Bf16State whole = start;
    AdamWUpdateRange(isa, Params(3), Bf16Buffers(whole, DType::kFloat32, DType::kBFloat16, 0), 0, n);

    Bf16State ranges = start;
    const AdamWBuffers b = Bf16Buffers(ranges, DType::kFloat32, DType::kBFloat16, 0);
    AdamWUpdateRange(isa, Params(3), b, 0, 13);
    AdamWUpdateRange(isa, Params(3), b, 13, 70001);
    AdamWUpdateRange(isa, Params(3), b, 70001, n);
    EXPECT_EQ(ranges.m, whole.m);
    EXPECT_EQ(ranges.v, whole.v);
    EXPECT_EQ(ranges.p, whole.p);

    // Segments at different t: SegmentedUpdate's sub-buffers carry their offset,
    // so each segment is rounded as that range of the whole chunk.
    Bf16State segmented = start;
    Bf16State by_range = start;
    const uint64_t segments[] = {1001, 999, n - 2000};
    const int64_t counts[] = {2, 5, 2};
    AdamWKernel one_thread(1, isa);
    SegmentedUpdate(one_thread, Params(0), Bf16Buffers(segmented, DType::kFloat32, DType::kBFloat16, 0),
                    SegmentedUpdateSpec{segments, counts, 0, {}});
    const AdamWBuffers whole_buffers = Bf16Buffers(by_range, DType::kFloat32, DType::kBFloat16, 0);
    AdamWUpdateRange(isa, Params(3), whole_buffers, 0, 1001);
    AdamWUpdateRange(isa, Params(6), whole_buffers, 1001, 2000);
    AdamWUpdateRange(isa, Params(3), whole_buffers, 2000, n);
    EXPECT_EQ(segmented.m, by_range.m);
    EXPECT_EQ(segmented.v, by_range.v);
    EXPECT_EQ(segmented.out, by_range.out);

    Bf16State threaded = start;
    AdamWKernel pool(4, isa);
    pool.Update(Params(3), Bf16Buffers(threaded, DType::kFloat32, DType::kBFloat16, 0));
    EXPECT_EQ(threaded.m, whole.m);
    EXPECT_EQ(threaded.v, whole.v);
    EXPECT_EQ(threaded.out, whole.out);

    // The smallest slices the kernel takes (fair turns): several per update.
    Bf16State sliced = start;
    AdamWKernel slicing(2, isa, /*slice_bytes=*/1);
    ASSERT_LT(slicing.slice_bytes() / 22, n / 2);
    slicing.Update(Params(3), Bf16Buffers(sliced, DType::kFloat32, DType::kBFloat16, 0), FairKey{1000, 3});
    EXPECT_EQ(sliced.m, whole.m);
    EXPECT_EQ(sliced.v, whole.v);
    EXPECT_EQ(sliced.p, whole.p);
    EXPECT_EQ(sliced.out, whole.out);
  }
}

// Without gradients v decays by beta2 a step. Nearest rounding would keep a bf16 v
// where it is forever (0.1% is below half a bf16 ulp); the stochastic rounding
// follows beta2^t on average.
TEST(AdamWBf16MomentsTest, SecondMomentDecaysUnderStochasticRounding) {
  const size_t n = 4096;
  for (Isa isa : AllIsas()) {
    SCOPED_TRACE(std::string(IsaName(isa)));
    std::vector<float> p(n, 0.5f);
    std::vector<uint16_t> m(n, 0), v(n, FloatToBFloat16(1.0f));
    std::vector<float> grad(n, 0.0f);
    AdamWBuffers b;
    b.master = p.data();
    b.exp_avg = m.data();
    b.exp_avg_sq = v.data();
    b.moments_dtype = DType::kBFloat16;
    b.grad = grad.data();
    b.n = n;
    AdamWStepParams params;  // beta2 = 0.999
    for (int64_t t = 1; t <= 1000; ++t) {
      params.step = t;
      AdamWUpdateRange(isa, params, b, 0, n);
    }
    double mean = 0;
    for (uint16_t h : v) mean += BFloat16ToFloat(h);
    mean /= n;
    const double expected = std::pow(static_cast<double>(0.999f), 1000);  // 0.3677
    EXPECT_NEAR(mean, expected, 0.01 * expected);
  }
}

}  // namespace
}  // namespace fuyou::optimizer
