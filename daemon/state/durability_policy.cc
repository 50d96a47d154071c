#include "state/durability_policy.h"

#include <algorithm>
#include <cstring>

#include "common/status_util.h"
#include "common/trace.h"
#include "fmt/format.h"
#include "fuyou/checked_math.h"
#include "stats/daemon_stats.h"

namespace fuyou {

DurabilityPolicy::DurabilityPolicy(StoreContext& context, DurabilityInterval interval)
    : context_(context), interval_(interval), last_durable_(std::chrono::steady_clock::now()) {}

void DurabilityPolicy::UpdateStarting() {
  if (step_begun_) return;
  step_begun_ = true;
  step_durable_ = true;
  if (interval_.every_steps <= 1) return;
  if (steps_since_durable_ + 1 >= interval_.every_steps) return;
  if (interval_.every_seconds > 0 &&
      std::chrono::duration<double>(std::chrono::steady_clock::now() - last_durable_).count() >=
          interval_.every_seconds) {
    return;
  }
  if (held_bytes_ == 0) {
    // Every chunk pending, plus an undo copy of each: twice the job's states.
    std::optional<uint64_t> bytes = 0;
    for (const v1::ChunkRecord& record : context_.acknowledged.chunks()) {
      bytes = CheckedAdd(bytes, CheckedMul(CommittedExtent(record).length(), 2));
    }
    if (!bytes || *bytes == 0 || !context_.cache.cache().TryHold(*bytes)) return;  // does not fit: durable
    held_bytes_ = *bytes;
  }
  step_durable_ = false;
}

const StatePin* DurabilityPolicy::Pending(uint32_t chunk_id) const {
  const auto it = pending_.find(chunk_id);
  return it == pending_.end() ? nullptr : &it->second;
}

bool DurabilityPolicy::HasAcknowledged() const {
  return !pending_.empty() || context_.acknowledged.committed_step() != context_.job.manifest().committed_step();
}

absl::StatusOr<StatePin> DurabilityPolicy::TakeUndo(uint32_t chunk_id, const StatePin& states) {
  if (!IsPending(chunk_id)) return StatePin();
  FUYOU_ASSIGN_OR_RETURN(StatePin undo,
                         context_.cache.Create(CacheSpace::kUndo, chunk_id, states.size(), /*wait=*/true));
  std::memcpy(undo.data(), states.data(), states.size());
  return undo;
}

bool DurabilityPolicy::Restore(uint32_t chunk_id, StatePin& undo) {
  auto pending = pending_.find(chunk_id);
  if (pending == pending_.end()) {
    DropUndo(chunk_id, undo);
    return false;
  }
  StatePin& states = pending->second;
  std::memcpy(states.data(), undo.data(), std::min(states.size(), undo.size()));
  context_.cache.cache().SetContents(states, ShadowVersion(*context_.Find(chunk_id)), /*committed=*/true);
  DropUndo(chunk_id, undo);
  return true;
}

void DurabilityPolicy::DropUndo(uint32_t chunk_id, StatePin& undo) {
  if (!undo) return;
  undo.Reset();
  context_.cache.Drop(CacheSpace::kUndo, chunk_id);
}

void DurabilityPolicy::Keep(uint32_t chunk_id, StatePin states) {
  context_.cache.cache().SetContents(states, ShadowVersion(*context_.Find(chunk_id)), /*committed=*/true);
  pending_[chunk_id] = std::move(states);
}

absl::Status DurabilityPolicy::WritePending(JobEdit& edit, int64_t step, const std::function<bool(uint32_t)>& skip,
                                            std::vector<uint32_t>& changed) {
  Job& job = context_.job;
  for (const auto& [chunk_id, states] : pending_) {
    if (skip(chunk_id)) continue;
    const v1::ChunkRecord& record = *context_.Find(chunk_id);
    const v1::StateExtent& extent = ShadowExtent(record);
    const int64_t write_start = trace::NowUs();
    absl::Status written = job.states().Write(extent.offset(), std::span(states.data(), extent.length()));
    trace::Record("ssd_write", chunk_id, write_start, trace::NowUs());
    if (!written.ok()) {
      return absl::Status(written.code(), fmt::format("job '{}': cannot write the acknowledged states of chunk {} "
                                                      "to make step {} durable: {}",
                                                      job.name(), chunk_id, step, written.message()));
    }
    context_.counters.Bump(Ticker::kBytesWritten, extent.length());
    edit.ShadowWritten(chunk_id, ComputeChunkChecksums(states.data(), RecordLayout(record)));
    changed.push_back(chunk_id);
  }
  return absl::OkStatus();
}

void DurabilityPolicy::Durable() {
  pending_.clear();  // unpinned: committed states the cache may evict
  ReleaseHold();
  steps_since_durable_ = 0;
  last_durable_ = std::chrono::steady_clock::now();
}

void DurabilityPolicy::ReleaseHold() {
  if (held_bytes_ == 0) return;
  context_.cache.cache().ReleaseHold(held_bytes_);
  held_bytes_ = 0;
}

void DurabilityPolicy::Clear() {
  pending_.clear();
  ReleaseHold();
}

}  // namespace fuyou
