// WeightsReader: the committed working weights of chunks that store them
// (Registration.store_weights, issue 12), fetched and read ahead.
//
// Fetch serves the weights of the last acknowledged step (committed_step()),
// also while the running step has the chunk staged (its states entry then
// holds the uncommitted update):
//   1. from DRAM when an entry holds them: the chunk's committed states (only
//      an entry whose weights are valid, never one loaded states-only for an
//      update), its pending states or undo copy (DurabilityPolicy), or a
//      weights-only entry (CacheSpace::kWeights, a read-ahead done or in
//      flight);
//   2. else it reads only the weights region of the committed extent (never
//      master, m or v) into a weights-only entry, verified against
//      StateExtent.weights_checksum.
// Then it reads ahead the next fetches of the order learned from the last step
// (FetchOrder), weights only, into entries made without waiting for budget and
// without evicting pinned entries; each is verified when its read completes.
// Weights-only entries are dropped by whoever changes a committed extent (the
// step's commit, an import's) and when the store closes.
//
// Not thread-safe (the store's calls are serialised); read completions run on
// the I/O threads and touch only the cache and the counters.
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include "absl/status/statusor.h"
#include "common/future.h"
#include "state/durability_policy.h"
#include "state/fetch_order.h"
#include "state/step_transaction.h"
#include "state/store_context.h"

namespace fuyou {

// Where a fetch found the weights.
struct FetchSource {
  // True: from DRAM (the chunk's cached states, its pending or undo copy, or
  // a read-ahead that had finished or was in flight). False: read now.
  bool from_dram = false;
  // Bytes this fetch read from storage (the weights region, a block
  // multiple); 0 from DRAM. Read-aheads it started are not included.
  uint64_t bytes_read = 0;
};

class WeightsReader {
 public:
  WeightsReader(StoreContext& context, const StepTransaction& step, const DurabilityPolicy& durability)
      : context_(context), step_(step), durability_(durability) {}
  // WaitForReads().
  ~WeightsReader() { WaitForReads(); }
  WeightsReader(const WeightsReader&) = delete;
  WeightsReader& operator=(const WeightsReader&) = delete;

  // See ChunkStore::FetchWeights.
  absl::StatusOr<FetchSource> Fetch(uint32_t chunk_id, std::span<std::byte> out);
  // Reads the weights of `chunk_ids` ahead, weights only.
  void ReadAhead(const std::vector<uint32_t>& chunk_ids);
  // The step ended (committed or rolled back): its fetches are the next prediction.
  void StepEnded() { order_.StepEnded(); }
  const FetchOrder& order() const { return order_; }
  // Waits for every read-ahead in flight.
  void WaitForReads() { in_flight_.WaitAll().IgnoreError(); }

 private:
  // Copies the committed weights of `record` from DRAM into `out` when an
  // entry holds them; false when none does.
  bool CopyFromDram(const v1::ChunkRecord& record, std::span<std::byte> out);
  // True when DRAM holds, or a read in flight will hold, the committed weights
  // of `record`; never waits.
  bool InDram(const v1::ChunkRecord& record) const;
  // Reads the weights region of `record`'s committed extent into a new
  // weights-only entry and copies it to `out`; `source` gets the bytes read.
  absl::Status ReadNow(const v1::ChunkRecord& record, std::span<std::byte> out, FetchSource& source);

  StoreContext& context_;
  const StepTransaction& step_;
  const DurabilityPolicy& durability_;
  FetchOrder order_;
  InFlight in_flight_;  // read-aheads
};

}  // namespace fuyou
