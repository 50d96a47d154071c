#include "state/chunk_registration.h"

#include <cstring>
#include <optional>

#include "common/crash_point.h"
#include "common/status_util.h"
#include "fmt/format.h"
#include "fuyou/checked_math.h"
#include "jobs/job_edit.h"
#include "optimizer/dtype_convert.h"
#include "stats/daemon_stats.h"

namespace fuyou {
namespace {

// The layout a registration gives a new chunk.
ChunkLayout RegistrationLayout(const ChunkRegistration& chunk) {
  ChunkLayout layout{chunk.num_elements};
  if (chunk.store_weights) layout.weights_dtype = chunk.param_dtype;
  layout.moments_dtype = chunk.moments_dtype;
  return layout;
}

}  // namespace

absl::Status CheckResumable(const StoreContext& context, std::span<const ChunkRegistration> chunks) {
  const Job& job = context.job;
  // Whether a chunk stores its working weights is part of its layout on
  // storage: a resumed chunk keeps it, and the weights' dtype with it.
  for (const ChunkRegistration& chunk : chunks) {
    const v1::ChunkRecord* record = context.Find(chunk.chunk_id);
    if (record == nullptr) continue;
    if (record->stores_weights() != chunk.store_weights) {
      return absl::FailedPreconditionError(fmt::format(
          "job '{}' chunk {} was created {} its working weights in the daemon, but this registration asks "
          "store_weights={}; a resumed chunk keeps what it was created with: register it with store_weights={} "
          "(fuyou.AdamW offload_params={}), or start a new job to change it; nothing was registered",
          job.name(), chunk.chunk_id, record->stores_weights() ? "storing" : "without storing",
          chunk.store_weights, record->stores_weights(), record->stores_weights() ? "True" : "False"));
    }
    if (const DType stored = RecordMomentsDType(*record); stored != chunk.moments_dtype) {
      return absl::FailedPreconditionError(fmt::format(
          "job '{}' chunk {} keeps its Adam moments (m, v) as {}, but this registration asks for {}; the state "
          "dtype is fixed when a job is created: resume it with state_dtype=\"{}\" (fuyou.AdamW), or start a new "
          "job (or export the optimizer state and import it into one) to change it; nothing was registered",
          job.name(), chunk.chunk_id, DTypeName(stored), DTypeName(chunk.moments_dtype),
          stored == DType::kBFloat16 ? "bf16" : stored == DType::kBlock8 ? "8bit" : "fp32"));
    }
    if (record->stores_weights() && static_cast<DType>(record->param_dtype()) != chunk.param_dtype) {
      return absl::FailedPreconditionError(fmt::format(
          "job '{}' chunk {} stores its working weights as {}, but this registration sends param_dtype {}; "
          "resume it with {} parameters, or start a new job to change their dtype; nothing was registered",
          job.name(), chunk.chunk_id, DTypeName(static_cast<DType>(record->param_dtype())),
          DTypeName(chunk.param_dtype), DTypeName(static_cast<DType>(record->param_dtype()))));
    }
  }
  return absl::OkStatus();
}

absl::StatusOr<std::vector<ChunkRegistered>> RegisterChunks(StoreContext& context, CommittedReader& reader,
                                                            LearnedOrder& order,
                                                            std::span<const ChunkRegistration> chunks,
                                                            uint64_t job_quota_bytes, StorageBudget* budget) {
  Job& job = context.job;
  // Reserve the extents of every new chunk before writing anything: a job that
  // does not fit (the per-job quota, or the storage paths) is refused with
  // nothing written and nothing committed. Each chunk's states are below half
  // the DRAM budget (validated); the sums are checked all the same.
  std::optional<uint64_t> new_bytes = 0;
  for (const ChunkRegistration& chunk : chunks) {
    if (context.Find(chunk.chunk_id) == nullptr) {
      new_bytes = CheckedAdd(new_bytes, CheckedMul(RegistrationLayout(chunk).ExtentBytes(), 2));
    }
  }
  if (!new_bytes) {
    return absl::InvalidArgumentError(fmt::format(
        "job '{}': the chunks of this request need more than 2^64 bytes of states; nothing was written",
        job.name()));
  }
  if (job_quota_bytes != 0 && *new_bytes != 0) {
    const std::optional<uint64_t> needed = CheckedAdd(job.bytes_on_storage(), *new_bytes);
    if (!needed || *needed > job_quota_bytes) {
      return absl::ResourceExhaustedError(fmt::format(
          "job '{}' needs {} bytes on storage, over the per-job quota of {} ({} bytes already reserved, {} more for "
          "the chunks of this request); nothing was written. Use fewer or smaller chunks, or raise [storage] "
          "job_quota / --job-quota",
          job.name(), needed ? fmt::format("{}", *needed) : std::string("more than 2^64"), job_quota_bytes,
          job.bytes_on_storage(), *new_bytes));
    }
  }
  // Held until the extents are reserved (the disk shows them after that).
  StorageBudget::Grant grant;
  if (budget != nullptr && *new_bytes != 0) {
    FUYOU_ASSIGN_OR_RETURN(grant, budget->Admit(job.uid(), *new_bytes, fmt::format("job '{}'", job.name())));
  }
  JobEdit edit(job);  // gives back its reservations unless committed
  bool any_new = false;
  for (const ChunkRegistration& chunk : chunks) {
    if (context.Find(chunk.chunk_id) != nullptr) continue;
    FUYOU_RETURN_IF_ERROR(edit.AddChunk(chunk.chunk_id, chunk.num_elements, chunk.param_dtype, chunk.grad_dtype,
                                        chunk.layout_fingerprint, chunk.store_weights, chunk.moments_dtype));
    edit.AdoptSegments(chunk.chunk_id, chunk.segment_elements);
    any_new = true;
  }
  if (any_new) FUYOU_CRASH_POINT("registration_reserved");
  // On failure, forget the states of new chunks: the manifest never named them.
  std::vector<uint32_t> cached_new;
  auto fail = [&](absl::Status status) {
    for (uint32_t id : cached_new) context.cache.Drop(CacheSpace::kStates, id);
    return status;
  };

  std::vector<ChunkRegistered> results;
  for (const ChunkRegistration& chunk : chunks) {
    const uint32_t id = chunk.chunk_id;
    if (const v1::ChunkRecord* record = context.Find(id)) {
      auto pin = reader.Acquire(*record, /*pending=*/false);
      if (!pin.ok()) return fail(pin.status());
      const ChunkStates states(pin->data(), RecordLayout(*record));
      if (states.weights() != nullptr) {  // its committed working weights, in param_dtype (checked above)
        std::memcpy(chunk.weights.data(), states.weights(), states.weights_bytes());
      } else {
        optimizer::ConvertFromFloat32(states.master(), chunk.weights.data(), chunk.param_dtype,
                                      record->num_elements());
      }
      edit.SetDTypes(id, chunk.param_dtype, chunk.grad_dtype);
      edit.AdoptLayoutFingerprint(id, chunk.layout_fingerprint);  // see ChunkSpec.layout_fingerprint
      edit.AdoptSegments(id, chunk.segment_elements);               // see ChunkSpec.segment_elements
      results.push_back(ChunkRegistered{.resumed = true,
                                        .update_count = record->update_count(),
                                        .segment_update_counts = {record->segment_update_counts().begin(),
                                                                  record->segment_update_counts().end()}});
      continue;
    }
    const v1::StateExtent& extent = CommittedExtent(*edit.Find(id));
    auto created = context.cache.Create(CacheSpace::kStates, id, extent.length(), /*wait=*/true);
    if (!created.ok()) return fail(created.status());
    cached_new.push_back(id);
    StatePin pin = std::move(*created);
    const ChunkLayout layout = RecordLayout(*edit.Find(id));
    const ChunkStates states(pin.data(), layout);
    optimizer::ConvertToFloat32(chunk.weights.data(), chunk.param_dtype, states.master(), chunk.num_elements);
    // m, v and the padding start at zero.
    const uint64_t master_bytes = layout.StateOffset(ChunkState::kExpAvg);
    std::memset(pin.data() + master_bytes, 0, pin.size() - master_bytes);
    // The working weights: the master just read, back in param_dtype (the
    // slot's values exactly: every param dtype converts to fp32 and back
    // losslessly), as an update would store them.
    if (states.weights() != nullptr) {
      optimizer::ConvertFromFloat32(states.master(), states.weights(), chunk.param_dtype, chunk.num_elements);
    }
    edit.InitialStatesWritten(id, ComputeChunkChecksums(pin.data(), layout));
    context.cache.cache().SetContents(pin, edit.Find(id)->committed_version(), /*committed=*/true);
    absl::Status written = job.states().Write(extent.offset(), std::span(pin.data(), extent.length()));
    if (written.ok()) context.counters.Bump(Ticker::kBytesWritten, extent.length());
    pin.Reset();
    if (!written.ok()) {
      return fail(absl::Status(written.code(),
                               fmt::format("job '{}': cannot write the initial states of chunk {}: {}; nothing of "
                                           "this registration was committed",
                                           job.name(), id, written.message())));
    }
    results.push_back(ChunkRegistered{.resumed = false, .update_count = 0});
  }
  if (any_new) FUYOU_CRASH_POINT("registration_states_written");
  if (edit.changed()) {
    absl::Status committed = edit.Commit();
    context.Reload();
    if (!committed.ok()) return fail(committed);
  }
  if (any_new) FUYOU_CRASH_POINT("registration_committed");
  for (const ChunkRegistration& chunk : chunks) order.Registered(chunk.chunk_id);
  return results;
}

}  // namespace fuyou
