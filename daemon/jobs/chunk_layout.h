// ChunkLayout: which states a chunk holds and where each lies in its bytes.
//
// The one definition of a chunk's state layout, used by the extents on storage
// (jobs/), the buffers in DRAM (state/) and the kernel's view of them. A chunk
// of n elements holds three states, one after the other: the fp32 master, and
// m and v in the chunk's moments dtype (fp32, or bf16 when the job was
// registered with state_dtype "bf16": ChunkRecord.moments_dtype, issue 22, or
// 8-bit blocks with state_dtype "8bit", issue 36), and,
// when it stores its working weights (ChunkRecord.stores_weights, issue 12),
// those weights in the chunk's param dtype in a region of their own:
//   [master: 4n][exp_avg (m): M][exp_avg_sq (v): M][padding to a block]
//   [weights: n * DTypeSize(param dtype)][padding to a block]   (stores_weights only)
// with M = MomentBytes(): s*n with s = DTypeSize(moments dtype) (4, or 2 for
// bf16); for 8-bit blocks, the n codes, padding to 4 bytes, then one fp32 scale
// per block of kMomentBlockElements (the last block may be shorter):
//   [codes: n][padding to 4][scales: 4 * ceil(n / 256)]
// The states (master|m|v, 4n + 2M bytes, as stored) carry StateExtent.checksum;
// the weights (n * DTypeSize bytes) carry StateExtent.weights_checksum. The
// weights region starts on a block boundary so that it can be read alone with
// O_DIRECT (a fetch of the weights never reads master, m or v). A chunk without
// weights keeps exactly the bytes and extent length it always had.
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>

#include "fuyou/dtype.h"

namespace fuyou {

// The states of a chunk, in the order they lie in its bytes. The values equal
// v1::StateKind - STATE_MASTER (offload.proto), which ReadState/WriteState name.
// The working weights are not a ChunkState: they are not fp32 and are never
// read or written through ReadState/WriteState (see ChunkLayout).
enum class ChunkState : int {
  kMaster = 0,    // fp32 master weights
  kExpAvg = 1,    // Adam's m
  kExpAvgSq = 2,  // Adam's v
};
inline constexpr int kChunkStateCount = 3;
// Bytes of one element of one fp32 state (the master; m and v with fp32 moments).
inline constexpr uint64_t kStateElementBytes = 4;
// Whether `dtype` can hold a chunk's m and v: fp32, bf16 or 8-bit blocks
// (fp16's range is too narrow for v, whose values reach g^2).
inline constexpr bool IsMomentsDType(DType dtype) {
  return dtype == DType::kFloat32 || dtype == DType::kBFloat16 || dtype == DType::kBlock8;
}

// The most elements a chunk may have. Far above what any slot or DRAM budget
// admits (a chunk must also fit its slot and half the DRAM budget), and low
// enough that every size derived from it (the payload, rounded up to a block,
// the weights, two extents) fits in uint64_t. Client input is capped with it
// before it is multiplied; so are manifests read from disk (ValidateManifest).
inline constexpr uint64_t kMaxChunkElements = uint64_t{1} << 48;

// The layout of one chunk's extent (and of its DRAM buffer). Every size is
// computed in checked arithmetic: nullopt when num_elements > kMaxChunkElements,
// the weights' dtype is not valid or the moments' dtype is not a moments dtype
// (IsMomentsDType), so a hostile manifest or request cannot wrap a size.
struct ChunkLayout {
  constexpr explicit ChunkLayout(uint64_t elements, std::optional<DType> weights = std::nullopt,
                                 DType moments = DType::kFloat32)
      : num_elements(elements), weights_dtype(weights), moments_dtype(moments) {}

  uint64_t num_elements = 0;
  // Set: the chunk stores its working weights in this dtype (its param dtype).
  std::optional<DType> weights_dtype;
  // The dtype of m and v (the master is always fp32).
  DType moments_dtype = DType::kFloat32;

  bool stores_weights() const { return weights_dtype.has_value(); }
  // The dtype `state` is stored in.
  DType StateDType(ChunkState state) const {
    return state == ChunkState::kMaster ? DType::kFloat32 : moments_dtype;
  }
  // Byte offset of `state` in the chunk's bytes. Precondition: StatesBytes() is
  // set (the layout is valid).
  uint64_t StateOffset(ChunkState state) const;
  // Bytes of m's region (and v's): n * DTypeSize(moments dtype), or for 8-bit
  // blocks AlignUp(n, 4) + 4 * ceil(n / kMomentBlockElements). nullopt as
  // StatesBytes().
  std::optional<uint64_t> MomentBytes() const;
  // Offset of the block scales in m's (and v's) region: AlignUp(n, 4). Only
  // meaningful for 8-bit blocks. Precondition: the layout is valid.
  uint64_t MomentScalesOffset() const { return (num_elements + 3) / 4 * 4; }
  // master|m|v: 4n + 2 * MomentBytes() (12n with fp32 moments, 8n with bf16,
  // about 6.03n with 8-bit blocks), covered by StateExtent.checksum.
  std::optional<uint64_t> StatesBytes() const;
  // Where the weights region starts: StatesBytes() rounded up to a block (for
  // a chunk without weights, where its extent ends).
  std::optional<uint64_t> WeightsOffset() const;
  // n * DTypeSize(weights dtype), covered by StateExtent.weights_checksum; 0
  // for a chunk without weights.
  std::optional<uint64_t> WeightsBytes() const;
  // WeightsBytes() rounded up to a block: what one O_DIRECT read of the weights
  // alone reads (0 without weights).
  std::optional<uint64_t> WeightsRegionBytes() const;
  // Bytes of one extent (and one DRAM buffer): WeightsOffset() +
  // WeightsRegionBytes(). For a chunk without weights, the states padded to a
  // block, as before weights existed.
  std::optional<uint64_t> ExtentBytes() const;
};

// The layout of a chunk without working weights, with fp32 moments (ChunkLayout{n}).
// Bytes that hold master|m|v (and are checksummed): kChunkStateCount * 4 * n;
// nullopt when n > kMaxChunkElements (computed in checked arithmetic).
std::optional<uint64_t> ChunkPayloadBytes(uint64_t num_elements);
// Bytes of one extent (and one DRAM buffer) for a chunk of n elements without
// weights: the payload padded to a storage block. nullopt when n > kMaxChunkElements.
std::optional<uint64_t> ChunkStateBytes(uint64_t num_elements);
// XXH3-64 of the states (master|m|v) in `states`, as StateExtent.checksum.
// Precondition: num_elements <= kMaxChunkElements and `states` holds
// ChunkPayloadBytes(num_elements) bytes.
uint64_t ChunkPayloadChecksum(const std::byte* states, uint64_t num_elements);

// XXH3-64 of the states (master|m|v, StatesBytes()) at `bytes`, as
// StateExtent.checksum. Precondition: the layout's sizes are valid.
uint64_t StatesChecksum(const std::byte* bytes, const ChunkLayout& layout);

// The two checksums an extent carries (StateExtent.checksum, weights_checksum).
struct ChunkChecksums {
  uint64_t states = 0;
  uint64_t weights = 0;  // 0 for a chunk without weights
  bool operator==(const ChunkChecksums&) const = default;
};
// The checksums of a chunk's buffer `bytes` laid out as `layout`.
// Precondition: the layout's sizes are valid and `bytes` holds ExtentBytes().
ChunkChecksums ComputeChunkChecksums(const std::byte* bytes, const ChunkLayout& layout);
// XXH3-64 of the weights alone: `weights` holds WeightsBytes() bytes (the
// weights region, as a fetch reads it). Precondition: the layout stores weights.
uint64_t WeightsChecksum(const std::byte* weights, const ChunkLayout& layout);

// A chunk's states in one buffer (layout.ExtentBytes() bytes), as the kernel
// and import/export see them. Does not own the bytes.
class ChunkStates {
 public:
  // A chunk without working weights.
  ChunkStates(std::byte* bytes, uint64_t num_elements) : ChunkStates(bytes, ChunkLayout{num_elements}) {}
  // Precondition: the layout's sizes are valid (a validated record or request).
  ChunkStates(std::byte* bytes, const ChunkLayout& layout);
  uint64_t num_elements() const { return layout_.num_elements; }
  const ChunkLayout& layout() const { return layout_; }
  // The bytes of `which`: num_elements() values of layout().StateDType(which)
  // (for 8-bit blocks: the n codes, followed by the block scales).
  std::byte* state(ChunkState which) const { return bytes_ + layout_.StateOffset(which); }
  // The fp32 block scales of m or v with 8-bit blocks (one per
  // kMomentBlockElements elements); null for other moments dtypes.
  float* moment_scales(ChunkState which) const;
  float* master() const { return reinterpret_cast<float*>(state(ChunkState::kMaster)); }
  // m and v, in layout().moments_dtype.
  std::byte* exp_avg() const { return state(ChunkState::kExpAvg); }
  std::byte* exp_avg_sq() const { return state(ChunkState::kExpAvgSq); }
  // The working weights (weights_bytes() bytes of weights_dtype()), or null
  // for a chunk that does not store them.
  std::byte* weights() const { return weights_offset_ == 0 ? nullptr : bytes_ + weights_offset_; }
  uint64_t weights_bytes() const { return weights_bytes_; }
  std::byte* bytes() const { return bytes_; }

 private:
  std::byte* bytes_;
  ChunkLayout layout_;
  uint64_t weights_offset_ = 0;  // 0: no weights (they never start at 0)
  uint64_t weights_bytes_ = 0;
};

}  // namespace fuyou
