#include "session/session.h"

#include <algorithm>
#include <cstring>

#include "common/crash_point.h"
#include "common/log.h"
#include "common/status_util.h"
#include "common/trace.h"
#include "fmt/format.h"
#include "jobs/chunk_segments.h"
#include "jobs/job_registry.h"
#include "optimizer/adamw_kernel.h"
#include "optimizer/segmented_update.h"
#include "journal/journal_scratch.h"
#include "session/session_quota.h"
#include "session/stream_replies.h"
#include "stats/daemon_stats.h"

namespace fuyou {

namespace {

// Hooks that take and give back `uid`'s bytes of one per-user limit of
// `limits` (none without limits: nothing is counted).
JournalQuotaHooks UserQuotaHooks(SessionQuota* limits, uid_t uid,
                                 absl::Status (SessionQuota::*take)(uid_t, uint64_t),
                                 void (SessionQuota::*give)(uid_t, uint64_t)) {
  JournalQuotaHooks hooks;
  if (limits != nullptr) {
    hooks.take = [limits, uid, take](uint64_t bytes) { return (limits->*take)(uid, bytes); };
    hooks.give = [limits, uid, give](uint64_t bytes) { (limits->*give)(uid, bytes); };
  }
  return hooks;
}

}  // namespace

Session::Session(SessionServices services, std::string id, std::shared_ptr<Job> job, SegmentLayout layout,
                 ClientIdentity client, std::string client_info)
    : services_(services),
      identity_{.id = std::move(id),
                .job_name = job->name(),
                .client = client,
                .client_info = std::move(client_info),
                .opened = std::chrono::steady_clock::now(),
                .layout = layout},
      counters_(services.stats.ScopesOf(client.uid)) {
  held_.job = std::move(job);
  held_.store = std::make_unique<ChunkStore>(*held_.job, services.cache, counters_, services.prefetch_window,
                                             services.durability);
  step_.current = held_.store->committed_step() + 1;
  PublishProgressLocked();  // (no other thread has the session yet)
  // Both scratches are admitted by the storage budget as registrations are
  // (the per-user storage limit, the free space kept for commits). Their
  // transfers and the job's are one owner's in the I/O queues (the job hold's,
  // JobRegistry::Acquire): the session takes one turn among the sessions.
  held_.journal = std::make_unique<GradJournal>(
      services.cache, "journal:" + identity_.id,
      services.journal_scratch != nullptr
          ? services.journal_scratch->ForSession(identity_.id,
                                                 ScratchCharge{.budget = services.storage_budget,
                                                               .uid = client.uid,
                                                               .what = "the gradient journal scratch"},
                                                 held_.job->io_owner())
          : nullptr,
      UserQuotaHooks(services.quota, client.uid, &SessionQuota::TakeJournal, &SessionQuota::GiveJournal));
  held_.activations = std::make_unique<ActivationSpill>(
      services.activation_scratch != nullptr
          ? services.activation_scratch->ForSession(
                identity_.id,
                ScratchCharge{.budget = services.storage_budget, .uid = client.uid, .what = "the activation scratch"},
                held_.job->io_owner())
          : nullptr,
      UserQuotaHooks(services.quota, client.uid, &SessionQuota::TakeActivations, &SessionQuota::GiveActivations));
}

Session::~Session() { Close(); }

int64_t Session::committed_step() const {
  std::lock_guard lock(mutex_);
  return step_.current - 1;
}

uint32_t Session::existing_chunks() const {
  std::lock_guard lock(mutex_);
  return held_.store ? held_.store->chunk_count() : 0;
}

absl::Status Session::AdoptSegment(std::unique_ptr<SessionSegment> segment) {
  std::lock_guard lock(mutex_);
  if (lifecycle_.closed) return absl::FailedPreconditionError(fmt::format("session {} is closed", identity_.id));
  if (held_.segment) {
    return absl::FailedPreconditionError(
        fmt::format("session {} already has its segment; a segment is handed over once per session", identity_.id));
  }
  if (segment->layout().num_slots != identity_.layout.num_slots ||
      segment->layout().slot_bytes != identity_.layout.slot_bytes) {
    return absl::InternalError(fmt::format("session {}: the segment's layout is not the session's", identity_.id));
  }
  held_.segment = std::move(segment);
  lifecycle_.has_segment.store(true, std::memory_order_release);
  return absl::OkStatus();
}

absl::Status Session::Attach() {
  std::lock_guard lock(mutex_);
  if (lifecycle_.closed) return absl::FailedPreconditionError(fmt::format("session {} is closed", identity_.id));
  if (!held_.segment) return NoSegmentError();
  if (lifecycle_.attached)
    return absl::FailedPreconditionError(fmt::format("session {} already has a stream attached", identity_.id));
  lifecycle_.attached = true;
  return absl::OkStatus();
}

bool Session::attached() const {
  std::lock_guard lock(mutex_);
  return lifecycle_.attached;
}

bool Session::closed() const {
  std::lock_guard lock(mutex_);
  return lifecycle_.closed;
}

int64_t Session::Close() {
  std::lock_guard lock(mutex_);
  if (lifecycle_.closed) return step_.current - 1;
  lifecycle_.closed = true;
  FUYOU_CRASH_POINT("session_close");
  if (held_.store->staged_count() != 0) {
    log::Info("session {} of job '{}' ended in step {}: {} chunk updates rolled back to step {}", identity_.id,
              identity_.job_name, step_.current, held_.store->staged_count(), step_.current - 1);
  }
  if (held_.store->pending_imports() != 0) {
    log::Info("session {} of job '{}' ended with an import of {} chunks not committed: dropped", identity_.id,
              identity_.job_name, held_.store->pending_imports());
  }
  held_.store->Close();  // waits for its I/O, rolls back, drops the import
  held_.store.reset();
  held_.journal.reset();  // the step's journals: DRAM and quota given back, scratch files unlinked
  DropActivationsLocked();    // answers the transfers in flight (before the segment goes: they use its slots)
  held_.activations.reset();  // spilled activations: quota given back, scratch files unlinked
  held_.segment.reset();
  services_.jobs.Release(*held_.job);
  held_.job.reset();
  return step_.current - 1;
}

absl::Status Session::NoteCommitResult(absl::Status status) {
  if (absl::IsAborted(status)) {
    log::Error("session {}: {}", identity_.id, status.message());
    lifecycle_.broken = status;
  }
  NoteCommitFailure();
  return status;
}

bool Session::NoteCommitFailure() {
  if (!lifecycle_.broken.ok()) return true;
  absl::Status failed = held_.store->PollCommit();
  if (failed.ok()) return false;
  log::Error("session {}: {}", identity_.id, failed.message());
  lifecycle_.broken = std::move(failed);
  return true;
}

absl::StatusOr<v1::RegisterChunksResponse> Session::RegisterChunks(const v1::RegisterChunksRequest& request) {
  std::lock_guard lock(mutex_);
  if (lifecycle_.closed) return absl::FailedPreconditionError(fmt::format("session {} is closed", identity_.id));
  if (NoteCommitFailure()) return lifecycle_.broken;
  if (!held_.segment) return NoSegmentError();
  // Validate everything before changing anything.
  FUYOU_RETURN_IF_ERROR(ValidateRegistrationLocked(request));
  std::vector<ChunkStore::Registration> chunks;
  for (const v1::ChunkSpec& spec : request.chunks()) {
    chunks.push_back(ChunkStore::Registration{
        .chunk_id = spec.chunk_id(),
        .num_elements = spec.num_elements(),
        .param_dtype = static_cast<DType>(spec.param_dtype()),
        .grad_dtype = static_cast<DType>(spec.grad_dtype()),
        .layout_fingerprint = spec.layout_fingerprint(),
        .segment_elements = SegmentsToStore(spec),
        .weights = held_.segment->ParamRegion(spec.slot()),
        .store_weights = spec.store_weights(),
        .moments_dtype = SpecMomentsDType(spec),
    });
  }
  auto registered = held_.store->Register(chunks, services_.job_quota_bytes, services_.storage_budget);
  if (!registered.ok()) return NoteCommitResult(registered.status());
  v1::RegisterChunksResponse response;
  for (size_t i = 0; i < chunks.size(); ++i) {
    const ChunkStore::Registration& chunk = chunks[i];
    v1::RegisteredChunk* result = response.add_chunks();
    result->set_chunk_id(chunk.chunk_id);
    result->set_resumed((*registered)[i].resumed);
    result->set_update_count((*registered)[i].update_count);
    for (int64_t count : (*registered)[i].segment_update_counts) result->add_segment_update_counts(count);
    registered_[chunk.chunk_id] =
        RegisteredChunk{chunk.num_elements, chunk.param_dtype, chunk.grad_dtype, chunk.store_weights};
  }
  PublishProgressLocked();
  return response;
}

Future<void> Session::Handle(const v1::ClientMessage& message, AnswerSink sink) {
  const uint64_t request_id = message.request_id();  // echoed, never trusted
  Future<v1::DaemonMessage> answer = Answer(message);
  // The answer as sent: the reply, or an Error for a transfer's future that
  // holds none (a dropped promise).
  auto named = [request_id](const absl::StatusOr<v1::DaemonMessage>& result) {
    v1::DaemonMessage reply = result.ok() ? *result : ErrorReply(result.status());
    reply.set_request_id(request_id);
    return reply;
  };
  if (answer.ready()) {
    sink(named(answer.result()), /*deferred=*/false);
    return MakeReadyFuture();
  }
  Future<void> answered = answer.Then([named, sink = std::move(sink)](const absl::StatusOr<v1::DaemonMessage>& result) {
    sink(named(result), /*deferred=*/true);
    return absl::OkStatus();
  });
  // A WaitDurable's answer comes when the store's background commit ends,
  // which every request that needs the commit, and Close, waits for anyway:
  // EndStep and AbortStep wait for the transfers' answers only.
  if (!message.has_wait_durable()) activation_answers_.Add(answered);
  return answered;
}

Future<v1::DaemonMessage> Session::Answer(const v1::ClientMessage& message) {
  auto now = [](v1::DaemonMessage reply) { return MakeReadyFuture<v1::DaemonMessage>(std::move(reply)); };
  std::lock_guard lock(mutex_);
  if (lifecycle_.closed)
    return now(ErrorReply(absl::FailedPreconditionError(fmt::format("session {} is closed", identity_.id)), {}, {}));
  // A background commit that failed ends the session at the first request
  // after it is known (at the latest the next GradReady or EndStep, which wait for it).
  if (NoteCommitFailure()) return now(ErrorReply(lifecycle_.broken, {}, {}));
  if (!held_.segment) return now(ErrorReply(NoSegmentError(), {}, {}));  // streams attach only with a segment
  Future<v1::DaemonMessage> reply = Dispatch(message);
  NoteCommitFailure();
  PublishProgressLocked();
  return reply;
}

Future<v1::DaemonMessage> Session::Dispatch(const v1::ClientMessage& message) {
  auto now = [](v1::DaemonMessage reply) { return MakeReadyFuture<v1::DaemonMessage>(std::move(reply)); };
  switch (message.kind_case()) {
    case v1::ClientMessage::kGradReady: return now(OnGradReady(message.grad_ready()));
    case v1::ClientMessage::kEndStep: return now(OnEndStep(message.end_step()));
    case v1::ClientMessage::kAbortStep: return now(OnAbortStep(message.abort_step()));
    case v1::ClientMessage::kReadState: return now(OnReadState(message.read_state()));
    case v1::ClientMessage::kWriteState: return now(OnWriteState(message.write_state()));
    case v1::ClientMessage::kSetUpdateCount: return now(OnSetUpdateCount(message.set_update_count()));
    case v1::ClientMessage::kCommitImport: return now(OnCommitImport(message.commit_import()));
    case v1::ClientMessage::kFetchWeights: return now(OnFetchWeights(message.fetch_weights()));
    case v1::ClientMessage::kSpillActivation: return OnSpillActivation(message.spill_activation());
    case v1::ClientMessage::kRecallActivation: return OnRecallActivation(message.recall_activation());
    case v1::ClientMessage::kDropActivations: return now(OnDropActivations());
    case v1::ClientMessage::kWaitDurable: return OnWaitDurable(message.wait_durable());
    case v1::ClientMessage::kAttach:
      return now(
          ErrorReply(absl::FailedPreconditionError("the stream is already attached; Attach is sent once"), {}, {}));
    default:
      return now(ErrorReply(absl::InvalidArgumentError("malformed message: ClientMessage has no kind set"), {}, {}));
  }
}

v1::DaemonMessage Session::OnGradReady(const v1::GradReady& request) {
  const uint32_t chunk_id = request.chunk_id();
  const int64_t step = request.step();
  if (absl::Status bad = CheckGradReady(request); !bad.ok()) return ErrorReply(bad, chunk_id, step);
  v1::DaemonMessage reply;
  v1::ParamsReady* ready = reply.mutable_params_ready();
  // The journal is written before anything of the step changes: a journal that
  // cannot be read back or written refuses the request with the step intact.
  const v1::JournalUse journal_use = request.journal();
  const bool from_journal = journal_use == v1::JOURNAL_USE_ADD || journal_use == v1::JOURNAL_USE_REPLAY;
  const auto journal_started = std::chrono::steady_clock::now();
  JournalAccess journal;
  if (journal_use != v1::JOURNAL_USE_UNSPECIFIED) {
    auto prepared = PrepareJournal(request, *ready);
    if (!prepared.ok()) return ErrorReply(prepared.status(), chunk_id, step);
    journal = std::move(*prepared);
  }
  // A redo replaces the chunk's update of this step: its staged states are
  // dropped and the update runs again from the committed states, which the
  // step never touched (a crash from here on resumes at the last commit).
  const bool redo = request.redo() != v1::REDO_REASON_UNSPECIFIED;
  const auto started = std::chrono::steady_clock::now();
  if (redo) {
    FUYOU_CRASH_POINT("redo_received");
    if (absl::Status dropped = held_.store->RollBackChunk(chunk_id); !dropped.ok()) {
      return ErrorReply(dropped, chunk_id, step);
    }
  } else {
    FUYOU_CRASH_POINT("grad_received");
  }
  const RegisteredChunk& registered = registered_.at(chunk_id);
  const v1::AdamWHyper& hyper = request.hyper();
  optimizer::AdamWStepParams params;  // params.step: per segment (SegmentedUpdate)
  params.lr = hyper.lr();
  params.beta1 = hyper.beta1();
  params.beta2 = hyper.beta2();
  params.eps = hyper.eps();
  params.weight_decay = hyper.weight_decay();
  params.grad_scale = hyper.grad_scale() == 0 ? 1.0f : hyper.grad_scale();
  // Each segment at its own t; segments without gradient keep their states and
  // count (validated by CheckGradReady against the chunk's segments).
  const v1::ChunkRecord& record = *held_.store->Find(chunk_id);
  const std::vector<uint64_t> segments(record.segment_elements().begin(), record.segment_elements().end());
  const std::vector<int64_t> counts = SegmentUpdateCounts(record);
  const std::vector<uint32_t> without(request.segments_without_grad().begin(), request.segments_without_grad().end());
  const optimizer::SegmentedUpdateSpec update{segments, counts, 0, without};
  uint64_t skipped = 0;  // elements without gradient
  for (uint32_t s : without) skipped += segments.empty() ? record.num_elements() : segments[s];
  double kernel_seconds = 0;  // set by run_kernel
  // Runs the kernel on the chunk's staged states.
  auto run_kernel = [&](const ChunkStates& states) {
    const uint64_t n = states.num_elements();
    optimizer::AdamWBuffers buffers;
    buffers.master = states.master();
    buffers.exp_avg = states.exp_avg();
    buffers.exp_avg_sq = states.exp_avg_sq();
    buffers.moments_dtype = states.layout().moments_dtype;
    buffers.exp_avg_scales = states.moment_scales(ChunkState::kExpAvg);
    buffers.exp_avg_sq_scales = states.moment_scales(ChunkState::kExpAvgSq);
    buffers.chunk_elements = n;
    // From the journal when the request uses one (REPLAY never reads the slot's gradients).
    buffers.grad = journal.data() != nullptr ? journal.data() : held_.segment->GradRegion(request.slot()).data();
    buffers.grad_dtype = registered.grad_dtype;
    // A chunk that stores its working weights gets them in its own states
    // (daemon memory, written back and committed with master, m and v), then
    // copied into the slot; any other chunk's go straight to the slot.
    std::byte* const slot_weights = held_.segment->ParamRegion(request.slot()).data();
    buffers.weights_out = states.weights() != nullptr ? states.weights() : slot_weights;
    buffers.weight_dtype = registered.param_dtype;
    buffers.n = n;
    const int64_t update_start = trace::NowUs();
    const auto kernel_started = std::chrono::steady_clock::now();
    // The kernel's turns are shared by uid, then by session (the job hold's I/O
    // owner names the session: one per Acquire).
    const FairKey tenant{uid(), held_.job->io_owner().id()};
    optimizer::SegmentedUpdate(services_.kernel, params, buffers, update, tenant);
    if (states.weights() != nullptr) std::memcpy(slot_weights, states.weights(), states.weights_bytes());
    kernel_seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - kernel_started).count();
    trace::Record("update", chunk_id, update_start, trace::NowUs());
    services_.stats.chunk_update_seconds.Observe(kernel_seconds);
    counters_.Bump(Ticker::kChunkUpdates);
    counters_.Bump(Ticker::kParamsUpdated, n - skipped);
    if (redo) {
      FUYOU_CRASH_POINT("redo_after_kernel");
    } else {
      FUYOU_CRASH_POINT("after_kernel");
    }
  };
  // The per-segment counts after the step, when they are not all update_count + 1.
  std::vector<int64_t> counts_after;
  if (!without.empty() || record.segment_update_counts_size() != 0) counts_after = CountsAfterUpdate(update);
  // The store stages the chunk's committed states; the kernel updates them
  // here, then the store writes them back.
  absl::StatusOr<StagedUpdate> staged = held_.store->BeginUpdate(chunk_id);
  if (!staged.ok()) {
    const absl::Status& failed = staged.status();
    if (redo) {
      // The chunk's update of the step is gone and no new one was made: the step
      // cannot commit (EndStep rolls it back), and no later GradReady fixes it.
      step_.failed_redo = absl::Status(failed.code(), fmt::format("the redo of chunk {} failed after its update of the "
                                                                  "step was dropped: {}",
                                                                  chunk_id, failed.message()));
      return ErrorReply(step_.failed_redo, chunk_id, step);
    }
    return ErrorReply(failed, chunk_id, step);
  }
  run_kernel(staged->states());
  held_.store->SubmitUpdate(*std::move(staged), std::move(counts_after));
  // The session's own figures (SessionInfo, fuyouctl top): the kernel, and the
  // rest of the request (waiting for the states, submitting the write-back).
  const double request_seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - started).count();
  ++activity_.chunk_updates;
  activity_.update_seconds += kernel_seconds;
  activity_.state_wait_seconds += std::max(0.0, request_seconds - kernel_seconds);
  if (redo) ++activity_.chunks_redone;
  if (request.speculative()) ++activity_.chunks_speculative;
  if (redo) {
    FUYOU_CRASH_POINT("redo_writeback_submitted");
    const bool clipped = request.redo() == v1::REDO_REASON_CLIPPED;
    const auto nanoseconds = static_cast<uint64_t>(
        std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now() - started).count());
    counters_.Bump(clipped ? Ticker::kChunksRedoneClipped : Ticker::kChunksRedoneChanged);
    counters_.Bump(Ticker::kRedoNanoseconds, nanoseconds);
  }
  if (request.speculative()) counters_.Bump(Ticker::kChunksSpeculative);
  if (from_journal) {
    const auto nanoseconds = static_cast<uint64_t>(std::chrono::duration_cast<std::chrono::nanoseconds>(
                                                       std::chrono::steady_clock::now() - journal_started)
                                                       .count());
    counters_.Bump(Ticker::kJournalReplays);
    counters_.Bump(Ticker::kJournalReplayNanoseconds, nanoseconds);
  }
  ready->set_step(step);
  ready->set_chunk_id(chunk_id);
  ready->set_slot(request.slot());
  return reply;
}

v1::DaemonMessage Session::OnEndStep(const v1::EndStep& request) {
  const int64_t step = request.step();
  if (absl::Status in_order = CheckStepInOrder("EndStep", step); !in_order.ok()) return ErrorReply(in_order, {}, step);
  FUYOU_CRASH_POINT("end_step_received");
  const int64_t end_step_start = trace::NowUs();
  held_.journal->Clear();   // the step's journals end with it, whether it commits or not
  DropActivationsLocked();  // and so do its spilled activations
  if (absl::Status failed = step_.failed_redo.ok() ? held_.store->WaitForWriteBacks() : step_.failed_redo;
      !failed.ok()) {
    held_.store->RollBackStep();
    step_.failed_redo = absl::OkStatus();
    return ErrorReply(absl::Status(failed.code(), fmt::format("step {} was rolled back to step {}: {}", step, step - 1,
                                                              failed.message())),
                      {}, step);
  }
  // Applied, not yet durable: the manifest's write and the syncs run in the
  // background while the next step's forward runs (ChunkStore::ApplyStep).
  auto committed = held_.store->ApplyStep(step);
  if (!committed.ok()) {
    const absl::Status status = NoteCommitResult(committed.status());
    return ErrorReply(absl::Status(status.code(), fmt::format("step {} could not commit and was rolled back: {}",
                                                              step, status.message())),
                      {}, step);
  }
  counters_.Bump(Ticker::kStepsCommitted);
  // fuyou_step_seconds: from the session's previous commit to this one.
  const auto now = std::chrono::steady_clock::now();
  if (step_.last_commit)
    services_.stats.step_seconds.Observe(std::chrono::duration<double>(now - *step_.last_commit).count());
  step_.last_commit = now;
  ++step_.current;
  trace::Record("end_step", 0, end_step_start, trace::NowUs());  // received to answered
  v1::DaemonMessage reply;
  reply.mutable_step_committed()->set_step(step);
  reply.mutable_step_committed()->set_chunks_updated(*committed);
  // The durable step before this one's commit, which is still in flight: the
  // next answer (or a SessionOpened after a restart) says whether it made it.
  reply.mutable_step_committed()->set_durable_step(held_.store->durable_step());
  return reply;
}

v1::DaemonMessage Session::OnAbortStep(const v1::AbortStep& request) {
  const int64_t step = request.step();
  if (absl::Status in_order = CheckStepInOrder("AbortStep", step); !in_order.ok()) {
    return ErrorReply(in_order, {}, step);
  }
  FUYOU_CRASH_POINT("abort_step_received");
  const uint64_t rolled_back = held_.store->staged_count();
  held_.store->RollBackStep();  // waits for the step's write-backs first
  held_.journal->Clear();
  DropActivationsLocked();
  step_.failed_redo = absl::OkStatus();
  // A step the training loop skipped (GradScaler's inf/nan, or the loop's own
  // choice): its speculative updates were wasted work, counted.
  if (request.reason() == v1::ABORT_REASON_SKIPPED_STEP || request.reason() == v1::ABORT_REASON_OVERFLOW) {
    counters_.Bump(Ticker::kChunksRolledBackSkippedStep, rolled_back);
    activity_.chunks_rolled_back += rolled_back;
  }
  v1::DaemonMessage reply;
  reply.mutable_step_aborted()->set_step(step);
  return reply;
}

Future<v1::DaemonMessage> Session::OnWaitDurable(const v1::WaitDurable& request) {
  const int64_t step = request.step();
  if (absl::Status bad = CheckWaitDurable(step); !bad.ok()) {
    return MakeReadyFuture<v1::DaemonMessage>(ErrorReply(bad, {}, step));
  }
  Future<int64_t> durable = held_.store->WhenDurable(step);
  // A commit made here (an acknowledged step made durable) that ABORTED breaks
  // the session as any commit does; a background commit's failure is noted by
  // the next request (NoteCommitFailure).
  if (durable.ready() && !durable.result().ok()) NoteCommitResult(durable.result().status());
  std::shared_ptr<std::atomic<int>> waits;  // counts this request while it waits
  if (!durable.ready()) {
    if (durable_waits_->fetch_add(1) >= kMaxDurableWaits) {
      durable_waits_->fetch_sub(1);
      return MakeReadyFuture<v1::DaemonMessage>(ErrorReply(
          absl::ResourceExhaustedError(fmt::format(
              "WaitDurable for step {}: {} WaitDurable requests of this session already wait for job '{}''s "
              "durable commit; wait for their answers first",
              step, kMaxDurableWaits, identity_.job_name)),
          {}, step));
    }
    waits = durable_waits_;
  }
  // Runs on the commit's thread when it ends (or here): builds the answer only.
  return durable.Then([step, waits](const absl::StatusOr<int64_t>& reached) -> absl::StatusOr<v1::DaemonMessage> {
    if (waits != nullptr) waits->fetch_sub(1);
    if (!reached.ok()) return ErrorReply(reached.status(), {}, step);
    v1::DaemonMessage reply;
    reply.mutable_step_durable()->set_step(step);
    reply.mutable_step_durable()->set_durable_step(*reached);
    return reply;
  });
}

void Session::PublishProgressLocked() {
  progress_.Publish({.chunks = static_cast<uint32_t>(registered_.size()),
                     .committed_step = step_.current - 1,
                     .activity = activity_});
}

v1::SessionInfo Session::Info() const {
  const SessionProgress::Snapshot progress = progress_.Read();
  const SessionActivity& activity = progress.activity;
  v1::SessionInfo info;
  info.set_session_id(identity_.id);
  info.set_job(identity_.job_name);
  info.set_uid(identity_.client.uid);
  info.set_pid(identity_.client.pid);
  info.set_client_info(identity_.client_info);
  info.set_chunks(progress.chunks);
  info.set_committed_step(progress.committed_step);
  info.set_segment_bytes(identity_.layout.TotalBytes());
  info.set_age_seconds(std::chrono::duration<double>(std::chrono::steady_clock::now() - identity_.opened).count());
  info.set_chunk_updates(activity.chunk_updates);
  info.set_update_seconds(activity.update_seconds);
  info.set_state_wait_seconds(activity.state_wait_seconds);
  info.set_chunks_speculative(activity.chunks_speculative);
  info.set_chunks_redone(activity.chunks_redone);
  info.set_chunks_rolled_back(activity.chunks_rolled_back);
  return info;
}

}  // namespace fuyou
