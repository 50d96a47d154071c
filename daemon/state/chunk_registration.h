// Registration of a job's chunks: new chunks' extents and initial states,
// resumed chunks' committed weights, adopted dtypes, fingerprints, segments.
//
// Two steps, so that the store can make its acknowledged steps durable in
// between: CheckResumable refuses, before anything is done, what a resumed
// chunk cannot change; RegisterChunks then does the work in one manifest
// commit. Crash points (common/crash_point.h): registration_reserved,
// registration_states_written, registration_committed.
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include "absl/status/statusor.h"
#include "fuyou/dtype.h"
#include "jobs/storage_budget.h"
#include "state/committed_reader.h"
#include "state/learned_order.h"
#include "state/store_context.h"

namespace fuyou {

struct ChunkRegistration {
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
  // ChunkSpec.moments_dtype (fp32 or bf16, checked by the session): the dtype
  // of m and v. Fixed at creation: a resumed chunk must send its stored one.
  DType moments_dtype = DType::kFloat32;
};

struct ChunkRegistered {
  bool resumed = false;
  int64_t update_count = 0;
  // ChunkRecord.segment_update_counts: per segment when they differ, else empty.
  std::vector<int64_t> segment_update_counts{};
};

// FAILED_PRECONDITION for a resumed chunk whose store_weights or moments dtype
// differs from its stored one, or that stores weights and changes its param_dtype.
absl::Status CheckResumable(const StoreContext& context, std::span<const ChunkRegistration> chunks);

// Registers `chunks` (validated by the caller, and CheckResumable; the
// acknowledged manifest is the durable one): see ChunkStore::Register.
// Registered chunks join `order` (the learned arrival order).
absl::StatusOr<std::vector<ChunkRegistered>> RegisterChunks(StoreContext& context, CommittedReader& reader,
                                                            LearnedOrder& order,
                                                            std::span<const ChunkRegistration> chunks,
                                                            uint64_t job_quota_bytes,
                                                            StorageBudget* budget = nullptr);

}  // namespace fuyou
