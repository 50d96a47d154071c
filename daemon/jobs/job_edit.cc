#include "jobs/job_edit.h"

#include <algorithm>

namespace fuyou {

JobEdit::JobEdit(Job& job) : job_(job), next_(job.manifest()) {}

JobEdit::~JobEdit() {
  if (!done_) job_.GiveBackUncommitted();
}

const v1::ChunkRecord* JobEdit::Find(uint32_t chunk_id) const {
  for (const v1::ChunkRecord& record : next_.chunks()) {
    if (record.chunk_id() == chunk_id) return &record;
  }
  return nullptr;
}

v1::ChunkRecord* JobEdit::Mutable(uint32_t chunk_id) {
  changed_ = true;
  for (v1::ChunkRecord& record : *next_.mutable_chunks()) {
    if (record.chunk_id() == chunk_id) return &record;
  }
  return nullptr;  // precondition violated: the caller names only existing chunks
}

absl::Status JobEdit::AddChunk(uint32_t chunk_id, uint64_t num_elements, DType param_dtype, DType grad_dtype,
                               uint64_t layout_fingerprint, bool stores_weights, DType moments_dtype) {
  absl::Status added =
      job_.AddChunk(next_, chunk_id, num_elements, param_dtype, grad_dtype, stores_weights, moments_dtype);
  if (!added.ok()) return added;
  Mutable(chunk_id)->set_layout_fingerprint(layout_fingerprint);
  return absl::OkStatus();
}

namespace {
void SetChecksums(v1::StateExtent& extent, ChunkChecksums checksums) {
  extent.set_checksum(checksums.states);
  extent.set_weights_checksum(checksums.weights);
}
}  // namespace

void JobEdit::InitialStatesWritten(uint32_t chunk_id, ChunkChecksums checksums) {
  v1::ChunkRecord* record = Mutable(chunk_id);
  SetChecksums(*record->mutable_extents(static_cast<int>(record->committed_version())), checksums);
}

void JobEdit::SetDTypes(uint32_t chunk_id, DType param_dtype, DType grad_dtype) {
  const v1::ChunkRecord* record = Find(chunk_id);
  if (record->param_dtype() == static_cast<v1::DType>(param_dtype) &&
      record->grad_dtype() == static_cast<v1::DType>(grad_dtype)) {
    return;
  }
  v1::ChunkRecord* edited = Mutable(chunk_id);
  edited->set_param_dtype(static_cast<v1::DType>(param_dtype));
  edited->set_grad_dtype(static_cast<v1::DType>(grad_dtype));
}

void JobEdit::AdoptLayoutFingerprint(uint32_t chunk_id, uint64_t fingerprint) {
  if (Find(chunk_id)->layout_fingerprint() != 0 || fingerprint == 0) return;
  Mutable(chunk_id)->set_layout_fingerprint(fingerprint);
}

void JobEdit::AdoptSegments(uint32_t chunk_id, std::span<const uint64_t> segments) {
  if (segments.empty() || !Find(chunk_id)->segment_elements().empty()) return;
  v1::ChunkRecord* record = Mutable(chunk_id);
  for (uint64_t elements : segments) record->add_segment_elements(elements);
}

void JobEdit::ShadowWritten(uint32_t chunk_id, ChunkChecksums checksums) {
  v1::ChunkRecord* record = Mutable(chunk_id);
  const uint32_t shadow = ShadowVersion(*record);
  SetChecksums(*record->mutable_extents(static_cast<int>(shadow)), checksums);
  record->set_committed_version(shadow);
}

void JobEdit::SetUpdateCount(uint32_t chunk_id, int64_t update_count) {
  v1::ChunkRecord* record = Mutable(chunk_id);
  record->set_update_count(update_count);
  record->clear_segment_update_counts();
}

void JobEdit::SetSegmentUpdateCounts(uint32_t chunk_id, std::span<const int64_t> counts) {
  v1::ChunkRecord* record = Mutable(chunk_id);
  record->clear_segment_update_counts();
  if (counts.empty()) return;
  const int64_t largest = *std::max_element(counts.begin(), counts.end());
  record->set_update_count(largest);
  if (std::all_of(counts.begin(), counts.end(), [&](int64_t count) { return count == largest; })) return;
  for (int64_t count : counts) record->add_segment_update_counts(count);
}

void JobEdit::SetCommittedStep(int64_t step) {
  changed_ = true;
  next_.set_committed_step(step);
}

absl::Status JobEdit::Commit() {
  done_ = true;
  absl::Status committed = job_.Commit(std::move(next_));
  if (!committed.ok() && !absl::IsAborted(committed)) job_.GiveBackUncommitted();
  return committed;
}

v1::JobManifest JobEdit::Release() {
  done_ = true;
  return std::move(next_);
}

}  // namespace fuyou
