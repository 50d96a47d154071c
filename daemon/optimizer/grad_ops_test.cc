#include "optimizer/grad_ops.h"

#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <vector>

namespace fuyou::optimizer {
namespace {

// ---- An independent reference: nearest representable value by search --------

uint32_t Bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}
float FromBits(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

// bf16 round to nearest even of a finite or infinite fp32, found by comparing the
// two bf16 neighbours in double (not by the bit trick the code uses).
uint16_t RefBf16(float f) {
  if (std::isnan(f)) return 0x7fc0;
  const uint32_t u = Bits(f);
  const uint16_t low = static_cast<uint16_t>(u >> 16);
  if ((u & 0xffffu) == 0) return low;
  const uint16_t high = static_cast<uint16_t>(low + 1);
  const double d = f;
  const double a = FromBits(uint32_t{low} << 16);
  const double b = FromBits(uint32_t{high} << 16);
  const double da = std::fabs(d - a), db = std::fabs(b - d);
  if (da < db) return low;
  if (db < da) return high;
  return (low & 1) ? high : low;
}
float RefBf16Value(float f) { return FromBits(uint32_t{RefBf16(f)} << 16); }

// fp16 through the compiler's own _Float16 conversions (round to nearest even).
float RefHalfValue(float f) { return static_cast<float>(static_cast<_Float16>(f)); }

std::vector<std::byte> Pack(const std::vector<float>& values, DType dtype) {
  std::vector<std::byte> out(values.size() * DTypeSize(dtype));
  for (size_t i = 0; i < values.size(); ++i) {
    if (dtype == DType::kFloat32) {
      std::memcpy(out.data() + 4 * i, &values[i], 4);
    } else if (dtype == DType::kBFloat16) {
      const uint16_t h = RefBf16(values[i]);
      std::memcpy(out.data() + 2 * i, &h, 2);
    } else {
      const _Float16 h = static_cast<_Float16>(values[i]);
      std::memcpy(out.data() + 2 * i, &h, 2);
    }
  }
  return out;
}

std::vector<float> Unpack(const std::vector<std::byte>& bytes, DType dtype) {
  const size_t n = bytes.size() / DTypeSize(dtype);
  std::vector<float> out(n);
  for (size_t i = 0; i < n; ++i) {
    if (dtype == DType::kFloat32) {
      std::memcpy(&out[i], bytes.data() + 4 * i, 4);
    } else if (dtype == DType::kBFloat16) {
      uint16_t h;
      std::memcpy(&h, bytes.data() + 2 * i, 2);
      out[i] = FromBits(uint32_t{h} << 16);
    } else {
      _Float16 h;
      std::memcpy(&h, bytes.data() + 2 * i, 2);
      out[i] = static_cast<float>(h);
    }
  }
  return out;
}

float RefRound(float f, DType dtype) {
  if (dtype == DType::kBFloat16) return RefBf16Value(f);
  if (dtype == DType::kFloat16) return RefHalfValue(f);
  return f;
}

std::vector<float> RandomValues(size_t n, float scale, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal(0.0f, scale);
  std::vector<float> values(n);
  for (float& v : values) v = normal(rng);
  return values;
}

bool SameValue(float a, float b) { return (std::isnan(a) && std::isnan(b)) || Bits(a) == Bits(b); }

class GradOpsDTypeTest : public ::testing::TestWithParam<DType> {};

TEST_P(GradOpsDTypeTest, OpsRoundAfterEachOpAsTheReference) {
  const DType dtype = GetParam();
  const std::vector<GradOp> ops = {
      {GradOp::Kind::kDiv, 1024.0f}, {GradOp::Kind::kMul, 0.3f}, {GradOp::Kind::kMul, 7.77f}, {GradOp::Kind::kDiv, 3.0f}};
  std::vector<float> input = RandomValues(4099, 100.0f, 1);
  input = Unpack(Pack(input, dtype), dtype);  // representable in dtype
  std::vector<std::byte> bytes = Pack(input, dtype);
  ApplyGradOps(bytes.data(), dtype, input.size(), ops);
  const std::vector<float> got = Unpack(bytes, dtype);
  for (size_t i = 0; i < input.size(); ++i) {
    float x = input[i];
    for (const GradOp& op : ops) x = RefRound(op.kind == GradOp::Kind::kMul ? x * op.operand : x / op.operand, dtype);
    ASSERT_TRUE(SameValue(got[i], x)) << "element " << i << " of " << DTypeName(dtype) << ": " << got[i] << " vs " << x;
  }
}

TEST_P(GradOpsDTypeTest, AddRoundsTheFp32SumAsTheReference) {
  const DType dtype = GetParam();
  const std::vector<float> a = Unpack(Pack(RandomValues(1025, 1.0f, 2), dtype), dtype);
  const std::vector<float> b = Unpack(Pack(RandomValues(1025, 0.01f, 3), dtype), dtype);
  std::vector<std::byte> acc = Pack(a, dtype);
  const std::vector<std::byte> add = Pack(b, dtype);
  AddGrads(acc.data(), add.data(), dtype, 0, a.size());
  const std::vector<float> got = Unpack(acc, dtype);
  for (size_t i = 0; i < a.size(); ++i) {
    ASSERT_TRUE(SameValue(got[i], RefRound(a[i] + b[i], dtype))) << "element " << i;
  }
}

TEST_P(GradOpsDTypeTest, NanStaysNan) {
  const DType dtype = GetParam();
  std::vector<std::byte> bytes = Pack({std::numeric_limits<float>::quiet_NaN(), 1.0f}, dtype);
  const std::vector<GradOp> ops = {{GradOp::Kind::kMul, 0.0f}, {GradOp::Kind::kDiv, 2.0f}};
  ApplyGradOps(bytes.data(), dtype, 2, ops);
  const std::vector<float> got = Unpack(bytes, dtype);
  EXPECT_TRUE(std::isnan(got[0]));
  EXPECT_EQ(got[1], 0.0f);
}

INSTANTIATE_TEST_SUITE_P(AllDTypes, GradOpsDTypeTest,
                         ::testing::Values(DType::kFloat32, DType::kBFloat16, DType::kFloat16),
                         [](const auto& info) { return std::string(DTypeName(info.param)); });

TEST(GradOpsTest, Bf16RoundsAfterEachOpNotOnceAtTheEnd) {
  // 1 * (1 + 2^-8) is halfway between bf16 1 and 1 + 2^-7: ties to even give 1,
  // twice. One rounding of 1 * (1 + 2^-8)^2 would give 1 + 2^-7.
  std::vector<std::byte> bytes = Pack({1.0f}, DType::kBFloat16);
  const float f = 1.0f + 1.0f / 256;
  const std::vector<GradOp> ops = {{GradOp::Kind::kMul, f}, {GradOp::Kind::kMul, f}};
  ApplyGradOps(bytes.data(), DType::kBFloat16, 1, ops);
  EXPECT_EQ(Unpack(bytes, DType::kBFloat16)[0], 1.0f);
}

TEST(GradOpsTest, Fp16OverflowsToInfinityAndBf16AddIsRounded) {
  std::vector<std::byte> half = Pack({60000.0f}, DType::kFloat16);
  const std::vector<GradOp> twice = {{GradOp::Kind::kMul, 2.0f}};
  ApplyGradOps(half.data(), DType::kFloat16, 1, twice);
  EXPECT_TRUE(std::isinf(Unpack(half, DType::kFloat16)[0]));
  // 1 + 2^-9 in bf16 (8 significant bits) rounds back to 1.
  std::vector<std::byte> acc = Pack({1.0f}, DType::kBFloat16);
  const std::vector<std::byte> add = Pack({1.0f / 512}, DType::kBFloat16);
  AddGrads(acc.data(), add.data(), DType::kBFloat16, 0, 1);
  EXPECT_EQ(Unpack(acc, DType::kBFloat16)[0], 1.0f);
}

TEST(GradOpsTest, Fp32OpsAreThePlainFp32Operations) {
  const std::vector<float> input = RandomValues(1000, 3.0f, 4);
  std::vector<std::byte> bytes = Pack(input, DType::kFloat32);
  const std::vector<GradOp> ops = {{GradOp::Kind::kMul, 0.1f}, {GradOp::Kind::kDiv, 0.7f}};
  ApplyGradOps(bytes.data(), DType::kFloat32, input.size(), ops);
  const std::vector<float> got = Unpack(bytes, DType::kFloat32);
  for (size_t i = 0; i < input.size(); ++i) {
    volatile float x = input[i] * 0.1f;
    x = x / 0.7f;
    ASSERT_EQ(Bits(got[i]), Bits(x)) << i;
  }
}

TEST(GradOpsTest, AddAndZeroTouchOnlyTheirRange) {
  std::vector<std::byte> acc = Pack({1, 2, 3, 4}, DType::kFloat32);
  const std::vector<std::byte> add = Pack({10, 20, 30, 40}, DType::kFloat32);
  AddGrads(acc.data(), add.data(), DType::kFloat32, 1, 3);
  EXPECT_EQ(Unpack(acc, DType::kFloat32), (std::vector<float>{1, 22, 33, 4}));
  ZeroGrads(acc.data(), DType::kFloat32, 0, 2);
  EXPECT_EQ(Unpack(acc, DType::kFloat32), (std::vector<float>{0, 0, 33, 4}));
}

TEST(GradOpsTest, StatsSumSquaresInFp64AndMaxAbs) {
  const std::vector<std::byte> bytes = Pack({3.0f, -4.0f, 1e20f, 0.5f}, DType::kFloat32);
  const GradStats first = ComputeGradStats(bytes.data(), DType::kFloat32, 0, 2);
  EXPECT_EQ(first.sum_squares, 25.0);
  EXPECT_EQ(first.max_abs, 4.0f);
  // 1e20^2 overflows fp32 but not fp64.
  const GradStats all = ComputeGradStats(bytes.data(), DType::kFloat32, 0, 4);
  EXPECT_DOUBLE_EQ(all.sum_squares, 25.0 + double{1e20f} * double{1e20f} + 0.25);
  EXPECT_EQ(all.max_abs, 1e20f);
  const std::vector<std::byte> nan = Pack({1.0f, std::numeric_limits<float>::quiet_NaN()}, DType::kBFloat16);
  const GradStats with_nan = ComputeGradStats(nan.data(), DType::kBFloat16, 0, 2);
  EXPECT_TRUE(std::isnan(with_nan.max_abs));
  EXPECT_TRUE(std::isnan(with_nan.sum_squares));
  EXPECT_EQ(ComputeGradStats(nan.data(), DType::kBFloat16, 0, 0).sum_squares, 0.0);
}

}  // namespace
}  // namespace fuyou::optimizer
