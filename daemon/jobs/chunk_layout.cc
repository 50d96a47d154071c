#include "jobs/chunk_layout.h"

#include "common/checksum.h"
#include "fuyou/checked_math.h"
#include "storage/io_engine.h"

namespace fuyou {

uint64_t ChunkLayout::StateOffset(ChunkState state) const {
  switch (state) {
    case ChunkState::kMaster: return 0;
    case ChunkState::kExpAvg: return num_elements * kStateElementBytes;
    case ChunkState::kExpAvgSq: return num_elements * kStateElementBytes + MomentBytes().value_or(0);
  }
  return 0;
}

std::optional<uint64_t> ChunkLayout::MomentBytes() const {
  if (num_elements > kMaxChunkElements || !IsMomentsDType(moments_dtype)) return std::nullopt;
  if (moments_dtype != DType::kBlock8) return num_elements * DTypeSize(moments_dtype);
  // n <= 2^48: neither term can wrap.
  const uint64_t blocks = (num_elements + kMomentBlockElements - 1) / kMomentBlockElements;
  return MomentScalesOffset() + blocks * sizeof(float);
}

std::optional<uint64_t> ChunkLayout::StatesBytes() const {
  const std::optional<uint64_t> moments = MomentBytes();
  if (!moments) return std::nullopt;
  return CheckedAdd(CheckedMul(num_elements, kStateElementBytes), CheckedMul(*moments, 2));
}

std::optional<uint64_t> ChunkLayout::WeightsOffset() const {
  return CheckedAlignUp(StatesBytes(), storage::kBlockSize);
}

std::optional<uint64_t> ChunkLayout::WeightsBytes() const {
  if (num_elements > kMaxChunkElements) return std::nullopt;
  if (!weights_dtype) return 0;
  if (!IsValidDType(*weights_dtype)) return std::nullopt;
  return CheckedMul(num_elements, DTypeSize(*weights_dtype));
}

std::optional<uint64_t> ChunkLayout::WeightsRegionBytes() const {
  return CheckedAlignUp(WeightsBytes(), storage::kBlockSize);
}

std::optional<uint64_t> ChunkLayout::ExtentBytes() const { return CheckedAdd(WeightsOffset(), WeightsRegionBytes()); }

std::optional<uint64_t> ChunkPayloadBytes(uint64_t num_elements) { return ChunkLayout{num_elements}.StatesBytes(); }

std::optional<uint64_t> ChunkStateBytes(uint64_t num_elements) { return ChunkLayout{num_elements}.ExtentBytes(); }

uint64_t ChunkPayloadChecksum(const std::byte* states, uint64_t num_elements) {
  return Checksum64(states, ChunkPayloadBytes(num_elements).value_or(0));
}

uint64_t WeightsChecksum(const std::byte* weights, const ChunkLayout& layout) {
  return Checksum64(weights, layout.WeightsBytes().value_or(0));
}

uint64_t StatesChecksum(const std::byte* bytes, const ChunkLayout& layout) {
  return Checksum64(bytes, layout.StatesBytes().value_or(0));
}

ChunkChecksums ComputeChunkChecksums(const std::byte* bytes, const ChunkLayout& layout) {
  ChunkChecksums sums;
  sums.states = StatesChecksum(bytes, layout);
  if (layout.stores_weights()) sums.weights = WeightsChecksum(bytes + layout.WeightsOffset().value_or(0), layout);
  return sums;
}

float* ChunkStates::moment_scales(ChunkState which) const {
  if (which == ChunkState::kMaster || layout_.moments_dtype != DType::kBlock8) return nullptr;
  return reinterpret_cast<float*>(state(which) + layout_.MomentScalesOffset());
}

ChunkStates::ChunkStates(std::byte* bytes, const ChunkLayout& layout) : bytes_(bytes), layout_(layout) {
  if (layout.stores_weights()) {
    weights_offset_ = layout.WeightsOffset().value_or(0);
    weights_bytes_ = layout.WeightsBytes().value_or(0);
  }
}

}  // namespace fuyou
