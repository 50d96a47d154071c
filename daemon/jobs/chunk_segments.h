// Chunk segments: the parameters (or parameter pieces) packed into a chunk, each
// with its own update count (Adam's t). The checks of every segment list and
// count that reaches the daemon, from a client (ChunkSpec.segment_elements,
// GradReady.segments_without_grad) or from disk (ChunkRecord.segment_elements,
// segment_update_counts), and the helpers that read a record's segments.
//
// The contract (offload.proto, manifest.proto):
//   - segment_elements: at most kMaxChunkSegments entries, each > 0, summing to
//     the chunk's num_elements; empty means one segment of num_elements.
//   - A resumed chunk sends the segments it was created with. A chunk stored
//     without segments (created before segments, or by a client that sends
//     none) adopts the first segments a resume sends, as a stored layout
//     fingerprint of 0 adopts the first one sent.
//   - segments_without_grad: ascending, no repeats, each < the number of
//     segments.
//   - segment_update_counts: empty (every segment at update_count), or one entry
//     per segment, each in [0, kMaxUpdateCount], the largest equal to
//     update_count.
// Client input is refused with INVALID_ARGUMENT (malformed) or
// FAILED_PRECONDITION (a resume that does not match what is stored), each
// message naming the chunk and what is wrong; a manifest problem is returned as
// text for ValidateManifest to wrap in its DATA_LOSS.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/status.h"
#include "fuyou/v1/manifest.pb.h"
#include "fuyou/v1/offload.pb.h"
#include "fuyou/wire_limits.h"

namespace fuyou {

// OK when `spec.segment_elements` is a valid segment list for its num_elements;
// else INVALID_ARGUMENT "chunk <id>: segment_elements ...".
absl::Status CheckSegmentElements(const v1::ChunkSpec& spec);

// OK when `spec` may resume `record` as far as segments go: the same list
// (empty and one segment of num_elements are the same list), or a record
// without segments (which then adopts spec's, see AdoptsSegments). Else
// FAILED_PRECONDITION naming the job, the chunk and both lists. `spec` has
// passed CheckSegmentElements.
absl::Status CheckResumedSegments(std::string_view job, const v1::ChunkRecord& record, const v1::ChunkSpec& spec);

// True when resuming `record` with `spec` stores spec's segments in the record:
// the record has none and spec sends more than one.
bool AdoptsSegments(const v1::ChunkRecord& record, const v1::ChunkSpec& spec);

// The segment list a new chunk's record stores for `spec`: empty for one
// segment (whether sent empty or as {num_elements}), else spec's list.
std::vector<uint64_t> SegmentsToStore(const v1::ChunkSpec& spec);

// OK when `request.segments_without_grad` is ascending, without repeats, and
// names segments of a chunk with `num_segments`; else INVALID_ARGUMENT
// "chunk <id>: segments_without_grad ...".
absl::Status CheckSegmentsWithoutGrad(const v1::GradReady& request, size_t num_segments);

// "" when the segment fields of `record` are consistent (segment_elements valid
// for num_elements; segment_update_counts empty or one per segment, each in
// [0, kMaxUpdateCount], their maximum equal to update_count); else what is
// wrong, for ValidateManifest ("chunk <id> " + problem).
std::string SegmentRecordProblem(const v1::ChunkRecord& record);

// Number of segments of a chunk: 1 when its record has no segment list.
size_t SegmentCount(const v1::ChunkRecord& record);

// The update count of each segment of `record` (SegmentCount entries): its
// segment_update_counts, or update_count for every segment when they are empty.
std::vector<int64_t> SegmentUpdateCounts(const v1::ChunkRecord& record);

}  // namespace fuyou
