// Session: export and import of a job's optimizer states, between steps.
//
// ReadState copies fp32 values of a chunk's committed state into a slot's
// parameter region. WriteState copies fp32 values from a slot's gradient region
// into a chunk's states, then writes the chunk's whole new states to its shadow
// extent at once (synchronously: an import is rare, and a chunk written in
// several pieces costs one extent write per piece). The cache may therefore
// evict them before CommitImport without losing anything. CommitImport points
// the manifest at the shadow extents and sets the update counts in one atomic
// commit that keeps the committed step; until then the committed extents are
// untouched and the end of the session drops the import.
#include <cstring>

#include "common/status_util.h"
#include "fmt/format.h"
#include "session/session.h"
#include "session/stream_replies.h"
#include "stats/daemon_stats.h"

namespace fuyou {
namespace {

bool IsStateKind(int which) { return which >= v1::STATE_MASTER && which <= v1::STATE_EXP_AVG_SQ; }

// The first float of state `which` in a chunk of n elements: [master][m][v].
float* StateBegin(const CacheEntry& entry, int which, uint64_t n) {
  return reinterpret_cast<float*>(entry.buffer.data()) + static_cast<uint64_t>(which - v1::STATE_MASTER) * n;
}

}  // namespace

absl::Status Session::CheckStateRequest(uint32_t chunk_id, int which, uint32_t slot, uint64_t first, uint64_t count,
                                        const char* verb) const {
  auto registered = registered_.find(chunk_id);
  if (registered == registered_.end()) {
    return absl::InvalidArgumentError(
        fmt::format("{}: chunk {} is not registered in this session of job '{}'", verb, chunk_id, job_name_));
  }
  if (!IsStateKind(which)) {
    return absl::InvalidArgumentError(fmt::format(
        "{}: chunk {}: state {} is not STATE_MASTER, STATE_EXP_AVG or STATE_EXP_AVG_SQ", verb, chunk_id, which));
  }
  const SegmentLayout& layout = layout_;
  if (absl::Status exists = CheckSlotExists(chunk_id, slot); !exists.ok()) {
    return absl::InvalidArgumentError(fmt::format("{}: {}", verb, exists.message()));
  }
  const uint64_t n = registered->second.num_elements;
  // Compared without adding or multiplying client values: nothing can wrap.
  if (count == 0 || first > n || count > n - first) {
    return absl::InvalidArgumentError(fmt::format(
        "{}: chunk {}: {} elements from element {} are not a non-empty range of the chunk's {} elements", verb,
        chunk_id, count, first, n));
  }
  if (count > layout.slot_bytes / sizeof(float)) {
    return absl::InvalidArgumentError(
        fmt::format("{}: chunk {}: {} fp32 values are more than the session's slots of {} bytes hold ({})", verb,
                    chunk_id, count, layout.slot_bytes, layout.slot_bytes / sizeof(float)));
  }
  if (!updated_.empty()) {
    return absl::FailedPreconditionError(fmt::format(
        "{}: chunk {}: step {} of job '{}' has {} chunk updates in flight; states are read and written only "
        "between steps (after EndStep or AbortStep)",
        verb, chunk_id, step_, job_name_, updated_.size()));
  }
  return absl::OkStatus();
}

v1::DaemonMessage Session::OnReadState(const v1::ReadState& request) {
  const uint32_t chunk_id = request.chunk_id();
  if (absl::Status bad = CheckStateRequest(chunk_id, request.which(), request.slot(), request.first_element(),
                                           request.num_elements(), "ReadState");
      !bad.ok()) {
    return ErrorReply(bad, chunk_id);
  }
  if (imported_.count(chunk_id) != 0) {
    return ErrorReply(absl::FailedPreconditionError(fmt::format(
                      "ReadState: chunk {} of job '{}' has import changes not yet committed; send CommitImport first",
                      chunk_id, job_name_)),
                  chunk_id);
  }
  const v1::ChunkRecord& record = job_->manifest().chunks(job_->FindChunk(chunk_id));
  auto acquired = AcquireStates(record);
  if (!acquired.ok()) return ErrorReply(acquired.status(), chunk_id);
  const float* source = StateBegin(**acquired, request.which(), record.num_elements()) + request.first_element();
  std::memcpy(segment_->ParamRegion(request.slot()).data(), source, request.num_elements() * sizeof(float));
  services_.cache.Unpin(*acquired);

  v1::DaemonMessage reply;
  v1::StateRead* read = reply.mutable_state_read();
  read->set_chunk_id(chunk_id);
  read->set_which(request.which());
  read->set_slot(request.slot());
  read->set_first_element(request.first_element());
  read->set_num_elements(request.num_elements());
  read->set_update_count(record.update_count());
  return reply;
}

absl::StatusOr<CacheEntryPtr> Session::AcquireImportedStates(const v1::ChunkRecord& record,
                                                              const ImportedChunk& imported) {
  if (CacheEntryPtr entry = services_.cache.Pin(job_key_, record.chunk_id())) {
    if (entry->load_status.ok() && entry->version == imported.new_version && entry->uncommitted) return entry;
    services_.cache.Unpin(entry);
    services_.cache.Drop(job_key_, record.chunk_id());
  }
  // Evicted: the shadow extent holds what the earlier WriteStates made.
  const v1::StateExtent& extent = record.extents(static_cast<int>(imported.new_version));
  auto created = services_.cache.Create(job_key_, record.chunk_id(), extent.length(), /*wait=*/true);
  if (!created.ok()) return created.status();
  CacheEntryPtr entry = std::move(*created);
  entry->version = imported.new_version;
  entry->uncommitted = true;
  absl::Status status = job_->states().Read(extent.offset(), entry->buffer.span().first(extent.length()));
  if (status.ok()) user_stats_.bytes_read.fetch_add(extent.length(), std::memory_order_relaxed);
  if (status.ok() && PayloadChecksum(*entry, record.num_elements()) != imported.checksum) {
    status = absl::DataLossError(fmt::format(
        "job '{}' chunk {}: the imported states read back from the shadow extent fail their checksum",
        job_name_, record.chunk_id()));
  }
  if (!status.ok()) {
    services_.cache.FinishLoad(entry, status);
    services_.cache.Unpin(entry);
    return status;
  }
  return entry;
}

v1::DaemonMessage Session::OnWriteState(const v1::WriteState& request) {
  const uint32_t chunk_id = request.chunk_id();
  if (absl::Status bad = CheckStateRequest(chunk_id, request.which(), request.slot(), request.first_element(),
                                           request.num_elements(), "WriteState");
      !bad.ok()) {
    return ErrorReply(bad, chunk_id);
  }
  const v1::ChunkRecord& record = job_->manifest().chunks(job_->FindChunk(chunk_id));
  const uint64_t n = record.num_elements();
  auto pending = imported_.find(chunk_id);
  auto acquired = pending != imported_.end() && pending->second.states_written
                      ? AcquireImportedStates(record, pending->second)
                      : AcquireStates(record);
  if (!acquired.ok()) return ErrorReply(acquired.status(), chunk_id);
  CacheEntryPtr entry = std::move(*acquired);
  float* target = StateBegin(*entry, request.which(), n) + request.first_element();
  std::memcpy(target, segment_->GradRegion(request.slot()).data(), request.num_elements() * sizeof(float));

  // The new states go to the shadow extent; the committed one stays intact.
  const uint32_t new_version = 1 - record.committed_version();
  entry->version = new_version;
  entry->uncommitted = true;
  const uint64_t checksum = PayloadChecksum(*entry, n);
  const v1::StateExtent& extent = record.extents(static_cast<int>(new_version));
  absl::Status written = job_->states().Write(extent.offset(), entry->buffer.span().first(extent.length()));
  if (written.ok()) user_stats_.bytes_written.fetch_add(extent.length(), std::memory_order_relaxed);
  services_.cache.Unpin(entry);
  if (!written.ok()) {
    services_.cache.Drop(job_key_, chunk_id);
    DropImportLocked();
    return ErrorReply(absl::Status(written.code(),
                               fmt::format("WriteState: job '{}' chunk {}: cannot write the imported states; the "
                                           "whole pending import was dropped: {}",
                                           job_name_, chunk_id, written.message())),
                  chunk_id);
  }
  ImportedChunk& imported = imported_[chunk_id];
  imported.states_written = true;
  imported.new_version = new_version;
  imported.checksum = checksum;

  v1::DaemonMessage reply;
  v1::StateWritten* done = reply.mutable_state_written();
  done->set_chunk_id(chunk_id);
  done->set_which(request.which());
  done->set_slot(request.slot());
  done->set_first_element(request.first_element());
  done->set_num_elements(request.num_elements());
  return reply;
}

v1::DaemonMessage Session::OnSetUpdateCount(const v1::SetUpdateCount& request) {
  const uint32_t chunk_id = request.chunk_id();
  if (registered_.count(chunk_id) == 0) {
    return ErrorReply(absl::InvalidArgumentError(fmt::format(
                      "SetUpdateCount: chunk {} is not registered in this session of job '{}'", chunk_id, job_name_)),
                  chunk_id);
  }
  if (request.update_count() < 0 || request.update_count() > kMaxUpdateCount) {
    return ErrorReply(absl::InvalidArgumentError(fmt::format(
                          "SetUpdateCount: chunk {}: update_count {} is outside 0..{} (2^53, the most updates a "
                          "chunk may count)",
                          chunk_id, request.update_count(), kMaxUpdateCount)),
                      chunk_id);
  }
  if (!updated_.empty()) {
    return ErrorReply(absl::FailedPreconditionError(fmt::format(
                      "SetUpdateCount: chunk {}: step {} of job '{}' has chunk updates in flight; update counts "
                      "are set only between steps",
                      chunk_id, step_, job_name_)),
                  chunk_id);
  }
  imported_[chunk_id].update_count = request.update_count();
  v1::DaemonMessage reply;
  reply.mutable_update_count_set()->set_chunk_id(chunk_id);
  reply.mutable_update_count_set()->set_update_count(request.update_count());
  return reply;
}

v1::DaemonMessage Session::OnCommitImport() {
  v1::DaemonMessage reply;
  if (!updated_.empty()) {
    v1::Error* error = reply.mutable_error();
    error->set_code(static_cast<int32_t>(absl::StatusCode::kFailedPrecondition));
    error->set_message(fmt::format("CommitImport: step {} of job '{}' has chunk updates in flight; end or abort "
                                   "the step first",
                                   step_, job_name_));
    return reply;
  }
  const auto changed = static_cast<uint32_t>(imported_.size());
  if (!imported_.empty()) {
    v1::JobManifest next = job_->manifest();
    for (const auto& [chunk_id, imported] : imported_) {
      v1::ChunkRecord* record = next.mutable_chunks(job_->FindChunk(chunk_id));
      if (imported.states_written) {
        record->set_committed_version(imported.new_version);
        record->mutable_extents(static_cast<int>(imported.new_version))->set_checksum(imported.checksum);
      }
      if (imported.update_count) record->set_update_count(*imported.update_count);
    }
    if (absl::Status committed = CommitJobLocked(std::move(next)); !committed.ok()) {
      DropImportLocked();
      v1::Error* error = reply.mutable_error();
      error->set_code(static_cast<int32_t>(committed.code()));
      error->set_message(fmt::format("CommitImport: job '{}': the import could not commit and was dropped: {}",
                                     job_name_, committed.message()));
      return reply;
    }
    for (const auto& [chunk_id, imported] : imported_) {
      if (!imported.states_written) continue;
      if (CacheEntryPtr entry = services_.cache.Pin(job_key_, chunk_id)) {
        if (entry->load_status.ok() && entry->version == imported.new_version) services_.cache.MarkCommitted(entry);
        services_.cache.Unpin(entry);
      }
    }
    imported_.clear();
  }
  reply.mutable_import_committed()->set_chunks_changed(changed);
  reply.mutable_import_committed()->set_committed_step(step_ - 1);
  return reply;
}

void Session::DropImportLocked() {
  for (const auto& [chunk_id, imported] : imported_) {
    if (imported.states_written) services_.cache.Drop(job_key_, chunk_id);
  }
  imported_.clear();
}

}  // namespace fuyou
