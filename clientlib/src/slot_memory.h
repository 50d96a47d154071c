// SlotMemory: a session's slots in memory: the segment (a sealed memfd the
// client maps, fuyou/client_segment.h), its layout (how many slots of how many
// bytes, fuyou/segment_layout.h) and the pool of which slots are free, held or
// in flight (slot_pool.h). Private to clientlib.
//
// Filled in order while the session opens: set_layout (from OpenSession's
// answer), Adopt (the mapped segment), StartPool; then the regions of each
// slot are valid until Unmap. Not thread-safe while it is filled or unmapped
// (the session does both on one thread); the pool is thread-safe.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>

#include "fuyou/client_segment.h"
#include "slot_pool.h"

namespace fuyou::internal {

class SlotMemory {
 public:
  void set_layout(uint32_t num_slots, uint64_t slot_bytes) {
    num_slots_ = num_slots;
    slot_bytes_ = slot_bytes;
  }
  uint32_t num_slots() const { return num_slots_; }
  uint64_t slot_bytes() const { return slot_bytes_; }

  // Takes the mapped segment (of the layout's total bytes).
  void Adopt(std::unique_ptr<ClientSegment> segment);
  ClientSegment& segment() { return *segment_; }
  // The segment's bytes from its start (its header); empty before Adopt.
  std::span<std::byte> bytes() const;

  // Creates the pool of the layout's slots, all free.
  void StartPool() { pool_ = std::make_unique<SlotPool>(num_slots_); }
  // Null before StartPool.
  SlotPool* pool() { return pool_.get(); }

  // The gradient and parameter regions of `slot` (slot_bytes each); empty for
  // a slot outside the layout, before Adopt, and after Unmap.
  std::span<std::byte> GradRegion(uint32_t slot) const;
  std::span<std::byte> ParamRegion(uint32_t slot) const;

  // Unmaps the segment; the pool stays (its waiters are the caller's to fail).
  void Unmap() { segment_.reset(); }

 private:
  uint32_t num_slots_ = 0;
  uint64_t slot_bytes_ = 0;
  std::unique_ptr<ClientSegment> segment_;
  std::unique_ptr<SlotPool> pool_;
};

}  // namespace fuyou::internal
