#include "slot_memory.h"

#include <utility>

#include "fuyou/segment_layout.h"

namespace fuyou::internal {

void SlotMemory::Adopt(std::unique_ptr<ClientSegment> segment) { segment_ = std::move(segment); }

std::span<std::byte> SlotMemory::bytes() const {
  if (segment_ == nullptr) return {};
  return segment_->bytes();
}

std::span<std::byte> SlotMemory::GradRegion(uint32_t slot) const {
  if (segment_ == nullptr || slot >= num_slots_) return {};
  return {segment_->bytes().data() + SegmentLayout{num_slots_, slot_bytes_}.GradOffset(slot), slot_bytes_};
}

std::span<std::byte> SlotMemory::ParamRegion(uint32_t slot) const {
  if (segment_ == nullptr || slot >= num_slots_) return {};
  return {segment_->bytes().data() + SegmentLayout{num_slots_, slot_bytes_}.ParamOffset(slot), slot_bytes_};
}

}  // namespace fuyou::internal
