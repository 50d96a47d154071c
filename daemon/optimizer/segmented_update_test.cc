#include "optimizer/segmented_update.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <numeric>
#include <string>
#include <vector>

#include "optimizer/adamw_kernel_internal.h"

namespace fuyou::optimizer {
namespace {

using internal::FloatToBFloat16;
using internal::FloatToHalf;

// The ISAs the kernel tests cover: the scalar reference and each SIMD path this
// CPU has.
std::vector<Isa> Isas() {
  std::vector<Isa> isas = {Isa::kScalar};
  for (Isa isa : {Isa::kAvx2, Isa::kAvx512}) {
    if (IsaSupported(isa)) isas.push_back(isa);
  }
  return isas;
}

struct Chunk {
  std::vector<float> p, m, v;
  std::vector<uint8_t> grad;
  std::vector<uint8_t> out;
};

uint32_t Bits(const std::vector<uint8_t>& bytes, size_t i, DType dtype) {
  uint32_t u = 0;
  std::memcpy(&u, &bytes[i * DTypeSize(dtype)], DTypeSize(dtype));
  return u;
}

void Put(std::vector<uint8_t>& bytes, size_t i, DType dtype, float value) {
  if (dtype == DType::kFloat32) {
    std::memcpy(&bytes[i * 4], &value, 4);
    return;
  }
  const uint16_t h = dtype == DType::kBFloat16 ? FloatToBFloat16(value) : FloatToHalf(value);
  std::memcpy(&bytes[i * 2], &h, 2);
}

uint32_t Rounded(float f, DType dtype) {
  if (dtype == DType::kFloat32) {
    uint32_t u;
    std::memcpy(&u, &f, 4);
    return u;
  }
  return dtype == DType::kBFloat16 ? FloatToBFloat16(f) : FloatToHalf(f);
}

Chunk MakeChunk(size_t n, DType grad_dtype, DType weight_dtype, uint32_t seed) {
  Chunk c;
  c.p.resize(n);
  c.m.resize(n);
  c.v.resize(n);
  c.grad.resize(n * DTypeSize(grad_dtype));
  c.out.assign(n * DTypeSize(weight_dtype), 0xcd);
  uint64_t s = seed * 0x9e3779b97f4a7c15ull + 1;
  auto uniform = [&] {
    s ^= s << 13;
    s ^= s >> 7;
    s ^= s << 17;
    return static_cast<float>(static_cast<int64_t>(s >> 40) - (1 << 23)) * 0x1p-23f;
  };
  for (size_t i = 0; i < n; ++i) {
    c.p[i] = uniform();
    c.m[i] = 0.01f * uniform();
    const float r = 0.01f * uniform();
    c.v[i] = r * r;
    Put(c.grad, i, grad_dtype, 0.05f * uniform());
  }
  return c;
}

AdamWBuffers BuffersOf(Chunk& c, DType grad_dtype, DType weight_dtype) {
  AdamWBuffers b;
  b.master = c.p.data();
  b.exp_avg = c.m.data();
  b.exp_avg_sq = c.v.data();
  b.grad = c.grad.data();
  b.grad_dtype = grad_dtype;
  b.weights_out = c.out.data();
  b.weight_dtype = weight_dtype;
  b.n = c.p.size();
  return b;
}

AdamWStepParams Hyper() {
  AdamWStepParams params;
  params.lr = 3e-3f;
  params.weight_decay = 0.1f;
  params.grad_scale = 0.5f;
  params.step = 999;  // ignored by SegmentedUpdate: each segment has its own t
  return params;
}

TEST(PlanSegmentedUpdateTest, OneSegmentIsOneRun) {
  const std::vector<SegmentRun> runs = PlanSegmentedUpdate(1000, SegmentedUpdateSpec{{}, {}, 4, {}});
  ASSERT_EQ(runs.size(), 1u);
  EXPECT_EQ(runs[0].begin, 0u);
  EXPECT_EQ(runs[0].end, 1000u);
  EXPECT_TRUE(runs[0].update);
  EXPECT_EQ(runs[0].step, 5);
}

TEST(PlanSegmentedUpdateTest, SegmentsAtTheSameCountWithGradientsAreOneKernelCall) {
  const std::vector<uint64_t> sizes = {3, 64, 1, 900, 32};
  // Uniform count, or per-segment counts that happen to be equal: one run.
  const std::vector<int64_t> equal = {7, 7, 7, 7, 7};
  for (const SegmentedUpdateSpec& spec :
       {SegmentedUpdateSpec{sizes, {}, 7, {}}, SegmentedUpdateSpec{sizes, equal, 0, {}}}) {
    const std::vector<SegmentRun> runs = PlanSegmentedUpdate(1000, spec);
    ASSERT_EQ(runs.size(), 1u);
    EXPECT_EQ(runs[0].end, 1000u);
    EXPECT_EQ(runs[0].step, 8);
  }
}

TEST(PlanSegmentedUpdateTest, SplitsWhereTheCountOrTheGradientChanges) {
  const std::vector<uint64_t> sizes = {10, 20, 30, 40, 50, 60};
  const std::vector<int64_t> counts = {3, 3, 2, 2, 2, 3};
  const std::vector<uint32_t> without = {3, 4};
  const std::vector<SegmentRun> runs = PlanSegmentedUpdate(210, SegmentedUpdateSpec{sizes, counts, 0, without});
  ASSERT_EQ(runs.size(), 4u);
  EXPECT_EQ(runs[0].begin, 0u);
  EXPECT_EQ(runs[0].end, 30u);
  EXPECT_EQ(runs[0].step, 4);
  EXPECT_EQ(runs[1].begin, 30u);
  EXPECT_EQ(runs[1].end, 60u);
  EXPECT_EQ(runs[1].step, 3);
  EXPECT_TRUE(runs[1].update);
  EXPECT_EQ(runs[2].begin, 60u);
  EXPECT_EQ(runs[2].end, 150u);
  EXPECT_FALSE(runs[2].update) << "two adjacent segments without gradient: one copy";
  EXPECT_EQ(runs[3].begin, 150u);
  EXPECT_EQ(runs[3].end, 210u);
  EXPECT_EQ(runs[3].step, 4);
}

TEST(CountsAfterUpdateTest, AdvancesOnlySegmentsWithAGradient) {
  const std::vector<uint64_t> sizes = {1, 1, 1, 1};
  const std::vector<int64_t> counts = {5, 4, 5, 0};
  const std::vector<uint32_t> without = {1, 3};
  EXPECT_EQ(CountsAfterUpdate(SegmentedUpdateSpec{sizes, counts, 0, without}), (std::vector<int64_t>{6, 4, 6, 0}));
  EXPECT_EQ(CountsAfterUpdate(SegmentedUpdateSpec{sizes, {}, 2, {}}), (std::vector<int64_t>{3, 3, 3, 3}));
  EXPECT_EQ(CountsAfterUpdate(SegmentedUpdateSpec{{}, {}, 2, {}}), (std::vector<int64_t>{3}));
  const std::vector<uint32_t> only = {0};
  EXPECT_EQ(CountsAfterUpdate(SegmentedUpdateSpec{{}, {}, 2, only}), (std::vector<int64_t>{2}));
}

// Segments of odd sizes, so that every segment but the first starts at an
// unaligned element (unaligned vectors, masked and padded tails; the 70001- and
// 130000-element ones are long enough for the AVX-512 path to stream the
// weights output from an unaligned start). Each segment's result must equal, bit
// for bit, the kernel's own update of that range with that segment's t, and a
// segment without gradient must keep master, m and v and return its weights.
TEST(SegmentedUpdateTest, EachSegmentEqualsTheKernelOnItsRangeWithItsOwnT) {
  const std::vector<uint64_t> sizes = {3, 70001, 17, 4097, 1, 130000, 5};
  const std::vector<int64_t> counts = {0, 5, 5, 2, 0, 7, 1};
  const std::vector<uint32_t> without = {2, 4, 6};
  const size_t n = std::accumulate(sizes.begin(), sizes.end(), size_t{0});
  const struct {
    DType grad, weight;
  } dtypes[] = {{DType::kFloat32, DType::kFloat32}, {DType::kBFloat16, DType::kFloat16},
                {DType::kFloat16, DType::kBFloat16}};
  uint32_t seed = 1;
  for (Isa isa : Isas()) {
    for (auto [grad_dtype, weight_dtype] : dtypes) {
      SCOPED_TRACE(std::string(IsaName(isa)) + " grad=" + std::string(DTypeName(grad_dtype)) +
                   " weights=" + std::string(DTypeName(weight_dtype)));
      Chunk start = MakeChunk(n, grad_dtype, weight_dtype, ++seed);
      // The gradient bytes of the segments without gradient are garbage (NaN):
      // they must not be read.
      size_t first = 0;
      for (size_t s = 0; s < sizes.size(); ++s) {
        if (std::find(without.begin(), without.end(), s) != without.end()) {
          for (size_t i = first; i < first + sizes[s]; ++i) {
            Put(start.grad, i, grad_dtype, std::numeric_limits<float>::quiet_NaN());
          }
        }
        first += sizes[s];
      }
      Chunk got = start;
      Chunk want = start;
      AdamWKernel kernel(4, isa);
      ASSERT_EQ(kernel.isa(), isa);
      SegmentedUpdate(kernel, Hyper(), BuffersOf(got, grad_dtype, weight_dtype),
                      SegmentedUpdateSpec{sizes, counts, 0, without});
      first = 0;
      for (size_t s = 0; s < sizes.size(); ++s) {
        const size_t end = first + sizes[s];
        if (std::find(without.begin(), without.end(), s) == without.end()) {
          AdamWStepParams params = Hyper();
          params.step = counts[s] + 1;
          AdamWUpdateRange(isa, params, BuffersOf(want, grad_dtype, weight_dtype), first, end);
        } else {
          for (size_t i = first; i < end; ++i) {
            const uint32_t w = Rounded(want.p[i], weight_dtype);
            std::memcpy(&want.out[i * DTypeSize(weight_dtype)], &w, DTypeSize(weight_dtype));
          }
        }
        first = end;
      }
      size_t failures = 0;
      for (size_t i = 0; i < n && failures < 10; ++i) {
        const bool same = std::memcmp(&got.p[i], &want.p[i], 4) == 0 && std::memcmp(&got.m[i], &want.m[i], 4) == 0 &&
                          std::memcmp(&got.v[i], &want.v[i], 4) == 0 &&
                          Bits(got.out, i, weight_dtype) == Bits(want.out, i, weight_dtype);
        if (!same) {
          ++failures;
          ADD_FAILURE() << "i=" << i << " p " << got.p[i] << " vs " << want.p[i] << ", m " << got.m[i] << " vs "
                        << want.m[i] << ", v " << got.v[i] << " vs " << want.v[i];
        }
      }
      // The segments without gradient kept their states exactly; the others moved.
      first = 0;
      for (size_t s = 0; s < sizes.size(); ++s) {
        const bool kept = std::find(without.begin(), without.end(), s) != without.end();
        bool unchanged = true;
        for (size_t i = first; i < first + sizes[s]; ++i) {
          unchanged = unchanged && std::memcmp(&got.p[i], &start.p[i], 4) == 0 &&
                      std::memcmp(&got.m[i], &start.m[i], 4) == 0 && std::memcmp(&got.v[i], &start.v[i], 4) == 0;
        }
        EXPECT_EQ(unchanged, kept) << "segment " << s;
        first += sizes[s];
      }
    }
  }
}

// The common case: a chunk whose segments all have gradients and one count is
// the plain whole-chunk kernel update, bit for bit.
TEST(SegmentedUpdateTest, UniformChunkEqualsOneWholeChunkUpdate) {
  const std::vector<uint64_t> sizes = {1000, 3, 99997, 7};
  const size_t n = 101007;
  for (Isa isa : Isas()) {
    SCOPED_TRACE(std::string(IsaName(isa)));
    const Chunk start = MakeChunk(n, DType::kBFloat16, DType::kBFloat16, 77);
    Chunk got = start;
    Chunk want = start;
    AdamWKernel kernel(3, isa);
    SegmentedUpdate(kernel, Hyper(), BuffersOf(got, DType::kBFloat16, DType::kBFloat16),
                    SegmentedUpdateSpec{sizes, {}, 11, {}});
    AdamWStepParams params = Hyper();
    params.step = 12;
    kernel.Update(params, BuffersOf(want, DType::kBFloat16, DType::kBFloat16));
    EXPECT_EQ(std::memcmp(got.p.data(), want.p.data(), 4 * n), 0);
    EXPECT_EQ(std::memcmp(got.m.data(), want.m.data(), 4 * n), 0);
    EXPECT_EQ(std::memcmp(got.v.data(), want.v.data(), 4 * n), 0);
    EXPECT_EQ(got.out, want.out);
  }
}

// Every segment without gradient: nothing changes, the weights come back.
TEST(SegmentedUpdateTest, NoSegmentWithAGradientReturnsTheWeightsUnchanged) {
  const std::vector<uint64_t> sizes = {5, 6};
  const std::vector<uint32_t> without = {0, 1};
  Chunk got = MakeChunk(11, DType::kFloat32, DType::kBFloat16, 3);
  const Chunk start = got;
  AdamWKernel kernel(1);
  SegmentedUpdate(kernel, Hyper(), BuffersOf(got, DType::kFloat32, DType::kBFloat16),
                  SegmentedUpdateSpec{sizes, {}, 4, without});
  EXPECT_EQ(got.p, start.p);
  EXPECT_EQ(got.m, start.m);
  EXPECT_EQ(got.v, start.v);
  for (size_t i = 0; i < 11; ++i) EXPECT_EQ(Bits(got.out, i, DType::kBFloat16), FloatToBFloat16(start.p[i]));
}

}  // namespace
}  // namespace fuyou::optimizer
