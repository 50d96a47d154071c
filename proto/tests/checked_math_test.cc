#include "fuyou/checked_math.h"

#include <cstdint>
#include <limits>

#include "fuyou/segment_layout.h"
#include "gtest/gtest.h"

namespace fuyou {
namespace {

constexpr uint64_t kMax = std::numeric_limits<uint64_t>::max();

// The helpers are usable in constant expressions.
static_assert(CheckedMul(uint64_t{3}, 4) == 12);
static_assert(!CheckedMul(uint64_t{1} << 63, 2));
static_assert(CheckedAlignUp(uint64_t{4097}, 4096) == 8192);
static_assert(!CheckedAlignUp(kMax - 4094, 4096));

TEST(CheckedMathTest, AddDetectsOverflow) {
  EXPECT_EQ(CheckedAdd(uint64_t{1}, 2), 3u);
  EXPECT_EQ(CheckedAdd(kMax - 1, 1), kMax);
  EXPECT_FALSE(CheckedAdd(kMax, 1));
  EXPECT_FALSE(CheckedAdd(uint64_t{1} << 63, uint64_t{1} << 63));
}

TEST(CheckedMathTest, MulDetectsOverflow) {
  EXPECT_EQ(CheckedMul(uint64_t{0}, kMax), 0u);
  EXPECT_EQ(CheckedMul(kMax, 1), kMax);
  EXPECT_EQ(CheckedMul(uint64_t{1} << 32, (uint64_t{1} << 31)), uint64_t{1} << 63);
  EXPECT_FALSE(CheckedMul(uint64_t{1} << 32, uint64_t{1} << 32));
  // The chunk sizes of issue 8: (2^62 + 1) elements of 12 bytes, or of 4 bytes.
  EXPECT_FALSE(CheckedMul((uint64_t{1} << 62) + 1, 12));
  EXPECT_FALSE(CheckedMul((uint64_t{1} << 62) + 1, 4));
  EXPECT_EQ(CheckedMul((uint64_t{1} << 61) - 1, 4), (uint64_t{1} << 63) - 4);
}

TEST(CheckedMathTest, AlignUpRefusesToRoundPastTheTop) {
  EXPECT_EQ(CheckedAlignUp(uint64_t{0}, 4096), 0u);
  EXPECT_EQ(CheckedAlignUp(uint64_t{1}, 4096), 4096u);
  EXPECT_EQ(CheckedAlignUp(uint64_t{4096}, 4096), 4096u);
  EXPECT_EQ(CheckedAlignUp(uint64_t{10}, 3), 12u);  // any alignment, not only powers of two
  const uint64_t top = kMax - 4095;                  // the largest multiple of 4096
  EXPECT_EQ(CheckedAlignUp(top, 4096), top);
  EXPECT_FALSE(CheckedAlignUp(top + 1, 4096));  // 2^64 - 4095: the unchecked form gives 0
  EXPECT_FALSE(CheckedAlignUp(kMax, 4096));
  EXPECT_FALSE(CheckedAlignUp(uint64_t{5}, 0));
}

TEST(CheckedMathTest, ChainsPassOverflowThrough) {
  EXPECT_EQ(CheckedAdd(CheckedMul(uint64_t{2}, 3), 4), 10u);
  EXPECT_FALSE(CheckedAdd(CheckedMul(kMax, 2), 4));
  EXPECT_FALSE(CheckedAlignUp(CheckedMul(kMax, 2), 4096));
  EXPECT_FALSE(CheckedMul(CheckedAdd(kMax, 1), std::optional<uint64_t>(1)));
  EXPECT_EQ(CheckedAlignUp(CheckedMul(uint64_t{3}, 12), 4096), 4096u);
}

// SegmentLayout::Checked: the segment sizes of issue 8 that used to wrap to a
// 4 KiB segment are refused, whatever the limit.
TEST(SegmentLayoutTest, CheckedRefusesSizesThatWrap) {
  EXPECT_FALSE(SegmentLayout::Checked(1, uint64_t{1} << 63, kMax));
  EXPECT_FALSE(SegmentLayout::Checked(4, uint64_t{1} << 62, kMax));
  EXPECT_FALSE(SegmentLayout::Checked(64, uint64_t{1} << 57, kMax));
  EXPECT_FALSE(SegmentLayout::Checked(1, kMax - 4094, kMax));
  EXPECT_FALSE(SegmentLayout::Checked(1, kMax, kMax));
}

TEST(SegmentLayoutTest, CheckedEnforcesTheLimit) {
  const uint64_t limit = kSegmentHeaderBytes + 2 * (uint64_t{1} << 20);
  auto layout = SegmentLayout::Checked(2, 1000, limit);
  ASSERT_TRUE(layout);
  EXPECT_EQ(layout->num_slots, 2u);
  EXPECT_EQ(layout->slot_bytes, 4096u);
  EXPECT_EQ(layout->TotalBytes(), kSegmentHeaderBytes + 4 * 4096);
  EXPECT_EQ(layout->ParamOffset(1), kSegmentHeaderBytes + 3 * 4096);
  // Exactly at the limit is allowed; one alignment unit more is not.
  const uint64_t fits = uint64_t{1} << 20;
  ASSERT_TRUE(SegmentLayout::Checked(1, fits, limit));
  EXPECT_EQ(SegmentLayout::Checked(1, fits, limit)->TotalBytes(), limit);
  EXPECT_FALSE(SegmentLayout::Checked(1, fits + 1, limit));
  EXPECT_FALSE(SegmentLayout::Checked(1, limit + 1, limit));
}

TEST(SegmentLayoutTest, CheckedRefusesEmptyAndTooManySlots) {
  EXPECT_FALSE(SegmentLayout::Checked(0, 4096, kMax));
  EXPECT_FALSE(SegmentLayout::Checked(kMaxSlots + 1, 4096, kMax));
  EXPECT_TRUE(SegmentLayout::Checked(kMaxSlots, 4096, kMax));
  EXPECT_FALSE(SegmentLayout::Checked(1, 0, kMax));
}

}  // namespace
}  // namespace fuyou
