// Session::Impl, registration and slots: RegisterChunk (checked locally, then
// RegisterChunks through a slot), PushGradients/PullParams over the zero-copy
// calls, and the slots (their regions in the segment: slot_memory.h).
#include <algorithm>
#include <cstring>

#include "channel.h"
#include "fmt/format.h"
#include "fmt/ranges.h"
#include "fuyou/wire_limits.h"
#include "session_impl.h"

namespace fuyou {
namespace {

using internal::RpcError;
using internal::SetDeadline;

v1::ChunkSpec ToProto(const ChunkSpec& spec, uint32_t slot) {
  v1::ChunkSpec proto;
  proto.set_chunk_id(spec.chunk_id);
  proto.set_num_elements(spec.num_elements);
  proto.set_param_dtype(static_cast<v1::DType>(spec.param_dtype));
  proto.set_grad_dtype(static_cast<v1::DType>(spec.grad_dtype));
  proto.set_slot(slot);
  proto.set_layout_fingerprint(spec.layout_fingerprint);
  for (uint64_t n : spec.segment_elements) proto.add_segment_elements(n);
  proto.set_store_weights(spec.store_weights);
  if (spec.moments_dtype != DType::kFloat32) proto.set_moments_dtype(static_cast<v1::DType>(spec.moments_dtype));
  return proto;
}

}  // namespace

absl::StatusOr<RegisterResult> Session::Impl::RegisterChunk(const ChunkSpec& spec,
                                                           std::span<std::byte> weights) {
  if (!IsValidDType(spec.param_dtype) || !IsValidDType(spec.grad_dtype)) {
    return absl::InvalidArgumentError(fmt::format(
        "chunk {} of {}: param dtype ({}) and grad dtype ({}) must be float32, bfloat16 or float16",
        spec.chunk_id, Who(), static_cast<int>(spec.param_dtype), static_cast<int>(spec.grad_dtype)));
  }
  if (spec.moments_dtype != DType::kFloat32 && spec.moments_dtype != DType::kBFloat16 &&
      spec.moments_dtype != DType::kBlock8) {
    return absl::InvalidArgumentError(fmt::format("chunk {} of {}: moments dtype ({}) must be float32, bfloat16 or "
                                                  "8-bit blocks",
                                                  spec.chunk_id, Who(), static_cast<int>(spec.moments_dtype)));
  }
  if (spec.num_elements == 0) {
    return absl::InvalidArgumentError(fmt::format("chunk {} of {} has no elements", spec.chunk_id, Who()));
  }
  const uint64_t widest = std::max(DTypeSize(spec.param_dtype), DTypeSize(spec.grad_dtype));
  if (spec.num_elements > memory_.slot_bytes() / widest) {
    return absl::InvalidArgumentError(fmt::format(
        "chunk {} of {} needs {} elements x {} bytes but the session's slots hold {} bytes: open "
        "the session with slot_bytes >= the largest chunk's bytes",
        spec.chunk_id, Who(), spec.num_elements, widest, memory_.slot_bytes()));
  }
  if (spec.segment_elements.size() > kMaxChunkSegments) {
    return absl::InvalidArgumentError(fmt::format(
        "chunk {} of {} has {} segments, more than the {} a chunk may have: send none (one "
        "segment) or pack fewer parameters into it",
        spec.chunk_id, Who(), spec.segment_elements.size(), kMaxChunkSegments));
  }
  if (!spec.segment_elements.empty()) {
    uint64_t total = 0;
    for (uint64_t n : spec.segment_elements) {
      if (n == 0 || n > spec.num_elements - total) {
        return absl::InvalidArgumentError(fmt::format(
            "chunk {} of {}: its segments of {} elements do not add up to its {} elements "
            "(each must be > 0)",
            spec.chunk_id, Who(), fmt::join(spec.segment_elements, "+"), spec.num_elements));
      }
      total += n;
    }
    if (total != spec.num_elements) {
      return absl::InvalidArgumentError(fmt::format(
          "chunk {} of {}: its segments hold {} elements, not its {}", spec.chunk_id, Who(),
          total, spec.num_elements));
    }
  }
  if (weights.size() != spec.param_bytes()) {
    return absl::InvalidArgumentError(fmt::format(
        "chunk {} of {}: weights are {} bytes, expected {} ({} elements of {})", spec.chunk_id,
        Who(), weights.size(), spec.param_bytes(), spec.num_elements, DTypeName(spec.param_dtype)));
  }
  {
    std::lock_guard lock(mu_);
    if (absl::Status status = CheckUsableLocked(); !status.ok()) return status;
    if (chunks_.contains(spec.chunk_id)) {
      return absl::AlreadyExistsError(
          fmt::format("chunk {} is already registered in the session of {}", spec.chunk_id, Who()));
    }
  }
  absl::StatusOr<uint32_t> slot = slots().Acquire(rpc_timeout());
  if (!slot.ok()) return slot.status();
  std::span<std::byte> region = ParamRegion(*slot);
  std::memcpy(region.data(), weights.data(), weights.size());

  v1::RegisterChunksRequest request;
  request.set_session_id(name_.id);
  *request.add_chunks() = ToProto(spec, *slot);
  v1::RegisterChunksResponse response;
  grpc::ClientContext context;
  SetDeadline(context, rpc_timeout());
  grpc::Status rpc = connection_.stub().RegisterChunks(&context, request, &response);
  if (!rpc.ok()) {
    slots().Release(*slot);
    return RpcError(rpc, fmt::format("RegisterChunks of chunk {} (slot {}) for {}", spec.chunk_id, *slot, Who()),
                    rpc_timeout());
  }
  if (response.chunks_size() != 1 || response.chunks(0).chunk_id() != spec.chunk_id) {
    slots().Release(*slot);
    return absl::InternalError(fmt::format(
        "RegisterChunks of chunk {} for {}: fuyoud answered {} results, not one for this chunk",
        spec.chunk_id, Who(), response.chunks_size()));
  }
  RegisterResult result{response.chunks(0).resumed(), response.chunks(0).update_count(),
                        {response.chunks(0).segment_update_counts().begin(),
                         response.chunks(0).segment_update_counts().end()}};
  if (result.resumed) std::memcpy(weights.data(), region.data(), weights.size());
  slots().Release(*slot);
  std::lock_guard lock(mu_);
  chunks_.Add(spec);
  return result;
}

absl::Status Session::Impl::PushGradients(uint32_t chunk_id, int64_t step, const AdamWHyper& hyper,
                                          std::span<const std::byte> gradients) {
  {
    std::lock_guard lock(mu_);
    if (absl::Status status = CheckUsableLocked(); !status.ok()) return status;
    const ChunkSpec* spec = chunks_.Find(chunk_id);
    if (spec == nullptr) {
      return absl::InvalidArgumentError(
          fmt::format("chunk {} is not registered in the session of {}: call RegisterChunk first", chunk_id, Who()));
    }
    if (gradients.size() != spec->grad_bytes()) {
      return absl::InvalidArgumentError(fmt::format(
          "chunk {} of {}: gradients are {} bytes, expected {} ({} elements of {})", chunk_id,
          Who(), gradients.size(), spec->grad_bytes(), spec->num_elements,
          DTypeName(spec->grad_dtype)));
    }
  }
  absl::StatusOr<uint32_t> slot = AcquireSlot(rpc_timeout());
  if (!slot.ok()) {
    return absl::Status(slot.status().code(),
                        fmt::format("chunk {} step {}: {}", chunk_id, step, std::string(slot.status().message())));
  }
  std::memcpy(GradRegion(*slot).data(), gradients.data(), gradients.size());
  absl::Status status = SendGradReady(chunk_id, *slot, step, hyper, {});
  if (!status.ok()) slots().Release(*slot);
  return status;
}

absl::Status Session::Impl::PullParams(uint32_t chunk_id, std::span<std::byte> weights) {
  {
    std::lock_guard lock(mu_);
    if (health_.closing()) return ClosedError();
    const ChunkSpec* spec = chunks_.Find(chunk_id);
    if (spec != nullptr && weights.size() != spec->param_bytes()) {
      return absl::InvalidArgumentError(fmt::format(
          "chunk {} of {}: weights are {} bytes, expected {} ({} elements of {})", chunk_id,
          Who(), weights.size(), spec->param_bytes(), spec->num_elements,
          DTypeName(spec->param_dtype)));
    }
  }
  absl::StatusOr<uint32_t> slot = WaitParams(chunk_id, rpc_timeout());
  if (!slot.ok()) return slot.status();
  std::span<std::byte> region = ParamRegion(*slot);
  std::memcpy(weights.data(), region.data(), std::min(weights.size(), region.size()));
  ReleaseSlot(*slot);
  return absl::OkStatus();
}

absl::StatusOr<uint32_t> Session::Impl::AcquireSlot(std::chrono::milliseconds timeout) {
  {
    std::lock_guard lock(mu_);
    if (absl::Status status = CheckUsableLocked(); !status.ok()) return status;
  }
  absl::StatusOr<uint32_t> slot = slots().Acquire(timeout);
  if (!slot.ok() && absl::IsDeadlineExceeded(slot.status())) {
    return absl::DeadlineExceededError(fmt::format("{}: {}", Who(), std::string(slot.status().message())));
  }
  return slot;
}

std::optional<JournalStats> Session::Impl::GetJournalStats(uint32_t chunk_id) {
  std::lock_guard lock(mu_);
  return chunks_.JournalStatsOf(chunk_id);
}

void Session::Impl::ReleaseSlot(uint32_t slot) { slots().Release(slot); }

}  // namespace fuyou
