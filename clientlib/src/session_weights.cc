// Session::Impl, streaming weights: FetchWeights of a chunk registered with
// store_weights into a held slot, and WeightsFetched. Several fetches may be in
// flight, of one chunk too; each is its own request, and WaitWeights takes the
// chunk's oldest.
#include <optional>

#include "fmt/format.h"
#include "session_impl.h"

namespace fuyou {

using internal::OfChunk;
using internal::PendingRequest;
using internal::RequestKind;

absl::Status Session::Impl::SendFetchWeights(uint32_t chunk_id, uint32_t slot) {
  uint64_t id = 0;
  {
    std::lock_guard lock(mu_);
    if (absl::Status status = CheckUsableLocked(); !status.ok()) return status;
    const ChunkSpec* spec = chunks_.Find(chunk_id);
    if (spec == nullptr) {
      return absl::InvalidArgumentError(fmt::format(
          "FetchWeights: chunk {} is not registered in the session of {}: call RegisterChunk first", chunk_id, Who()));
    }
    if (!spec->store_weights) {
      return absl::FailedPreconditionError(fmt::format(
          "FetchWeights: chunk {} of {} was registered without store_weights, so the daemon keeps no working "
          "weights for it; register it with ChunkSpec.store_weights (a new job for chunks created without)",
          chunk_id, Who()));
    }
    if (requests_.Count([](const PendingRequest& r) { return internal::IsStateTransfer(r.kind); }) != 0) {
      return absl::FailedPreconditionError(fmt::format(
          "FetchWeights of chunk {} of {}: an export or import request is in progress; fetch after it", chunk_id,
          Who()));
    }
    if (absl::Status status = slots().BeginFlight(slot); !status.ok()) {
      return absl::Status(status.code(), fmt::format("FetchWeights of chunk {} of {}: {}", chunk_id, Who(),
                                                     std::string(status.message())));
    }
    id = requests_.Add({.kind = RequestKind::kFetchWeights, .chunk_id = chunk_id, .slot = slot});
  }
  v1::ClientMessage message;
  message.mutable_fetch_weights()->set_chunk_id(chunk_id);
  message.mutable_fetch_weights()->set_slot(slot);
  absl::Status status =
      WriteRequest(id, message, fmt::format("FetchWeights of chunk {} into slot {}", chunk_id, slot));
  if (!status.ok()) slots().EndFlight(slot);  // the caller holds the slot again
  return status;
}

absl::StatusOr<uint32_t> Session::Impl::WaitWeights(uint32_t chunk_id, std::chrono::milliseconds timeout) {
  std::unique_lock lock(mu_);
  if (health_.closing()) return ClosedError();
  const std::optional<uint64_t> id = requests_.FindOldest(OfChunk(RequestKind::kFetchWeights, chunk_id));
  if (!id) {
    if (!health_.lost().ok()) return health_.lost();
    return absl::FailedPreconditionError(fmt::format(
        "chunk {} of {} has no weights fetch in flight: send one with SendFetchWeights first", chunk_id, Who()));
  }
  const uint32_t slot = requests_.Find(*id)->slot;
  switch (AwaitLocked(lock, *id, timeout)) {
    case Awaited::kTakenByAnother:
      return absl::FailedPreconditionError(
          fmt::format("chunk {} of {}: another thread took its fetched weights", chunk_id, Who()));
    case Awaited::kTimedOut:
      return absl::DeadlineExceededError(fmt::format("no WeightsFetched for chunk {} (slot {}) of {} within {} ms",
                                                     chunk_id, slot, Who(), timeout.count()));
    case Awaited::kAnswered:
      break;
  }
  PendingRequest fetch = *requests_.Take(*id);
  if (fetch.status.ok()) return fetch.slot;
  // Refused or lost: the slot comes back to the job and is freed here, since the
  // caller gets no slot to release.
  slots().EndFlight(fetch.slot);
  slots().Release(fetch.slot);
  return fetch.status;
}

}  // namespace fuyou
