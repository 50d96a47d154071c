// The limits of the wire contract that both sides check, each defined once: the
// daemon refuses a message past one (INVALID_ARGUMENT), clientlib refuses to send
// it, and the Python client reads the same values from the binding
// (fuyou._fuyou.MAX_SLOTS, MAX_CHUNK_SEGMENTS). offload.proto's comments name them.
#pragma once

#include <cstdint>

namespace fuyou {

// Shared-memory slots of one session (OpenSession.num_slots: 1..kMaxSlots).
inline constexpr uint32_t kMaxSlots = 64;

// Entries of ChunkSpec.segment_elements (the parameters packed into one chunk).
// A client with more parameters in a chunk registers it as one segment.
inline constexpr uint32_t kMaxChunkSegments = 4096;

}  // namespace fuyou
