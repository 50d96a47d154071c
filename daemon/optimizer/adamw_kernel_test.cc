#include "optimizer/adamw_kernel.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <string>
#include <thread>
#include <vector>

#include "optimizer/adamw_kernel_internal.h"
#include "optimizer/kernel_test_support.h"
#include "optimizer/dtype_convert.h"

namespace fuyou::optimizer {
namespace {

using internal::BFloat16ToFloat;
using internal::BitsToFloat;
using internal::FloatBits;
using internal::FloatToBFloat16;
using internal::FloatToHalf;
using internal::HalfToFloat;

using kernel_testing::Rng;

std::vector<Isa> SimdIsas() { return kernel_testing::SupportedIsas(/*with_scalar=*/false); }

const DType kDTypes[] = {DType::kFloat32, DType::kBFloat16, DType::kFloat16};

// Fills `bytes` with n gradients of `dtype` (values ~ 0.05 * uniform, a few exact
// zeros and tiny values sprinkled in).
std::vector<uint8_t> MakeGrad(DType dtype, size_t n, Rng& rng) {
  std::vector<uint8_t> bytes(n * DTypeSize(dtype));
  for (size_t i = 0; i < n; ++i) {
    float g = 0.05f * rng.Uniform();
    if (i % 97 == 3) g = 0.0f;
    if (i % 101 == 5) g *= 1e-4f;
    switch (dtype) {
      case DType::kFloat32: std::memcpy(&bytes[i * 4], &g, 4); break;
      case DType::kBFloat16: {
        uint16_t h = FloatToBFloat16(g);
        std::memcpy(&bytes[i * 2], &h, 2);
        break;
      }
      default: {
        uint16_t h = FloatToHalf(g);
        std::memcpy(&bytes[i * 2], &h, 2);
        break;
      }
    }
  }
  return bytes;
}

struct State {
  std::vector<float> p, m, v;
  std::vector<uint8_t> out;
};

State MakeState(size_t n, DType weight_dtype, Rng& rng) {
  State s;
  s.p.resize(n);
  s.m.resize(n);
  s.v.resize(n);
  for (size_t i = 0; i < n; ++i) {
    s.p[i] = rng.Uniform();
    s.m[i] = 0.01f * rng.Uniform();
    const float r = 0.01f * rng.Uniform();
    s.v[i] = r * r;
  }
  s.out.assign(n * DTypeSize(weight_dtype), 0xcd);
  return s;
}

AdamWBuffers Buffers(State& s, const std::vector<uint8_t>& grad, DType grad_dtype,
                     DType weight_dtype, bool with_out) {
  AdamWBuffers b;
  b.master = s.p.data();
  b.exp_avg = s.m.data();
  b.exp_avg_sq = s.v.data();
  b.grad = grad.data();
  b.grad_dtype = grad_dtype;
  b.weights_out = with_out ? s.out.data() : nullptr;
  b.weight_dtype = weight_dtype;
  b.n = s.p.size();
  return b;
}

float OutValue(const std::vector<uint8_t>& out, DType dtype, size_t i) {
  if (dtype == DType::kFloat32) {
    float f;
    std::memcpy(&f, &out[i * 4], 4);
    return f;
  }
  uint16_t h;
  std::memcpy(&h, &out[i * 2], 2);
  return dtype == DType::kBFloat16 ? BFloat16ToFloat(h) : HalfToFloat(h);
}

uint32_t OutBits(const std::vector<uint8_t>& out, DType dtype, size_t i) {
  uint32_t u = 0;
  std::memcpy(&u, &out[i * DTypeSize(dtype)], DTypeSize(dtype));
  return u;
}

uint32_t Rounded(float f, DType dtype) {
  if (dtype == DType::kFloat32) return FloatBits(f);
  return dtype == DType::kBFloat16 ? FloatToBFloat16(f) : FloatToHalf(f);
}

// Runs `steps` AdamW steps with the scalar reference and with `isa` from the same
// state and gradients (each step restarts both from the reference's state, so the
// tolerances stay per step) and checks they agree element by element:
// m and v within 1e-6 of the magnitude of their terms, master within 1e-6 of
// |p| + |update|, and the weights output exactly the rounding of the master.
void CompareWithScalar(Isa isa, DType grad_dtype, DType weight_dtype, size_t n, bool with_out,
                       int steps, uint64_t seed) {
  SCOPED_TRACE(std::string(IsaName(isa)) + " grad=" + std::string(DTypeName(grad_dtype)) +
               " weights=" + std::string(DTypeName(weight_dtype)) + " n=" + std::to_string(n) +
               (with_out ? "" : " (no output)"));
  Rng rng(seed);
  State ref = MakeState(n, weight_dtype, rng);
  State simd;
  AdamWStepParams params;
  params.lr = 3e-3f;
  params.weight_decay = 0.1f;
  params.grad_scale = 0.5f;
  constexpr double kTol = 1e-6;
  for (int t = 1; t <= steps; ++t) {
    params.step = t;
    const std::vector<uint8_t> grad = MakeGrad(grad_dtype, n, rng);
    simd = ref;
    const State before = ref;
    AdamWUpdateRange(Isa::kScalar, params, Buffers(ref, grad, grad_dtype, weight_dtype, with_out),
                     0, n);
    AdamWUpdateRange(isa, params, Buffers(simd, grad, grad_dtype, weight_dtype, with_out), 0, n);
    const auto c = internal::MakeStepConstants(params);
    size_t failures = 0;
    for (size_t i = 0; i < n && failures < 10; ++i) {
      const float g = OutValue(grad, grad_dtype, i) * params.grad_scale;
      const double m_tol = kTol * (std::fabs(before.m[i] * c.beta1) + std::fabs(c.one_minus_beta1 * g)) + 1e-38;
      const double v_tol = kTol * std::fabs(ref.v[i]) + 1e-38;
      const double p_decayed = before.p[i] * c.decay;
      // The update is proportional to m: m's own (allowed) difference, which
      // cancellation in m can make large relative to m, carries into the update.
      const double update = std::fabs(p_decayed - ref.p[i]);
      const double m_rel = ref.m[i] == 0.0f ? 0.0 : std::fabs((static_cast<double>(simd.m[i]) - ref.m[i]) / ref.m[i]);
      const double p_tol = kTol * (std::fabs(p_decayed) + update) + update * m_rel + 1e-38;
      bool ok = std::fabs(static_cast<double>(simd.m[i]) - ref.m[i]) <= m_tol &&
                std::fabs(static_cast<double>(simd.v[i]) - ref.v[i]) <= v_tol &&
                std::fabs(static_cast<double>(simd.p[i]) - ref.p[i]) <= p_tol;
      if (with_out) {
        ok = ok && OutBits(simd.out, weight_dtype, i) == Rounded(simd.p[i], weight_dtype) &&
             OutBits(ref.out, weight_dtype, i) == Rounded(ref.p[i], weight_dtype);
      }
      if (!ok) {
        ++failures;
        ADD_FAILURE() << "t=" << t << " i=" << i << " p " << ref.p[i] << " vs " << simd.p[i]
                      << ", m " << ref.m[i] << " vs " << simd.m[i] << ", v " << ref.v[i]
                      << " vs " << simd.v[i] << ", out " << OutValue(ref.out, weight_dtype, i)
                      << " vs " << OutValue(simd.out, weight_dtype, i) << " (before: p "
                      << before.p[i] << ", m " << before.m[i] << ", v " << before.v[i]
                      << ", g " << g << ")";
      }
    }
    // The update must actually have happened.
    ASSERT_NE(before.p, ref.p);
  }
  if (with_out) {
    // Nothing past n written (the output buffer is exactly n elements, so check the
    // last element really came from the kernel).
    EXPECT_EQ(OutBits(simd.out, weight_dtype, n - 1), Rounded(simd.p[n - 1], weight_dtype));
  }
}

TEST(AdamWKernelTest, SimdMatchesScalarAllDTypesSmallSizes) {
  if (SimdIsas().empty()) GTEST_SKIP() << "no SIMD ISA on this CPU";
  uint64_t seed = 1;
  for (Isa isa : SimdIsas()) {
    for (DType gd : kDTypes) {
      for (DType wd : kDTypes) {
        // 70001: long enough for the AVX-512 path to stream the weights output.
        for (size_t n : {size_t{1}, size_t{7}, size_t{4095}, size_t{4097}, size_t{70001}}) {
          CompareWithScalar(isa, gd, wd, n, /*with_out=*/true, /*steps=*/3, ++seed);
        }
      }
      CompareWithScalar(isa, gd, DType::kFloat32, 4097, /*with_out=*/false, 3, ++seed);
    }
  }
}

TEST(AdamWKernelTest, SimdMatchesScalarLarge) {
  if (SimdIsas().empty()) GTEST_SKIP() << "no SIMD ISA on this CPU";
  constexpr size_t kN = 20'000'000;
  for (Isa isa : SimdIsas()) {
    const DType gd = isa == Isa::kAvx512 ? DType::kBFloat16 : DType::kFloat16;
    CompareWithScalar(isa, gd, gd, kN, /*with_out=*/true, /*steps=*/2, 99);
  }
}

TEST(AdamWKernelTest, SimdStartsAndEndsAnywhere) {
  // Ranges with odd begin/end (unaligned vectors, masked and padded tails, an
  // unaligned start of a streamed output).
  for (Isa isa : SimdIsas()) {
    Rng rng(5);
    const size_t n = 200'000;
    const State start = MakeState(n, DType::kBFloat16, rng);
    State ref = start;
    State simd = start;
    const std::vector<uint8_t> grad = MakeGrad(DType::kFloat16, n, rng);
    AdamWStepParams params;
    const std::pair<size_t, size_t> ranges[] = {{3, 5}, {17, 90}, {91, 91}, {100, 199},
                                                {1001, 99'999}, {100'003, 199'999}};
    for (auto [b, e] : ranges) {
      AdamWUpdateRange(Isa::kScalar, params,
                       Buffers(ref, grad, DType::kFloat16, DType::kBFloat16, true), b, e);
      AdamWUpdateRange(isa, params, Buffers(simd, grad, DType::kFloat16, DType::kBFloat16, true),
                       b, e);
    }
    for (size_t i = 0; i < n; ++i) {
      bool touched = false;
      for (auto [b, e] : ranges) touched = touched || (i >= b && i < e);
      ASSERT_NEAR(simd.p[i], ref.p[i], 1e-6 * std::max(1.0f, std::fabs(ref.p[i])))
          << IsaName(isa) << " i=" << i;
      ASSERT_EQ(OutBits(simd.out, DType::kBFloat16, i) != 0xcdcd, touched)
          << IsaName(isa) << " i=" << i;
    }
  }
}

// AdamW in double precision, written from the paper's/torch's formula.
struct DoubleAdamW {
  double p, m = 0, v = 0;
  void Step(double g, int t, double lr, double b1, double b2, double eps, double wd) {
    p *= 1 - lr * wd;
    m = b1 * m + (1 - b1) * g;
    v = b2 * v + (1 - b2) * g * g;
    const double denom = std::sqrt(v) / std::sqrt(1 - std::pow(b2, t)) + eps;
    p -= lr / (1 - std::pow(b1, t)) * m / denom;
  }
};

TEST(AdamWKernelTest, MatchesDoublePrecisionAdamW) {
  const std::vector<float> p0 = {0.5f, -1.25f, 3.0f, 1e-3f, -7.5f, 0.0f, 2.0f, 0.75f, -0.3f};
  const std::vector<std::vector<float>> grads = {
      {0.1f, -0.2f, 0.0f, 1e-4f, 5.0f, -1.0f, 0.3f, 1e-6f, -0.05f},
      {-0.1f, 0.25f, 0.5f, -1e-4f, 4.0f, 1.0f, 0.3f, 2e-6f, 0.02f},
      {0.3f, 0.1f, -0.5f, 1e-4f, -3.0f, 0.5f, 0.3f, 0.0f, 0.01f}};
  AdamWStepParams params;
  params.lr = 1e-2f;
  params.beta1 = 0.8f;
  params.beta2 = 0.95f;
  params.eps = 1e-6f;
  params.weight_decay = 0.05f;
  params.grad_scale = 0.25f;
  std::vector<Isa> isas = SimdIsas();
  isas.push_back(Isa::kScalar);
  for (Isa isa : isas) {
    std::vector<DoubleAdamW> want;
    for (float p : p0) want.push_back({p});
    std::vector<float> p = p0, m(p0.size(), 0.0f), v(p0.size(), 0.0f);
    for (int t = 1; t <= 3; ++t) {
      params.step = t;
      AdamWBuffers b;
      b.master = p.data();
      b.exp_avg = m.data();
      b.exp_avg_sq = v.data();
      b.grad = grads[t - 1].data();
      b.n = p.size();
      AdamWUpdateRange(isa, params, b, 0, b.n);
      for (size_t i = 0; i < p.size(); ++i) {
        want[i].Step(static_cast<double>(grads[t - 1][i]) * params.grad_scale, t, params.lr,
                     params.beta1, params.beta2, params.eps, params.weight_decay);
        EXPECT_NEAR(p[i], want[i].p, 2e-6 * std::max(1.0, std::fabs(want[i].p)))
            << IsaName(isa) << " t=" << t << " i=" << i;
        EXPECT_NEAR(m[i], want[i].m, 1e-6 * std::max(1e-3, std::fabs(want[i].m)))
            << IsaName(isa) << " t=" << t << " i=" << i;
        EXPECT_NEAR(v[i], want[i].v, 1e-6 * std::max(1e-6, std::fabs(want[i].v)))
            << IsaName(isa) << " t=" << t << " i=" << i;
      }
    }
  }
}

// Expected values produced by torch 1.13 torch.optim.AdamW (foreach=False and True
// agree bit for bit) with hyper-parameters that are exact in float, so a float
// parameter block carries exactly torch's values:
//   lr=2^-10, betas=(0.875, 1-2^-10), eps=2^-27, weight_decay=0.125, 3 steps.
TEST(AdamWKernelTest, MatchesTorchAdamW) {
  const std::vector<float> p0 = {-0x1.2ca2e8p-4f, 0x1.92811cp-2f, 0x1.e4c5cep-2f, -0x1.1d45a6p-1f, 0x1.b0d7ap-1f, -0x1.ca26e2p-2f, -0x1.6c28f8p-3f, 0x1.3b7da2p-1f, 0x1.1afa44p-4f, -0x1.aea49p-1f, 0x1.454d76p-3f, 0x1.0ffd1ap-4f};
  const std::vector<std::vector<float>> grads = {
      {0x0p+0f, 0x1.4484cp-100f, 0x1.1dc9dp-3f, 0x1.13dec8p-3f, 0x1.f35854p-3f, 0x1.4c32fep-6f, 0x1.f5def0p-3f, 0x1.9ed7e0p-3f, 0x1.6c5ef6p-3f, -0x1.77fc04p-4f, -0x1.770b96p-5f, -0x1.28be88p-4f},
      {0x0p+0f, -0x1.972b66p-4f, 0x1.73b4d8p-3f, -0x1.edda74p-5f, 0x1.4ab6cep-3f, 0x1.8b4dfap-3f, -0x1.5a1cfcp-5f, -0x1.1095ccp-7f, -0x1.92ef26p-4f, -0x1.ffbc3ep-4f, -0x1.3476c8p-6f, 0x1.cf2796p-6f},
      {0x0p+0f, 0x1.0e8ba6p-5f, -0x1.fabaap-8f, -0x1.79d278p-4f, -0x1.83ea3ap-3f, 0x1.9be8f0p-4f, -0x1.1c9bfep-4f, 0x1.7330eap-4f, 0x1.5f68a8p-7f, 0x1.f5c60ap-5f, 0x1.0e0ba8p-5f, -0x1.66ec96p-4f}};
  const std::vector<std::vector<float>> want_p = {
      {-0x1.2c9982p-4f, 0x1.927488p-2f, 0x1.e3b6a8p-2f, -0x1.1dbcbcp-1f, 0x1.b04a1ap-1f, -0x1.cb189p-2f, -0x1.6e1d96p-3f, 0x1.3af3c6p-1f, 0x1.16f16cp-4f, -0x1.ae171ap-1f, 0x1.47434cp-3f, 0x1.13f49ap-4f},
      {-0x1.2c901ep-4f, 0x1.9328fep-2f, 0x1.e2a78p-2f, -0x1.1dd97ap-1f, 0x1.afc0d8p-1f, -0x1.cbdbdap-2f, -0x1.6f1d96p-3f, 0x1.3a9978p-1f, 0x1.160efap-4f, -0x1.ad89dap-1f, 0x1.490488p-3f, 0x1.1548dcp-4f},
      {-0x1.2c86bap-4f, 0x1.9372ep-2f, 0x1.e1db52p-2f, -0x1.1dbc5ap-1f, 0x1.af91f6p-1f, -0x1.cca862p-2f, -0x1.6f7bbcp-3f, 0x1.3a3578p-1f, 0x1.153d68p-4f, -0x1.ad40d2p-1f, 0x1.496312p-3f, 0x1.17e6bp-4f}};
  const std::vector<float> want_m = {0x0p+0f, -0x1.ba004ep-8f, 0x1.081b76p-5f, -0x1.56e9dp-8f, 0x1.1bc55ap-6f, 0x1.23d1cap-5f, 0x1.4c74b6p-7f, 0x1.e84d8cp-6f, 0x1.f29a7cp-8f, -0x1.e4bea4p-7f, -0x1.301a6p-9f, -0x1.e4cdcep-7f};
  const std::vector<float> want_v = {0x0p+0f, 0x1.6739eap-17f, 0x1.ad4a82p-15f, 0x1.ef9786p-16f, 0x1.f0ae6cp-14f, 0x1.871dc2p-15f, 0x1.109246p-14f, 0x1.934f52p-15f, 0x1.52f15cp-15f, 0x1.c6bc74p-16f, 0x1.cf089ep-19f, 0x1.c16cdep-17f};
  AdamWStepParams params;
  params.lr = 0x1p-10f;
  params.beta1 = 0.875f;
  params.beta2 = 1.0f - 0x1p-10f;
  params.eps = 0x1p-27f;
  params.weight_decay = 0.125f;
  std::vector<Isa> isas = SimdIsas();
  isas.push_back(Isa::kScalar);
  for (Isa isa : isas) {
    std::vector<float> p = p0, m(p0.size(), 0.0f), v(p0.size(), 0.0f);
    std::vector<float> out(p0.size());
    for (int t = 1; t <= 3; ++t) {
      params.step = t;
      AdamWBuffers b;
      b.master = p.data();
      b.exp_avg = m.data();
      b.exp_avg_sq = v.data();
      b.grad = grads[t - 1].data();
      b.weights_out = out.data();
      b.n = p.size();
      AdamWUpdateRange(isa, params, b, 0, b.n);
      for (size_t i = 0; i < p.size(); ++i) {
        // The scalar reference keeps torch's order: within one float ulp of torch.
        // The SIMD paths fold the divisions and use FMA: within a few ulp.
        const float tol = (isa == Isa::kScalar ? 1.0f : 4.0f) *
                          (std::nextafter(std::fabs(want_p[t - 1][i]), INFINITY) -
                           std::fabs(want_p[t - 1][i]));
        EXPECT_NEAR(p[i], want_p[t - 1][i], tol) << IsaName(isa) << " t=" << t << " i=" << i;
        EXPECT_EQ(FloatBits(out[i]), FloatBits(p[i]));
      }
    }
    for (size_t i = 0; i < p.size(); ++i) {
      EXPECT_NEAR(m[i], want_m[i], 2e-7f * std::fabs(want_m[i])) << IsaName(isa) << " i=" << i;
      EXPECT_NEAR(v[i], want_v[i], 2e-7f * std::fabs(want_v[i])) << IsaName(isa) << " i=" << i;
    }
  }
}

TEST(AdamWKernelTest, ThreadedUpdateEqualsSingleThreadRange) {
  const size_t n = 1'000'003;  // not a multiple of 64
  Rng rng(11);
  const State start = MakeState(n, DType::kBFloat16, rng);
  const std::vector<uint8_t> grad = MakeGrad(DType::kBFloat16, n, rng);
  AdamWStepParams params;
  params.step = 4;
  for (unsigned threads : {1u, 2u, 3u, 5u}) {
    AdamWKernel kernel(threads);
    EXPECT_EQ(kernel.threads(), threads);
    EXPECT_EQ(kernel.isa(), DetectIsa());
    State a = start, b = start;
    kernel.Update(params, Buffers(a, grad, DType::kBFloat16, DType::kBFloat16, true));
    AdamWUpdateRange(kernel.isa(), params, Buffers(b, grad, DType::kBFloat16, DType::kBFloat16, true),
                     0, n);
    EXPECT_EQ(a.p, b.p) << threads;
    EXPECT_EQ(a.m, b.m) << threads;
    EXPECT_EQ(a.v, b.v) << threads;
    EXPECT_EQ(a.out, b.out) << threads;
    EXPECT_NE(a.p, start.p);
  }
}

TEST(AdamWKernelTest, ResultDoesNotDependOnWhereARangeIsSplit) {
  // The same element must get the same bits whether it is reached by the main loop,
  // a tail, an alignment head or a streamed stretch (a thread split, a retry).
  const size_t n = 150'001;
  Rng rng(21);
  const State start = MakeState(n, DType::kFloat16, rng);
  const std::vector<uint8_t> grad = MakeGrad(DType::kFloat32, n, rng);
  std::vector<Isa> isas = SimdIsas();
  isas.push_back(Isa::kScalar);
  for (Isa isa : isas) {
    State whole = start;
    AdamWUpdateRange(isa, {}, Buffers(whole, grad, DType::kFloat32, DType::kFloat16, true), 0, n);
    for (size_t split : {size_t{1}, size_t{13}, size_t{70'007}, size_t{149'990}}) {
      State parts = start;
      const AdamWBuffers b = Buffers(parts, grad, DType::kFloat32, DType::kFloat16, true);
      AdamWUpdateRange(isa, {}, b, split, n);
      AdamWUpdateRange(isa, {}, b, 0, split);
      EXPECT_EQ(parts.p, whole.p) << IsaName(isa) << " split=" << split;
      EXPECT_EQ(parts.m, whole.m) << IsaName(isa) << " split=" << split;
      EXPECT_EQ(parts.v, whole.v) << IsaName(isa) << " split=" << split;
      EXPECT_EQ(parts.out, whole.out) << IsaName(isa) << " split=" << split;
    }
  }
}

TEST(AdamWKernelTest, DefaultThreadsAndExplicitIsa) {
  AdamWKernel kernel;
  EXPECT_EQ(kernel.threads(), std::max(1u, std::thread::hardware_concurrency()));
  AdamWKernel scalar(2, Isa::kScalar);
  EXPECT_EQ(scalar.isa(), Isa::kScalar);
  EXPECT_TRUE(IsaSupported(Isa::kScalar));
  EXPECT_TRUE(IsaSupported(DetectIsa()));
}

TEST(AdamWKernelTest, SmallAndEmptyUpdates) {
  AdamWKernel kernel(3);
  for (size_t n : {size_t{0}, size_t{1}, size_t{63}, size_t{65}}) {
    Rng rng(n + 1);
    const size_t alloc = std::max<size_t>(n, 1);
    State a = MakeState(alloc, DType::kFloat32, rng), b = a;
    const std::vector<uint8_t> grad = MakeGrad(DType::kFloat32, alloc, rng);
    AdamWBuffers ba = Buffers(a, grad, DType::kFloat32, DType::kFloat32, true);
    AdamWBuffers bb = Buffers(b, grad, DType::kFloat32, DType::kFloat32, true);
    ba.n = bb.n = n;
    kernel.Update({}, ba);
    AdamWUpdateRange(kernel.isa(), {}, bb, 0, n);
    EXPECT_EQ(a.p, b.p);
    EXPECT_EQ(a.out, b.out);
  }
}

TEST(AdamWKernelTest, ConcurrentUpdatesAreSerialisedAndCorrect) {
  AdamWKernel kernel(2);
  constexpr int kCallers = 4;
  const size_t n = 300'000;
  std::vector<State> states, expected;
  std::vector<std::vector<uint8_t>> grads;
  for (int c = 0; c < kCallers; ++c) {
    Rng rng(100 + c);
    states.push_back(MakeState(n, DType::kFloat16, rng));
    grads.push_back(MakeGrad(DType::kFloat32, n, rng));
  }
  expected = states;
  AdamWStepParams params;
  for (int c = 0; c < kCallers; ++c) {
    for (int t = 1; t <= 5; ++t) {
      params.step = t;
      AdamWUpdateRange(kernel.isa(), params,
                       Buffers(expected[c], grads[c], DType::kFloat32, DType::kFloat16, true), 0, n);
    }
  }
  std::vector<std::thread> callers;
  for (int c = 0; c < kCallers; ++c) {
    callers.emplace_back([&, c] {
      AdamWStepParams p;
      for (int t = 1; t <= 5; ++t) {
        p.step = t;
        kernel.Update(p, Buffers(states[c], grads[c], DType::kFloat32, DType::kFloat16, true));
      }
    });
  }
  for (std::thread& t : callers) t.join();
  for (int c = 0; c < kCallers; ++c) {
    EXPECT_EQ(states[c].p, expected[c].p) << c;
    EXPECT_EQ(states[c].out, expected[c].out) << c;
  }
}

// Fair turns (issue 32): updates of several users and sessions, at once, each
// cut into many slices that interleave with the others', give exactly the bits
// of one range over each chunk, and every slice size gives the same.
TEST(AdamWKernelTest, SlicedUpdatesOfConcurrentTenantsEqualOneRange) {
  constexpr int kCallers = 4;
  const size_t n = 700'001;  // not a multiple of a slice or of 64
  std::vector<State> start, expected;
  std::vector<std::vector<uint8_t>> grads;
  for (int c = 0; c < kCallers; ++c) {
    Rng rng(300 + c);
    start.push_back(MakeState(n, DType::kBFloat16, rng));
    grads.push_back(MakeGrad(DType::kBFloat16, n, rng));
  }
  for (unsigned threads : {1u, 2u, 3u}) {
    AdamWKernel kernel(threads, DetectIsa(), /*slice_bytes=*/1);  // the smallest slices
    EXPECT_LT(kernel.slice_bytes(), n * 28 / 4) << "at least four slices per update (28 bytes an element)";
    expected = start;
    std::vector<State> states = start;
    AdamWStepParams params;
    for (int c = 0; c < kCallers; ++c) {
      for (int t = 1; t <= 3; ++t) {
        params.step = t;
        AdamWUpdateRange(kernel.isa(), params,
                         Buffers(expected[c], grads[c], DType::kBFloat16, DType::kBFloat16, true), 0, n);
      }
    }
    std::vector<std::thread> callers;
    for (int c = 0; c < kCallers; ++c) {
      callers.emplace_back([&, c] {
        AdamWStepParams p;
        const FairKey tenant{static_cast<uint64_t>(c % 2 == 0 ? 65534 : 0), static_cast<uint64_t>(c)};
        for (int t = 1; t <= 3; ++t) {
          p.step = t;
          kernel.Update(p, Buffers(states[c], grads[c], DType::kBFloat16, DType::kBFloat16, true), tenant);
        }
      });
    }
    for (std::thread& t : callers) t.join();
    for (int c = 0; c < kCallers; ++c) {
      EXPECT_EQ(states[c].p, expected[c].p) << c << " threads=" << threads;
      EXPECT_EQ(states[c].m, expected[c].m) << c << " threads=" << threads;
      EXPECT_EQ(states[c].v, expected[c].v) << c << " threads=" << threads;
      EXPECT_EQ(states[c].out, expected[c].out) << c << " threads=" << threads;
    }
  }
}

// ---- Conversions ------------------------------------------------------------------

// An overflowed g*g makes v (and the denominator) infinite: torch's m / inf is a zero
// update, and so must the SIMD paths' reciprocal be (not the NaN that a plain
// Newton-Raphson step on an infinite denominator would give). Also huge but finite
// denominators, and the masked tail.
TEST(AdamWKernelTest, InfiniteSecondMomentGivesZeroUpdate) {
  std::vector<Isa> isas = SimdIsas();
  isas.push_back(Isa::kScalar);
  for (Isa isa : isas) {
    for (size_t n : {size_t{5}, size_t{100}, size_t{1000}}) {
      std::vector<float> p(n), m(n, 0.0f), v(n, 0.0f), grad(n);
      for (size_t i = 0; i < n; ++i) {
        p[i] = 0.5f + 0.001f * static_cast<float>(i);
        grad[i] = i % 3 == 0 ? 1e30f : (i % 3 == 1 ? 1e18f : 0.25f);
      }
      const std::vector<float> p0 = p;
      AdamWStepParams params;
      AdamWBuffers b;
      b.master = p.data();
      b.exp_avg = m.data();
      b.exp_avg_sq = v.data();
      b.grad = grad.data();
      b.n = n;
      AdamWUpdateRange(isa, params, b, 0, n);
      const auto c = internal::MakeStepConstants(params);
      for (size_t i = 0; i < n; ++i) {
        if (i % 3 == 0) {
          ASSERT_TRUE(std::isinf(v[i])) << IsaName(isa) << " i=" << i;
          // m / inf == 0: only the decay applies.
          EXPECT_EQ(p[i], p0[i] * c.decay) << IsaName(isa) << " n=" << n << " i=" << i;
        } else {
          EXPECT_TRUE(std::isfinite(p[i])) << IsaName(isa) << " n=" << n << " i=" << i;
          // First step: the update is lr * m_hat / (sqrt(v_hat) + eps) ~ lr * sign(g).
          EXPECT_NEAR(p[i], p0[i] * c.decay - params.lr, 1e-6f) << IsaName(isa) << " i=" << i;
        }
      }
    }
  }
}

TEST(ConversionTest, BFloat16RoundsToNearestEven) {
  EXPECT_EQ(FloatToBFloat16(1.0f), 0x3f80);
  EXPECT_EQ(FloatToBFloat16(1.0f + 0x1p-8f), 0x3f80);               // tie -> even (down)
  EXPECT_EQ(FloatToBFloat16(1.0f + 0x1p-8f + 0x1p-20f), 0x3f81);   // above the tie
  EXPECT_EQ(FloatToBFloat16(1.0f + 3 * 0x1p-8f), 0x3f82);          // tie -> even (up)
  EXPECT_EQ(FloatToBFloat16(-1.0f - 3 * 0x1p-8f), 0xbf82);
  EXPECT_EQ(FloatToBFloat16(std::numeric_limits<float>::max()), 0x7f80);  // rounds to inf
  EXPECT_EQ(FloatToBFloat16(INFINITY), 0x7f80);
  EXPECT_EQ(FloatToBFloat16(-INFINITY), 0xff80);
  EXPECT_EQ(FloatToBFloat16(0x1p-130f), 0x0008);  // subnormal kept
  // NaNs stay NaNs, even those whose low bits would carry into infinity.
  for (uint32_t bits : {0x7f800001u, 0x7fffffffu, 0xff800001u, 0x7fc00000u, 0x7f80ffffu}) {
    const uint16_t h = FloatToBFloat16(BitsToFloat(bits));
    EXPECT_TRUE(std::isnan(BFloat16ToFloat(h))) << std::hex << bits;
    EXPECT_EQ(h & 0x8000, (bits >> 16) & 0x8000);
  }
  // Every bf16 round-trips exactly.
  for (uint32_t h = 0; h < 0x10000; ++h) {
    const float f = BFloat16ToFloat(static_cast<uint16_t>(h));
    if (std::isnan(f)) continue;
    ASSERT_EQ(FloatToBFloat16(f), h);
  }
}

TEST(ConversionTest, HalfKnownValues) {
  EXPECT_EQ(HalfToFloat(0x3c00), 1.0f);
  EXPECT_EQ(HalfToFloat(0x7bff), 65504.0f);
  EXPECT_EQ(HalfToFloat(0x0001), 0x1p-24f);
  EXPECT_EQ(HalfToFloat(0x03ff), 0x3ffp-24f);
  EXPECT_EQ(HalfToFloat(0x0400), 0x1p-14f);
  EXPECT_EQ(HalfToFloat(0x8001), -0x1p-24f);
  EXPECT_EQ(HalfToFloat(0x7c00), INFINITY);
  EXPECT_EQ(HalfToFloat(0xfc00), -INFINITY);
  EXPECT_TRUE(std::isnan(HalfToFloat(0x7c01)));
  EXPECT_TRUE(std::isnan(HalfToFloat(0xfe00)));
  EXPECT_EQ(FloatToHalf(65504.0f), 0x7bff);
  EXPECT_EQ(FloatToHalf(65519.996f), 0x7bff);
  EXPECT_EQ(FloatToHalf(65520.0f), 0x7c00);  // tie rounds to even: infinity
  EXPECT_EQ(FloatToHalf(1e10f), 0x7c00);
  EXPECT_EQ(FloatToHalf(-1e10f), 0xfc00);
  EXPECT_EQ(FloatToHalf(0x1p-24f), 0x0001);
  EXPECT_EQ(FloatToHalf(0x1p-25f), 0x0000);                 // tie -> even (zero)
  EXPECT_EQ(FloatToHalf(0x1p-25f * (1 + 0x1p-23f)), 0x0001);
  EXPECT_EQ(FloatToHalf(3 * 0x1p-25f), 0x0002);             // 1.5 ulp tie -> even (2)
  EXPECT_EQ(FloatToHalf(-0x1p-26f), 0x8000);
  EXPECT_EQ(FloatToHalf(0x3ffp-24f + 0x1p-25f), 0x0400);    // carries into the normals
  EXPECT_EQ(FloatToHalf(1.0f + 0x1p-11f), 0x3c00);          // tie -> even
  EXPECT_EQ(FloatToHalf(1.0f + 3 * 0x1p-11f), 0x3c02);
  EXPECT_TRUE(std::isnan(HalfToFloat(FloatToHalf(NAN))));
  EXPECT_TRUE(std::isnan(HalfToFloat(FloatToHalf(BitsToFloat(0x7f800001u)))));
  // Every non-NaN half round-trips exactly.
  for (uint32_t h = 0; h < 0x10000; ++h) {
    const float f = HalfToFloat(static_cast<uint16_t>(h));
    if (std::isnan(f)) continue;
    ASSERT_EQ(FloatToHalf(f), h) << std::hex << h;
  }
}

// Float values that stress the conversions: every half/bf16 neighbourhood boundary
// and tie, specials, and random bit patterns.
std::vector<float> StressFloats() {
  std::vector<float> out;
  for (uint32_t h = 0; h < 0x10000; ++h) {
    const uint32_t f = FloatBits(HalfToFloat(static_cast<uint16_t>(h)));
    for (uint32_t d : {0u, 1u, 0xfffu, 0x1000u, 0x1001u, 0x2000u}) {
      out.push_back(BitsToFloat(f + d));
      out.push_back(BitsToFloat(f - d));
    }
    const uint32_t b = h << 16;
    for (uint32_t d : {0u, 1u, 0x7fffu, 0x8000u, 0x8001u}) out.push_back(BitsToFloat(b + d));
  }
  Rng rng(3);
  for (int i = 0; i < 1'000'000; ++i) out.push_back(BitsToFloat(static_cast<uint32_t>(rng.Next())));
  out.push_back(13.0f);  // leave a tail that is not a multiple of any vector width
  return out;
}

TEST(ConversionTest, SimdConversionsMatchScalarBitForBit) {
  const std::vector<float> floats = StressFloats();
  std::vector<uint16_t> all_halves(0x10000 + 5);
  for (size_t i = 0; i < all_halves.size(); ++i) all_halves[i] = static_cast<uint16_t>(i);
  for (Isa isa : SimdIsas()) {
    SCOPED_TRACE(IsaName(isa));
    void (*to_f32)(const void*, DType, float*, size_t) = nullptr;
    void (*from_f32)(const float*, void*, DType, size_t) = nullptr;
#if defined(FUYOU_OPTIMIZER_HAVE_AVX2)
    if (isa == Isa::kAvx2) {
      to_f32 = internal::ToFloat32Avx2;
      from_f32 = internal::FromFloat32Avx2;
    }
#endif
#if defined(FUYOU_OPTIMIZER_HAVE_AVX512)
    if (isa == Isa::kAvx512) {
      to_f32 = internal::ToFloat32Avx512;
      from_f32 = internal::FromFloat32Avx512;
    }
#endif
    ASSERT_NE(to_f32, nullptr);
    for (DType dtype : {DType::kBFloat16, DType::kFloat16}) {
      SCOPED_TRACE(DTypeName(dtype));
      // Narrow -> float: every 16-bit pattern.
      std::vector<float> wide(all_halves.size());
      to_f32(all_halves.data(), dtype, wide.data(), all_halves.size());
      for (size_t i = 0; i < all_halves.size(); ++i) {
        const float want = dtype == DType::kBFloat16 ? BFloat16ToFloat(all_halves[i])
                                                     : HalfToFloat(all_halves[i]);
        ASSERT_EQ(FloatBits(wide[i]), FloatBits(want)) << std::hex << all_halves[i];
      }
      // Float -> narrow: stress values.
      std::vector<uint16_t> narrow(floats.size());
      from_f32(floats.data(), narrow.data(), dtype, floats.size());
      for (size_t i = 0; i < floats.size(); ++i) {
        const uint16_t want =
            dtype == DType::kBFloat16 ? FloatToBFloat16(floats[i]) : FloatToHalf(floats[i]);
        ASSERT_EQ(narrow[i], want) << std::hex << FloatBits(floats[i]);
      }
    }
  }
}

TEST(ConversionTest, PublicConvertRoundTrips) {
  const std::vector<float> floats = StressFloats();
  for (DType dtype : kDTypes) {
    SCOPED_TRACE(DTypeName(dtype));
    std::vector<uint8_t> narrow(floats.size() * DTypeSize(dtype));
    std::vector<float> back(floats.size());
    ConvertFromFloat32(floats.data(), narrow.data(), dtype, floats.size());
    ConvertToFloat32(narrow.data(), dtype, back.data(), floats.size());
    for (size_t i = 0; i < floats.size(); ++i) {
      const float want = dtype == DType::kFloat32    ? floats[i]
                         : dtype == DType::kBFloat16 ? BFloat16ToFloat(FloatToBFloat16(floats[i]))
                                                     : HalfToFloat(FloatToHalf(floats[i]));
      if (std::isnan(want)) {
        ASSERT_TRUE(std::isnan(back[i]));
      } else {
        ASSERT_EQ(FloatBits(back[i]), FloatBits(want)) << std::hex << FloatBits(floats[i]);
      }
    }
  }
}

}  // namespace
}  // namespace fuyou::optimizer
