// Session: export and import of a job's optimizer states, between steps.
//
// ReadState copies fp32 values of a chunk's committed state into a slot's
// parameter region. WriteState copies fp32 values from a slot's gradient region
// into a chunk's states; the store writes the chunk's whole new states to its
// shadow extent at once (synchronously: an import is rare), so the cache may
// evict them before CommitImport without losing anything. CommitImport points
// the manifest at the shadow extents and sets the update counts in one atomic
// commit that keeps the committed step (or sets a new job's: resume_step);
// until then the committed extents are untouched and the end of the session
// drops the import (ChunkStore's import).
#include <algorithm>
#include <optional>
#include <vector>

#include "common/status_util.h"
#include "fmt/format.h"
#include "jobs/chunk_segments.h"
#include "session/session.h"
#include "session/stream_replies.h"

namespace fuyou {
namespace {

ChunkState ToChunkState(int which) { return static_cast<ChunkState>(which - v1::STATE_MASTER); }

}  // namespace

v1::DaemonMessage Session::OnReadState(const v1::ReadState& request) {
  const uint32_t chunk_id = request.chunk_id();
  if (absl::Status bad = CheckStateRequest(chunk_id, request.which(), request.slot(), request.first_element(),
                                           request.num_elements(), "ReadState");
      !bad.ok()) {
    return ErrorReply(bad, chunk_id);
  }
  if (held_.store->HasPendingImport(chunk_id)) {
    return ErrorReply(absl::FailedPreconditionError(fmt::format(
                          "ReadState: chunk {} of job '{}' has import changes not yet committed; send CommitImport "
                          "first",
                          chunk_id, identity_.job_name)),
                      chunk_id);
  }
  auto* out = reinterpret_cast<float*>(held_.segment->ParamRegion(request.slot()).data());
  if (absl::Status read = held_.store->ExportState(chunk_id, ToChunkState(request.which()), request.first_element(),
                                                   std::span(out, request.num_elements()));
      !read.ok()) {
    return ErrorReply(read, chunk_id);
  }
  v1::DaemonMessage reply;
  v1::StateRead* read = reply.mutable_state_read();
  read->set_chunk_id(chunk_id);
  read->set_which(request.which());
  read->set_slot(request.slot());
  read->set_first_element(request.first_element());
  read->set_num_elements(request.num_elements());
  read->set_update_count(held_.store->Find(chunk_id)->update_count());
  return reply;
}

v1::DaemonMessage Session::OnWriteState(const v1::WriteState& request) {
  const uint32_t chunk_id = request.chunk_id();
  if (absl::Status bad = CheckStateRequest(chunk_id, request.which(), request.slot(), request.first_element(),
                                           request.num_elements(), "WriteState");
      !bad.ok()) {
    return ErrorReply(bad, chunk_id);
  }
  const auto* values = reinterpret_cast<const float*>(held_.segment->GradRegion(request.slot()).data());
  if (absl::Status written = held_.store->ImportState(chunk_id, ToChunkState(request.which()), request.first_element(),
                                                      std::span(values, request.num_elements()));
      !written.ok()) {
    return ErrorReply(absl::Status(written.code(), fmt::format("WriteState: {}", written.message())), chunk_id);
  }
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
    return ErrorReply(
        absl::InvalidArgumentError(fmt::format("SetUpdateCount: chunk {} is not registered in this session of job '{}'",
                                               chunk_id, identity_.job_name)),
        chunk_id);
  }
  if (request.update_count() < 0 || request.update_count() > kMaxUpdateCount) {
    return ErrorReply(absl::InvalidArgumentError(fmt::format(
                          "SetUpdateCount: chunk {}: update_count {} is outside 0..{} (2^53, the most updates a "
                          "chunk may count)",
                          chunk_id, request.update_count(), kMaxUpdateCount)),
                      chunk_id);
  }
  std::vector<int64_t> segment_counts(request.segment_update_counts().begin(), request.segment_update_counts().end());
  if (!segment_counts.empty()) {
    const size_t segments = SegmentCount(*held_.store->Find(chunk_id));
    if (segment_counts.size() != segments) {
      return ErrorReply(absl::InvalidArgumentError(fmt::format(
                            "SetUpdateCount: chunk {} of job '{}' has {} segments, but {} segment_update_counts "
                            "were sent; send one per segment, or none",
                            chunk_id, identity_.job_name, segments, segment_counts.size())),
                        chunk_id);
    }
    int64_t largest = 0;
    for (size_t i = 0; i < segment_counts.size(); ++i) {
      if (segment_counts[i] < 0 || segment_counts[i] > kMaxUpdateCount) {
        return ErrorReply(absl::InvalidArgumentError(fmt::format(
                              "SetUpdateCount: chunk {}: segment_update_counts[{}] = {} is outside 0..{}", chunk_id,
                              i, segment_counts[i], kMaxUpdateCount)),
                          chunk_id);
      }
      largest = std::max(largest, segment_counts[i]);
    }
    if (largest != request.update_count()) {
      return ErrorReply(absl::InvalidArgumentError(fmt::format(
                            "SetUpdateCount: chunk {}: update_count {} is not the largest of its "
                            "segment_update_counts ({}); send their maximum",
                            chunk_id, request.update_count(), largest)),
                        chunk_id);
    }
  }
  if (held_.store->staged_count() != 0) {
    return ErrorReply(absl::FailedPreconditionError(fmt::format(
                          "SetUpdateCount: chunk {}: step {} of job '{}' has chunk updates in flight; update counts "
                          "are set only between steps",
                          chunk_id, step_.current, identity_.job_name)),
                      chunk_id);
  }
  held_.store->ImportUpdateCount(chunk_id, request.update_count(), std::move(segment_counts));
  v1::DaemonMessage reply;
  reply.mutable_update_count_set()->set_chunk_id(chunk_id);
  reply.mutable_update_count_set()->set_update_count(request.update_count());
  return reply;
}

v1::DaemonMessage Session::OnCommitImport(const v1::CommitImport& request) {
  if (held_.store->staged_count() != 0) {
    return ErrorReply(absl::FailedPreconditionError(
        fmt::format("CommitImport: step {} of job '{}' has chunk updates in flight; end or abort the step first",
                    step_.current, identity_.job_name)));
  }
  std::optional<int64_t> resume_step;
  if (request.resume_step() != 0) {
    if (request.resume_step() < 0 || request.resume_step() > kMaxUpdateCount) {
      return ErrorReply(absl::InvalidArgumentError(fmt::format(
          "CommitImport: resume_step {} is outside 1..{}; send 0 to keep the committed step", request.resume_step(),
          kMaxUpdateCount)));
    }
    if (step_.current != 1) {
      return ErrorReply(absl::FailedPreconditionError(fmt::format(
          "CommitImport: job '{}' has committed step {}; resume_step {} sets the step of a job that committed none "
          "yet (send 0 to keep it)",
          identity_.job_name, step_.current - 1, request.resume_step())));
    }
    resume_step = request.resume_step();
  }
  auto changed = held_.store->CommitImport(resume_step);
  if (!changed.ok()) {
    const absl::Status status = NoteCommitResult(changed.status());
    return ErrorReply(absl::Status(
        status.code(), fmt::format("CommitImport: job '{}': the import could not commit and was dropped: {}",
                                   identity_.job_name, status.message())));
  }
  v1::DaemonMessage reply;
  step_.current = held_.store->committed_step() + 1;
  reply.mutable_import_committed()->set_chunks_changed(*changed);
  reply.mutable_import_committed()->set_committed_step(step_.current - 1);
  return reply;
}

}  // namespace fuyou
