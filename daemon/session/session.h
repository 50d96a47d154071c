// Session: one job's training stream on the daemon: the protocol only.
//
// Owns the session's shared-memory segment and its hold on the job. The segment
// arrives after OpenSession (the client creates it and hands it over, see
// session_segment.h): until AdoptSegment, RegisterChunks and Attach are refused
// with FAILED_PRECONDITION, and segment() is null. For each stream message it
// validates the request (treating every field as hostile), calls the job's
// ChunkStore (state/chunk_store.h: states in DRAM and on storage, the step's
// write-backs, commit, roll-back, import) and the AdamW kernel, and replies.
//
// The step: each GradReady stages the chunk's update in the store, the kernel
// runs on the staged states and writes the new weights into the slot, and
// ParamsReady is answered while the store writes the states back to the
// chunk's shadow extent and prefetches the next chunks. EndStep commits the
// step; AbortStep, a failed write-back or the end of the session before EndStep
// roll it back. Between steps, ReadState/WriteState/SetUpdateCount/CommitImport
// export and import states (session_import.cc). At any time, a step in flight
// included, FetchWeights copies a chunk's committed working weights (a chunk
// registered with store_weights) into a slot (session_weights.cc). WaitDurable
// is answered once a committed step is durable: when the store's background
// commit ends, on the commit's thread, without the session's lock (the
// session's other messages, other sessions and the admin API's Info go on
// meanwhile). The checks of every request are in session_checks.cc.
//
// Thread-safe: the stream handler, RegisterChunks and CloseSession may call in
// from different threads; calls are serialised. I/O completions never take the
// session's lock (they run on the storage engine's threads, inside the store).
#pragma once

#include <sys/types.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <string_view>

#include "absl/status/statusor.h"
#include "common/future.h"
#include "fuyou/dtype.h"
#include "fuyou/v1/admin.pb.h"
#include "fuyou/v1/offload.pb.h"
#include "jobs/job.h"
#include "journal/activation_spill.h"
#include "journal/grad_journal.h"
#include "session/session_progress.h"
#include "session/session_segment.h"
#include "state/chunk_store.h"
#include "state/state_cache.h"

namespace fuyou {

class DaemonStats;
class JournalScratch;
class SessionQuota;
class JobRegistry;
namespace optimizer {
class AdamWKernel;
}

// Who a session belongs to: the process at the other end of its connection.
struct ClientIdentity {
  uid_t uid = 0;
  pid_t pid = 0;
};

// The daemon-wide services a session uses; all outlive every session.
struct SessionServices {
  JobRegistry& jobs;
  StateCache& cache;
  optimizer::AdamWKernel& kernel;
  DaemonStats& stats;
  // At most how many chunks ahead of the one being updated are read in
  // advance; within it, as many as the DRAM window holds (the budget less the
  // holds and the store's write-backs in flight: StoreContext::ReadAheadBytes).
  // kDeepestPrefetchWindow lets DRAM decide: a prefetch evicts only what is
  // needed after it and never the resident prefix (StateCache, SetOrder). The
  // default stays kDefaultPrefetchWindow: in the first step, before an order is
  // learned, a deep window read some chunks' states twice under ASan's timing
  // (weights_integration_test, step 1: 141 MiB read against 133).
  unsigned prefetch_window = kDefaultPrefetchWindow;
  // Most bytes one job may reserve on storage; 0 = unlimited.
  uint64_t job_quota_bytes = 0;
  // The per-user storage limit and the free space kept (JobRegistry's), for
  // registrations and the activation scratch; null: none.
  StorageBudget* storage_budget = nullptr;
  // How often a step is made durable ([durability] commit_every_steps/seconds).
  DurabilityInterval durability = {};
  // Where gradient journals beyond the DRAM budget are spilled; null: nowhere
  // (a journal that DRAM cannot hold is refused).
  JournalScratch* journal_scratch = nullptr;
  // Where SpillActivation writes (<root>/activations); null: nowhere (a spill
  // is refused with FAILED_PRECONDITION).
  JournalScratch* activation_scratch = nullptr;
  // The per-user limits the journals are charged to (SessionRegistry sets it);
  // null: no per-user journal limit.
  SessionQuota* quota = nullptr;
};

// Most GradReady.grad_ops in one request.
inline constexpr int kMaxGradOps = 64;

class Session {
 public:
  // `layout` is the segment the client must hand over (AdoptSegment).
  Session(SessionServices services, std::string id, std::shared_ptr<Job> job, SegmentLayout layout,
          ClientIdentity client, std::string client_info);
  // Closes the session if still open.
  ~Session();
  Session(const Session&) = delete;
  Session& operator=(const Session&) = delete;

  const std::string& id() const { return identity_.id; }
  const std::string& job_name() const { return identity_.job_name; }
  uid_t uid() const { return identity_.client.uid; }
  // The segment the client must create: fixed at OpenSession.
  const SegmentLayout& layout() const { return identity_.layout; }
  // True once AdoptSegment has succeeded (also after Close). Lock-free.
  bool has_segment() const { return lifecycle_.has_segment.load(std::memory_order_acquire); }
  int64_t committed_step() const;
  // Chunks the job has on the storage tier (registered in any session).
  uint32_t existing_chunks() const;

  // Takes the client's segment, whose layout must be layout(). FAILED_PRECONDITION
  // when the session is closed or already has a segment (one per session).
  absl::Status AdoptSegment(std::unique_ptr<SessionSegment> segment);

  // The client's stream is attached. FAILED_PRECONDITION when the session is
  // closed, has no segment yet, or already has a stream.
  absl::Status Attach();
  bool attached() const;

  absl::StatusOr<v1::RegisterChunksResponse> RegisterChunks(const v1::RegisterChunksRequest& request);

  // Where the answers of Handle go (OffloadService: the stream's ReplyWriter):
  // called once per message with its answer. `deferred` is false when called
  // on Handle's own thread before it returns, true when called on an I/O
  // completion thread, where it must not wait.
  using AnswerSink = std::function<void(v1::DaemonMessage answer, bool deferred)>;

  // Handles one stream message (not Attach) and gives its answer to `sink`,
  // carrying the message's request_id as received (never checked: ids are the
  // client's to match). Every message is answered before Handle returns but
  // SpillActivation and RecallActivation, which are answered when their
  // transfer completes (issue 23: the session's other messages do not wait
  // for a spill's SSD write), so possibly after later messages; EndStep,
  // AbortStep, DropActivations and Close wait for those answers first; and
  // WaitDurable, answered when its step's background commit ends (Close waits
  // for that commit). The Future is ready once the answer was given to `sink`.
  Future<void> Handle(const v1::ClientMessage& message, AnswerSink sink);

  // Ends the session: waits for its I/O, rolls back an uncommitted step, frees the
  // segment and releases the job. Idempotent. Returns the last committed step.
  int64_t Close();
  bool closed() const;

  // The session as of its last finished request; never waits for one in flight.
  v1::SessionInfo Info() const;

 private:
  struct RegisteredChunk {
    uint64_t num_elements = 0;
    DType param_dtype = DType::kFloat32;
    DType grad_dtype = DType::kFloat32;
    bool store_weights = false;  // ChunkSpec.store_weights (the job's record agrees)
  };

  // Request checks (session_checks.cc). Each returns OK or the error to reply.
  // Every chunk of a RegisterChunks request is well-formed and fits its slot,
  // the DRAM budget and (when resumed) the job's record of it.
  absl::Status ValidateRegistrationLocked(const v1::RegisterChunksRequest& request) const;
  // OK when `spec` may resume `record`: the stored layout fingerprint is 0 (it
  // adopts spec's) or equal to spec's. FAILED_PRECONDITION otherwise, a sent 0
  // included (see ChunkSpec.layout_fingerprint in offload.proto).
  absl::Status CheckLayoutFingerprint(const v1::ChunkRecord& record, const v1::ChunkSpec& spec) const;
  // OK when `spec` may resume `record`: the same store_weights as the chunk was
  // created with. FAILED_PRECONDITION otherwise (ChunkSpec.store_weights).
  absl::Status CheckStoreWeights(const v1::ChunkRecord& record, const v1::ChunkSpec& spec) const;
  // OK when `slot` is a slot of this session's segment; else INVALID_ARGUMENT
  // "chunk <id>: slot <slot> does not exist (the session has <n> slots)".
  absl::Status CheckSlotExists(uint32_t chunk_id, uint32_t slot) const;
  // OK when `step` is the job's next step; else FAILED_PRECONDITION "<request>
  // for step <step> is out of order: ..." naming the committed and next steps.
  absl::Status CheckStepInOrder(std::string_view request, int64_t step) const;
  // OK when `step` may be waited for (WaitDurable): 0 .. the committed step;
  // INVALID_ARGUMENT when negative, FAILED_PRECONDITION when later.
  absl::Status CheckWaitDurable(int64_t step) const;
  // OK when a GradReady may be applied now: in order, a registered chunk in an
  // existing slot, valid hyperparameters, not yet updated in this step (or, for
  // a redo, updated in it), no import pending, the step not failed, the chunk
  // below kMaxUpdateCount, segments without gradient that the chunk has.
  absl::Status CheckGradReady(const v1::GradReady& request) const;
  // OK when chunk, state, slot and range of a ReadState/WriteState are valid and
  // no step is in flight.
  absl::Status CheckStateRequest(uint32_t chunk_id, int which, uint32_t slot, uint64_t first, uint64_t count,
                                 const char* verb) const;
  // OK when a FetchWeights may be served now: a chunk registered in this
  // session (INVALID_ARGUMENT), an existing slot (INVALID_ARGUMENT), a chunk
  // registered with store_weights (FAILED_PRECONDITION). Messages are handled
  // one at a time and none holds a slot past its reply, so no other message of
  // the session uses the slot while a FetchWeights is handled.
  absl::Status CheckFetchWeights(const v1::FetchWeights& request) const;
  // FAILED_PRECONDITION: RegisterChunks or Attach before the segment arrived.
  absl::Status NoSegmentError() const;

  // OK when the journal fields of a GradReady (journal, grad_ops) are valid
  // for it: known values, ops only with ADD/REPLAY and at most kMaxGradOps,
  // ADD/REPLAY only as a redo and with a journal of this step.
  absl::Status CheckJournalUse(const v1::GradReady& request) const;

  // The reply to one stream message, before Handle names its request: the
  // session's gates (closed, a failed background commit, no segment), then
  // Dispatch. Ready at once but for an activation transfer's.
  Future<v1::DaemonMessage> Answer(const v1::ClientMessage& message);
  v1::DaemonMessage OnGradReady(const v1::GradReady& request);
  // Writes the chunk's journal as GradReady.journal says (session_journal.cc):
  // KEEP copies the slot's gradients (zeros for segments without gradient);
  // ADD applies grad_ops and adds the slot's gradients; REPLAY applies grad_ops.
  // Returns the open journal, whose bytes are the update's gradients, and sets
  // the journal's per-segment statistics in `ready`. Nothing of the step's
  // updates is changed; on error the chunk may have lost its journal.
  absl::StatusOr<JournalAccess> PrepareJournal(const v1::GradReady& request, v1::ParamsReady& ready);
  v1::DaemonMessage OnEndStep(const v1::EndStep& request);
  v1::DaemonMessage OnAbortStep(const v1::AbortStep& request);
  // StepDurable once the step is durable (ChunkStore::WhenDurable): ready at
  // once, or when the background commit ends (its continuation builds the
  // answer and touches nothing of the session).
  Future<v1::DaemonMessage> OnWaitDurable(const v1::WaitDurable& request);
  // Import and export (session_import.cc).
  v1::DaemonMessage OnReadState(const v1::ReadState& request);
  v1::DaemonMessage OnWriteState(const v1::WriteState& request);
  v1::DaemonMessage OnSetUpdateCount(const v1::SetUpdateCount& request);
  v1::DaemonMessage OnCommitImport(const v1::CommitImport& request);
  // Streaming weights (session_weights.cc).
  v1::DaemonMessage OnFetchWeights(const v1::FetchWeights& request);
  // Activation offload's storage tier (session_activations.cc).
  // The answer when the transfer completes (a ready one for a refusal).
  Future<v1::DaemonMessage> OnSpillActivation(const v1::SpillActivation& request);
  Future<v1::DaemonMessage> OnRecallActivation(const v1::RecallActivation& request);
  v1::DaemonMessage OnDropActivations();
  // Waits until every activation transfer has been answered (Handle's sink
  // called), then drops the spilled activations; EndStep, AbortStep and
  // DropActivations so answer after the transfers they end.
  ActivationSpill::Dropped DropActivationsLocked();
  // Returns `status`; an ABORTED one (a commit happened, durability unknown)
  // breaks the session: every later request gets that error.
  absl::Status NoteCommitResult(absl::Status status);
  // True when the session is broken, made so now when the store's background
  // commit is known to have failed (ChunkStore::PollCommit): every later
  // request gets that error.
  bool NoteCommitFailure();
  // Handle's switch over the message kinds.
  Future<v1::DaemonMessage> Dispatch(const v1::ClientMessage& message);

  // What the session is, fixed at OpenSession.
  struct Identity {
    std::string id;
    std::string job_name;
    ClientIdentity client;
    std::string client_info;
    std::chrono::steady_clock::time_point opened;
    SegmentLayout layout;  // the segment the client must hand over
  };
  // What the session holds until Close releases it (the store first, after its
  // I/O; the hold on the job last): each is null after Close.
  struct Held {
    std::shared_ptr<Job> job;                     // the session's hold on the job (JobRegistry::Release)
    std::unique_ptr<ChunkStore> store;            // the job's states
    std::unique_ptr<SessionSegment> segment;      // null until AdoptSegment
    std::unique_ptr<GradJournal> journal;         // the step's gradient journals
    std::unique_ptr<ActivationSpill> activations;  // the step's spilled activations
  };
  // Where the session is in its life: the gates a request passes.
  struct Lifecycle {
    std::atomic<bool> has_segment{false};  // read without the lock (has_segment())
    bool attached = false;
    bool closed = false;
    absl::Status broken;  // set when the job can no longer be used safely
  };
  // The step being accumulated.
  struct StepState {
    int64_t current = 1;  // committed + 1
    // Set when a redo failed after it dropped the chunk's update of the step: the
    // step has lost an update, so it cannot commit (EndStep rolls it back and
    // returns this error); cleared when the step ends.
    absl::Status failed_redo;
    std::optional<std::chrono::steady_clock::time_point> last_commit;  // for DaemonStats::step_seconds
  };
  // Publishes what Info reports (progress_) as the members below are now.
  void PublishProgressLocked();

  SessionServices services_;
  const Identity identity_;
  const StatsScopes counters_;  // the daemon's and the client's own counts

  mutable std::mutex mutex_;  // guards everything below (lifecycle_.has_segment is also read without it)
  Held held_;
  Lifecycle lifecycle_;
  std::map<uint32_t, RegisteredChunk> registered_;
  StepState step_;
  SessionActivity activity_;
  // What Info reads without mutex_ (not guarded by it: thread-safe).
  SessionProgress progress_;
  // Handle's answers of activation transfers not yet given to their sink (not
  // guarded by mutex_: thread-safe, and added to after the lock is released).
  InFlight activation_answers_;
  // WaitDurable requests waiting for a background commit (OnWaitDurable): at
  // most kMaxDurableWaits, so a client cannot pile up answers that no reader
  // bounds (a commit's answers are sent without waiting for room). Shared with
  // the continuations, which may end after the session.
  static constexpr int kMaxDurableWaits = 16;
  std::shared_ptr<std::atomic<int>> durable_waits_ = std::make_shared<std::atomic<int>>(0);
};

}  // namespace fuyou
