// ChunkLayout: which states a chunk holds and where each lies in its bytes.
//
// The one definition of a chunk's state layout, used by the extents on storage
// (jobs/), the buffers in DRAM (state/) and the kernel's view of them. Today a
// chunk of n elements holds three fp32 states, one after the other:
//   [master: 4n bytes][exp_avg (m): 4n bytes][exp_avg_sq (v): 4n bytes][padding]
// the payload (checksummed) is the states, the extent is the payload rounded up
// to a block. A further state (e.g. working weights) is added here, in
// ChunkState and kChunkStateCount, and every size follows.
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>

namespace fuyou {

// The states of a chunk, in the order they lie in its bytes. The values equal
// v1::StateKind - STATE_MASTER (offload.proto), which ReadState/WriteState name.
enum class ChunkState : int {
  kMaster = 0,    // fp32 master weights
  kExpAvg = 1,    // Adam's m
  kExpAvgSq = 2,  // Adam's v
};
inline constexpr int kChunkStateCount = 3;
// Bytes of one element of one state (fp32).
inline constexpr uint64_t kStateElementBytes = 4;

// The most elements a chunk may have. Far above what any slot or DRAM budget
// admits (a chunk must also fit its slot and half the DRAM budget), and low
// enough that every size derived from it (the payload, rounded up to a block,
// two extents) fits in uint64_t. Client input is capped with it before it is
// multiplied; so are manifests read from disk (ValidateManifest).
inline constexpr uint64_t kMaxChunkElements = uint64_t{1} << 48;

// Bytes that hold data (and are checksummed): kChunkStateCount * 4 * n; nullopt
// when n > kMaxChunkElements (computed in checked arithmetic).
std::optional<uint64_t> ChunkPayloadBytes(uint64_t num_elements);
// Bytes of one extent (and one DRAM buffer) for a chunk of n elements: the
// payload padded to a storage block. nullopt when n > kMaxChunkElements.
std::optional<uint64_t> ChunkStateBytes(uint64_t num_elements);
// The checksum an extent carries: XXH3-64 of the payload of `states`.
// Precondition: num_elements <= kMaxChunkElements and `states` holds
// ChunkPayloadBytes(num_elements) bytes.
uint64_t ChunkPayloadChecksum(const std::byte* states, uint64_t num_elements);

// Byte offset of `state` in the buffer of a chunk of n elements.
// Precondition: n <= kMaxChunkElements.
constexpr uint64_t StateOffset(ChunkState state, uint64_t num_elements) {
  return static_cast<uint64_t>(state) * num_elements * kStateElementBytes;
}

// A chunk's states in one buffer (ChunkStateBytes(n) bytes), as the kernel and
// import/export see them. Does not own the bytes.
class ChunkStates {
 public:
  ChunkStates(std::byte* bytes, uint64_t num_elements) : bytes_(bytes), n_(num_elements) {}
  uint64_t num_elements() const { return n_; }
  float* state(ChunkState which) const { return reinterpret_cast<float*>(bytes_ + StateOffset(which, n_)); }
  float* master() const { return state(ChunkState::kMaster); }
  float* exp_avg() const { return state(ChunkState::kExpAvg); }
  float* exp_avg_sq() const { return state(ChunkState::kExpAvgSq); }
  std::byte* bytes() const { return bytes_; }

 private:
  std::byte* bytes_;
  uint64_t n_;
};

}  // namespace fuyou
