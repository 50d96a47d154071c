#include "state/chunk_store.h"

#include <algorithm>
#include <cstring>

#include "common/crash_point.h"
#include "common/log.h"
#include "common/status_util.h"
#include "common/trace.h"
#include "fmt/format.h"
#include "fuyou/checked_math.h"
#include "jobs/job_edit.h"
#include "optimizer/dtype_convert.h"
#include "stats/daemon_stats.h"

namespace fuyou {
namespace {

std::vector<uint32_t> RegistrationOrder(const Job& job) {
  std::vector<uint32_t> ids;
  for (const v1::ChunkRecord& record : job.manifest().chunks()) ids.push_back(record.chunk_id());
  return ids;
}

ChunkChecksums Checksums(const StatePin& pin, const ChunkLayout& layout) {
  return ComputeChunkChecksums(pin.data(), layout);
}

// The layout a registration gives a new chunk.
ChunkLayout RegistrationLayout(const ChunkStore::Registration& chunk) {
  ChunkLayout layout{chunk.num_elements};
  if (chunk.store_weights) layout.weights_dtype = chunk.param_dtype;
  return layout;
}

// Counts one weights fetch (hit: served from DRAM) and `bytes` read for it.
void CountWeights(WeightsCounters& counters, bool fetch, bool hit, uint64_t bytes) {
  if (fetch) counters.weights_fetches.fetch_add(1, std::memory_order_relaxed);
  if (hit) counters.weights_fetch_cache_hits.fetch_add(1, std::memory_order_relaxed);
  if (bytes != 0) counters.weights_bytes_read.fetch_add(bytes, std::memory_order_relaxed);
}

// Sets `record`'s update counts as JobEdit::SetSegmentUpdateCounts would.
void SetCounts(v1::ChunkRecord& record, const std::vector<int64_t>& counts) {
  record.clear_segment_update_counts();
  if (counts.empty()) return;
  const int64_t largest = *std::max_element(counts.begin(), counts.end());
  record.set_update_count(largest);
  if (std::all_of(counts.begin(), counts.end(), [&](int64_t count) { return count == largest; })) return;
  for (int64_t count : counts) record.add_segment_update_counts(count);
}

// The counts of `record` after one more update (`segment_counts` as given to StageUpdate).
void CountUpdate(v1::ChunkRecord& record, const std::vector<int64_t>& segment_counts) {
  if (!segment_counts.empty()) {
    SetCounts(record, segment_counts);
  } else if (record.segment_update_counts_size() != 0) {  // every segment counts one more
    std::vector<int64_t> counts(record.segment_update_counts().begin(), record.segment_update_counts().end());
    for (int64_t& count : counts) ++count;
    SetCounts(record, counts);
  } else {
    record.set_update_count(record.update_count() + 1);
  }
}

}  // namespace

ChunkStore::ChunkStore(Job& job, StateCache& cache, StoreCounters counters, unsigned prefetch_window,
                       DurabilityInterval durability)
    : job_(job),
      cache_(cache),
      counters_(counters),
      prefetch_window_(prefetch_window),
      job_key_(job.key()),
      order_(RegistrationOrder(job)),
      durability_(durability),
      undo_key_(job.key() + "#undo"),
      weights_key_(job.key() + "#weights"),
      acknowledged_(job.manifest()),
      last_durable_(std::chrono::steady_clock::now()) {}

ChunkStore::~ChunkStore() { Close(); }

int64_t ChunkStore::committed_step() const { return acknowledged_.committed_step(); }

int64_t ChunkStore::durable_step() const { return job_.manifest().committed_step(); }

uint32_t ChunkStore::chunk_count() const { return static_cast<uint32_t>(job_.manifest().chunks_size()); }

const v1::ChunkRecord* ChunkStore::Find(uint32_t chunk_id) const {
  // acknowledged_ lists the chunks in the durable manifest's order (it is a copy
  // of it, with later counts and step).
  const int index = job_.FindChunk(chunk_id);
  return index < 0 ? nullptr : &acknowledged_.chunks(index);
}

// ---- I/O bookkeeping.

void ChunkStore::StartIo() {
  std::lock_guard lock(io_mutex_);
  ++inflight_io_;
}

void ChunkStore::FinishIo() {
  std::lock_guard lock(io_mutex_);
  --inflight_io_;
  io_done_.notify_all();
}

void ChunkStore::WaitForIo() {
  std::unique_lock lock(io_mutex_);
  io_done_.wait(lock, [&] { return inflight_io_ == 0; });
}

absl::Status ChunkStore::StepError() const {
  std::lock_guard lock(io_mutex_);
  return write_error_;
}

absl::Status ChunkStore::WaitForWriteBacks() {
  WaitForIo();
  return StepError();
}

// ---- Committed states.

absl::Status ChunkStore::VerifyWeights(const StatePin& pin, uint32_t chunk_id, const ChunkLayout& layout,
                                       const v1::StateExtent& extent, uint64_t at) const {
  if (WeightsChecksum(pin.data() + at, layout) == extent.weights_checksum()) return absl::OkStatus();
  return absl::DataLossError(fmt::format(
      "job '{}' chunk {}: the working weights read from {} at offset {} ({} bytes) fail their checksum; the extent "
      "is corrupt and nothing was returned from it (the job's committed states cannot be trusted: delete the job "
      "or restore it from a checkpoint)",
      job_.name(), chunk_id, job_.states().path().string(), extent.offset() + layout.WeightsOffset().value_or(0),
      layout.WeightsBytes().value_or(0)));
}

namespace {

// Bytes an update reads of `record`'s committed extent: only the states
// region (its block-padded WeightsOffset) for a chunk that stores weights, the
// whole extent otherwise (there the two are the same).
uint64_t StatesReadBytes(const v1::ChunkRecord& record, const v1::StateExtent& extent) {
  return record.stores_weights() ? *RecordLayout(record).WeightsOffset() : extent.length();
}

// After a states-only load: zeroes what follows the states (the padding and
// the weights region), so that no stale DRAM contents reach storage in the
// padding (the update writes the weights themselves).
void ClearAfterStates(const StatePin& pin, const ChunkLayout& layout, uint64_t extent_bytes) {
  const uint64_t states = *layout.StatesBytes();
  std::memset(pin.data() + states, 0, extent_bytes - states);
}

}  // namespace

absl::Status ChunkStore::VerifyStates(const StatePin& pin, uint32_t chunk_id, const ChunkLayout& layout,
                                      const v1::StateExtent& extent) const {
  if (ChunkPayloadChecksum(pin.data(), layout.num_elements) == extent.checksum()) return absl::OkStatus();
  return absl::DataLossError(fmt::format(
      "job '{}' chunk {}: the states read from {} at offset {} fail their checksum; the extent is corrupt and "
      "nothing was returned from it",
      job_.name(), chunk_id, job_.states().path().string(), extent.offset()));
}

absl::Status ChunkStore::CheckRead(const StatePin& pin, uint32_t chunk_id, const ChunkLayout& layout,
                                   const v1::StateExtent& extent, bool states_only) const {
  absl::Status status = VerifyStates(pin, chunk_id, layout, extent);
  if (!layout.stores_weights()) return status;
  if (states_only) {
    ClearAfterStates(pin, layout, extent.length());
    return status;
  }
  if (!status.ok()) return status;
  return VerifyWeights(pin, chunk_id, layout, extent, *layout.WeightsOffset());
}

absl::Status ChunkStore::ReadStoredWeights(const StatePin& pin, const v1::ChunkRecord& record) {
  const ChunkLayout layout = RecordLayout(record);
  const v1::StateExtent& extent = CommittedExtent(record);
  const uint64_t offset = *layout.WeightsOffset();
  const uint64_t region = *layout.WeightsRegionBytes();
  const int64_t read_start = trace::NowUs();
  absl::Status status = job_.states().Read(extent.offset() + offset, std::span(pin.data() + offset, region));
  trace::Record("ssd_read_weights", record.chunk_id(), read_start, trace::NowUs());
  if (!status.ok()) {
    return absl::Status(status.code(), fmt::format("job '{}' chunk {}: cannot read its committed working weights: {}",
                                                   job_.name(), record.chunk_id(), status.message()));
  }
  counters_.user.bytes_read.fetch_add(region, std::memory_order_relaxed);
  FUYOU_RETURN_IF_ERROR(VerifyWeights(pin, record.chunk_id(), layout, extent, offset));
  cache_.SetContents(pin, record.committed_version(), /*committed=*/true, /*weights_valid=*/true);
  return absl::OkStatus();
}

absl::StatusOr<StatePin> ChunkStore::AcquireCommitted(const v1::ChunkRecord& record, bool states_only) {
  // A pending chunk's acknowledged states are in DRAM only, tagged as its shadow.
  const bool pending = pending_.count(record.chunk_id()) != 0;
  const uint32_t version = pending ? ShadowVersion(record) : record.committed_version();
  if (StatePin pin = cache_.Pin(job_key_, record.chunk_id())) {
    if (pin.load_status().ok() && pin.version() == version && pin.committed()) {
      // A prefetch read these bytes from storage: that is a miss the read-ahead
      // hid, not a read served from DRAM.
      auto& daemon_counter = pin.first_use_of_prefetch() ? counters_.daemon.cache_misses : counters_.daemon.cache_hits;
      auto& user_counter = pin.first_use_of_prefetch() ? counters_.user.cache_misses : counters_.user.cache_hits;
      daemon_counter.fetch_add(1, std::memory_order_relaxed);
      user_counter.fetch_add(1, std::memory_order_relaxed);
      // Loaded for an update (states only) but wanted whole: the weights too.
      // (A pending entry always holds its weights: an update made it.)
      if (!states_only && !pin.weights_valid()) FUYOU_RETURN_IF_ERROR(ReadStoredWeights(pin, record));
      return pin;
    }
    if (pending) {
      return absl::InternalError(fmt::format("job '{}' chunk {}: its acknowledged states are not in DRAM", job_.name(),
                                             record.chunk_id()));
    }
    pin.Reset();
    cache_.Drop(job_key_, record.chunk_id());
  }
  if (pending) {
    return absl::InternalError(fmt::format("job '{}' chunk {}: its acknowledged states left DRAM", job_.name(),
                                           record.chunk_id()));
  }
  counters_.daemon.cache_misses.fetch_add(1, std::memory_order_relaxed);
  counters_.user.cache_misses.fetch_add(1, std::memory_order_relaxed);
  const v1::StateExtent& extent = CommittedExtent(record);
  const bool partial = states_only && record.stores_weights();
  const uint64_t read_bytes = partial ? StatesReadBytes(record, extent) : extent.length();
  FUYOU_ASSIGN_OR_RETURN(StatePin pin, cache_.Create(job_key_, record.chunk_id(), extent.length(), /*wait=*/true));
  cache_.SetContents(pin, version, /*committed=*/true, /*weights_valid=*/!partial);
  const int64_t read_start = trace::NowUs();
  absl::Status status = job_.states().Read(extent.offset(), std::span(pin.data(), read_bytes));
  trace::Record("ssd_read", record.chunk_id(), read_start, trace::NowUs());
  if (status.ok()) counters_.user.bytes_read.fetch_add(read_bytes, std::memory_order_relaxed);
  const ChunkLayout layout = RecordLayout(record);
  if (!status.ok()) {
    status = absl::Status(status.code(), fmt::format("job '{}' chunk {}: cannot read its committed states: {}",
                                                     job_.name(), record.chunk_id(), status.message()));
  } else {
    status = CheckRead(pin, record.chunk_id(), layout, extent, partial);
  }
  if (!status.ok()) {
    cache_.FinishLoad(pin, status);  // not kept: freed as the pin goes
    return status;
  }
  return pin;
}

void ChunkStore::Prefetch(const std::vector<uint32_t>& chunk_ids) {
  // For the chunks' updates: the states region only (StageUpdate).
  for (uint32_t chunk_id : chunk_ids) {
    const v1::ChunkRecord* record = Find(chunk_id);
    if (record == nullptr || IsStaged(chunk_id) || cache_.Contains(job_key_, chunk_id)) continue;
    const v1::StateExtent& extent = CommittedExtent(*record);
    const bool partial = record->stores_weights();
    const uint64_t read_bytes = StatesReadBytes(*record, extent);
    auto created = cache_.Create(job_key_, chunk_id, extent.length(), /*wait=*/false, /*loading=*/true);
    if (!created.ok()) continue;  // no budget free now: the update will read on demand
    auto pin = std::make_shared<StatePin>(std::move(*created));
    cache_.SetContents(*pin, record->committed_version(), /*committed=*/true, /*weights_valid=*/!partial);
    StartIo();
    // By value: a commit may replace the manifest `record` lives in meanwhile.
    (void)job_.states().ReadAsync(extent.offset(), std::span(pin->data(), read_bytes)).Then(
        [this, pin, layout = RecordLayout(*record), extent, chunk_id, partial, read_bytes,
         read_start = trace::NowUs()](absl::Status status) {
          trace::Record("ssd_read", chunk_id, read_start, trace::NowUs());
          if (status.ok()) counters_.user.bytes_read.fetch_add(read_bytes, std::memory_order_relaxed);
          if (status.ok()) status = CheckRead(*pin, chunk_id, layout, extent, partial);
          cache_.FinishLoad(*pin, status);
          pin->Reset();
          FinishIo();
          return absl::OkStatus();
        });
  }
}

// ---- Registration.

absl::StatusOr<std::vector<ChunkStore::Registered>> ChunkStore::Register(std::span<const Registration> chunks,
                                                                         uint64_t job_quota_bytes) {
  // Whether a chunk stores its working weights is part of its layout on
  // storage: a resumed chunk keeps it, and the weights' dtype with it.
  for (const Registration& chunk : chunks) {
    const v1::ChunkRecord* record = Find(chunk.chunk_id);
    if (record == nullptr) continue;
    if (record->stores_weights() != chunk.store_weights) {
      return absl::FailedPreconditionError(fmt::format(
          "job '{}' chunk {} was created {} its working weights in the daemon, but this registration asks "
          "store_weights={}; a resumed chunk keeps what it was created with: register it with store_weights={} "
          "(fuyou.AdamW offload_params={}), or start a new job to change it; nothing was registered",
          job_.name(), chunk.chunk_id, record->stores_weights() ? "storing" : "without storing",
          chunk.store_weights, record->stores_weights(), record->stores_weights() ? "True" : "False"));
    }
    if (record->stores_weights() && static_cast<DType>(record->param_dtype()) != chunk.param_dtype) {
      return absl::FailedPreconditionError(fmt::format(
          "job '{}' chunk {} stores its working weights as {}, but this registration sends param_dtype {}; "
          "resume it with {} parameters, or start a new job to change their dtype; nothing was registered",
          job_.name(), chunk.chunk_id, DTypeName(static_cast<DType>(record->param_dtype())),
          DTypeName(chunk.param_dtype), DTypeName(static_cast<DType>(record->param_dtype()))));
    }
  }
  FUYOU_RETURN_IF_ERROR(MakeDurable());  // the edit below starts from the durable manifest
  ReleaseHold();  // the job's size may change: the next non-durable step holds anew
  // Reserve the extents of every new chunk before writing anything: a job that
  // does not fit (the per-job quota, or the storage paths) is refused with
  // nothing written and nothing committed. Each chunk's states are below half
  // the DRAM budget (validated); the sums are checked all the same.
  std::optional<uint64_t> new_bytes = 0;
  for (const Registration& chunk : chunks) {
    if (Find(chunk.chunk_id) == nullptr) {
      new_bytes = CheckedAdd(new_bytes, CheckedMul(RegistrationLayout(chunk).ExtentBytes(), 2));
    }
  }
  if (!new_bytes) {
    return absl::InvalidArgumentError(fmt::format(
        "job '{}': the chunks of this request need more than 2^64 bytes of states; nothing was written",
        job_.name()));
  }
  if (job_quota_bytes != 0 && *new_bytes != 0) {
    const std::optional<uint64_t> needed = CheckedAdd(job_.bytes_on_storage(), *new_bytes);
    if (!needed || *needed > job_quota_bytes) {
      return absl::ResourceExhaustedError(fmt::format(
          "job '{}' needs {} bytes on storage, over the per-job quota of {} ({} bytes already reserved, {} more for "
          "the chunks of this request); nothing was written. Use fewer or smaller chunks, or raise [storage] "
          "job_quota / --job-quota",
          job_.name(), needed ? fmt::format("{}", *needed) : std::string("more than 2^64"), job_quota_bytes,
          job_.bytes_on_storage(), *new_bytes));
    }
  }
  JobEdit edit(job_);  // gives back its reservations unless committed
  bool any_new = false;
  for (const Registration& chunk : chunks) {
    if (Find(chunk.chunk_id) != nullptr) continue;
    FUYOU_RETURN_IF_ERROR(edit.AddChunk(chunk.chunk_id, chunk.num_elements, chunk.param_dtype, chunk.grad_dtype,
                                        chunk.layout_fingerprint, chunk.store_weights));
    edit.AdoptSegments(chunk.chunk_id, chunk.segment_elements);
    any_new = true;
  }
  if (any_new) FUYOU_CRASH_POINT("registration_reserved");
  // On failure, forget the states of new chunks: the manifest never named them.
  std::vector<uint32_t> cached_new;
  auto fail = [&](absl::Status status) {
    for (uint32_t id : cached_new) cache_.Drop(job_key_, id);
    return status;
  };

  std::vector<Registered> results;
  for (const Registration& chunk : chunks) {
    const uint32_t id = chunk.chunk_id;
    if (const v1::ChunkRecord* record = Find(id)) {
      auto pin = AcquireCommitted(*record);
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
      results.push_back(Registered{.resumed = true,
                                   .update_count = record->update_count(),
                                   .segment_update_counts = {record->segment_update_counts().begin(),
                                                             record->segment_update_counts().end()}});
      continue;
    }
    const v1::StateExtent& extent = CommittedExtent(*edit.Find(id));
    auto created = cache_.Create(job_key_, id, extent.length(), /*wait=*/true);
    if (!created.ok()) return fail(created.status());
    cached_new.push_back(id);
    StatePin pin = std::move(*created);
    const ChunkLayout layout = RecordLayout(*edit.Find(id));
    const ChunkStates states(pin.data(), layout);
    optimizer::ConvertToFloat32(chunk.weights.data(), chunk.param_dtype, states.master(), chunk.num_elements);
    // m, v and the padding start at zero.
    const uint64_t master_bytes = StateOffset(ChunkState::kExpAvg, chunk.num_elements);
    std::memset(pin.data() + master_bytes, 0, pin.size() - master_bytes);
    // The working weights: the master just read, back in param_dtype (the
    // slot's values exactly: every param dtype converts to fp32 and back
    // losslessly), as an update would store them.
    if (states.weights() != nullptr) {
      optimizer::ConvertFromFloat32(states.master(), states.weights(), chunk.param_dtype, chunk.num_elements);
    }
    edit.InitialStatesWritten(id, Checksums(pin, layout));
    cache_.SetContents(pin, edit.Find(id)->committed_version(), /*committed=*/true);
    absl::Status written = job_.states().Write(extent.offset(), std::span(pin.data(), extent.length()));
    if (written.ok()) counters_.user.bytes_written.fetch_add(extent.length(), std::memory_order_relaxed);
    pin.Reset();
    if (!written.ok()) {
      return fail(absl::Status(written.code(),
                               fmt::format("job '{}': cannot write the initial states of chunk {}: {}; nothing of "
                                           "this registration was committed",
                                           job_.name(), id, written.message())));
    }
    results.push_back(Registered{.resumed = false, .update_count = 0});
  }
  if (any_new) FUYOU_CRASH_POINT("registration_states_written");
  if (edit.changed()) {
    absl::Status committed = edit.Commit();
    acknowledged_ = job_.manifest();
    if (!committed.ok()) return fail(committed);
  }
  if (any_new) FUYOU_CRASH_POINT("registration_committed");
  for (const Registration& chunk : chunks) order_.Registered(chunk.chunk_id);
  return results;
}

// ---- The step.

absl::Status ChunkStore::StageUpdate(uint32_t chunk_id, absl::FunctionRef<void(const ChunkStates&)> update,
                                     std::vector<int64_t> segment_update_counts) {
  const v1::ChunkRecord* record = Find(chunk_id);
  if (record == nullptr || IsStaged(chunk_id)) {
    return absl::InternalError(fmt::format("job '{}': chunk {} cannot be staged (unknown or already staged)",
                                           job_.name(), chunk_id));
  }
  if (!step_begun_) {
    step_durable_ = NextStepDurable();
    step_begun_ = true;
  }
  // The states region only: the update writes the whole weights region.
  FUYOU_ASSIGN_OR_RETURN(StatePin pin, AcquireCommitted(*record, /*states_only=*/true));
  // A pending chunk's acknowledged states exist only in these bytes: keep a
  // copy for a redo or a roll-back.
  StatePin undo;
  if (pending_.count(chunk_id) != 0) {
    FUYOU_ASSIGN_OR_RETURN(undo, cache_.Create(undo_key_, chunk_id, pin.size(), /*wait=*/true));
    std::memcpy(undo.data(), pin.data(), pin.size());
  }
  // From here the bytes are this step's update, not the committed states: an
  // abandoned update is never taken for them.
  const uint32_t shadow = ShadowVersion(*record);
  cache_.SetContents(pin, shadow, /*committed=*/false);
  const ChunkLayout layout = RecordLayout(*record);
  update(ChunkStates(pin.data(), layout));

  if (!step_durable_) {
    // Kept in DRAM, not written: CommitStep makes it the chunk's pending states.
    auto write = std::make_shared<WriteBack>();
    write->done = true;
    staged_[chunk_id] = Staged{write, std::move(segment_update_counts), std::move(pin), std::move(undo)};
    order_.Arrived(chunk_id);
    Prefetch(order_.After(chunk_id, prefetch_window_));
    return absl::OkStatus();
  }

  // Write the new states to the shadow extent; the committed one stays intact.
  // The checksum is computed when the write completes (the bytes stay pinned
  // until then), so the caller does not wait for a pass over the states.
  auto write = std::make_shared<WriteBack>();
  staged_[chunk_id] = Staged{write, std::move(segment_update_counts), StatePin(), std::move(undo)};
  order_.Arrived(chunk_id);
  const v1::StateExtent& extent = ShadowExtent(*record);
  auto held = std::make_shared<StatePin>(std::move(pin));
  StartIo();
  (void)job_.states().WriteAsync(extent.offset(), std::span<const std::byte>(held->data(), extent.length())).Then(
      [this, held, write, chunk_id, layout, length = extent.length(), write_start = trace::NowUs()](absl::Status status) {
        trace::Record("ssd_write", chunk_id, write_start, trace::NowUs());
        const ChunkChecksums checksums = status.ok() ? Checksums(*held, layout) : ChunkChecksums{};
        if (status.ok()) counters_.user.bytes_written.fetch_add(length, std::memory_order_relaxed);
        FUYOU_CRASH_POINT("writeback_completed");
        held->Reset();
        std::lock_guard lock(io_mutex_);
        write->done = true;
        write->checksums = checksums;
        if (!status.ok()) {
          write->status = absl::Status(status.code(), fmt::format("job '{}': write-back of chunk {} failed: {}",
                                                                  job_.name(), chunk_id, status.message()));
          if (write_error_.ok()) write_error_ = write->status;
        }
        --inflight_io_;
        io_done_.notify_all();
        return absl::OkStatus();
      });
  FUYOU_CRASH_POINT("writeback_submitted");
  // Read ahead: the chunks that followed this one in the last step.
  Prefetch(order_.After(chunk_id, prefetch_window_));
  return absl::OkStatus();
}

absl::Status ChunkStore::RollBackChunk(uint32_t chunk_id) {
  auto staged = staged_.find(chunk_id);
  if (staged == staged_.end()) {
    return absl::FailedPreconditionError(fmt::format(
        "job '{}': chunk {} has no update staged in step {}; there is nothing to roll back", job_.name(), chunk_id,
        committed_step() + 1));
  }
  {
    std::unique_lock lock(io_mutex_);
    io_done_.wait(lock, [&] { return staged->second.write->done; });
  }
  Unstage(chunk_id, staged->second);
  staged_.erase(staged);
  order_.Forget(chunk_id);
  return absl::OkStatus();
}

bool ChunkStore::NextStepDurable() {
  if (durability_.every_steps <= 1) return true;
  if (steps_since_durable_ + 1 >= durability_.every_steps) return true;
  if (durability_.every_seconds > 0 &&
      std::chrono::duration<double>(std::chrono::steady_clock::now() - last_durable_).count() >=
          durability_.every_seconds) {
    return true;
  }
  if (held_bytes_ == 0) {
    // Every chunk pending, plus an undo copy of each: twice the job's states.
    std::optional<uint64_t> bytes = 0;
    for (const v1::ChunkRecord& record : acknowledged_.chunks()) {
      bytes = CheckedAdd(bytes, CheckedMul(CommittedExtent(record).length(), 2));
    }
    if (!bytes || *bytes == 0 || !cache_.TryHold(*bytes)) return true;  // does not fit: durable
    held_bytes_ = *bytes;
  }
  return false;
}

void ChunkStore::ReleaseHold() {
  if (held_bytes_ == 0) return;
  cache_.ReleaseHold(held_bytes_);
  held_bytes_ = 0;
}

void ChunkStore::Unstage(uint32_t chunk_id, Staged& staged) {
  staged.kept.Reset();
  auto pending = pending_.find(chunk_id);
  if (staged.undo && pending != pending_.end()) {
    StatePin& states = pending->second;
    std::memcpy(states.data(), staged.undo.data(), std::min(states.size(), staged.undo.size()));
    cache_.SetContents(states, ShadowVersion(*Find(chunk_id)), /*committed=*/true);
    staged.undo.Reset();
    cache_.Drop(undo_key_, chunk_id);
    return;
  }
  if (staged.undo) {
    staged.undo.Reset();
    cache_.Drop(undo_key_, chunk_id);
  }
  cache_.Drop(job_key_, chunk_id);
}

absl::Status ChunkStore::CommitDurable(const v1::JobManifest& next) {
  JobEdit edit(job_);
  std::vector<uint32_t> changed;
  for (const auto& [chunk_id, staged] : staged_) {
    edit.ShadowWritten(chunk_id, staged.write->checksums);  // read after WaitForIo: no completion writes it
    changed.push_back(chunk_id);
  }
  // The acknowledged states of the pending chunks this step did not update go
  // to their shadow extents now (the committed extents hold the durable step).
  for (const auto& [chunk_id, states] : pending_) {
    if (IsStaged(chunk_id)) continue;
    const v1::ChunkRecord& record = *Find(chunk_id);
    const v1::StateExtent& extent = ShadowExtent(record);
    const int64_t write_start = trace::NowUs();
    absl::Status written = job_.states().Write(extent.offset(), std::span(states.data(), extent.length()));
    trace::Record("ssd_write", chunk_id, write_start, trace::NowUs());
    if (!written.ok()) {
      return absl::Status(written.code(), fmt::format("job '{}': cannot write the acknowledged states of chunk {} "
                                                      "to make step {} durable: {}",
                                                      job_.name(), chunk_id, next.committed_step(), written.message()));
    }
    counters_.user.bytes_written.fetch_add(extent.length(), std::memory_order_relaxed);
    edit.ShadowWritten(chunk_id, Checksums(states, RecordLayout(record)));
    changed.push_back(chunk_id);
  }
  for (uint32_t chunk_id : changed) {
    const v1::ChunkRecord& record = next.chunks(job_.FindChunk(chunk_id));
    if (record.segment_update_counts_size() != 0) {
      edit.SetSegmentUpdateCounts(chunk_id, std::vector<int64_t>(record.segment_update_counts().begin(),
                                                                 record.segment_update_counts().end()));
    } else {
      edit.SetUpdateCount(chunk_id, record.update_count());
    }
  }
  edit.SetCommittedStep(next.committed_step());
  if (!pending_.empty()) FUYOU_CRASH_POINT("durable_commit_pending_written");
  absl::Status committed = edit.Commit();
  if (!committed.ok() && !absl::IsAborted(committed)) return committed;
  DropWeightsEntries(changed);
  for (uint32_t chunk_id : changed) {
    cache_.MarkCommitted(job_key_, chunk_id, job_.FindRecord(chunk_id)->committed_version());
  }
  acknowledged_ = job_.manifest();
  pending_.clear();  // unpinned: committed states the cache may evict
  ReleaseHold();
  steps_since_durable_ = 0;
  last_durable_ = std::chrono::steady_clock::now();
  return committed;
}

absl::Status ChunkStore::MakeDurable() {
  if (pending_.empty() && acknowledged_.committed_step() == durable_step()) return absl::OkStatus();
  if (!staged_.empty()) {
    return absl::FailedPreconditionError(fmt::format(
        "job '{}': step {} has updates staged; the acknowledged steps are made durable between steps", job_.name(),
        committed_step() + 1));
  }
  return CommitDurable(acknowledged_);
}

absl::StatusOr<uint32_t> ChunkStore::CommitStep(int64_t step) {
  if (absl::Status failed = WaitForWriteBacks(); !failed.ok()) {
    RollBackStep();
    return failed;
  }
  // The acknowledged manifest after this step: the staged chunks' counts, the step.
  v1::JobManifest next = acknowledged_;
  for (const auto& [chunk_id, staged] : staged_) {
    CountUpdate(*next.mutable_chunks(job_.FindChunk(chunk_id)), staged.segment_update_counts);
  }
  next.set_committed_step(step);
  if (step_durable_) {
    if (absl::Status committed = CommitDurable(next); !committed.ok()) {
      RollBackStep();
      return committed;
    }
  } else {
    // Acknowledged only: the updates become the chunks' pending states, in DRAM.
    std::vector<uint32_t> updated;
    for (auto& [chunk_id, staged] : staged_) {
      cache_.SetContents(staged.kept, ShadowVersion(*Find(chunk_id)), /*committed=*/true);
      pending_[chunk_id] = std::move(staged.kept);
      updated.push_back(chunk_id);
    }
    DropWeightsEntries(updated);  // their weights are the pending entries' now
    acknowledged_ = std::move(next);
    ++steps_since_durable_;
  }
  for (auto& [chunk_id, staged] : staged_) {
    if (!staged.undo) continue;
    staged.undo.Reset();
    cache_.Drop(undo_key_, chunk_id);
  }
  const auto committed = static_cast<uint32_t>(staged_.size());
  order_.StepCommitted();
  fetch_order_.StepEnded();
  staged_.clear();
  step_begun_ = false;
  Prefetch(order_.First(prefetch_window_));
  ReadWeightsAhead(fetch_order_.First(prefetch_window_));  // the next step's first fetches
  return committed;
}

void ChunkStore::RollBackStep() {
  WaitForIo();
  for (auto& [chunk_id, staged] : staged_) Unstage(chunk_id, staged);
  staged_.clear();
  step_begun_ = false;
  order_.StepRolledBack();
  fetch_order_.StepEnded();  // a skipped step fetched in the order of any other
  std::lock_guard lock(io_mutex_);
  write_error_ = absl::OkStatus();
}

// ---- Export and import.

absl::Status ChunkStore::ExportState(uint32_t chunk_id, ChunkState which, uint64_t first, std::span<float> out) {
  const v1::ChunkRecord* record = Find(chunk_id);
  FUYOU_ASSIGN_OR_RETURN(StatePin pin, AcquireCommitted(*record));
  const float* source = ChunkStates(pin.data(), record->num_elements()).state(which) + first;
  std::memcpy(out.data(), source, out.size_bytes());
  return absl::OkStatus();
}

absl::StatusOr<StatePin> ChunkStore::AcquireImported(const v1::ChunkRecord& record, const Imported& imported) {
  const uint32_t shadow = ShadowVersion(record);
  if (StatePin pin = cache_.Pin(job_key_, record.chunk_id())) {
    if (pin.load_status().ok() && pin.version() == shadow && !pin.committed()) return pin;
    pin.Reset();
    cache_.Drop(job_key_, record.chunk_id());
  }
  // Evicted: the shadow extent holds what the earlier ImportState calls wrote.
  const v1::StateExtent& extent = ShadowExtent(record);
  FUYOU_ASSIGN_OR_RETURN(StatePin pin, cache_.Create(job_key_, record.chunk_id(), extent.length(), /*wait=*/true));
  cache_.SetContents(pin, shadow, /*committed=*/false);
  absl::Status status = job_.states().Read(extent.offset(), std::span(pin.data(), extent.length()));
  if (status.ok()) counters_.user.bytes_read.fetch_add(extent.length(), std::memory_order_relaxed);
  if (status.ok() && Checksums(pin, RecordLayout(record)) != imported.checksums) {
    status = absl::DataLossError(fmt::format(
        "job '{}' chunk {}: the imported states read back from the shadow extent fail their checksum", job_.name(),
        record.chunk_id()));
  }
  if (!status.ok()) {
    cache_.FinishLoad(pin, status);
    return status;
  }
  return pin;
}

absl::Status ChunkStore::ImportState(uint32_t chunk_id, ChunkState which, uint64_t first,
                                     std::span<const float> values) {
  FUYOU_RETURN_IF_ERROR(MakeDurable());  // the import writes the shadow extents
  const v1::ChunkRecord* record = Find(chunk_id);
  const ChunkLayout layout = RecordLayout(*record);
  auto pending = imported_.find(chunk_id);
  FUYOU_ASSIGN_OR_RETURN(StatePin pin, pending != imported_.end() && pending->second.states_written
                                           ? AcquireImported(*record, pending->second)
                                           : AcquireCommitted(*record));
  const ChunkStates states(pin.data(), layout);
  std::memcpy(states.state(which) + first, values.data(), values.size_bytes());
  if (which == ChunkState::kMaster && states.weights() != nullptr) {
    // The working weights follow the imported master, as after an update.
    optimizer::ConvertFromFloat32(states.master(), states.weights(), *layout.weights_dtype, layout.num_elements);
  }
  // The new states go to the shadow extent; the committed one stays intact.
  cache_.SetContents(pin, ShadowVersion(*record), /*committed=*/false);
  const ChunkChecksums checksums = Checksums(pin, layout);
  const v1::StateExtent& extent = ShadowExtent(*record);
  absl::Status written = job_.states().Write(extent.offset(), std::span(pin.data(), extent.length()));
  if (written.ok()) counters_.user.bytes_written.fetch_add(extent.length(), std::memory_order_relaxed);
  pin.Reset();
  if (!written.ok()) {
    cache_.Drop(job_key_, chunk_id);
    DropImport();
    return absl::Status(written.code(), fmt::format("job '{}' chunk {}: cannot write the imported states; the whole "
                                                    "pending import was dropped: {}",
                                                    job_.name(), chunk_id, written.message()));
  }
  Imported& imported = imported_[chunk_id];
  imported.states_written = true;
  imported.checksums = checksums;
  return absl::OkStatus();
}

void ChunkStore::ImportUpdateCount(uint32_t chunk_id, int64_t update_count,
                                   std::vector<int64_t> segment_update_counts) {
  Imported& imported = imported_[chunk_id];
  imported.update_count = update_count;
  imported.segment_update_counts = std::move(segment_update_counts);
}

absl::StatusOr<uint32_t> ChunkStore::CommitImport() {
  const auto changed = static_cast<uint32_t>(imported_.size());
  if (imported_.empty()) return changed;
  if (absl::Status durable = MakeDurable(); !durable.ok()) {
    DropImport();
    return durable;
  }
  JobEdit edit(job_);
  for (const auto& [chunk_id, imported] : imported_) {
    if (imported.states_written) edit.ShadowWritten(chunk_id, imported.checksums);
    if (!imported.update_count) continue;
    edit.SetUpdateCount(chunk_id, *imported.update_count);
    if (!imported.segment_update_counts.empty()) edit.SetSegmentUpdateCounts(chunk_id, imported.segment_update_counts);
  }
  absl::Status committed = edit.Commit();
  acknowledged_ = job_.manifest();
  if (!committed.ok()) {
    DropImport();
    return committed;
  }
  for (const auto& [chunk_id, imported] : imported_) {
    if (!imported.states_written) continue;
    cache_.MarkCommitted(job_key_, chunk_id, Find(chunk_id)->committed_version());
    cache_.Drop(weights_key_, chunk_id);  // the committed extent changed
  }
  imported_.clear();
  return changed;
}

void ChunkStore::DropImport() {
  for (const auto& [chunk_id, imported] : imported_) {
    if (imported.states_written) cache_.Drop(job_key_, chunk_id);
  }
  imported_.clear();
}

void ChunkStore::Close() {
  if (closed_) return;
  closed_ = true;
  WaitForIo();
  RollBackStep();
  // The acknowledged steps become durable: a closed session (or a drained
  // daemon) loses nothing it acknowledged.
  if (absl::Status durable = MakeDurable(); !durable.ok()) {
    log::Error("job '{}': could not make the acknowledged step {} durable at close (a restart resumes at step {}): {}",
               job_.name(), committed_step(), durable_step(), durable.message());
  }
  pending_.clear();
  ReleaseHold();
  DropImport();
  cache_.Demote(job_key_);
  // Weights-only entries are valid only while this store drops them at each
  // commit: none outlives it.
  cache_.DropJob(weights_key_);
}

// ---- Working weights.

bool ChunkStore::CopyWeightsFromDram(const v1::ChunkRecord& record, std::span<std::byte> out) {
  const uint32_t chunk_id = record.chunk_id();
  const ChunkLayout layout = RecordLayout(record);
  auto copy_from = [&](const StatePin& pin) {
    std::memcpy(out.data(), ChunkStates(pin.data(), layout).weights(), out.size());
    return true;
  };
  const auto staged = staged_.find(chunk_id);
  if (staged != staged_.end()) {
    // Its entry holds this step's update. A pending chunk's acknowledged
    // states are in the undo copy; any other's are in its committed extent.
    if (staged->second.undo) return copy_from(staged->second.undo);
  } else if (auto pending = pending_.find(chunk_id); pending != pending_.end()) {
    return copy_from(pending->second);
  } else if (StatePin pin = cache_.Pin(job_key_, chunk_id, /*use=*/false)) {
    // The chunk's states (a prefetch in flight is waited for); looking does not
    // count as the update's use of a prefetch.
    // An entry loaded for an update (states only) does not hold the weights.
    if (pin.load_status().ok() && pin.committed() && pin.version() == record.committed_version() &&
        pin.weights_valid()) {
      return copy_from(pin);
    }
  }
  if (StatePin pin = cache_.Pin(weights_key_, chunk_id)) {  // a read-ahead in flight is waited for
    if (pin.load_status().ok() && pin.version() == record.committed_version()) {
      std::memcpy(out.data(), pin.data(), out.size());
      return true;
    }
    pin.Reset();
    cache_.Drop(weights_key_, chunk_id);
  }
  return false;
}

bool ChunkStore::WeightsInDram(const v1::ChunkRecord& record) const {
  const uint32_t chunk_id = record.chunk_id();
  if (pending_.count(chunk_id) != 0) return true;  // pinned (the undo copy while staged)
  if (!IsStaged(chunk_id) && cache_.Holds(job_key_, chunk_id, record.committed_version(), /*whole=*/true)) {
    return true;
  }
  return cache_.Holds(weights_key_, chunk_id, record.committed_version());
}

void ChunkStore::ReadWeightsAhead(const std::vector<uint32_t>& chunk_ids) {
  for (uint32_t chunk_id : chunk_ids) {
    const v1::ChunkRecord* record = Find(chunk_id);
    if (record == nullptr || !record->stores_weights() || WeightsInDram(*record)) continue;
    const ChunkLayout layout = RecordLayout(*record);
    const uint64_t region = *layout.WeightsRegionBytes();  // a validated record: fits
    // Never waits and never evicts a pinned entry: without free budget the
    // fetch reads on demand.
    auto created = cache_.Create(weights_key_, chunk_id, region, /*wait=*/false, /*loading=*/true);
    if (!created.ok()) continue;
    auto pin = std::make_shared<StatePin>(std::move(*created));
    cache_.SetContents(*pin, record->committed_version(), /*committed=*/true);
    const v1::StateExtent& extent = CommittedExtent(*record);
    StartIo();
    // By value: a commit may replace the manifest `record` lives in meanwhile.
    (void)job_.states().ReadAsync(extent.offset() + *layout.WeightsOffset(), std::span(pin->data(), region)).Then(
        [this, pin, layout, extent, chunk_id, region, read_start = trace::NowUs()](absl::Status status) {
          trace::Record("ssd_read_weights", chunk_id, read_start, trace::NowUs());
          if (status.ok()) {
            counters_.user.bytes_read.fetch_add(region, std::memory_order_relaxed);
            CountWeights(counters_.daemon.weights, false, false, region);
            CountWeights(counters_.user.weights, false, false, region);
            status = VerifyWeights(*pin, chunk_id, layout, extent);
          }
          cache_.FinishLoad(*pin, status);
          pin->Reset();
          FinishIo();
          return absl::OkStatus();
        });
  }
}

void ChunkStore::DropWeightsEntries(const std::vector<uint32_t>& chunk_ids) {
  for (uint32_t chunk_id : chunk_ids) cache_.Drop(weights_key_, chunk_id);
}

absl::StatusOr<ChunkStore::FetchSource> ChunkStore::FetchWeights(uint32_t chunk_id, std::span<std::byte> out) {
  const v1::ChunkRecord* record = Find(chunk_id);
  if (record == nullptr || !record->stores_weights()) {
    return absl::FailedPreconditionError(fmt::format(
        "job '{}': chunk {} {}; only a chunk registered with store_weights has working weights to fetch",
        job_.name(), chunk_id, record == nullptr ? "does not exist" : "does not store its working weights"));
  }
  const ChunkLayout layout = RecordLayout(*record);
  const uint64_t weights_bytes = *layout.WeightsBytes();  // a validated record: fits
  if (out.size() != weights_bytes) {
    return absl::InvalidArgumentError(fmt::format(
        "job '{}' chunk {}: its working weights are {} bytes ({} elements of {}), not the {} bytes given; nothing "
        "was fetched",
        job_.name(), chunk_id, weights_bytes, record->num_elements(),
        DTypeName(static_cast<DType>(record->param_dtype())), out.size()));
  }
  const std::vector<uint32_t> ahead = fetch_order_.Fetched(chunk_id, prefetch_window_);
  FetchSource source;
  if (CopyWeightsFromDram(*record, out)) {
    source.from_dram = true;
  } else if (pending_.count(chunk_id) != 0) {
    // Its committed extent holds the durable step, not the acknowledged one.
    return absl::InternalError(fmt::format(
        "job '{}' chunk {}: its acknowledged working weights are not in DRAM", job_.name(), chunk_id));
  } else {
    // Only the weights region of the committed extent (which the running step
    // never writes), into an entry of its own: the chunk's states entry, if
    // any, may hold this step's update.
    const v1::StateExtent& extent = CommittedExtent(*record);
    const uint64_t region = *layout.WeightsRegionBytes();
    const uint64_t offset = extent.offset() + *layout.WeightsOffset();
    FUYOU_ASSIGN_OR_RETURN(StatePin pin, cache_.Create(weights_key_, chunk_id, region, /*wait=*/true));
    cache_.SetContents(pin, record->committed_version(), /*committed=*/true);
    const int64_t read_start = trace::NowUs();
    absl::Status status = job_.states().Read(offset, std::span(pin.data(), region));
    trace::Record("ssd_read_weights", chunk_id, read_start, trace::NowUs());
    if (!status.ok()) {
      status = absl::Status(status.code(), fmt::format("job '{}' chunk {}: cannot read its working weights from {} "
                                                       "at offset {}: {}",
                                                       job_.name(), chunk_id, job_.states().path().string(), offset,
                                                       status.message()));
    } else {
      counters_.user.bytes_read.fetch_add(region, std::memory_order_relaxed);
      source.bytes_read = region;
      status = VerifyWeights(pin, chunk_id, layout, extent);
    }
    if (!status.ok()) {
      CountWeights(counters_.daemon.weights, false, false, source.bytes_read);
      CountWeights(counters_.user.weights, false, false, source.bytes_read);
      cache_.FinishLoad(pin, status);  // not kept: freed as the pin goes
      return status;
    }
    std::memcpy(out.data(), pin.data(), out.size());
  }
  CountWeights(counters_.daemon.weights, true, source.from_dram, source.bytes_read);
  CountWeights(counters_.user.weights, true, source.from_dram, source.bytes_read);
  ReadWeightsAhead(ahead);
  return source;
}

}  // namespace fuyou
