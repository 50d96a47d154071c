// Layout of a session's shared-memory segment: the data-plane contract that the
// job (clientlib) and fuyoud both follow. Gradients and weights move only here.
//
//   [ header page (4096 B) ][ slot 0: grad region | param region ][ slot 1 ] ...
//
// Each region is `slot_bytes` long, a multiple of kSegmentAlignment, so every
// region starts 4 KiB-aligned (fit for O_DIRECT and cudaHostRegister).
// A slot is owned by the job until it sends GradReady naming it, then by the
// daemon until the daemon answers ParamsReady (or an Error) for it.
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>

#include "fuyou/checked_math.h"
#include "fuyou/wire_limits.h"

namespace fuyou {

inline constexpr uint64_t kSegmentAlignment = 4096;
inline constexpr uint64_t kSegmentHeaderBytes = 4096;
inline constexpr uint64_t kSegmentMagic = 0x31564f5559554643ULL;  // "CFUYUOV1"

// Written by the daemon at offset 0 when it creates the segment; the client
// checks it after mapping so a wrong or stale segment is refused, not misread.
struct SegmentHeader {
  uint64_t magic;
  uint32_t num_slots;
  uint32_t reserved;
  uint64_t slot_bytes;
  uint64_t total_bytes;
};

struct SegmentLayout {
  uint32_t num_slots = 0;
  uint64_t slot_bytes = 0;  // bytes of each region; multiple of kSegmentAlignment

  // Builds the layout for `slots` slots of `requested_slot_bytes` (rounded up
  // to kSegmentAlignment), or nullopt unless 1 <= slots <= kMaxSlots,
  // requested_slot_bytes > 0 and the whole segment (TotalBytes) is at most
  // `max_total_bytes`. The slot size is capped at max_total_bytes before it is
  // rounded and the total is computed in checked arithmetic, so no request can
  // wrap to a small segment. The only way to build a layout from untrusted sizes.
  static constexpr std::optional<SegmentLayout> Checked(uint32_t slots, uint64_t requested_slot_bytes,
                                                        uint64_t max_total_bytes) {
    if (slots == 0 || slots > kMaxSlots || requested_slot_bytes == 0) return std::nullopt;
    if (requested_slot_bytes > max_total_bytes) return std::nullopt;
    const std::optional<uint64_t> slot_bytes = CheckedAlignUp(requested_slot_bytes, kSegmentAlignment);
    const std::optional<uint64_t> total =
        CheckedAdd(CheckedMul(CheckedMul(uint64_t{slots}, 2), slot_bytes), kSegmentHeaderBytes);
    if (!total || *total > max_total_bytes) return std::nullopt;
    return SegmentLayout{slots, *slot_bytes};
  }
  // Offsets and total below are exact for a layout from Checked (its total fits).
  constexpr uint64_t GradOffset(uint32_t slot) const {
    return kSegmentHeaderBytes + uint64_t{slot} * 2 * slot_bytes;
  }
  constexpr uint64_t ParamOffset(uint32_t slot) const { return GradOffset(slot) + slot_bytes; }
  constexpr uint64_t TotalBytes() const {
    return kSegmentHeaderBytes + uint64_t{num_slots} * 2 * slot_bytes;
  }
};

}  // namespace fuyou
