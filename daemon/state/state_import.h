// StateImport: export of committed states, and the pending import of states
// and update counts, made durable by one Commit (a checkpoint load).
//
// ImportState writes a chunk's whole new states to its shadow extent at once
// (synchronously); the committed extents are never touched, so dropping the
// import needs no I/O. Commit points the changed chunks at their shadows and
// sets the imported counts in one manifest commit that keeps the committed
// step. Between steps only (no chunk staged, checked by the caller), and after
// the acknowledged steps were made durable (the caller's MakeDurable).
//
// Not thread-safe (the store's calls are serialised).
#pragma once

#include <cstdint>
#include <map>
#include <optional>
#include <span>
#include <vector>

#include "absl/status/statusor.h"
#include "jobs/chunk_layout.h"
#include "state/committed_reader.h"
#include "state/durability_policy.h"
#include "state/store_context.h"

namespace fuyou {

class StateImport {
 public:
  StateImport(StoreContext& context, CommittedReader& reader, const DurabilityPolicy& durability)
      : context_(context), reader_(reader), durability_(durability) {}

  // See ChunkStore::ExportState.
  absl::Status Export(uint32_t chunk_id, ChunkState which, uint64_t first, std::span<float> out);
  // See ChunkStore::ImportState (the caller made the job durable first).
  absl::Status Import(uint32_t chunk_id, ChunkState which, uint64_t first, std::span<const float> values);
  // See ChunkStore::ImportUpdateCount.
  void ImportUpdateCount(uint32_t chunk_id, int64_t update_count, std::vector<int64_t> segment_update_counts);
  bool HasPending(uint32_t chunk_id) const { return imported_.count(chunk_id) != 0; }
  size_t pending() const { return imported_.size(); }
  // Commits the pending import (see ChunkStore::CommitImport), with the job's
  // committed step set to `resume_step` when given; drops it on an error.
  absl::StatusOr<uint32_t> Commit(std::optional<int64_t> resume_step = std::nullopt);
  // Forgets the pending import: the committed states were never touched.
  void Drop();

 private:
  struct Imported {
    bool states_written = false;  // the shadow extent holds new states
    ChunkChecksums checksums;
    std::optional<int64_t> update_count;
    std::vector<int64_t> segment_update_counts{};  // empty: every segment at update_count
  };
  // The states of a chunk with pending import writes, pinned (cache or shadow extent).
  absl::StatusOr<StatePin> AcquireImported(const v1::ChunkRecord& record, const Imported& imported);

  StoreContext& context_;
  CommittedReader& reader_;
  const DurabilityPolicy& durability_;
  std::map<uint32_t, Imported> imported_;  // the pending import, until Commit
};

}  // namespace fuyou
