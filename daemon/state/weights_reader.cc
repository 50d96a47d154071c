#include "state/weights_reader.h"

#include <cstring>
#include <memory>

#include "common/status_util.h"
#include "common/trace.h"
#include "fmt/format.h"
#include "state/committed_reader.h"
#include "stats/daemon_stats.h"

namespace fuyou {
namespace {

// Counts one weights fetch (hit: served from DRAM) and `bytes` read for it,
// into the daemon's and the user's counters.
void CountWeights(const StoreCounters& counters, bool fetch, bool hit, uint64_t bytes) {
  if (fetch) counters.Bump(Ticker::kWeightsFetches);
  if (hit) counters.Bump(Ticker::kWeightsFetchCacheHits);
  if (bytes != 0) counters.Bump(Ticker::kWeightsBytesRead, bytes);
}

}  // namespace

bool WeightsReader::CopyFromDram(const v1::ChunkRecord& record, std::span<std::byte> out) {
  const uint32_t chunk_id = record.chunk_id();
  const ChunkLayout layout = RecordLayout(record);
  const JobCache& cache = context_.cache;
  auto copy_from = [&](const StatePin& pin) {
    std::memcpy(out.data(), ChunkStates(pin.data(), layout).weights(), out.size());
    return true;
  };
  if (step_.IsStaged(chunk_id)) {
    // Its entry holds this step's update. A pending chunk's acknowledged
    // states are in the undo copy; any other's are in its committed extent.
    if (const StatePin* undo = step_.Undo(chunk_id)) return copy_from(*undo);
  } else if (const StatePin* pending = durability_.Pending(chunk_id)) {
    return copy_from(*pending);
  } else if (StatePin pin = cache.Pin(CacheSpace::kStates, chunk_id, /*use=*/false)) {
    // The chunk's states (a prefetch in flight is waited for); looking does not
    // count as the update's use of a prefetch.
    // An entry loaded for an update (states only) does not hold the weights.
    if (pin.load_status().ok() && pin.committed() && pin.version() == record.committed_version() &&
        pin.weights_valid()) {
      return copy_from(pin);
    }
  }
  if (StatePin pin = cache.Pin(CacheSpace::kWeights, chunk_id)) {  // a read-ahead in flight is waited for
    if (pin.load_status().ok() && pin.version() == record.committed_version()) {
      std::memcpy(out.data(), pin.data(), out.size());
      return true;
    }
    pin.Reset();
    cache.Drop(CacheSpace::kWeights, chunk_id);
  }
  return false;
}

bool WeightsReader::InDram(const v1::ChunkRecord& record) const {
  const uint32_t chunk_id = record.chunk_id();
  const JobCache& cache = context_.cache;
  if (durability_.IsPending(chunk_id)) return true;  // pinned (the undo copy while staged)
  if (!step_.IsStaged(chunk_id) &&
      cache.Holds(CacheSpace::kStates, chunk_id, record.committed_version(), /*whole=*/true)) {
    return true;
  }
  return cache.Holds(CacheSpace::kWeights, chunk_id, record.committed_version());
}

void WeightsReader::ReadAhead(const std::vector<uint32_t>& chunk_ids) {
  const JobCache& cache = context_.cache;
  // The same depth rule as the states' prefetch: the predicted fetches whose
  // weights fit in the DRAM window, in order.
  const uint64_t window = context_.ReadAheadBytes(step_.WriteBackBytesInFlight());
  uint64_t ahead = 0;
  for (uint32_t chunk_id : chunk_ids) {
    const v1::ChunkRecord* record = context_.Find(chunk_id);
    if (record == nullptr || !record->stores_weights()) continue;
    const ChunkLayout layout = RecordLayout(*record);
    const uint64_t region = *layout.WeightsRegionBytes();  // a validated record: fits
    if (region > window - ahead) break;  // ahead <= window: no underflow
    ahead += region;
    if (InDram(*record)) continue;
    // Never waits and never evicts a pinned entry: without free budget this
    // fetch and the later ones read on demand.
    auto created = cache.Create(CacheSpace::kWeights, chunk_id, region, /*wait=*/false, /*loading=*/true,
                                /*filled_bytes=*/region);
    if (!created.ok()) break;
    auto pin = std::make_shared<StatePin>(std::move(*created));
    cache.cache().SetContents(*pin, record->committed_version(), /*committed=*/true);
    const v1::StateExtent& extent = CommittedExtent(*record);
    // By value: a commit may replace the manifest `record` lives in meanwhile.
    in_flight_.Add(context_.job.states()
                       .ReadAsync(extent.offset() + *layout.WeightsOffset(), std::span(pin->data(), region))
                       .Then([&job = context_.job, &state_cache = cache.cache(), counters = context_.counters, pin,
                              layout, extent, chunk_id, region, read_start = trace::NowUs()](absl::Status status) {
                         trace::Record("ssd_read_weights", chunk_id, read_start, trace::NowUs());
                         if (status.ok()) {
                           counters.Bump(Ticker::kBytesRead, region);
                           CountWeights(counters, false, false, region);
                           status = VerifyWeights(job, pin->data(), chunk_id, layout, extent);
                         }
                         state_cache.FinishLoad(*pin, status);
                         pin->Reset();
                         return status;
                       }));
  }
}

absl::Status WeightsReader::ReadNow(const v1::ChunkRecord& record, std::span<std::byte> out, FetchSource& source) {
  // Only the weights region of the committed extent (which the running step
  // never writes), into an entry of its own: the chunk's states entry, if
  // any, may hold this step's update.
  Job& job = context_.job;
  const uint32_t chunk_id = record.chunk_id();
  const ChunkLayout layout = RecordLayout(record);
  const v1::StateExtent& extent = CommittedExtent(record);
  const uint64_t region = *layout.WeightsRegionBytes();
  const uint64_t offset = extent.offset() + *layout.WeightsOffset();
  FUYOU_ASSIGN_OR_RETURN(StatePin pin,
                         context_.cache.Create(CacheSpace::kWeights, chunk_id, region, /*wait=*/true,
                                               /*loading=*/false, /*filled_bytes=*/region));
  context_.cache.cache().SetContents(pin, record.committed_version(), /*committed=*/true);
  const int64_t read_start = trace::NowUs();
  absl::Status status = job.states().Read(offset, std::span(pin.data(), region));
  trace::Record("ssd_read_weights", chunk_id, read_start, trace::NowUs());
  if (!status.ok()) {
    status = absl::Status(status.code(), fmt::format("job '{}' chunk {}: cannot read its working weights from {} "
                                                     "at offset {}: {}",
                                                     job.name(), chunk_id, job.states().path().string(), offset,
                                                     status.message()));
  } else {
    context_.counters.Bump(Ticker::kBytesRead, region);
    source.bytes_read = region;
    status = VerifyWeights(job, pin.data(), chunk_id, layout, extent);
  }
  if (!status.ok()) {
    CountWeights(context_.counters, false, false, source.bytes_read);
    context_.cache.cache().FinishLoad(pin, status);  // not kept: freed as the pin goes
    return status;
  }
  std::memcpy(out.data(), pin.data(), out.size());
  return absl::OkStatus();
}

absl::StatusOr<FetchSource> WeightsReader::Fetch(uint32_t chunk_id, std::span<std::byte> out) {
  Job& job = context_.job;
  const v1::ChunkRecord* record = context_.Find(chunk_id);
  if (record == nullptr || !record->stores_weights()) {
    return absl::FailedPreconditionError(fmt::format(
        "job '{}': chunk {} {}; only a chunk registered with store_weights has working weights to fetch",
        job.name(), chunk_id, record == nullptr ? "does not exist" : "does not store its working weights"));
  }
  const uint64_t weights_bytes = *RecordLayout(*record).WeightsBytes();  // a validated record: fits
  if (out.size() != weights_bytes) {
    return absl::InvalidArgumentError(fmt::format(
        "job '{}' chunk {}: its working weights are {} bytes ({} elements of {}), not the {} bytes given; nothing "
        "was fetched",
        job.name(), chunk_id, weights_bytes, record->num_elements(),
        DTypeName(static_cast<DType>(record->param_dtype())), out.size()));
  }
  const std::vector<uint32_t> ahead = order_.Fetched(chunk_id, context_.weights_window());
  FetchSource source;
  if (CopyFromDram(*record, out)) {
    source.from_dram = true;
  } else if (durability_.IsPending(chunk_id)) {
    // Its committed extent holds the durable step, not the acknowledged one.
    return absl::InternalError(fmt::format(
        "job '{}' chunk {}: its acknowledged working weights are not in DRAM", job.name(), chunk_id));
  } else {
    FUYOU_RETURN_IF_ERROR(ReadNow(*record, out, source));
  }
  CountWeights(context_.counters, true, source.from_dram, source.bytes_read);
  ReadAhead(ahead);
  return source;
}

}  // namespace fuyou
