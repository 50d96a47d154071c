#include "state/state_import.h"

#include <cstring>

#include "common/status_util.h"
#include "fmt/format.h"
#include "jobs/job_edit.h"
#include "optimizer/block8_moments.h"
#include "optimizer/dtype_convert.h"
#include "stats/daemon_stats.h"

namespace fuyou {
namespace {

// Which moment `which` is (8-bit moments; not the master).
optimizer::Moment MomentOf(ChunkState which) {
  return which == ChunkState::kExpAvg ? optimizer::Moment::kExpAvg : optimizer::Moment::kExpAvgSq;
}

}  // namespace

absl::Status StateImport::Export(uint32_t chunk_id, ChunkState which, uint64_t first, std::span<float> out) {
  const v1::ChunkRecord* record = context_.Find(chunk_id);
  FUYOU_ASSIGN_OR_RETURN(StatePin pin, reader_.Acquire(*record, durability_.IsPending(chunk_id)));
  const ChunkStates states(pin.data(), RecordLayout(*record));
  // Always fp32 on the wire: bf16 moments are widened (exactly), 8-bit ones decoded.
  const DType dtype = states.layout().StateDType(which);
  if (dtype == DType::kBlock8) {
    optimizer::DecodeBlock8(MomentOf(which), reinterpret_cast<const uint8_t*>(states.state(which)),
                            states.moment_scales(which), first, out);
    return absl::OkStatus();
  }
  optimizer::ConvertToFloat32(states.state(which) + first * DTypeSize(dtype), dtype, out.data(), out.size());
  return absl::OkStatus();
}

absl::StatusOr<StatePin> StateImport::AcquireImported(const v1::ChunkRecord& record, const Imported& imported) {
  const JobCache& cache = context_.cache;
  Job& job = context_.job;
  const uint32_t shadow = ShadowVersion(record);
  if (StatePin pin = cache.Pin(CacheSpace::kStates, record.chunk_id())) {
    if (pin.load_status().ok() && pin.version() == shadow && !pin.committed()) return pin;
    pin.Reset();
    cache.Drop(CacheSpace::kStates, record.chunk_id());
  }
  // Evicted: the shadow extent holds what the earlier ImportState calls wrote.
  const v1::StateExtent& extent = ShadowExtent(record);
  FUYOU_ASSIGN_OR_RETURN(StatePin pin,
                         cache.Create(CacheSpace::kStates, record.chunk_id(), extent.length(), /*wait=*/true));
  cache.cache().SetContents(pin, shadow, /*committed=*/false);
  absl::Status status = job.states().Read(extent.offset(), std::span(pin.data(), extent.length()));
  if (status.ok()) context_.counters.Bump(Ticker::kBytesRead, extent.length());
  if (status.ok() && ComputeChunkChecksums(pin.data(), RecordLayout(record)) != imported.checksums) {
    status = absl::DataLossError(fmt::format(
        "job '{}' chunk {}: the imported states read back from the shadow extent fail their checksum", job.name(),
        record.chunk_id()));
  }
  if (!status.ok()) {
    cache.cache().FinishLoad(pin, status);
    return status;
  }
  return pin;
}

absl::Status StateImport::Import(uint32_t chunk_id, ChunkState which, uint64_t first,
                                 std::span<const float> values) {
  const JobCache& cache = context_.cache;
  Job& job = context_.job;
  const v1::ChunkRecord* record = context_.Find(chunk_id);
  const ChunkLayout layout = RecordLayout(*record);
  auto pending = imported_.find(chunk_id);
  FUYOU_ASSIGN_OR_RETURN(StatePin pin, pending != imported_.end() && pending->second.states_written
                                           ? AcquireImported(*record, pending->second)
                                           : reader_.Acquire(*record, durability_.IsPending(chunk_id)));
  const ChunkStates states(pin.data(), layout);
  // fp32 on the wire: bf16 moments are rounded to nearest even; 8-bit ones
  // encoded, each block touched with a new scale.
  const DType dtype = layout.StateDType(which);
  if (dtype == DType::kBlock8) {
    optimizer::EncodeBlock8(MomentOf(which), reinterpret_cast<uint8_t*>(states.state(which)),
                            states.moment_scales(which), layout.num_elements, first, values);
  } else {
    optimizer::ConvertFromFloat32(values.data(), states.state(which) + first * DTypeSize(dtype), dtype,
                                  values.size());
  }
  if (which == ChunkState::kMaster && states.weights() != nullptr) {
    // The working weights follow the imported master, as after an update.
    optimizer::ConvertFromFloat32(states.master(), states.weights(), *layout.weights_dtype, layout.num_elements);
  }
  // The new states go to the shadow extent; the committed one stays intact.
  cache.cache().SetContents(pin, ShadowVersion(*record), /*committed=*/false);
  const ChunkChecksums checksums = ComputeChunkChecksums(pin.data(), layout);
  const v1::StateExtent& extent = ShadowExtent(*record);
  absl::Status written = job.states().Write(extent.offset(), std::span(pin.data(), extent.length()));
  if (written.ok()) context_.counters.Bump(Ticker::kBytesWritten, extent.length());
  pin.Reset();
  if (!written.ok()) {
    cache.Drop(CacheSpace::kStates, chunk_id);
    Drop();
    return absl::Status(written.code(), fmt::format("job '{}' chunk {}: cannot write the imported states; the whole "
                                                    "pending import was dropped: {}",
                                                    job.name(), chunk_id, written.message()));
  }
  Imported& imported = imported_[chunk_id];
  imported.states_written = true;
  imported.checksums = checksums;
  return absl::OkStatus();
}

void StateImport::ImportUpdateCount(uint32_t chunk_id, int64_t update_count,
                                    std::vector<int64_t> segment_update_counts) {
  Imported& imported = imported_[chunk_id];
  imported.update_count = update_count;
  imported.segment_update_counts = std::move(segment_update_counts);
}

absl::StatusOr<uint32_t> StateImport::Commit(std::optional<int64_t> resume_step) {
  const auto changed = static_cast<uint32_t>(imported_.size());
  if (imported_.empty() && !resume_step) return changed;
  JobEdit edit(context_.job);
  if (resume_step) edit.SetCommittedStep(*resume_step);
  for (const auto& [chunk_id, imported] : imported_) {
    if (imported.states_written) edit.ShadowWritten(chunk_id, imported.checksums);
    if (!imported.update_count) continue;
    edit.SetUpdateCount(chunk_id, *imported.update_count);
    if (!imported.segment_update_counts.empty()) edit.SetSegmentUpdateCounts(chunk_id, imported.segment_update_counts);
  }
  absl::Status committed = edit.Commit();
  context_.Reload();
  if (!committed.ok()) {
    Drop();
    return committed;
  }
  for (const auto& [chunk_id, imported] : imported_) {
    if (!imported.states_written) continue;
    context_.cache.MarkCommitted(chunk_id, context_.Find(chunk_id)->committed_version());
    context_.cache.Drop(CacheSpace::kWeights, chunk_id);  // the committed extent changed
  }
  imported_.clear();
  return changed;
}

void StateImport::Drop() {
  for (const auto& [chunk_id, imported] : imported_) {
    if (imported.states_written) context_.cache.Drop(CacheSpace::kStates, chunk_id);
  }
  imported_.clear();
}

}  // namespace fuyou
