#include "state/step_transaction.h"

#include <algorithm>
#include <memory>

#include "common/crash_point.h"
#include "common/status_util.h"
#include "common/trace.h"
#include "fmt/format.h"
#include "stats/daemon_stats.h"

namespace fuyou {
namespace {

// Sets `record`'s update counts as JobEdit::SetSegmentUpdateCounts would.
void SetCounts(v1::ChunkRecord& record, const std::vector<int64_t>& counts) {
  record.clear_segment_update_counts();
  if (counts.empty()) return;
  const int64_t largest = *std::max_element(counts.begin(), counts.end());
  record.set_update_count(largest);
  if (std::all_of(counts.begin(), counts.end(), [&](int64_t count) { return count == largest; })) return;
  for (int64_t count : counts) record.add_segment_update_counts(count);
}

// The counts of `record` after one more update (`segment_counts` as given to Submit).
void CountUpdate(v1::ChunkRecord& record, const std::vector<int64_t>& segment_counts) {
  if (!segment_counts.empty()) {
    SetCounts(record, segment_counts);
  } else if (record.segment_update_counts_size() != 0) {  // every segment counts one more
    std::vector<int64_t> counts(record.segment_update_counts().begin(), record.segment_update_counts().end());
    for (int64_t& count : counts) ++count;
    SetCounts(record, counts);
  } else {
    record.set_update_count(record.update_count() + 1);
  }
}

}  // namespace

StagedUpdate::StagedUpdate(StagedUpdate&& other) noexcept
    : step_(other.step_), chunk_id_(other.chunk_id_), states_(other.states_) {
  other.step_ = nullptr;
}

StagedUpdate::~StagedUpdate() {
  if (step_ != nullptr) step_->Abandon(chunk_id_);
}

StepTransaction::StepTransaction(StoreContext& context, DurabilityPolicy& durability, LearnedOrder order)
    : context_(context), durability_(durability), order_(std::move(order)) {}

StepTransaction::~StepTransaction() { WaitForWriteBacks().IgnoreError(); }

StagedUpdate StepTransaction::Begin(const v1::ChunkRecord& record, StatePin states, StatePin undo) {
  // From here the bytes are this step's update, not the committed states: an
  // abandoned update is never taken for them.
  context_.cache.cache().SetContents(states, ShadowVersion(record), /*committed=*/false);
  const ChunkStates view(states.data(), RecordLayout(record));
  Staged& staged = staged_[record.chunk_id()];
  staged.states = std::move(states);
  staged.undo = std::move(undo);
  return StagedUpdate(this, record.chunk_id(), view);
}

void StepTransaction::Submit(StagedUpdate update, std::vector<int64_t> segment_update_counts) {
  const uint32_t chunk_id = update.chunk_id_;
  update.step_ = nullptr;
  Staged& staged = staged_.at(chunk_id);
  staged.segment_update_counts = std::move(segment_update_counts);
  order_.Arrived(chunk_id);
  if (!durability_.step_durable()) {
    // Kept in DRAM, not written: Commit makes it the chunk's pending states.
    staged.kept = std::move(staged.states);
    staged.write = MakeReadyFuture<ChunkChecksums>(ChunkChecksums{});
    return;
  }
  // Write the new states to the shadow extent; the committed one stays intact.
  // The checksum is computed when the write completes (the bytes stay pinned
  // until then), so the caller does not wait for a pass over the states.
  const v1::ChunkRecord& record = *context_.Find(chunk_id);
  const v1::StateExtent& extent = ShadowExtent(record);
  auto held = std::make_shared<StatePin>(std::move(staged.states));
  // Once written, the bytes are flushed while the step goes on (an fdatasync
  // through the ring), so that the commit finds little left to sync.
  auto synced = std::make_shared<Promise<void>>();
  syncs_.push_back(synced->future());
  staged.write =
      context_.job.states()
          .WriteAsync(extent.offset(), std::span<const std::byte>(held->data(), extent.length()))
          .Then([held, synced, chunk_id, layout = RecordLayout(record), length = extent.length(), job = &context_.job,
                 counters = context_.counters,
                 write_start = trace::NowUs()](const absl::Status& status) -> absl::StatusOr<ChunkChecksums> {
            trace::Record("ssd_write", chunk_id, write_start, trace::NowUs());
            if (status.ok()) {
              (void)job->states().SyncAsync().Then([synced](const absl::Status& sync) {
                synced->Set(sync);
                return absl::OkStatus();
              });
            } else {
              synced->Set(absl::OkStatus());  // nothing to sync: the step fails on the write
            }
            const ChunkChecksums checksums =
                status.ok() ? ComputeChunkChecksums(held->data(), layout) : ChunkChecksums{};
            if (status.ok()) counters.Bump(Ticker::kBytesWritten, length);
            FUYOU_CRASH_POINT("writeback_completed");
            held->Reset();
            if (!status.ok()) {
              return absl::Status(status.code(), fmt::format("job '{}': write-back of chunk {} failed: {}",
                                                             job->name(), chunk_id, status.message()));
            }
            return checksums;
          });
  writes_.push_back(staged.write);
  FUYOU_CRASH_POINT("writeback_submitted");
}

void StepTransaction::Abandon(uint32_t chunk_id) {
  auto staged = staged_.find(chunk_id);
  if (staged == staged_.end()) return;
  Unstage(chunk_id, staged->second);
  staged_.erase(staged);
}

const StatePin* StepTransaction::Undo(uint32_t chunk_id) const {
  const auto staged = staged_.find(chunk_id);
  return staged == staged_.end() || !staged->second.undo ? nullptr : &staged->second.undo;
}

absl::Status StepTransaction::StepError() const {
  for (const Future<ChunkChecksums>& write : writes_) {
    if (write.ready() && !write.result().ok()) return write.result().status();
  }
  return absl::OkStatus();
}

absl::Status StepTransaction::WaitForWriteBacks() const {
  WaitAll(writes_).IgnoreError();
  return StepError();
}

uint64_t StepTransaction::WriteBackBytesInFlight() const {
  uint64_t bytes = 0;
  for (const auto& [chunk_id, staged] : staged_) {
    if (staged.write.valid() && !staged.write.ready()) bytes += ShadowExtent(*context_.Find(chunk_id)).length();
  }
  return bytes;
}

absl::Status StepTransaction::RollBackChunk(uint32_t chunk_id) {
  auto staged = staged_.find(chunk_id);
  if (staged == staged_.end()) {
    return absl::FailedPreconditionError(fmt::format(
        "job '{}': chunk {} has no update staged in step {}; there is nothing to roll back", context_.job.name(),
        chunk_id, context_.acknowledged.committed_step() + 1));
  }
  if (staged->second.write.valid()) staged->second.write.Wait();
  Unstage(chunk_id, staged->second);
  staged_.erase(staged);
  order_.Forget(chunk_id);
  return absl::OkStatus();
}

void StepTransaction::Unstage(uint32_t chunk_id, Staged& staged) {
  staged.kept.Reset();
  staged.states.Reset();
  if (staged.undo && durability_.Restore(chunk_id, staged.undo)) return;
  context_.cache.Drop(CacheSpace::kStates, chunk_id);
}

absl::Status StepTransaction::FinishCommit() {
  if (!commit_failure_.ok()) return commit_failure_;
  if (!commit_.pending()) return absl::OkStatus();
  const int64_t step = commit_.step();
  const absl::Status status = commit_.Finish();
  if (status.ok()) return status;
  // The step was acknowledged (its states are in the cache as committed, the
  // acknowledged manifest names them) but is not durable: forget all of it.
  // The job's durable manifest is the step before, its extents never written.
  context_.cache.DropAll(CacheSpace::kStates);
  context_.cache.DropAll(CacheSpace::kWeights);
  context_.Reload();
  commit_failure_ = absl::Status(
      status.code(),
      fmt::format("job '{}': step {} was applied but its durable commit failed: {}; the job stays at its durable step "
                  "{}, and this session cannot go on: reopen the job to resume from step {}",
                  context_.job.name(), step, status.message(), context_.job.manifest().committed_step(),
                  context_.job.manifest().committed_step()));
  return commit_failure_;
}

absl::Status StepTransaction::PollCommit() {
  if (commit_.failed()) return FinishCommit();
  return commit_failure_;
}

void StepTransaction::Applied(const std::vector<uint32_t>& changed, const v1::JobManifest& manifest) {
  const Job& job = context_.job;
  for (uint32_t chunk_id : changed) {
    context_.cache.Drop(CacheSpace::kWeights, chunk_id);  // the committed extent changed
    context_.cache.MarkCommitted(chunk_id, manifest.chunks(job.FindChunk(chunk_id)).committed_version());
  }
  context_.acknowledged = manifest;
  durability_.Durable();
}

absl::Status StepTransaction::CommitDurable(const v1::JobManifest& next, bool background) {
  Job& job = context_.job;
  JobEdit edit(job);
  std::vector<uint32_t> changed;
  for (const auto& [chunk_id, staged] : staged_) {
    edit.ShadowWritten(chunk_id, *staged.write.result());  // the write-backs completed, without error
    changed.push_back(chunk_id);
  }
  // The acknowledged states of the pending chunks this step did not update go
  // to their shadow extents now (the committed extents hold the durable step).
  FUYOU_RETURN_IF_ERROR(durability_.WritePending(
      edit, next.committed_step(), [&](uint32_t chunk_id) { return IsStaged(chunk_id); }, changed));
  for (uint32_t chunk_id : changed) {
    const v1::ChunkRecord& record = next.chunks(job.FindChunk(chunk_id));
    if (record.segment_update_counts_size() != 0) {
      edit.SetSegmentUpdateCounts(chunk_id, std::vector<int64_t>(record.segment_update_counts().begin(),
                                                                 record.segment_update_counts().end()));
    } else {
      edit.SetUpdateCount(chunk_id, record.update_count());
    }
  }
  edit.SetCommittedStep(next.committed_step());
  if (durability_.HasPending()) FUYOU_CRASH_POINT("durable_commit_pending_written");
  std::vector<storage::IoFuture> syncs = std::move(syncs_);
  syncs_.clear();
  if (!background) {
    absl::Status committed = edit.Commit();  // its fdatasync covers the write-backs' syncs
    if (!committed.ok() && !absl::IsAborted(committed)) return committed;
    Applied(changed, job.manifest());
    return committed;
  }
  // Applied now, durable on the commit's thread (BackgroundCommit).
  v1::JobManifest manifest = edit.Release();
  Applied(changed, manifest);
  commit_.Start(job, next.committed_step(), std::move(manifest), std::move(syncs));
  return absl::OkStatus();
}

absl::StatusOr<uint32_t> StepTransaction::Commit(int64_t step, bool background) {
  if (absl::Status failed = WaitForWriteBacks(); !failed.ok()) {
    RollBack();
    return failed;
  }
  // The previous step's durable commit, when still running (a step without
  // updates: any update waited for it already).
  if (absl::Status previous = FinishCommit(); !previous.ok()) {
    RollBack();
    return previous;
  }
  // The acknowledged manifest after this step: the staged chunks' counts, the step.
  v1::JobManifest next = context_.acknowledged;
  for (const auto& [chunk_id, staged] : staged_) {
    CountUpdate(*next.mutable_chunks(context_.job.FindChunk(chunk_id)), staged.segment_update_counts);
  }
  next.set_committed_step(step);
  if (durability_.step_durable()) {
    if (absl::Status committed = CommitDurable(next, background); !committed.ok()) {
      RollBack();
      return committed;
    }
  } else {
    // Acknowledged only: the updates become the chunks' pending states, in DRAM.
    for (auto& [chunk_id, staged] : staged_) {
      durability_.Keep(chunk_id, std::move(staged.kept));
      context_.cache.Drop(CacheSpace::kWeights, chunk_id);  // their weights are the pending entries' now
    }
    context_.acknowledged = std::move(next);
    durability_.Acknowledged();
  }
  for (auto& [chunk_id, staged] : staged_) durability_.DropUndo(chunk_id, staged.undo);
  const auto committed = static_cast<uint32_t>(staged_.size());
  order_.StepCommitted();
  staged_.clear();
  writes_.clear();
  syncs_.clear();
  durability_.StepEnded();
  return committed;
}

void StepTransaction::RollBack() {
  WaitForWriteBacks().IgnoreError();
  for (auto& [chunk_id, staged] : staged_) Unstage(chunk_id, staged);
  staged_.clear();
  writes_.clear();
  syncs_.clear();  // the syncs in flight cover bytes no manifest names
  durability_.StepEnded();
  order_.StepRolledBack();
}

}  // namespace fuyou
