#include "storage/aligned_buffer.h"

#include <cstdint>
#include <cstring>
#include <utility>

#include "gtest/gtest.h"

namespace fuyou::storage {
namespace {

bool AlignedTo(const void* p, uintptr_t unit) { return reinterpret_cast<uintptr_t>(p) % unit == 0; }

TEST(AlignedBufferTest, RoundsSmallSizesToPages) {
  absl::StatusOr<AlignedBuffer> buffer = AlignedBuffer::Allocate(5000);
  ASSERT_TRUE(buffer.ok()) << buffer.status();
  EXPECT_EQ(buffer->size(), 8192u);
  EXPECT_TRUE(AlignedTo(buffer->data(), 4096));
  std::memset(buffer->data(), 0xab, buffer->size());  // the whole rounded size is usable
  EXPECT_EQ(buffer->span().size(), 8192u);
}

TEST(AlignedBufferTest, LargeSizesStartOnAHugePageAndWasteNoMoreThanAPage) {
  constexpr size_t kHuge = size_t{2} << 20;
  absl::StatusOr<AlignedBuffer> buffer = AlignedBuffer::Allocate(kHuge + 1);
  ASSERT_TRUE(buffer.ok()) << buffer.status();
  EXPECT_EQ(buffer->size(), kHuge + 4096);
  EXPECT_TRUE(AlignedTo(buffer->data(), kHuge));
  std::memset(buffer->data(), 1, buffer->size());
}

TEST(AlignedBufferTest, ShrinkToKeepsTheFirstPagesAndTheirBytes) {
  AlignedBuffer buffer = *AlignedBuffer::Allocate((size_t{4} << 20) + 3 * 4096);
  std::byte* const data = buffer.data();
  std::memset(data, 0x5a, buffer.size());
  buffer.ShrinkTo((size_t{2} << 20) + 1);
  EXPECT_EQ(buffer.data(), data);
  EXPECT_EQ(buffer.size(), (size_t{2} << 20) + 4096) << "rounded up to a page";
  for (size_t i = 0; i < buffer.size(); i += 4096) ASSERT_EQ(data[i], std::byte{0x5a}) << i;
  buffer.ShrinkTo(buffer.size() + 4096);
  EXPECT_EQ(buffer.size(), (size_t{2} << 20) + 4096) << "never grows";
  buffer.ShrinkTo(0);
  EXPECT_EQ(buffer.data(), nullptr);
  EXPECT_EQ(buffer.size(), 0u);
}

TEST(AlignedBufferTest, ZeroBytesIsEmpty) {
  absl::StatusOr<AlignedBuffer> buffer = AlignedBuffer::Allocate(0);
  ASSERT_TRUE(buffer.ok());
  EXPECT_EQ(buffer->data(), nullptr);
  EXPECT_EQ(buffer->size(), 0u);
}

TEST(AlignedBufferTest, ImpossibleSizeIsResourceExhausted) {
  absl::StatusOr<AlignedBuffer> buffer = AlignedBuffer::Allocate(size_t{1} << 62);
  EXPECT_EQ(buffer.status().code(), absl::StatusCode::kResourceExhausted);
}

TEST(AlignedBufferTest, MovesTransferOwnership) {
  absl::StatusOr<AlignedBuffer> allocated = AlignedBuffer::Allocate(4096);
  ASSERT_TRUE(allocated.ok());
  AlignedBuffer a = *std::move(allocated);
  std::byte* data = a.data();
  data[0] = std::byte{42};

  AlignedBuffer b(std::move(a));
  EXPECT_EQ(a.data(), nullptr);
  EXPECT_EQ(a.size(), 0u);
  EXPECT_EQ(b.data(), data);
  EXPECT_EQ(b.data()[0], std::byte{42});

  absl::StatusOr<AlignedBuffer> other = AlignedBuffer::Allocate(8192);
  ASSERT_TRUE(other.ok());
  AlignedBuffer c = *std::move(other);
  c = std::move(b);  // releases c's old mapping
  EXPECT_EQ(c.data(), data);
  EXPECT_EQ(c.size(), 4096u);
  EXPECT_EQ(b.data(), nullptr);
}

}  // namespace
}  // namespace fuyou::storage
