// CommittedReader: a job's committed chunk states, acquired and verified.
//
// Acquire gives a chunk's committed states pinned in DRAM: a StateCache hit
// (CacheSpace::kStates), a prefetch already in flight, or a read of the
// committed extent verified against its checksums. For an update (and the
// prefetch for it) of a chunk that stores working weights only the states
// region (master|m|v, WeightsOffset bytes) is read and checked
// (StateExtent.checksum): the update writes the whole weights region, so a step
// reads the weights only for its forward and backward fetches. Such an entry's
// weights are not valid (StatePin::weights_valid) until the update ran, and an
// acquire of the whole states (registration, import, export) reads its weights
// region first.
//
// A pending chunk (DurabilityPolicy: acknowledged states not yet durable) has
// its states in DRAM only, tagged as its shadow; the caller says which chunk is.
//
// Prefetch reads chunks ahead without waiting; the reads are in flight until
// WaitForReads (Close waits for them).
//
// Not thread-safe (the store's calls are serialised); the read completions run
// on the I/O threads and touch only the cache and the counters.
#pragma once

#include <cstdint>
#include <functional>
#include <vector>

#include "absl/status/statusor.h"
#include "common/future.h"
#include "jobs/chunk_layout.h"
#include "state/store_context.h"

namespace fuyou {

// Checks of bytes read from `extent`, each DATA_LOSS naming the job, chunk,
// file and offset on a mismatch. Safe on an I/O completion thread.
// The states region at `states` (master|m|v) against StateExtent.checksum.
absl::Status VerifyStates(Job& job, const std::byte* states, uint32_t chunk_id, const ChunkLayout& layout,
                          const v1::StateExtent& extent);
// The weights region at `weights` against StateExtent.weights_checksum.
absl::Status VerifyWeights(Job& job, const std::byte* weights, uint32_t chunk_id, const ChunkLayout& layout,
                           const v1::StateExtent& extent);

class CommittedReader {
 public:
  explicit CommittedReader(StoreContext& context) : context_(context) {}
  // WaitForReads().
  ~CommittedReader();
  CommittedReader(const CommittedReader&) = delete;
  CommittedReader& operator=(const CommittedReader&) = delete;

  // The committed states of `record`, pinned. `pending`: the chunk's states are
  // its acknowledged ones, in DRAM only (INTERNAL when they are not there).
  // `states_only` (for an update): a chunk that stores weights read from
  // storage reads only its states region, and its entry is marked as not
  // holding the weights; otherwise the whole extent, and a states-only entry
  // found in DRAM gets its weights region read and verified first. Counts a
  // cache hit or miss. DATA_LOSS on a checksum mismatch, the I/O error else.
  absl::StatusOr<StatePin> Acquire(const v1::ChunkRecord& record, bool pending, bool states_only = false);
  // Reads the committed states of `chunk_ids` (the predicted order) ahead for
  // their updates (the states region only for chunks that store weights), into
  // entries made without waiting for budget, evicting only what StateCache's
  // prefetch rule allows (never a pinned entry, an unused prefetch, the
  // resident prefix or an entry needed before the chunk read); each is
  // verified when its read completes.
  // Skips unknown chunks, chunks `skip` says, and chunks already in DRAM. The
  // chunks taken, in order, have at most `window_bytes` of states together
  // (those already in DRAM or skipped count too: they are ahead of the update
  // as well; see StoreContext::ReadAheadBytes); it stops at the first beyond
  // the window and at the first that gets no budget now, so that the reads
  // follow the prediction's order.
  void Prefetch(const std::vector<uint32_t>& chunk_ids, const std::function<bool(uint32_t)>& skip,
                uint64_t window_bytes = UINT64_MAX);
  // Waits for every prefetch in flight.
  void WaitForReads() { in_flight_.WaitAll().IgnoreError(); }

 private:
  // Reads the committed weights region of `record` into the pinned states-only
  // entry `pin`, verifies it and marks the entry whole.
  absl::Status ReadStoredWeights(const StatePin& pin, const v1::ChunkRecord& record);

  StoreContext& context_;
  InFlight in_flight_;  // prefetches
};

// OK when `pin` holds what a read of `extent` brought in (VerifyStates, and
// VerifyWeights of a chunk that stores them unless the read was `states_only`:
// then what follows the states is zeroed, see StatePin::weights_valid).
absl::Status CheckRead(Job& job, const StatePin& pin, uint32_t chunk_id, const ChunkLayout& layout,
                       const v1::StateExtent& extent, bool states_only);

}  // namespace fuyou
