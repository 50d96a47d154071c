// JobEdit: the next manifest of a job, built with named operations and made the
// committed one by one Commit.
//
// Every change of a job's committed manifest goes through a JobEdit: a
// registration (new chunks, adopted dtypes and fingerprints), a step (chunks
// whose update went to their shadow extents, their update counts, the step) and
// an import. The edit starts from the committed manifest; until Commit nothing
// on disk changes, and an edit that is dropped (destroyed uncommitted) gives
// back the space its AddChunk calls reserved.
//
// Preconditions: every chunk named exists in the edit (in the committed
// manifest or added by AddChunk); the caller validated it. A JobEdit is used on
// the Job's thread (Job is not thread-safe) and must not outlive the Job.
#pragma once

#include <cstdint>
#include <span>

#include "absl/status/status.h"
#include "fuyou/dtype.h"
#include "fuyou/v1/manifest.pb.h"
#include "jobs/job.h"

namespace fuyou {

class JobEdit {
 public:
  explicit JobEdit(Job& job);
  // Gives back the reservations of an uncommitted edit (Job::GiveBackUncommitted).
  ~JobEdit();
  JobEdit(const JobEdit&) = delete;
  JobEdit& operator=(const JobEdit&) = delete;

  // The record of `chunk_id` as this edit leaves it, or null.
  const v1::ChunkRecord* Find(uint32_t chunk_id) const;
  // True when anything was changed since the edit began.
  bool changed() const { return changed_; }

  // A new chunk with two fresh extents, reserved now (Job::AddChunk): its
  // committed version is 0, update count 0; its initial states go to
  // CommittedExtent(*Find(chunk_id)) and InitialStatesWritten records them.
  // `stores_weights` (ChunkRecord.stores_weights): the extents also hold the
  // chunk's working weights (ChunkLayout); `moments_dtype`: m and v's dtype.
  absl::Status AddChunk(uint32_t chunk_id, uint64_t num_elements, DType param_dtype, DType grad_dtype,
                        uint64_t layout_fingerprint, bool stores_weights = false,
                        DType moments_dtype = DType::kFloat32);
  // The committed extent of a new chunk now holds states with `checksums`.
  void InitialStatesWritten(uint32_t chunk_id, ChunkChecksums checksums);
  // A resumed chunk's dtypes as the client now sends them.
  void SetDTypes(uint32_t chunk_id, DType param_dtype, DType grad_dtype);
  // A stored fingerprint of 0 adopts `fingerprint` (ChunkSpec.layout_fingerprint);
  // a stored non-zero one is kept.
  void AdoptLayoutFingerprint(uint32_t chunk_id, uint64_t fingerprint);
  // A chunk stored without segments (ChunkRecord.segment_elements empty: a new
  // chunk, or one created before segments) takes `segments` (validated by the
  // caller, jobs/chunk_segments.h); one stored with segments keeps them. An
  // empty `segments` changes nothing.
  void AdoptSegments(uint32_t chunk_id, std::span<const uint64_t> segments);

  // The chunk's new states (and weights, for a chunk that stores them) were
  // written to its shadow extent and hash to `checksums`: after Commit the
  // shadow is the committed extent and the old committed one is the next
  // shadow. Once per chunk and edit.
  void ShadowWritten(uint32_t chunk_id, ChunkChecksums checksums);
  // The chunk's committed update count after the commit (Adam's t), in
  // [0, kMaxUpdateCount]; clears per-segment counts (every segment has it).
  void SetUpdateCount(uint32_t chunk_id, int64_t update_count);
  // The chunk's per-segment update counts after the commit, one per segment of
  // ChunkRecord.segment_elements (manifest.proto); update_count becomes the
  // largest. Counts that are all equal are stored as update_count alone.
  void SetSegmentUpdateCounts(uint32_t chunk_id, std::span<const int64_t> counts);
  // The job's committed step after the commit.
  void SetCommittedStep(int64_t step);

  // Job::Commit of the edited manifest (see its contract: ABORTED means committed
  // but not known durable). Call once; on an error the job stays as committed.
  absl::Status Commit();
  // Ends the edit without committing and returns the edited manifest, for a
  // commit that runs elsewhere (Job::WriteManifest, then Job::Adopt). The edit
  // gives nothing back, so it must not have reserved anything (no AddChunk).
  v1::JobManifest Release();

 private:
  v1::ChunkRecord* Mutable(uint32_t chunk_id);

  Job& job_;
  v1::JobManifest next_;
  bool changed_ = false;
  bool done_ = false;
};

}  // namespace fuyou
