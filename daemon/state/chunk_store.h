// ChunkStore: one job's chunk states across DRAM and storage, for one session.
//
// The layer between the stream protocol (session/) and the job's files
// (jobs/). It owns:
//   - acquiring a chunk's committed states: from the DRAM tier (StateCache), a
//     prefetch already in flight, or read from the committed extent and
//     verified against its checksum. For an update (and the prefetch for it)
//     of a chunk that stores working weights, only the states region
//     (master|m|v, WeightsOffset bytes) is read and checked (StateExtent.
//     checksum): the update writes the whole weights region, so a step reads
//     the weights only for its forward and backward fetches. Such an entry's
//     weights are not valid (StatePin::weights_valid) until the update ran;
//     FetchWeights never serves from it, and acquiring the whole states
//     (registration, import, export) reads its weights region first;
//   - prefetching the next chunks in the learned order (LearnedOrder);
//   - the step: StageUpdate runs the caller's update (the kernel) on a chunk's
//     committed states in DRAM, then writes the result to the chunk's shadow
//     extent asynchronously; the store owns that in-flight I/O, its checksums
//     (computed when the write completes) and its errors. CommitStep makes
//     every staged chunk's shadow the committed extent in one manifest commit
//     (JobEdit); RollBackStep and RollBackChunk drop staged updates. The
//     committed extents are never written during a step, so a roll-back needs
//     no I/O: the committed states are read again when next needed;
//   - registration of chunks (new chunks' initial states, adopted dtypes and
//     fingerprints) and import (pending state writes and update counts, made
//     durable by one CommitImport);
//   - the working weights of chunks that store them (Registration.store_weights,
//     issue 12): a fourth state after master, m and v in the same extent
//     (jobs/chunk_layout.h), written by the same update, write-back and
//     commit, with a checksum of its own. FetchWeights serves the committed
//     weights from DRAM (an entry whose weights are valid) or reads only their
//     region of the committed extent,
//     and reads the next fetches ahead in the order learned from the last
//     step (FetchOrder), into entries of their own under the same budget.
//
// The durability interval (DurabilityInterval: [durability] commit_every_steps
// N, commit_every_seconds). With N = 1 every CommitStep is durable as above.
// With N > 1 a step is either durable (every Nth, or once the seconds passed)
// or acknowledged only: its updated states stay pinned in DRAM, not written,
// and the manifest (the durable step) is not touched. committed_step() is the
// last acknowledged step, durable_step() the one a restart resumes at; a crash
// loses at most the N-1 acknowledged steps after it. The extents: a chunk's
// committed extent holds the durable states and is never written before the
// next durable commit; the acknowledged states live only in DRAM (a pinned
// entry, "pending"), and the next durable commit writes them to the shadow
// extent (overwriting whatever an older update left there) and flips it. A step
// that updates a pending chunk first copies its acknowledged states (an "undo"
// entry) so that a redo or a roll-back returns to them. Pending states are
// never evicted, so the interval applies only while twice the job's states fit
// in half the DRAM budget (StateCache::TryHold); otherwise every step is
// durable, as with N = 1. MakeDurable (Close, Register, import) commits the
// acknowledged steps. Chunks with working weights take part as any other: a
// pending chunk's acknowledged weights are in its pinned DRAM entry (and in
// the undo copy while the running step updates it), and FetchWeights serves
// them from there, so a fetch always returns the weights of committed_step().
//
// The byte layout of a chunk's states is ChunkStates (jobs/chunk_layout.h).
//
// Errors are returned, never thrown; a call that fails changes nothing unless
// its contract says what it dropped. ABORTED from a commit (CommitStep,
// CommitImport, Register) means the manifest was replaced but is not known to
// be durable: the caller must stop using the job.
//
// Threading: calls are serialised by the caller (Session holds its lock); I/O
// completions run on the storage engine's threads and touch only the store's
// in-flight bookkeeping, under its own mutex. The Job, cache and counters
// outlive the store; Close (or the destructor) waits for all I/O.
#pragma once

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "absl/functional/function_ref.h"
#include "absl/status/statusor.h"
#include "fuyou/dtype.h"
#include "jobs/chunk_layout.h"
#include "jobs/job.h"
#include "jobs/storage_budget.h"
#include "state/fetch_order.h"
#include "state/learned_order.h"
#include "state/state_cache.h"

namespace fuyou {

class DaemonStats;
struct UserCounters;

// What the store counts into: the daemon's counters and the job owner's.
struct StoreCounters {
  DaemonStats& daemon;
  UserCounters& user;
};

// How often a step is made durable (DaemonConfig commit_every_steps/seconds).
struct DurabilityInterval {
  uint32_t every_steps = 1;   // 1: every step
  double every_seconds = 0;   // > 0: also once this long passed since the last durable step
};

class ChunkStore {
 public:
  // `prefetch_window`: how many chunks after the one being updated are read ahead.
  ChunkStore(Job& job, StateCache& cache, StoreCounters counters, unsigned prefetch_window,
             DurabilityInterval durability = {});
  // Close().
  ~ChunkStore();
  ChunkStore(const ChunkStore&) = delete;
  ChunkStore& operator=(const ChunkStore&) = delete;

  // ---- The committed job.
  // The last acknowledged step (CommitStep), durable or not.
  int64_t committed_step() const;
  // The last durable step: what a restart resumes at (<= committed_step()).
  int64_t durable_step() const;
  // Makes the acknowledged steps durable (a no-op when committed_step() is
  // durable): writes every pending chunk's states to its shadow extent and
  // commits the manifest at committed_step(). Precondition: no chunk staged.
  // On an error nothing is committed and the pending states stay in DRAM;
  // ABORTED as for CommitStep.
  absl::Status MakeDurable();
  // Chunks the job has on storage (registered in any session).
  uint32_t chunk_count() const;
  // The record of `chunk_id` as of committed_step() (sizes, dtypes, update
  // count, extents; the extents and versions are the durable ones), or null.
  const v1::ChunkRecord* Find(uint32_t chunk_id) const;

  // ---- Registration.
  struct Registration {
    uint32_t chunk_id = 0;
    uint64_t num_elements = 0;
    DType param_dtype = DType::kFloat32;
    DType grad_dtype = DType::kFloat32;
    uint64_t layout_fingerprint = 0;
    // ChunkSpec.segment_elements as stored (jobs/chunk_segments.h,
    // SegmentsToStore): empty for one segment. A new chunk stores them; a
    // resumed chunk stored without segments adopts them.
    std::vector<uint64_t> segment_elements{};  // {}: may be left out of a designated initializer
    // The chunk's parameters in param_dtype: read for a new chunk (its initial
    // master weights), overwritten with the committed master for a resumed one
    // (with its committed working weights when it stores them).
    std::span<std::byte> weights;
    // ChunkSpec.store_weights: the chunk keeps its working weights (param_dtype)
    // as a fourth state. Fixed at creation: a resumed chunk must send the value
    // it was created with, and one that stores weights its param_dtype.
    bool store_weights = false;
  };
  struct Registered {
    bool resumed = false;
    int64_t update_count = 0;
    // ChunkRecord.segment_update_counts: per segment when they differ, else empty.
    std::vector<int64_t> segment_update_counts{};
  };
  // Registers `chunks` (validated by the caller: sizes, dtypes, fingerprints,
  // no duplicates; a resumed chunk has the stored element count). New chunks
  // get extents reserved, then their initial states (master from `weights`,
  // m = v = 0, and for store_weights the working weights, master converted
  // back to param_dtype, i.e. the slot's values) written to their committed
  // extents; resumed chunks' committed master is converted into `weights` (a
  // chunk that stores weights gets its committed weights copied there), and
  // their dtypes, a missing fingerprint and missing segments are adopted. One
  // manifest commit when anything changed. All or nothing: RESOURCE_EXHAUSTED
  // (over `job_quota_bytes`, 0 = unlimited, refused by `budget` when given: the
  // per-user storage limit and the free space kept, or the storage full) or an I/O
  // error leaves the job as committed, nothing reserved. FAILED_PRECONDITION,
  // before anything is done, for a resumed chunk whose store_weights differs
  // from its stored one, or that stores weights and changes its param_dtype.
  // Results are in the order of `chunks`. Crash points: registration_reserved,
  // registration_states_written, registration_committed.
  absl::StatusOr<std::vector<Registered>> Register(std::span<const Registration> chunks, uint64_t job_quota_bytes,
                                                   StorageBudget* budget = nullptr);

  // ---- The step (committed_step() + 1).
  // Stages chunk `chunk_id`'s update: pins its committed states (cache hit,
  // prefetch, or read and verify: DATA_LOSS on a checksum mismatch), runs
  // `update` on them in this thread (the kernel changes them in place; for a
  // chunk that stores its working weights, `update` must also leave the new
  // weights in ChunkStates::weights(): the session's kernel writes them there
  // and copies them to the slot), then
  // submits their write-back to the chunk's shadow extent and returns without
  // waiting for it, after starting prefetches of the chunks predicted next.
  // The write-back's result is collected by CommitStep (StepError until then);
  // its checksums (states and weights) are computed when it completes.
  // `segment_update_counts`: the chunk's per-segment update counts after this
  // step, one per segment of ChunkRecord.segment_elements (the caller computes
  // them from the committed ones, Find(chunk_id)->segment_update_counts());
  // empty means every segment's count goes up by one.
  // Preconditions: the chunk exists, is not staged in this step, has fewer
  // than kMaxUpdateCount updates, and no import is pending. On an error nothing
  // is staged and `update` did not run. Crash points: writeback_submitted (after
  // the submission), writeback_completed (in the completion).
  absl::Status StageUpdate(uint32_t chunk_id, absl::FunctionRef<void(const ChunkStates&)> update,
                           std::vector<int64_t> segment_update_counts = {});
  bool IsStaged(uint32_t chunk_id) const { return staged_.count(chunk_id) != 0; }
  size_t staged_count() const { return staged_.size(); }
  // The first failed write-back of this step, or OK. It stays until the step
  // rolls back (RollBackChunk does not clear it).
  absl::Status StepError() const;
  // Waits until every write-back of this step completed; returns StepError().
  absl::Status WaitForWriteBacks();
  // Drops chunk `chunk_id`'s staged update of this step (a redo): waits for
  // its write-back to the shadow extent to finish first, so a later write to
  // that extent is never reordered with it, then forgets it. Staging the chunk
  // again starts from its committed states (read again from the committed
  // extent, which was never touched). FAILED_PRECONDITION when the chunk is
  // not staged in this step; nothing changes then.
  absl::Status RollBackChunk(uint32_t chunk_id);
  // Commits the step as `step` (== committed_step() + 1, checked by the
  // caller). A step that is not durable (see the durability interval above)
  // keeps its updated states pinned in DRAM and writes nothing. A durable one
  // waits for the write-backs, writes the pending chunks' states to their
  // shadow extents, then in one manifest commit points
  // every staged chunk at its shadow extent with its checksum, its update
  // count + 1 (or its segments' counts, see StageUpdate) and sets the committed
  // step; the step's arrivals become the learned order and the next step's
  // first chunks are prefetched. Returns the number of chunks committed. On a failed write-back
  // or commit the step is rolled back (RollBackStep) and the error returned.
  absl::StatusOr<uint32_t> CommitStep(int64_t step);
  // Drops every staged update and the step's error (waits for the write-backs).
  void RollBackStep();

  // ---- Export and import, between steps (no chunk staged).
  // Copies `out.size()` fp32 values of state `which` of chunk `chunk_id` from
  // element `first` of its committed states into `out`. Precondition: the range
  // lies in the chunk and the chunk has no pending import.
  absl::Status ExportState(uint32_t chunk_id, ChunkState which, uint64_t first, std::span<float> out);
  // Copies `values` into state `which` of chunk `chunk_id` from element `first`
  // (the chunk's pending import if it has one, else its committed states), and
  // writes the chunk's whole new states to its shadow extent synchronously. A
  // chunk that stores working weights gets them recomputed from its new master
  // (param_dtype, as an update would), so that fetches after CommitImport
  // return the imported weights.
  // Precondition: the range lies in the chunk. On a failed write the whole
  // pending import is dropped and the error returned.
  absl::Status ImportState(uint32_t chunk_id, ChunkState which, uint64_t first, std::span<const float> values);
  // Sets chunk `chunk_id`'s update count as part of the pending import, and its
  // per-segment counts when `segment_update_counts` is not empty (then one per
  // segment, the largest equal to update_count).
  // Precondition: counts in [0, kMaxUpdateCount], checked by the caller.
  void ImportUpdateCount(uint32_t chunk_id, int64_t update_count,
                         std::vector<int64_t> segment_update_counts = {});
  bool HasPendingImport(uint32_t chunk_id) const { return imported_.count(chunk_id) != 0; }
  size_t pending_imports() const { return imported_.size(); }
  // Makes the pending import durable in one manifest commit that keeps the
  // committed step; returns the number of chunks changed (0 when none is
  // pending, and then nothing is written). On an error the import is dropped.
  absl::StatusOr<uint32_t> CommitImport();
  // Forgets the pending import: the committed states were never touched.
  void DropImport();

  // ---- Working weights (chunks registered with store_weights).
  // Where FetchWeights found the weights.
  struct FetchSource {
    // True: from DRAM (the chunk's cached states, its pending or undo copy, or
    // a read-ahead that had finished or was in flight). False: read now.
    bool from_dram = false;
    // Bytes this fetch read from storage (the weights region, a block
    // multiple); 0 from DRAM. Read-aheads it started are not included.
    uint64_t bytes_read = 0;
  };
  // Copies the working weights of chunk `chunk_id` as of committed_step() into
  // `out` (num_elements values of the chunk's param_dtype: out.size() must be
  // RecordLayout(*Find(chunk_id)).WeightsBytes()). Also while the running step
  // has the chunk staged: its DRAM entry then holds the uncommitted update, so
  // the committed weights come from the committed extent (or a weights-only
  // entry read from it). Served from DRAM when an entry holds the committed
  // weights (not a states entry loaded states-only for an update, whose
  // weights region is not valid until the update ran); else reads only the weights region of the committed extent
  // (never master, m or v) into a weights-only cache entry, verified against
  // StateExtent.weights_checksum: DATA_LOSS naming the job, chunk, file and
  // offset when they fail it (nothing is copied then). Then reads the next
  // fetches predicted by the last step's order (FetchOrder) ahead, up to
  // `prefetch_window` of them, weights only, into cache entries that never
  // evict pinned entries and never wait for budget; each is verified when its
  // read completes. Counts the fetch, a DRAM hit and the bytes read (this
  // fetch's and its read-aheads') into StoreCounters (WeightsCounters).
  // Preconditions (checked by the caller, who answers the client): the chunk
  // exists and stores weights; otherwise FAILED_PRECONDITION. INVALID_ARGUMENT
  // when `out` has the wrong size. Neither changes anything. Any step state
  // (between steps, staged chunks, a pending import) is allowed.
  absl::StatusOr<FetchSource> FetchWeights(uint32_t chunk_id, std::span<std::byte> out);
  // The learned order of weight fetches (tests, diagnostics).
  const FetchOrder& fetch_order() const { return fetch_order_; }

  // Waits for every read and write in flight, rolls the step back, drops a
  // pending import and demotes the job's cached states (evicted first, kept for
  // a quick resume). Idempotent; the store is unusable afterwards.
  void Close();

 private:
  // A staged chunk's write-back; guarded by io_mutex_.
  struct WriteBack {
    bool done = false;
    absl::Status status;
    ChunkChecksums checksums;  // of the states (and weights) written, once done and OK
  };
  struct Staged {
    std::shared_ptr<WriteBack> write;
    std::vector<int64_t> segment_update_counts{};
    StatePin kept;  // a step that is not durable: the update, kept in DRAM, not written
    StatePin undo;  // a pending chunk: a copy of its acknowledged states, for a roll-back
  };
  struct Imported {
    bool states_written = false;  // the shadow extent holds new states
    ChunkChecksums checksums;
    std::optional<int64_t> update_count;
    std::vector<int64_t> segment_update_counts{};  // empty: every segment at update_count
  };

  // The committed states of `record`, pinned. `states_only` (for an update,
  // which writes the whole weights region): a chunk that stores weights read
  // from storage reads only its states region (WeightsOffset bytes), verified
  // against StateExtent.checksum alone, and its entry is marked as not holding
  // the weights (StatePin::weights_valid false; FetchWeights never serves from
  // it). Otherwise the whole extent; a states-only entry found in DRAM then
  // gets its weights region read and verified (ReadStoredWeights).
  absl::StatusOr<StatePin> AcquireCommitted(const v1::ChunkRecord& record, bool states_only = false);
  // Reads the committed weights region of `record` into the pinned states-only
  // entry `pin`, verifies it and marks the entry whole.
  absl::Status ReadStoredWeights(const StatePin& pin, const v1::ChunkRecord& record);
  // The states of a chunk with pending import writes, pinned (cache or shadow extent).
  absl::StatusOr<StatePin> AcquireImported(const v1::ChunkRecord& record, const Imported& imported);
  // OK when `pin` holds what a read of `extent` brought in, hashing to the
  // extent's checksums: the states, and the weights of a chunk that stores
  // them unless the read was `states_only` (then what follows the states is
  // zeroed, see StatePin::weights_valid). Else DATA_LOSS naming the job, chunk,
  // file and offset. Safe on an I/O completion thread.
  absl::Status CheckRead(const StatePin& pin, uint32_t chunk_id, const ChunkLayout& layout,
                         const v1::StateExtent& extent, bool states_only) const;
  // The states region alone (master|m|v, StateExtent.checksum), as CheckRead.
  absl::Status VerifyStates(const StatePin& pin, uint32_t chunk_id, const ChunkLayout& layout,
                            const v1::StateExtent& extent) const;
  // The same for the weights region, at byte `at` of `pin` (0: a weights-only
  // entry; WeightsOffset: a states entry).
  absl::Status VerifyWeights(const StatePin& pin, uint32_t chunk_id, const ChunkLayout& layout,
                             const v1::StateExtent& extent, uint64_t at = 0) const;
  // Reads the committed states of `chunk_ids` ahead for their updates: the
  // states region only for chunks that store weights (as AcquireCommitted
  // with states_only).
  void Prefetch(const std::vector<uint32_t>& chunk_ids);
  // Copies the committed weights of `record` from DRAM into `out` when an
  // entry holds them (see FetchWeights); false when none does.
  bool CopyWeightsFromDram(const v1::ChunkRecord& record, std::span<std::byte> out);
  // True when DRAM holds, or a read in flight will hold, the committed weights
  // of `record`; never waits.
  bool WeightsInDram(const v1::ChunkRecord& record) const;
  // Reads the weights of `chunk_ids` ahead (FetchWeights), weights only.
  void ReadWeightsAhead(const std::vector<uint32_t>& chunk_ids);
  // Forgets the weights-only entries of chunks whose committed extent changed.
  void DropWeightsEntries(const std::vector<uint32_t>& chunk_ids);
  // Decides, at a step's first update, whether the step will be durable.
  bool NextStepDurable();
  // Drops a staged update: a pending chunk gets its acknowledged states back
  // from the undo copy, any other is forgotten (its committed extent holds them).
  void Unstage(uint32_t chunk_id, Staged& staged);
  // The durable commit of `next` (the acknowledged manifest: counts, step) with
  // the staged chunks' write-backs and the pending chunks' states.
  absl::Status CommitDurable(const v1::JobManifest& next);
  void ReleaseHold();
  void StartIo();
  void FinishIo();
  void WaitForIo();

  Job& job_;
  StateCache& cache_;
  StoreCounters counters_;
  const unsigned prefetch_window_;
  const std::string job_key_;  // Job::key(): the cache's name of the job
  bool closed_ = false;
  LearnedOrder order_;
  std::map<uint32_t, Staged> staged_;       // this step's updates
  std::map<uint32_t, Imported> imported_;   // the pending import, until CommitImport

  // The durability interval.
  const DurabilityInterval durability_;
  const std::string undo_key_;             // the cache's name of the undo copies
  // Working weights: the cache's name of the weights-only entries (the
  // weights region of a chunk's committed extent, version = that extent's),
  // dropped whenever the chunk's committed extent changes; and the learned
  // order of fetches.
  const std::string weights_key_;
  FetchOrder fetch_order_;
  v1::JobManifest acknowledged_;           // the manifest as of committed_step() (Find)
  std::map<uint32_t, StatePin> pending_;   // acknowledged states not yet durable, pinned
  uint32_t steps_since_durable_ = 0;
  std::chrono::steady_clock::time_point last_durable_;
  bool step_begun_ = false;    // a chunk was staged in this step
  bool step_durable_ = true;   // this step commits durably (decided at its first update)
  uint64_t held_bytes_ = 0;    // StateCache::TryHold reservation

  // In-flight I/O; guarded by io_mutex_, which I/O completions take.
  mutable std::mutex io_mutex_;
  std::condition_variable io_done_;
  int inflight_io_ = 0;
  absl::Status write_error_;
};

}  // namespace fuyou
