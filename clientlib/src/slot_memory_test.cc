// SlotMemory: each slot's gradient and parameter regions lie where the segment
// layout puts them, and there are none outside the layout or without a segment.
#include "slot_memory.h"

#include <gtest/gtest.h>

#include "fuyou/segment_layout.h"

namespace fuyou::internal {
namespace {

constexpr uint32_t kSlots = 3;
constexpr uint64_t kSlotBytes = 8192;

SlotMemory Mapped() {
  SlotMemory memory;
  memory.set_layout(kSlots, kSlotBytes);
  auto segment = ClientSegment::Create(SegmentLayout{kSlots, kSlotBytes}.TotalBytes());
  EXPECT_TRUE(segment.ok()) << segment.status();
  memory.Adopt(*std::move(segment));
  return memory;
}

TEST(SlotMemoryTest, RegionsLieWhereTheLayoutPutsThem) {
  SlotMemory memory = Mapped();
  const SegmentLayout layout{kSlots, kSlotBytes};
  std::byte* base = memory.bytes().data();
  ASSERT_NE(base, nullptr);
  EXPECT_EQ(memory.bytes().size(), layout.TotalBytes());
  for (uint32_t slot = 0; slot < kSlots; ++slot) {
    EXPECT_EQ(memory.GradRegion(slot).data(), base + layout.GradOffset(slot));
    EXPECT_EQ(memory.GradRegion(slot).size(), kSlotBytes);
    EXPECT_EQ(memory.ParamRegion(slot).data(), base + layout.ParamOffset(slot));
    EXPECT_EQ(memory.ParamRegion(slot).size(), kSlotBytes);
  }
}

TEST(SlotMemoryTest, NoRegionOutsideTheLayoutNorWithoutASegment) {
  SlotMemory memory;
  memory.set_layout(kSlots, kSlotBytes);
  EXPECT_TRUE(memory.GradRegion(0).empty()) << "before Adopt";
  EXPECT_TRUE(memory.bytes().empty());
  memory = Mapped();
  EXPECT_TRUE(memory.GradRegion(kSlots).empty());
  EXPECT_TRUE(memory.ParamRegion(kSlots).empty());
  memory.Unmap();
  EXPECT_TRUE(memory.GradRegion(0).empty()) << "after Unmap";
  EXPECT_TRUE(memory.ParamRegion(0).empty());
}

TEST(SlotMemoryTest, ThePoolHasTheLayoutsSlots) {
  SlotMemory memory = Mapped();
  EXPECT_EQ(memory.pool(), nullptr) << "before StartPool";
  memory.StartPool();
  ASSERT_NE(memory.pool(), nullptr);
  EXPECT_EQ(memory.pool()->num_slots(), kSlots);
  EXPECT_EQ(memory.pool()->free_slots(), kSlots);
}

}  // namespace
}  // namespace fuyou::internal
