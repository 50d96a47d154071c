// Session: streaming a chunk's working weights (issue 12).
//
// FetchWeights copies the committed working weights of a chunk registered with
// store_weights into a slot's parameter region: the weights of the last
// committed step, whatever the running step has staged (the store never
// changes the committed weights before the step commits). It is served
// whenever the session is attached, between steps and during one, and changes
// nothing but the slot: the store reads the weights from DRAM or from the
// committed extent (verified against their own checksum) and reads the next
// ones ahead in the order it learned.
#include "common/status_util.h"  // fmt formats absl::string_view (Status::message)
#include "fmt/format.h"
#include "session/session.h"
#include "session/stream_replies.h"

namespace fuyou {

v1::DaemonMessage Session::OnFetchWeights(const v1::FetchWeights& request) {
  const uint32_t chunk_id = request.chunk_id();
  const uint32_t slot = request.slot();
  // A refusal names the chunk and no step (the client tells it from a refused
  // GradReady of the same chunk by that).
  if (absl::Status bad = CheckFetchWeights(request); !bad.ok()) return ErrorReply(bad, chunk_id);
  const RegisteredChunk& registered = registered_.at(chunk_id);
  // num_elements * DTypeSize(param_dtype) <= slot_bytes (checked at registration):
  // no overflow, and the span lies in the slot's region.
  const uint64_t bytes = registered.num_elements * DTypeSize(registered.param_dtype);
  std::span<std::byte> out = held_.segment->ParamRegion(slot).first(bytes);
  // The store counts the fetch, a DRAM hit and the bytes it read (GetStats 24-26).
  absl::StatusOr<ChunkStore::FetchSource> fetched = held_.store->FetchWeights(chunk_id, out);
  if (!fetched.ok()) {
    return ErrorReply(absl::Status(fetched.status().code(),
                                   fmt::format("FetchWeights: chunk {} of job '{}' into slot {}: {}", chunk_id,
                                               identity_.job_name, slot, fetched.status().message())),
                      chunk_id);
  }
  v1::DaemonMessage reply;
  v1::WeightsFetched* done = reply.mutable_weights_fetched();
  done->set_chunk_id(chunk_id);
  done->set_slot(slot);
  done->set_step(step_.current - 1);
  return reply;
}

}  // namespace fuyou
