#include "jobs/job_copy.h"

#include <algorithm>
#include <span>

#include "common/status_util.h"
#include "fmt/format.h"
#include "storage/aligned_buffer.h"

namespace fuyou {

absl::StatusOr<uint64_t> CopyJobStates(Job& src, Job& dst) {
  const v1::JobManifest& from = src.manifest();
  if (dst.manifest().chunks_size() != 0) {
    return absl::FailedPreconditionError(
        fmt::format("cannot copy job '{}' into job '{}': the target already has chunks", src.name(), dst.name()));
  }
  uint64_t largest = 4096;
  for (const v1::ChunkRecord& record : from.chunks()) largest = std::max(largest, CommittedExtent(record).length());
  FUYOU_ASSIGN_OR_RETURN(storage::AlignedBuffer buffer, storage::AlignedBuffer::Allocate(largest));

  v1::JobManifest next = dst.manifest();
  uint64_t copied = 0;
  for (const v1::ChunkRecord& record : from.chunks()) {
    const uint32_t chunk_id = record.chunk_id();
    FUYOU_RETURN_IF_ERROR(dst.AddChunk(next, chunk_id, record.num_elements(), static_cast<DType>(record.param_dtype()),
                                       static_cast<DType>(record.grad_dtype()), record.stores_weights(),
                                       RecordMomentsDType(record)));
    v1::ChunkRecord& added = *next.mutable_chunks(next.chunks_size() - 1);
    const v1::StateExtent& in = CommittedExtent(record);
    v1::StateExtent& out = *added.mutable_extents(static_cast<int>(added.committed_version()));
    if (in.length() != out.length()) {
      return absl::InternalError(fmt::format(
          "cannot copy job '{}' into job '{}': chunk {} has a committed extent of {} bytes, a new one {} bytes",
          src.name(), dst.name(), chunk_id, in.length(), out.length()));
    }
    const std::span<std::byte> bytes = buffer.span().first(in.length());
    if (absl::Status read = src.states().Read(in.offset(), bytes); !read.ok()) {
      return absl::Status(read.code(), fmt::format("cannot copy job '{}' into job '{}': reading chunk {}: {}",
                                                   src.name(), dst.name(), chunk_id, read.message()));
    }
    if (absl::Status written = dst.states().Write(out.offset(), bytes); !written.ok()) {
      return absl::Status(written.code(), fmt::format("cannot copy job '{}' into job '{}': writing chunk {}: {}",
                                                      src.name(), dst.name(), chunk_id, written.message()));
    }
    out.set_checksum(in.checksum());
    out.set_weights_checksum(in.weights_checksum());
    added.set_update_count(record.update_count());
    added.set_layout_fingerprint(record.layout_fingerprint());
    *added.mutable_segment_elements() = record.segment_elements();
    *added.mutable_segment_update_counts() = record.segment_update_counts();
    copied += in.length();
  }
  next.set_committed_step(from.committed_step());
  if (absl::Status committed = dst.Commit(std::move(next)); !committed.ok()) {
    return absl::Status(committed.code(), fmt::format("cannot copy job '{}' into job '{}': committing: {}", src.name(),
                                                      dst.name(), committed.message()));
  }
  return copied;
}

}  // namespace fuyou
