#include "storage/spare_buffers.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>

namespace fuyou::storage {
namespace {

AlignedBuffer Filled(size_t bytes, unsigned char value) {
  AlignedBuffer buffer = *AlignedBuffer::Allocate(bytes);
  std::memset(buffer.data(), value, buffer.size());
  return buffer;
}

bool AllEqual(const std::byte* begin, const std::byte* end, unsigned char value) {
  return std::all_of(begin, end, [&](std::byte b) { return b == std::byte{value}; });
}

TEST(SpareBuffersTest, ATakenBufferIsTheSameMappingZeroedFromKeepOn) {
  SpareBuffers spares(2);
  AlignedBuffer buffer = Filled(3 * 4096, 0xab);
  const std::byte* mapping = buffer.data();
  spares.Put(std::move(buffer));
  EXPECT_EQ(spares.bytes(), 3u * 4096);

  auto taken = spares.Take(3 * 4096);
  ASSERT_TRUE(taken.has_value());
  EXPECT_EQ(taken->data(), mapping) << "reused, not mapped anew";
  SpareBuffers::ZeroFrom(*taken, /*keep=*/4096 + 100);
  EXPECT_TRUE(AllEqual(taken->data(), taken->data() + 4096 + 100, 0xab)) << "the caller's part is left as it was";
  EXPECT_TRUE(AllEqual(taken->data() + 4096 + 100, taken->data() + taken->size(), 0))
      << "the rest reads as a fresh mapping: no bytes of the last user";
  EXPECT_EQ(spares.count(), 0u);
}

TEST(SpareBuffersTest, TheSmallestLargeEnoughBufferIsCutToSizeKeepingItsPages) {
  SpareBuffers spares(4);
  spares.Put(Filled(6 * 4096, 6));
  spares.Put(Filled(4 * 4096, 4));
  spares.Put(Filled(5 * 4096, 5));
  auto taken = spares.Take(3 * 4096);
  ASSERT_TRUE(taken.has_value());
  EXPECT_EQ(taken->size(), 3u * 4096) << "cut to the size asked for";
  EXPECT_TRUE(AllEqual(taken->data(), taken->data() + taken->size(), 4)) << "from the smallest that fits, its bytes kept";
  EXPECT_EQ(spares.bytes(), 11u * 4096);
  taken = spares.Take(5 * 4096);
  ASSERT_TRUE(taken.has_value());
  EXPECT_TRUE(AllEqual(taken->data(), taken->data() + taken->size(), 5)) << "an exact fit before a larger one";
  EXPECT_EQ(spares.bytes(), 6u * 4096);
}

TEST(SpareBuffersTest, NoneIsTakenWhenAllAreSmaller) {
  SpareBuffers spares(4);
  spares.Put(Filled(2 * 4096, 2));
  spares.Put(Filled(3 * 4096, 3));
  EXPECT_FALSE(spares.Take(4 * 4096).has_value());
  EXPECT_EQ(spares.bytes(), 5u * 4096) << "both kept";
  EXPECT_FALSE(SpareBuffers(4).Take(4096).has_value()) << "none kept: none taken";
}

TEST(SpareBuffersTest, BeyondTheLimitTheOldestIsFreedAndFreeOneEmptiesIt) {
  SpareBuffers spares(2);
  spares.Put(Filled(4096, 1));
  spares.Put(Filled(2 * 4096, 2));
  spares.Put(Filled(3 * 4096, 3));
  EXPECT_EQ(spares.count(), 2u);
  EXPECT_EQ(spares.bytes(), 5u * 4096) << "the oldest went first";
  EXPECT_TRUE(spares.FreeOne());
  EXPECT_EQ(spares.bytes(), 3u * 4096);
  EXPECT_TRUE(spares.FreeOne());
  EXPECT_FALSE(spares.FreeOne());
  spares.Put(AlignedBuffer());
  EXPECT_EQ(spares.count(), 0u) << "an empty buffer is not kept";
}

TEST(SpareBuffersTest, ZeroMaxKeepsNothing) {
  SpareBuffers spares(0);
  spares.Put(Filled(4096, 1));
  EXPECT_EQ(spares.count(), 0u);
}

}  // namespace
}  // namespace fuyou::storage
