// StepTransaction: the running step (committed_step() + 1) of one job.
//
// Begin stages a chunk's update: it takes the chunk's committed states, pinned
// (CommittedReader::Acquire, states only) and marks them as this step's update;
// the caller (the session) runs the kernel on StagedUpdate::states() in its own
// thread and hands the update back with Submit, which writes the new states to
// the chunk's shadow extent asynchronously (in a step that is durable, see
// DurabilityPolicy) or keeps them pinned in DRAM (one that is not). The
// write-back's result is a Future of the checksums of what it wrote, computed
// when it completes. Commit makes every staged chunk's shadow the committed
// extent in one manifest commit (JobEdit: ShadowWritten, SetUpdateCount or
// SetSegmentUpdateCounts, SetCommittedStep); RollBack and RollBackChunk drop
// staged updates. The committed extents are never written during a step, so
// a roll-back needs no I/O.
//
// A durable step's commit is applied at once (the acknowledged manifest names
// the new extents, the cache holds the new states as committed) and, with
// `background`, made durable on a thread of its own (BackgroundCommit) while
// the next step runs: FinishCommit waits for it, and whatever writes a shadow
// extent or commits again (the next step's first Begin, Commit, CommitDurable)
// calls it first, since the applied step's shadows are the extents the durable
// manifest still names. Each write-back, once done, starts a data sync of the
// state files (StateFile::SyncAsync); the commit waits for those before its
// final fdatasync, which then finds little left to flush.
//
// Crash points (common/crash_point.h): writeback_submitted (after a
// write-back's submission), writeback_completed (in its completion),
// durable_commit_pending_written (pending states written, before the commit),
// and BackgroundCommit's.
//
// Not thread-safe (the store's calls are serialised); write-back completions
// run on the I/O threads and touch only their own Future, the pin they write
// from and the counters.
#pragma once

#include <cstdint>
#include <map>
#include <vector>

#include "absl/status/statusor.h"
#include "common/future.h"
#include "jobs/chunk_layout.h"
#include "state/background_commit.h"
#include "state/durability_policy.h"
#include "state/learned_order.h"
#include "state/store_context.h"

namespace fuyou {

class StepTransaction;

// One chunk's update of the step, between Begin and Submit: the caller changes
// states() in place (master, m, v, and the working weights of a chunk that
// stores them). Move-only. Dropped without Submit, the update is rolled back
// (as RollBackChunk, without I/O to wait for).
class StagedUpdate {
 public:
  StagedUpdate(StagedUpdate&& other) noexcept;
  StagedUpdate& operator=(StagedUpdate&&) = delete;
  StagedUpdate(const StagedUpdate&) = delete;
  ~StagedUpdate();

  uint32_t chunk_id() const { return chunk_id_; }
  // The chunk's states in DRAM, for the kernel.
  const ChunkStates& states() const { return states_; }

 private:
  friend class StepTransaction;
  StagedUpdate(StepTransaction* step, uint32_t chunk_id, ChunkStates states)
      : step_(step), chunk_id_(chunk_id), states_(states) {}

  StepTransaction* step_;  // null once submitted or moved from
  uint32_t chunk_id_;
  ChunkStates states_;
};

class StepTransaction {
 public:
  StepTransaction(StoreContext& context, DurabilityPolicy& durability, LearnedOrder order);
  // Waits for the write-backs in flight.
  ~StepTransaction();
  StepTransaction(const StepTransaction&) = delete;
  StepTransaction& operator=(const StepTransaction&) = delete;

  // Stages the update of `record`'s chunk on `states`, its committed states
  // pinned; `undo` is the copy of a pending chunk's acknowledged states
  // (DurabilityPolicy::TakeUndo), else empty. Precondition: not staged.
  StagedUpdate Begin(const v1::ChunkRecord& record, StatePin states, StatePin undo);
  // Submits the filled `update` (see ChunkStore::SubmitUpdate for the counts).
  void Submit(StagedUpdate update, std::vector<int64_t> segment_update_counts);

  bool IsStaged(uint32_t chunk_id) const { return staged_.count(chunk_id) != 0; }
  size_t staged_count() const { return staged_.size(); }
  // The undo copy of a staged pending chunk, or null.
  const StatePin* Undo(uint32_t chunk_id) const;
  // The first failed write-back of this step (in submission order), or OK; it
  // stays until the step ends.
  absl::Status StepError() const;
  // Waits until every write-back of this step completed; returns StepError().
  absl::Status WaitForWriteBacks() const;
  // Bytes of the staged chunks' write-backs still in flight (their buffers
  // stay pinned until they complete); never waits.
  uint64_t WriteBackBytesInFlight() const;
  // Drops the chunk's staged update after its write-back finished.
  // FAILED_PRECONDITION when it is not staged.
  absl::Status RollBackChunk(uint32_t chunk_id);
  // Commits the step as `step` (see ChunkStore::CommitStep, and ApplyStep for
  // `background`); rolls it back on an error.
  absl::StatusOr<uint32_t> Commit(int64_t step, bool background = false);
  // The durable commit of `next` (the acknowledged manifest: counts, step)
  // with the staged chunks' write-backs and the pending chunks' states:
  // synchronous (on an error nothing is applied), or applied now and made
  // durable in the background. Preconditions: the write-backs completed,
  // FinishCommit() returned OK.
  absl::Status CommitDurable(const v1::JobManifest& next, bool background = false);
  // Waits for the background commit, if one is pending. Its error (or an
  // earlier one) stays: the applied step is dropped from the cache and the
  // acknowledged manifest is the durable one again; every later call of the
  // store that needs the commit returns the error (the session must end).
  absl::Status FinishCommit();
  // Without waiting: the failure of the background commit once it is known
  // (collected as FinishCommit does), else OK.
  absl::Status PollCommit();
  // True while a background commit runs or waits to be collected.
  bool commit_pending() const { return commit_.pending(); }
  // The background commit's step and result (BackgroundCommit::step, result);
  // precondition: commit_pending().
  int64_t commit_step() const { return commit_.step(); }
  Future<void> commit_result() const { return commit_.result(); }
  // Drops every staged update and the step's error (waits for the write-backs).
  void RollBack();

  // The learned order of arrivals (read ahead along it).
  LearnedOrder& order() { return order_; }

 private:
  friend class StagedUpdate;
  struct Staged {
    StatePin states;  // between Begin and Submit: the update being filled
    Future<ChunkChecksums> write;  // the write-back (ready with {} when kept in DRAM)
    std::vector<int64_t> segment_update_counts{};
    StatePin kept;  // a step that is not durable: the update, kept in DRAM, not written
    StatePin undo;  // a pending chunk: a copy of its acknowledged states, for a roll-back
  };
  // Drops a staged update: a pending chunk gets its acknowledged states back
  // from the undo copy, any other is forgotten (its committed extent holds them).
  void Unstage(uint32_t chunk_id, Staged& staged);
  // A StagedUpdate dropped without Submit.
  void Abandon(uint32_t chunk_id);
  // A durable commit applied: `changed` chunks' committed extents are those of
  // `manifest`, now the acknowledged one; the pending states are durable.
  void Applied(const std::vector<uint32_t>& changed, const v1::JobManifest& manifest);

  StoreContext& context_;
  DurabilityPolicy& durability_;
  LearnedOrder order_;
  std::map<uint32_t, Staged> staged_;       // this step's updates
  std::vector<Future<ChunkChecksums>> writes_;  // this step's write-backs, rolled back ones too
  std::vector<storage::IoFuture> syncs_;        // their data syncs, started as each write-back completed
  BackgroundCommit commit_;                     // the last step's durable commit, when running
  absl::Status commit_failure_;                 // a background commit that failed: the store is done
};

}  // namespace fuyou
