#include "state/chunk_store.h"

#include "common/log.h"
#include "common/status_util.h"
#include "fmt/format.h"

namespace fuyou {
namespace {

std::vector<uint32_t> RegistrationOrder(const Job& job) {
  std::vector<uint32_t> ids;
  for (const v1::ChunkRecord& record : job.manifest().chunks()) ids.push_back(record.chunk_id());
  return ids;
}

}  // namespace

ChunkStore::ChunkStore(Job& job, StateCache& cache, StoreCounters counters, unsigned prefetch_window,
                       DurabilityInterval durability)
    : context_(job, cache, counters, prefetch_window),
      durability_(context_, durability),
      step_(context_, durability_, LearnedOrder(RegistrationOrder(job))),
      reader_(context_),
      weights_(context_, step_, durability_),
      import_(context_, reader_, durability_) {
  PublishOrder();
}

void ChunkStore::PublishOrder() { context_.cache.SetStatesOrder(step_.order().predicted()); }

ChunkStore::~ChunkStore() { Close(); }

absl::Status ChunkStore::MakeDurable() {
  FUYOU_RETURN_IF_ERROR(step_.FinishCommit());
  if (!durability_.HasAcknowledged()) return absl::OkStatus();
  if (step_.staged_count() != 0) {
    return absl::FailedPreconditionError(fmt::format(
        "job '{}': step {} has updates staged; the acknowledged steps are made durable between steps",
        context_.job.name(), committed_step() + 1));
  }
  return step_.CommitDurable(context_.acknowledged);
}

Future<int64_t> ChunkStore::WhenDurable(int64_t step) {
  if (absl::Status failed = step_.PollCommit(); !failed.ok()) return MakeReadyFuture<int64_t>(failed);
  if (durable_step() >= step) return MakeReadyFuture<int64_t>(durable_step());
  if (step_.commit_pending() && step_.commit_step() >= step) {
    return step_.commit_result().Then(
        [job = context_.job.name(), step, committing = step_.commit_step()](
            const absl::Status& status) -> absl::StatusOr<int64_t> {
          if (status.ok()) return committing;
          return absl::Status(status.code(), fmt::format("job '{}': step {} is not durable: the durable commit of "
                                                         "step {} failed: {}",
                                                         job, step, committing, status.message()));
        });
  }
  // Acknowledged only (the durability interval): durable now.
  if (absl::Status made = MakeDurable(); !made.ok()) return MakeReadyFuture<int64_t>(made);
  return MakeReadyFuture<int64_t>(durable_step());
}

absl::StatusOr<std::vector<ChunkStore::Registered>> ChunkStore::Register(std::span<const Registration> chunks,
                                                                         uint64_t job_quota_bytes,
                                                                         StorageBudget* budget) {
  FUYOU_RETURN_IF_ERROR(CheckResumable(context_, chunks));
  FUYOU_RETURN_IF_ERROR(MakeDurable());  // the edit starts from the durable manifest
  durability_.ReleaseHold();  // the job's size may change: the next non-durable step holds anew
  auto registered = RegisterChunks(context_, reader_, step_.order(), chunks, job_quota_bytes, budget);
  PublishOrder();
  return registered;
}

absl::StatusOr<StagedUpdate> ChunkStore::BeginUpdate(uint32_t chunk_id) {
  const v1::ChunkRecord* record = Find(chunk_id);
  if (record == nullptr || IsStaged(chunk_id)) {
    return absl::InternalError(fmt::format("job '{}': chunk {} cannot be staged (unknown or already staged)",
                                           context_.job.name(), chunk_id));
  }
  FUYOU_RETURN_IF_ERROR(step_.FinishCommit());  // the write-back may go where the last commit frees
  durability_.UpdateStarting();
  // The states region only: the update writes the whole weights region.
  FUYOU_ASSIGN_OR_RETURN(StatePin pin,
                         reader_.Acquire(*record, durability_.IsPending(chunk_id), /*states_only=*/true));
  // A pending chunk's acknowledged states exist only in these bytes: keep a
  // copy for a redo or a roll-back.
  FUYOU_ASSIGN_OR_RETURN(StatePin undo, durability_.TakeUndo(chunk_id, pin));
  return step_.Begin(*record, std::move(pin), std::move(undo));
}

void ChunkStore::SubmitUpdate(StagedUpdate update, std::vector<int64_t> segment_update_counts) {
  const uint32_t chunk_id = update.chunk_id();
  step_.Submit(std::move(update), std::move(segment_update_counts));
  // Read ahead: the chunks that followed this one in the last step.
  Prefetch(step_.order().After(chunk_id, context_.prefetch_window));
}

void ChunkStore::Prefetch(const std::vector<uint32_t>& chunk_ids) {
  reader_.Prefetch(chunk_ids, [this](uint32_t chunk_id) { return step_.IsStaged(chunk_id); },
                   context_.ReadAheadBytes(step_.WriteBackBytesInFlight()));
}

void ChunkStore::WaitForReads() {
  reader_.WaitForReads();
  weights_.WaitForReads();
}

absl::Status ChunkStore::WaitForWriteBacks() {
  WaitForReads();
  return step_.WaitForWriteBacks();
}

absl::StatusOr<uint32_t> ChunkStore::CommitStep(int64_t step) { return EndStep(step, /*background=*/false); }

absl::StatusOr<uint32_t> ChunkStore::ApplyStep(int64_t step) { return EndStep(step, /*background=*/true); }

absl::StatusOr<uint32_t> ChunkStore::EndStep(int64_t step, bool background) {
  WaitForReads();
  absl::StatusOr<uint32_t> committed = step_.Commit(step, background);
  weights_.StepEnded();  // a skipped step fetched in the order of any other
  PublishOrder();
  if (!committed.ok()) return committed;
  Prefetch(step_.order().First(context_.prefetch_window));
  weights_.ReadAhead(weights_.order().First(context_.weights_window()));  // the next step's first fetches
  return committed;
}

void ChunkStore::RollBackStep() {
  WaitForReads();
  step_.RollBack();
  weights_.StepEnded();
  PublishOrder();  // the step runs again: what it used is needed again
}

absl::Status ChunkStore::ImportState(uint32_t chunk_id, ChunkState which, uint64_t first,
                                     std::span<const float> values) {
  FUYOU_RETURN_IF_ERROR(MakeDurable());  // the import writes the shadow extents
  return import_.Import(chunk_id, which, first, values);
}

absl::StatusOr<uint32_t> ChunkStore::CommitImport(std::optional<int64_t> resume_step) {
  if (import_.pending() == 0 && !resume_step) return 0u;
  if (absl::Status durable = MakeDurable(); !durable.ok()) {
    import_.Drop();
    return durable;
  }
  return import_.Commit(resume_step);
}

void ChunkStore::Close() {
  if (closed_) return;
  closed_ = true;
  RollBackStep();  // waits for the I/O in flight first
  // The acknowledged steps become durable: a closed session (or a drained
  // daemon) loses nothing it acknowledged.
  if (absl::Status durable = MakeDurable(); !durable.ok()) {
    log::Error("job '{}': could not make the acknowledged step {} durable at close (a restart resumes at step {}): {}",
               context_.job.name(), committed_step(), durable_step(), durable.message());
  }
  durability_.Clear();
  import_.Drop();
  context_.cache.Demote();
  context_.cache.SetStatesOrder({});  // no more steps: the ranks go with the store
  // Weights-only entries are valid only while this store drops them at each
  // commit: none outlives it.
  context_.cache.DropAll(CacheSpace::kWeights);
}

}  // namespace fuyou
