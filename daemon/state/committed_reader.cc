#include "state/committed_reader.h"

#include <cstring>
#include <memory>

#include "common/status_util.h"
#include "common/trace.h"
#include "fmt/format.h"
#include "stats/daemon_stats.h"

namespace fuyou {
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

void CountLookup(const StoreCounters& counters, bool hit) {
  counters.Bump(hit ? Ticker::kCacheHits : Ticker::kCacheMisses);
}

}  // namespace

absl::Status VerifyWeights(Job& job, const std::byte* weights, uint32_t chunk_id, const ChunkLayout& layout,
                           const v1::StateExtent& extent) {
  if (WeightsChecksum(weights, layout) == extent.weights_checksum()) return absl::OkStatus();
  return absl::DataLossError(fmt::format(
      "job '{}' chunk {}: the working weights read from {} at offset {} ({} bytes) fail their checksum; the extent "
      "is corrupt and nothing was returned from it (the job's committed states cannot be trusted: delete the job "
      "or restore it from a checkpoint)",
      job.name(), chunk_id, job.states().path().string(), extent.offset() + layout.WeightsOffset().value_or(0),
      layout.WeightsBytes().value_or(0)));
}

absl::Status VerifyStates(Job& job, const std::byte* states, uint32_t chunk_id, const ChunkLayout& layout,
                          const v1::StateExtent& extent) {
  if (StatesChecksum(states, layout) == extent.checksum()) return absl::OkStatus();
  return absl::DataLossError(fmt::format(
      "job '{}' chunk {}: the states read from {} at offset {} fail their checksum; the extent is corrupt and "
      "nothing was returned from it",
      job.name(), chunk_id, job.states().path().string(), extent.offset()));
}

absl::Status CheckRead(Job& job, const StatePin& pin, uint32_t chunk_id, const ChunkLayout& layout,
                       const v1::StateExtent& extent, bool states_only) {
  absl::Status status = VerifyStates(job, pin.data(), chunk_id, layout, extent);
  if (!layout.stores_weights()) return status;
  if (states_only) {
    ClearAfterStates(pin, layout, extent.length());
    return status;
  }
  if (!status.ok()) return status;
  return VerifyWeights(job, pin.data() + *layout.WeightsOffset(), chunk_id, layout, extent);
}

CommittedReader::~CommittedReader() { WaitForReads(); }

absl::Status CommittedReader::ReadStoredWeights(const StatePin& pin, const v1::ChunkRecord& record) {
  Job& job = context_.job;
  const ChunkLayout layout = RecordLayout(record);
  const v1::StateExtent& extent = CommittedExtent(record);
  const uint64_t offset = *layout.WeightsOffset();
  const uint64_t region = *layout.WeightsRegionBytes();
  const int64_t read_start = trace::NowUs();
  absl::Status status = job.states().Read(extent.offset() + offset, std::span(pin.data() + offset, region));
  trace::Record("ssd_read_weights", record.chunk_id(), read_start, trace::NowUs());
  if (!status.ok()) {
    return absl::Status(status.code(), fmt::format("job '{}' chunk {}: cannot read its committed working weights: {}",
                                                   job.name(), record.chunk_id(), status.message()));
  }
  context_.counters.Bump(Ticker::kBytesRead, region);
  FUYOU_RETURN_IF_ERROR(VerifyWeights(job, pin.data() + offset, record.chunk_id(), layout, extent));
  context_.cache.cache().SetContents(pin, record.committed_version(), /*committed=*/true, /*weights_valid=*/true);
  return absl::OkStatus();
}

absl::StatusOr<StatePin> CommittedReader::Acquire(const v1::ChunkRecord& record, bool pending, bool states_only) {
  Job& job = context_.job;
  const JobCache& cache = context_.cache;
  // A pending chunk's acknowledged states are in DRAM only, tagged as its shadow.
  const uint32_t version = pending ? ShadowVersion(record) : record.committed_version();
  if (StatePin pin = cache.Pin(CacheSpace::kStates, record.chunk_id())) {
    if (pin.load_status().ok() && pin.version() == version && pin.committed()) {
      // A prefetch read these bytes from storage: that is a miss the read-ahead
      // hid, not a read served from DRAM.
      CountLookup(context_.counters, /*hit=*/!pin.first_use_of_prefetch());
      // Loaded for an update (states only) but wanted whole: the weights too.
      // (A pending entry always holds its weights: an update made it.)
      if (!states_only && !pin.weights_valid()) FUYOU_RETURN_IF_ERROR(ReadStoredWeights(pin, record));
      return pin;
    }
    if (pending) {
      return absl::InternalError(fmt::format("job '{}' chunk {}: its acknowledged states are not in DRAM", job.name(),
                                             record.chunk_id()));
    }
    pin.Reset();
    cache.Drop(CacheSpace::kStates, record.chunk_id());
  }
  if (pending) {
    return absl::InternalError(fmt::format("job '{}' chunk {}: its acknowledged states left DRAM", job.name(),
                                           record.chunk_id()));
  }
  CountLookup(context_.counters, /*hit=*/false);
  const v1::StateExtent& extent = CommittedExtent(record);
  const bool partial = states_only && record.stores_weights();
  const uint64_t read_bytes = partial ? StatesReadBytes(record, extent) : extent.length();
  FUYOU_ASSIGN_OR_RETURN(StatePin pin,
                         cache.Create(CacheSpace::kStates, record.chunk_id(), extent.length(), /*wait=*/true,
                                      /*loading=*/false, /*filled_bytes=*/read_bytes));
  cache.cache().SetContents(pin, version, /*committed=*/true, /*weights_valid=*/!partial);
  const int64_t read_start = trace::NowUs();
  absl::Status status = job.states().Read(extent.offset(), std::span(pin.data(), read_bytes));
  trace::Record("ssd_read", record.chunk_id(), read_start, trace::NowUs());
  if (status.ok()) context_.counters.Bump(Ticker::kBytesRead, read_bytes);
  if (!status.ok()) {
    status = absl::Status(status.code(), fmt::format("job '{}' chunk {}: cannot read its committed states: {}",
                                                     job.name(), record.chunk_id(), status.message()));
  } else {
    status = CheckRead(job, pin, record.chunk_id(), RecordLayout(record), extent, partial);
  }
  if (!status.ok()) {
    cache.cache().FinishLoad(pin, status);  // not kept: freed as the pin goes
    return status;
  }
  return pin;
}

void CommittedReader::Prefetch(const std::vector<uint32_t>& chunk_ids, const std::function<bool(uint32_t)>& skip,
                               uint64_t window_bytes) {
  const JobCache& cache = context_.cache;
  uint64_t ahead = 0;  // states of the chunks taken so far
  for (uint32_t chunk_id : chunk_ids) {
    const v1::ChunkRecord* record = context_.Find(chunk_id);
    if (record == nullptr) continue;
    const v1::StateExtent& extent = CommittedExtent(*record);
    if (extent.length() > window_bytes - ahead) break;  // ahead <= window_bytes: no underflow
    ahead += extent.length();
    if (skip(chunk_id) || cache.Contains(CacheSpace::kStates, chunk_id)) continue;
    const bool partial = record->stores_weights();
    const uint64_t read_bytes = StatesReadBytes(*record, extent);
    auto created = cache.Create(CacheSpace::kStates, chunk_id, extent.length(), /*wait=*/false, /*loading=*/true,
                                /*filled_bytes=*/read_bytes);
    if (!created.ok()) break;  // no budget free now: this update and the later ones read on demand
    auto pin = std::make_shared<StatePin>(std::move(*created));
    cache.cache().SetContents(*pin, record->committed_version(), /*committed=*/true, /*weights_valid=*/!partial);
    // By value: a commit may replace the manifest `record` lives in meanwhile.
    in_flight_.Add(context_.job.states()
                       .ReadAsync(extent.offset(), std::span(pin->data(), read_bytes))
                       .Then([&job = context_.job, &state_cache = cache.cache(), counters = context_.counters, pin,
                              layout = RecordLayout(*record), extent, chunk_id, partial, read_bytes,
                              read_start = trace::NowUs()](absl::Status status) {
                         trace::Record("ssd_read", chunk_id, read_start, trace::NowUs());
                         if (status.ok()) counters.Bump(Ticker::kBytesRead, read_bytes);
                         if (status.ok()) status = CheckRead(job, *pin, chunk_id, layout, extent, partial);
                         state_cache.FinishLoad(*pin, status);
                         pin->Reset();
                         return status;
                       }));
  }
}

}  // namespace fuyou
