// ChunkStore: one job's chunk states across DRAM and storage, for one session.
//
// The layer between the stream protocol (session/) and the job's files
// (jobs/): a facade over parts with one idea each, which share a StoreContext
// (the job, its cache spaces, the counters, the acknowledged manifest):
//   - CommittedReader (committed_reader.h): acquiring a chunk's committed
//     states (DRAM, a prefetch in flight, or read and verified) and prefetching
//     the next chunks in the learned order;
//   - StepTransaction (step_transaction.h): the step. BeginUpdate gives a
//     StagedUpdate whose states the session updates (it runs the kernel), and
//     SubmitUpdate writes them back to the chunk's shadow extent; CommitStep
//     makes the shadows committed in one JobEdit, RollBackStep and
//     RollBackChunk drop staged updates;
//   - DurabilityPolicy (durability_policy.h): which steps are durable
//     ([durability] commit_every_steps, commit_every_seconds), the pending
//     states of the others and their undo copies. committed_step() is the last
//     acknowledged step, durable_step() the one a restart resumes at;
//   - StateImport (state_import.h): export, and the pending import;
//   - WeightsReader (weights_reader.h): the committed working weights of
//     chunks that store them, fetched and read ahead (FetchOrder);
//   - registration (chunk_registration.h).
// The byte layout of a chunk's states is ChunkStates (jobs/chunk_layout.h).
//
// Errors are returned, never thrown; a call that fails changes nothing unless
// its contract says what it dropped. ABORTED from a commit (CommitStep,
// CommitImport, Register, MakeDurable) means the manifest was replaced but is
// not known to be durable: the caller must stop using the job.
//
// Threading: calls are serialised by the caller (Session holds its lock); I/O
// completions run on the storage engine's threads and touch only their own
// Futures, pins and counters. The Job, cache and counters outlive the store;
// Close (or the destructor) waits for all I/O.
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include "absl/status/statusor.h"
#include "jobs/chunk_layout.h"
#include "jobs/job.h"
#include "state/chunk_registration.h"
#include "state/committed_reader.h"
#include "state/durability_policy.h"
#include "state/state_import.h"
#include "state/step_transaction.h"
#include "state/store_context.h"
#include "state/weights_reader.h"

namespace fuyou {

class ChunkStore {
 public:
  using Registration = ChunkRegistration;
  using Registered = ChunkRegistered;
  using FetchSource = fuyou::FetchSource;

  // `prefetch_window`: at most how many chunks after the one being updated are
  // read ahead; within it the DRAM window decides (StoreContext::ReadAheadBytes:
  // the budget less the holds and this store's write-backs in flight).
  ChunkStore(Job& job, StateCache& cache, StoreCounters counters, unsigned prefetch_window,
             DurabilityInterval durability = {});
  // Close().
  ~ChunkStore();
  ChunkStore(const ChunkStore&) = delete;
  ChunkStore& operator=(const ChunkStore&) = delete;

  // ---- The committed job.
  int64_t committed_step() const { return context_.acknowledged.committed_step(); }
  int64_t durable_step() const { return context_.job.manifest().committed_step(); }
  // Makes the acknowledged steps durable (a no-op when committed_step() is):
  // waits for a background commit (WaitForCommit), writes every pending
  // chunk's states to its shadow extent and commits the manifest.
  // FAILED_PRECONDITION while a chunk is staged. On an error nothing is
  // committed and the pending states stay in DRAM.
  absl::Status MakeDurable();
  // ---- The background commit of the last step applied (ApplyStep).
  // Waits for it (OK when none runs): durable_step() is then the applied step.
  // A commit that failed (its step acknowledged, not durable) stays the
  // store's error: the cache forgets the step, committed_step() is
  // durable_step() again, and BeginUpdate, CommitStep, ApplyStep, MakeDurable,
  // Register, ImportState and CommitImport return it; the caller must end the
  // session (the job resumes at durable_step()).
  absl::Status WaitForCommit() { return step_.FinishCommit(); }
  // Without waiting: that error once the commit is known to have failed, else OK.
  absl::Status PollCommit() { return step_.PollCommit(); }
  bool commit_pending() const { return step_.commit_pending(); }
  // The durable step once step `step` (<= committed_step(), checked by the
  // caller) is durable, without waiting here: ready at once when
  // durable_step() >= step; the running background commit's step when that
  // commit makes `step` durable (set on the commit's thread when it ends,
  // before WaitForCommit adopts it; its error, naming the job and `step`,
  // when it failed: ABORTED too, as the step is then not known durable); a
  // step acknowledged only (DurabilityPolicy) is made durable now
  // (MakeDurable, synchronously: its error, FAILED_PRECONDITION while a chunk
  // is staged). The store's error when a commit failed before.
  Future<int64_t> WhenDurable(int64_t step);
  // Chunks the job has on storage (registered in any session).
  uint32_t chunk_count() const { return static_cast<uint32_t>(context_.job.manifest().chunks_size()); }
  // The record of `chunk_id` as of committed_step() (sizes, dtypes, update
  // count, extents; the extents and versions are the durable ones), or null.
  const v1::ChunkRecord* Find(uint32_t chunk_id) const { return context_.Find(chunk_id); }

  // ---- Registration. Registers `chunks` (validated by the caller) after
  // making the acknowledged steps durable: new chunks get extents and initial
  // states, resumed chunks give their committed weights back into
  // `Registration::weights`; one manifest commit, all or nothing.
  // RESOURCE_EXHAUSTED over `job_quota_bytes` (0 = unlimited), refused by
  // `budget` when given (the per-user storage limit and the free space kept),
  // or the storage full;
  // FAILED_PRECONDITION (before anything) for a resumed chunk that changes
  // store_weights, or its param_dtype while storing weights.
  absl::StatusOr<std::vector<Registered>> Register(std::span<const Registration> chunks, uint64_t job_quota_bytes,
                                                   StorageBudget* budget = nullptr);

  // ---- The step (committed_step() + 1).
  // Stages chunk `chunk_id`'s update, first waiting for the previous step's
  // background commit (its write-back goes to an extent that commit frees):
  // pins its committed states (the states
  // region only for a chunk that stores weights; DATA_LOSS on a checksum
  // mismatch) and returns them for the caller to update in place (for a chunk
  // that stores working weights, the new weights go to ChunkStates::weights()).
  // Preconditions: the chunk exists, is not staged in this step, has fewer than
  // kMaxUpdateCount updates, and no import is pending. On an error nothing is
  // staged. Dropping the StagedUpdate without SubmitUpdate rolls it back.
  absl::StatusOr<StagedUpdate> BeginUpdate(uint32_t chunk_id);
  // Submits the updated states: their write-back to the chunk's shadow extent
  // starts and this returns without waiting for it (StepError until CommitStep
  // collects it), after starting prefetches of the chunks predicted next.
  // `segment_update_counts`: the chunk's per-segment update counts after this
  // step (from Find(chunk_id)->segment_update_counts()); empty means every
  // segment's count goes up by one. Crash points: writeback_submitted,
  // writeback_completed.
  void SubmitUpdate(StagedUpdate update, std::vector<int64_t> segment_update_counts = {});
  bool IsStaged(uint32_t chunk_id) const { return step_.IsStaged(chunk_id); }
  size_t staged_count() const { return step_.staged_count(); }
  // The first failed write-back of this step, or OK; it stays until the step
  // rolls back (RollBackChunk does not clear it).
  absl::Status StepError() const { return step_.StepError(); }
  // Waits until every read and write-back in flight completed; returns StepError().
  absl::Status WaitForWriteBacks();
  // Drops chunk `chunk_id`'s staged update (a redo) once its write-back
  // finished; staging it again starts from its committed states.
  // FAILED_PRECONDITION when the chunk is not staged; nothing changes then.
  absl::Status RollBackChunk(uint32_t chunk_id) { return step_.RollBackChunk(chunk_id); }
  // Commits the step as `step` (== committed_step() + 1, checked by the
  // caller): durably (the write-backs and the pending chunks' states in one
  // manifest commit) or acknowledged only (see DurabilityPolicy); the step's
  // arrivals become the learned order and the next step's first chunks are
  // prefetched. Returns the number of chunks committed. On a failed
  // write-back or commit the step is rolled back and the error returned.
  absl::StatusOr<uint32_t> CommitStep(int64_t step);
  // As CommitStep, but a durable step returns once it is applied: its states
  // are committed_step()'s (what the next step reads, exports and fetches),
  // while the manifest's write and the syncs run on a thread of their own
  // (BackgroundCommit); durable_step() moves at WaitForCommit. An error of
  // that commit is the store's (see WaitForCommit). A step acknowledged only
  // (DurabilityPolicy) is as with CommitStep.
  absl::StatusOr<uint32_t> ApplyStep(int64_t step);
  // Drops every staged update and the step's error (waits for the I/O).
  void RollBackStep();

  // ---- Export and import, between steps (no chunk staged): see StateImport.
  absl::Status ExportState(uint32_t chunk_id, ChunkState which, uint64_t first, std::span<float> out) {
    return import_.Export(chunk_id, which, first, out);
  }
  // Makes the acknowledged steps durable, then writes the chunk's new states
  // to its shadow extent; on a failed write the whole pending import is dropped.
  absl::Status ImportState(uint32_t chunk_id, ChunkState which, uint64_t first, std::span<const float> values);
  void ImportUpdateCount(uint32_t chunk_id, int64_t update_count, std::vector<int64_t> segment_update_counts = {}) {
    import_.ImportUpdateCount(chunk_id, update_count, std::move(segment_update_counts));
  }
  bool HasPendingImport(uint32_t chunk_id) const { return import_.HasPending(chunk_id); }
  size_t pending_imports() const { return import_.pending(); }
  // One manifest commit keeping the committed step, or setting it to
  // `resume_step` (the caller checked that no step was committed yet); the
  // number of chunks changed (0, and nothing written, when none is pending and
  // no step is set). On an error the import is dropped.
  absl::StatusOr<uint32_t> CommitImport(std::optional<int64_t> resume_step = std::nullopt);
  void DropImport() { import_.Drop(); }

  // ---- Working weights (chunks registered with store_weights): the weights
  // of committed_step() into `out` (see WeightsReader), then reads the next
  // predicted fetches ahead. FAILED_PRECONDITION for a chunk that does not
  // exist or store weights, INVALID_ARGUMENT for a wrong `out` size, DATA_LOSS
  // when the weights read fail their checksum; none changes anything.
  absl::StatusOr<FetchSource> FetchWeights(uint32_t chunk_id, std::span<std::byte> out) {
    return weights_.Fetch(chunk_id, out);
  }
  const FetchOrder& fetch_order() const { return weights_.order(); }

  // Waits for every read and write in flight, rolls the step back, waits for
  // the background commit and makes the acknowledged steps durable, drops a
  // pending import and demotes the job's
  // cached states (evicted first, kept for a quick resume). Idempotent; the
  // store is unusable afterwards.
  void Close();

 private:
  // Waits for the prefetches and read-aheads in flight.
  void WaitForReads();
  absl::StatusOr<uint32_t> EndStep(int64_t step, bool background);
  // Prefetches the committed states of `chunk_ids` not staged in this step,
  // as far as the DRAM window allows (StoreContext::ReadAheadBytes).
  void Prefetch(const std::vector<uint32_t>& chunk_ids);
  // Tells the cache the learned order (StateCache::SetOrder) after it may have
  // changed: at the start, after a registration, a step's end or roll-back.
  void PublishOrder();

  StoreContext context_;
  DurabilityPolicy durability_;
  StepTransaction step_;
  CommittedReader reader_;
  WeightsReader weights_;
  StateImport import_;
  bool closed_ = false;
};

}  // namespace fuyou
