#include "jobs/chunk_layout.h"

#include <xxhash.h>

#include "fuyou/checked_math.h"
#include "storage/io_engine.h"

namespace fuyou {

std::optional<uint64_t> ChunkPayloadBytes(uint64_t num_elements) {
  if (num_elements > kMaxChunkElements) return std::nullopt;
  return CheckedMul(num_elements, kChunkStateCount * kStateElementBytes);
}

std::optional<uint64_t> ChunkStateBytes(uint64_t num_elements) {
  return CheckedAlignUp(ChunkPayloadBytes(num_elements), storage::kBlockSize);
}

uint64_t ChunkPayloadChecksum(const std::byte* states, uint64_t num_elements) {
  return XXH3_64bits(states, ChunkPayloadBytes(num_elements).value_or(0));
}

}  // namespace fuyou
