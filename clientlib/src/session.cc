// Session: the client side of one offload session (see fuyou/client.h).
//
// Waiters: a chunk's GradReady waits for ParamsReady (pending_), its
// FetchWeights for WeightsFetched (fetches_, oldest first), EndStep/AbortStep
// for their answer (steps_), one control request for its own (control_). An
// Error goes to the one it answers: a fetch's names the chunk and no step.
//
// Threads: the caller's threads, plus one reader thread per session that reads
// the daemon's messages from the Stream and wakes whoever waits for them.
// Locks: `mu_` guards the waiting state (pending chunks, step waiters, errors);
// `write_mu_` serializes writes on the stream and is never taken while `mu_` is
// held. The slot pool has its own lock.
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstring>
#include <map>
#include <mutex>
#include <optional>
#include <thread>

#include "channel.h"
#include "fmt/format.h"
#include "fmt/ranges.h"
#include "fuyou/client.h"
#include "fuyou/client_segment.h"
#include "fuyou/segment_layout.h"
#include "fuyou/v1/offload.grpc.pb.h"
#include "session_impl.h"
#include "slot_pool.h"

namespace fuyou {
namespace {

using internal::RpcError;
using internal::SetDeadline;

// How long Close waits for the daemon to end the stream after CloseSession
// before it cancels the stream (the session is already closed by then).
constexpr std::chrono::milliseconds kStreamDrainTimeout{2000};

// Most ChunkSpec.segment_elements a chunk may have (offload.proto).
constexpr size_t kMaxSegmentsPerChunk = 4096;

absl::Status StatusFromErrorMessage(const v1::Error& error) {
  int code = error.code();
  if (code <= 0 || code > static_cast<int>(absl::StatusCode::kUnauthenticated)) {
    code = static_cast<int>(absl::StatusCode::kUnknown);
  }
  return absl::Status(static_cast<absl::StatusCode>(code), error.message());
}

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

std::string DefaultClientInfo() {
  char host[256] = {};
  if (::gethostname(host, sizeof(host) - 1) != 0) host[0] = '\0';
  return fmt::format("clientlib pid {} on {}", ::getpid(), host);
}

}  // namespace



// ----------------------------------------------------------------------------
// Opening

absl::Status Session::Impl::Start() {
  v1::OpenSessionRequest request;
  request.set_job(options_.job);
  request.set_num_slots(options_.num_slots);
  request.set_slot_bytes(options_.slot_bytes);
  request.set_client_info(options_.client_info.empty() ? DefaultClientInfo() : options_.client_info);
  v1::OpenSessionResponse response;
  grpc::ClientContext context;
  SetDeadline(context, client_.rpc_timeout);
  grpc::Status rpc = stub_->OpenSession(&context, request, &response);
  if (!rpc.ok()) {
    return RpcError(rpc, fmt::format("OpenSession for job '{}'", options_.job), client_.rpc_timeout);
  }
  session_id_ = response.session_id();
  num_slots_ = response.num_slots();
  slot_bytes_ = response.slot_bytes();
  committed_step_ = response.committed_step();

  // Checked: the daemon's answer sizes memory this process creates and maps.
  const std::optional<SegmentLayout> layout = SegmentLayout::Checked(num_slots_, slot_bytes_, UINT64_MAX);
  if (num_slots_ != options_.num_slots || slot_bytes_ < options_.slot_bytes ||
      slot_bytes_ % kSegmentAlignment != 0 || !layout || response.segment_bytes() != layout->TotalBytes()) {
    return absl::FailedPreconditionError(fmt::format(
        "fuyoud opened {} with {} slots of {} bytes ({} bytes in all), which does not fit the "
        "request of {} slots of {} bytes: client and daemon disagree on the segment layout",
        Who(), num_slots_, slot_bytes_, response.segment_bytes(), options_.num_slots,
        options_.slot_bytes));
  }
  if (absl::Status status = CreateSegment(response); !status.ok()) return status;
  slots_ = std::make_unique<internal::SlotPool>(num_slots_);
  return Attach();
}

absl::Status Session::Impl::CreateSegment(const v1::OpenSessionResponse& response) {
  const std::filesystem::path socket = response.segment_socket();
  if (!socket.is_absolute()) {
    return absl::FailedPreconditionError(fmt::format(
        "fuyoud opened {} but named no segment socket (\"{}\"): it is older than this client, which "
        "hands over its segment as a memfd; upgrade fuyoud",
        Who(), response.segment_socket()));
  }
  absl::StatusOr<std::unique_ptr<ClientSegment>> segment = ClientSegment::Create(response.segment_bytes());
  if (!segment.ok()) {
    return absl::Status(segment.status().code(), fmt::format("cannot create the segment of {}: {}", Who(),
                                                             std::string(segment.status().message())));
  }
  segment_ = std::move(*segment);
  base_ = segment_->bytes().data();
  if (absl::Status handed = segment_->HandOver(socket, session_id_, client_.rpc_timeout); !handed.ok()) {
    return absl::Status(handed.code(), fmt::format("handing the segment of {} to fuyoud failed: {}", Who(),
                                                   std::string(handed.message())));
  }
  // The fd has done its job: the daemon holds its own mapping.
  segment_->CloseFd();
  // The header fuyoud wrote through its own mapping (before it answered OK)
  // proves that it maps this memory.
  const uint64_t expected = response.segment_bytes();
  SegmentHeader header;
  std::memcpy(&header, base_, sizeof(header));
  if (header.magic != kSegmentMagic) {
    return absl::DataLossError(fmt::format(
        "the segment of {} has magic {:#018x}, expected {:#018x}, after fuyoud accepted it: fuyoud "
        "does not map the memory this client created, or is incompatible with this client",
        Who(), header.magic, kSegmentMagic));
  }
  if (header.num_slots != num_slots_ || header.slot_bytes != slot_bytes_ ||
      header.total_bytes != expected) {
    return absl::FailedPreconditionError(fmt::format(
        "the segment of {} has a header of {} slots of {} bytes ({} in all) but "
        "OpenSession announced {} slots of {} bytes ({} in all)",
        Who(), header.num_slots, header.slot_bytes, header.total_bytes, num_slots_,
        slot_bytes_, expected));
  }
  return absl::OkStatus();
}

absl::Status Session::Impl::Attach() {
  stream_context_ = std::make_unique<grpc::ClientContext>();
  stream_ = stub_->Stream(stream_context_.get());
  reader_ = std::thread([this] { ReadLoop(); });
  v1::ClientMessage message;
  message.mutable_attach()->set_session_id(session_id_);
  if (absl::Status status = Write(message, "Attach"); !status.ok()) return status;
  std::unique_lock lock(mu_);
  if (!cv_.wait_for(lock, client_.rpc_timeout,
                    [&] { return attached_ || reader_done_ || !session_error_.ok(); })) {
    return absl::DeadlineExceededError(
        fmt::format("fuyoud did not answer Attach of {} within {} ms", Who(), client_.rpc_timeout.count()));
  }
  if (!session_error_.ok()) return std::exchange(session_error_, absl::OkStatus());
  if (!attached_) return lost_.ok() ? ClosedError() : lost_;
  return absl::OkStatus();
}

// ----------------------------------------------------------------------------
// The stream

absl::Status Session::Impl::CheckUsableLocked() {
  if (closing_) return ClosedError();
  if (!lost_.ok()) return lost_;
  if (!fatal_.ok()) return fatal_;
  if (!session_error_.ok()) return std::exchange(session_error_, absl::OkStatus());
  return absl::OkStatus();
}

absl::Status Session::Impl::Write(const v1::ClientMessage& message, std::string_view what) {
  {
    std::lock_guard lock(write_mu_);
    if (!writes_closed_ && stream_->Write(message)) return absl::OkStatus();
  }
  // The stream is broken: give the reader a moment to learn gRPC's reason.
  std::unique_lock lock(mu_);
  cv_.wait_for(lock, std::chrono::seconds(1), [&] { return reader_done_; });
  if (closing_) return ClosedError();
  if (!lost_.ok()) return lost_;
  return absl::UnavailableError(
      fmt::format("connection to fuyoud lost: cannot send {} of {}", what, Who()));
}

void Session::Impl::ReadLoop() {
  v1::DaemonMessage message;
  while (stream_->Read(&message)) Dispatch(message);
  grpc::Status status;
  {
    std::lock_guard lock(write_mu_);
    writes_closed_ = true;
    status = stream_->Finish();
  }
  OnStreamEnd(status);
}

void Session::Impl::Dispatch(const v1::DaemonMessage& message) {
  std::lock_guard lock(mu_);
  switch (message.kind_case()) {
    case v1::DaemonMessage::kAttached:
      attached_ = true;
      break;
    case v1::DaemonMessage::kParamsReady: {
      const v1::ParamsReady& ready = message.params_ready();
      auto it = pending_.find(ready.chunk_id());
      if (it == pending_.end() || it->second.done) return;  // not ours to wait for
      PendingChunk& pending = it->second;
      pending.done = true;
      if (ready.segment_sum_squares_size() != 0 || ready.segment_max_abs_size() != 0) {
        journal_stats_[ready.chunk_id()] =
            JournalStats{{ready.segment_sum_squares().begin(), ready.segment_sum_squares().end()},
                         {ready.segment_max_abs().begin(), ready.segment_max_abs().end()}};
      } else {
        journal_stats_.erase(ready.chunk_id());
      }
      slots_->EndFlight(pending.slot);
      if (ready.slot() != pending.slot) {
        pending.status = absl::InternalError(fmt::format(
            "fuyoud answered ParamsReady for chunk {} of {} in slot {}, but its gradients were "
            "sent in slot {}",
            ready.chunk_id(), Who(), ready.slot(), pending.slot));
      }
      break;
    }
    case v1::DaemonMessage::kWeightsFetched: {
      const v1::WeightsFetched& fetched = message.weights_fetched();
      auto it = fetches_.find(fetched.chunk_id());
      if (it == fetches_.end()) return;  // not ours to wait for
      auto oldest = std::find_if(it->second.begin(), it->second.end(), [](const PendingFetch& f) { return !f.done; });
      if (oldest == it->second.end()) return;
      oldest->done = true;
      slots_->EndFlight(oldest->slot);
      if (fetched.slot() != oldest->slot) {
        oldest->status = absl::InternalError(fmt::format(
            "fuyoud answered FetchWeights of chunk {} of {} in slot {}, but the fetch named slot {}",
            fetched.chunk_id(), Who(), fetched.slot(), oldest->slot));
      }
      break;
    }
    case v1::DaemonMessage::kStepCommitted: {
      const v1::StepCommitted& committed = message.step_committed();
      int64_t current = committed_step_.load();
      while (committed.step() > current && !committed_step_.compare_exchange_weak(current, committed.step())) {
      }
      auto it = steps_.find(committed.step());
      if (it != steps_.end() && !it->second.done && !it->second.abort) {
        it->second.done = true;
        it->second.result = StepResult{committed.step(), committed.chunks_updated(), committed.durable_step()};
      }
      break;
    }
    case v1::DaemonMessage::kStepAborted: {
      auto it = steps_.find(message.step_aborted().step());
      if (it != steps_.end() && !it->second.done && it->second.abort) {
        it->second.done = true;
        it->second.result = StepResult{message.step_aborted().step(), 0};
      }
      break;
    }
    case v1::DaemonMessage::kStateRead:
    case v1::DaemonMessage::kStateWritten:
    case v1::DaemonMessage::kUpdateCountSet:
    case v1::DaemonMessage::kImportCommitted:
      if (!control_.active || control_.done) return;  // its waiter gave up
      control_.done = true;
      control_.reply = message;
      break;
    case v1::DaemonMessage::kError:
      DeliverError(message.error());
      break;
    default:
      return;
  }
  cv_.notify_all();
}

// Called with mu_ held.
void Session::Impl::DeliverError(const v1::Error& error) {
  absl::Status status = StatusFromErrorMessage(error);
  if ((absl::IsAborted(status) || absl::IsInternal(status)) && fatal_.ok()) fatal_ = status;
  // A refused FetchWeights names its chunk and no step (a refused GradReady
  // names both); fetches are never in flight beside a control request.
  if (error.has_chunk_id() && !error.has_step() && DeliverFetchError(error.chunk_id(), status)) return;
  if (control_.active && !control_.done && !(error.has_chunk_id() && pending_.contains(error.chunk_id()))) {
    control_.done = true;  // control requests are only sent while no chunk is in flight
    control_.status = status;
    return;
  }
  if (error.has_chunk_id()) {
    auto it = pending_.find(error.chunk_id());
    if (it != pending_.end() && !it->second.done) {
      it->second.done = true;
      it->second.status = status;
      slots_->EndFlight(it->second.slot);
      return;
    }
  } else {
    auto waiter = steps_.end();
    if (error.has_step()) waiter = steps_.find(error.step());
    if (waiter == steps_.end() || waiter->second.done) {
      waiter = std::find_if(steps_.begin(), steps_.end(), [](const auto& s) { return !s.second.done; });
    }
    if (waiter != steps_.end() && !waiter->second.done) {
      waiter->second.done = true;
      waiter->second.status = status;
      return;
    }
  }
  // Nobody waits for it: the next call reports it (once).
  if (session_error_.ok()) session_error_ = status;
}

// Called with mu_ held.
bool Session::Impl::DeliverFetchError(uint32_t chunk_id, const absl::Status& status) {
  auto it = fetches_.find(chunk_id);
  if (it == fetches_.end()) return false;
  auto oldest = std::find_if(it->second.begin(), it->second.end(), [](const PendingFetch& f) { return !f.done; });
  if (oldest == it->second.end()) return false;
  oldest->done = true;
  oldest->status = status;
  slots_->EndFlight(oldest->slot);
  return true;
}

void Session::Impl::OnStreamEnd(const grpc::Status& grpc_status) {
  {
    std::lock_guard lock(mu_);
    reader_done_ = true;
    absl::Status end;
    if (closing_) {
      end = ClosedError();
    } else {
      std::string reason = grpc_status.ok() ? std::string("the daemon ended the session's stream")
                                            : grpc_status.error_message();
      if (reason.empty()) reason = fmt::format("gRPC status {}", static_cast<int>(grpc_status.error_code()));
      lost_ = absl::UnavailableError(fmt::format("connection to fuyoud lost: {} ({})", reason, Who()));
      end = lost_;
    }
    for (auto& [id, pending] : pending_) {
      if (!pending.done) {
        pending.done = true;
        pending.status = end;
      }
    }
    for (auto& [id, fetches] : fetches_) {
      for (PendingFetch& fetch : fetches) {
        if (!fetch.done) {
          fetch.done = true;
          fetch.status = end;
        }
      }
    }
    for (auto& [step, waiter] : steps_) {
      if (!waiter.done) {
        waiter.done = true;
        waiter.status = end;
      }
    }
    if (control_.active && !control_.done) {
      control_.done = true;
      control_.status = end;
    }
    if (slots_ != nullptr) slots_->Fail(end);
  }
  cv_.notify_all();
}

// ----------------------------------------------------------------------------
// Registration and steps

absl::StatusOr<RegisterResult> Session::Impl::RegisterChunk(const ChunkSpec& spec,
                                                           std::span<std::byte> weights) {
  if (!IsValidDType(spec.param_dtype) || !IsValidDType(spec.grad_dtype)) {
    return absl::InvalidArgumentError(fmt::format(
        "chunk {} of {}: param dtype ({}) and grad dtype ({}) must be float32, bfloat16 or float16",
        spec.chunk_id, Who(), static_cast<int>(spec.param_dtype), static_cast<int>(spec.grad_dtype)));
  }
  if (spec.moments_dtype != DType::kFloat32 && spec.moments_dtype != DType::kBFloat16) {
    return absl::InvalidArgumentError(fmt::format("chunk {} of {}: moments dtype ({}) must be float32 or bfloat16",
                                                  spec.chunk_id, Who(), static_cast<int>(spec.moments_dtype)));
  }
  if (spec.num_elements == 0) {
    return absl::InvalidArgumentError(fmt::format("chunk {} of {} has no elements", spec.chunk_id, Who()));
  }
  const uint64_t widest = std::max(DTypeSize(spec.param_dtype), DTypeSize(spec.grad_dtype));
  if (spec.num_elements > slot_bytes_ / widest) {
    return absl::InvalidArgumentError(fmt::format(
        "chunk {} of {} needs {} elements x {} bytes but the session's slots hold {} bytes: open "
        "the session with slot_bytes >= the largest chunk's bytes",
        spec.chunk_id, Who(), spec.num_elements, widest, slot_bytes_));
  }
  if (spec.segment_elements.size() > kMaxSegmentsPerChunk) {
    return absl::InvalidArgumentError(fmt::format(
        "chunk {} of {} has {} segments, more than the {} a chunk may have: send none (one "
        "segment) or pack fewer parameters into it",
        spec.chunk_id, Who(), spec.segment_elements.size(), kMaxSegmentsPerChunk));
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
  absl::StatusOr<uint32_t> slot = slots_->Acquire(client_.rpc_timeout);
  if (!slot.ok()) return slot.status();
  std::span<std::byte> region = ParamRegion(*slot);
  std::memcpy(region.data(), weights.data(), weights.size());

  v1::RegisterChunksRequest request;
  request.set_session_id(session_id_);
  *request.add_chunks() = ToProto(spec, *slot);
  v1::RegisterChunksResponse response;
  grpc::ClientContext context;
  SetDeadline(context, client_.rpc_timeout);
  grpc::Status rpc = stub_->RegisterChunks(&context, request, &response);
  if (!rpc.ok()) {
    slots_->Release(*slot);
    return RpcError(rpc, fmt::format("RegisterChunks of chunk {} (slot {}) for {}", spec.chunk_id, *slot, Who()),
                    client_.rpc_timeout);
  }
  if (response.chunks_size() != 1 || response.chunks(0).chunk_id() != spec.chunk_id) {
    slots_->Release(*slot);
    return absl::InternalError(fmt::format(
        "RegisterChunks of chunk {} for {}: fuyoud answered {} results, not one for this chunk",
        spec.chunk_id, Who(), response.chunks_size()));
  }
  RegisterResult result{response.chunks(0).resumed(), response.chunks(0).update_count(),
                        {response.chunks(0).segment_update_counts().begin(),
                         response.chunks(0).segment_update_counts().end()}};
  if (result.resumed) std::memcpy(weights.data(), region.data(), weights.size());
  slots_->Release(*slot);
  std::lock_guard lock(mu_);
  chunks_[spec.chunk_id] = spec;
  return result;
}

absl::Status Session::Impl::PushGradients(uint32_t chunk_id, int64_t step, const AdamWHyper& hyper,
                                          std::span<const std::byte> gradients) {
  {
    std::lock_guard lock(mu_);
    if (absl::Status status = CheckUsableLocked(); !status.ok()) return status;
    auto it = chunks_.find(chunk_id);
    if (it == chunks_.end()) {
      return absl::InvalidArgumentError(
          fmt::format("chunk {} is not registered in the session of {}: call RegisterChunk first", chunk_id, Who()));
    }
    if (gradients.size() != it->second.grad_bytes()) {
      return absl::InvalidArgumentError(fmt::format(
          "chunk {} of {}: gradients are {} bytes, expected {} ({} elements of {})", chunk_id,
          Who(), gradients.size(), it->second.grad_bytes(), it->second.num_elements,
          DTypeName(it->second.grad_dtype)));
    }
  }
  absl::StatusOr<uint32_t> slot = AcquireSlot(client_.rpc_timeout);
  if (!slot.ok()) {
    return absl::Status(slot.status().code(),
                        fmt::format("chunk {} step {}: {}", chunk_id, step, std::string(slot.status().message())));
  }
  std::memcpy(GradRegion(*slot).data(), gradients.data(), gradients.size());
  absl::Status status = SendGradReady(chunk_id, *slot, step, hyper, {});
  if (!status.ok()) slots_->Release(*slot);
  return status;
}

absl::Status Session::Impl::PullParams(uint32_t chunk_id, std::span<std::byte> weights) {
  {
    std::lock_guard lock(mu_);
    if (closing_) return ClosedError();
    auto it = chunks_.find(chunk_id);
    if (it != chunks_.end() && weights.size() != it->second.param_bytes()) {
      return absl::InvalidArgumentError(fmt::format(
          "chunk {} of {}: weights are {} bytes, expected {} ({} elements of {})", chunk_id,
          Who(), weights.size(), it->second.param_bytes(), it->second.num_elements,
          DTypeName(it->second.param_dtype)));
    }
  }
  absl::StatusOr<uint32_t> slot = WaitParams(chunk_id, client_.rpc_timeout);
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
  absl::StatusOr<uint32_t> slot = slots_->Acquire(timeout);
  if (!slot.ok() && absl::IsDeadlineExceeded(slot.status())) {
    return absl::DeadlineExceededError(fmt::format("{}: {}", Who(), std::string(slot.status().message())));
  }
  return slot;
}

std::span<std::byte> Session::Impl::GradRegion(uint32_t slot) {
  if (base_ == nullptr || slot >= num_slots_) return {};
  return {base_ + SegmentLayout{num_slots_, slot_bytes_}.GradOffset(slot), slot_bytes_};
}

std::span<std::byte> Session::Impl::ParamRegion(uint32_t slot) {
  if (base_ == nullptr || slot >= num_slots_) return {};
  return {base_ + SegmentLayout{num_slots_, slot_bytes_}.ParamOffset(slot), slot_bytes_};
}

absl::Status Session::Impl::SendGradReady(uint32_t chunk_id, uint32_t slot, int64_t step,
                                          const AdamWHyper& hyper, const GradReadyOptions& options) {
  {
    std::lock_guard lock(mu_);
    if (absl::Status status = CheckUsableLocked(); !status.ok()) return status;
    if (!options.segments_without_grad.empty()) {
      auto spec = chunks_.find(chunk_id);
      const uint64_t segments =
          spec == chunks_.end() ? 0 : std::max<uint64_t>(1, spec->second.segment_elements.size());
      for (size_t i = 0; i < options.segments_without_grad.size(); ++i) {
        const uint32_t index = options.segments_without_grad[i];
        if (index >= segments || (i > 0 && index <= options.segments_without_grad[i - 1])) {
          return absl::InvalidArgumentError(fmt::format(
              "GradReady of chunk {} of {}: segments without gradients [{}] must be ascending, "
              "without repeats, and below the chunk's {} segments",
              chunk_id, Who(), fmt::join(options.segments_without_grad, ", "), segments));
        }
      }
    }
    if (auto it = pending_.find(chunk_id); it != pending_.end()) {
      return absl::FailedPreconditionError(fmt::format(
          "chunk {} of {} already has gradients of step {} in slot {}: take its parameters with "
          "PullParams or WaitParams before sending it again",
          chunk_id, Who(), it->second.step, it->second.slot));
    }
    if (absl::Status status = slots_->BeginFlight(slot); !status.ok()) {
      return absl::Status(status.code(), fmt::format("chunk {} of {}: {}", chunk_id, Who(), std::string(status.message())));
    }
    PendingChunk& pending = pending_[chunk_id];
    pending.slot = slot;
    pending.step = step;
  }
  v1::ClientMessage message;
  v1::GradReady* ready = message.mutable_grad_ready();
  ready->set_step(step);
  ready->set_chunk_id(chunk_id);
  ready->set_slot(slot);
  v1::AdamWHyper* h = ready->mutable_hyper();
  h->set_lr(hyper.lr);
  h->set_beta1(hyper.beta1);
  h->set_beta2(hyper.beta2);
  h->set_eps(hyper.eps);
  h->set_weight_decay(hyper.weight_decay);
  h->set_grad_scale(hyper.grad_scale);
  for (uint32_t index : options.segments_without_grad) ready->add_segments_without_grad(index);
  ready->set_speculative(options.speculative);
  ready->set_redo(static_cast<v1::RedoReason>(options.redo));
  ready->set_journal(static_cast<v1::JournalUse>(options.journal));
  for (const GradOp& op : options.grad_ops) {
    v1::GradOp* sent = ready->add_grad_ops();
    sent->set_kind(static_cast<v1::GradOp::Kind>(op.kind));
    sent->set_operand(op.operand);
  }
  absl::Status status = Write(message, fmt::format("GradReady of chunk {} step {}", chunk_id, step));
  if (!status.ok()) {
    std::lock_guard lock(mu_);
    pending_.erase(chunk_id);
    slots_->EndFlight(slot);  // the caller holds the slot again
  }
  return status;
}

std::optional<JournalStats> Session::Impl::GetJournalStats(uint32_t chunk_id) {
  std::lock_guard lock(mu_);
  auto found = journal_stats_.find(chunk_id);
  if (found == journal_stats_.end()) return std::nullopt;
  return found->second;
}

absl::StatusOr<uint32_t> Session::Impl::WaitParams(uint32_t chunk_id, std::chrono::milliseconds timeout) {
  std::unique_lock lock(mu_);
  if (closing_) return ClosedError();
  auto it = pending_.find(chunk_id);
  if (it == pending_.end()) {
    if (!lost_.ok()) return lost_;
    return absl::FailedPreconditionError(fmt::format(
        "chunk {} of {} has no gradients in flight: send them with PushGradients or "
        "SendGradReady first",
        chunk_id, Who()));
  }
  const bool answered = cv_.wait_for(lock, timeout, [&] {
    it = pending_.find(chunk_id);
    return it == pending_.end() || it->second.done;
  });
  if (it == pending_.end()) {
    return absl::FailedPreconditionError(
        fmt::format("chunk {} of {}: another thread took its parameters", chunk_id, Who()));
  }
  if (!answered) {
    return absl::DeadlineExceededError(fmt::format(
        "no ParamsReady for chunk {} (slot {}, step {}) of {} within {} ms", chunk_id,
        it->second.slot, it->second.step, Who(), timeout.count()));
  }
  PendingChunk pending = std::move(it->second);
  pending_.erase(it);
  if (pending.status.ok()) return pending.slot;
  // Refused or lost: the slot comes back to the job and is freed here, since the
  // caller gets no slot to release.
  slots_->EndFlight(pending.slot);
  slots_->Release(pending.slot);
  return pending.status;
}

void Session::Impl::ReleaseSlot(uint32_t slot) { slots_->Release(slot); }

// ----------------------------------------------------------------------------
// Streaming weights

absl::Status Session::Impl::SendFetchWeights(uint32_t chunk_id, uint32_t slot) {
  {
    std::lock_guard lock(mu_);
    if (absl::Status status = CheckUsableLocked(); !status.ok()) return status;
    auto spec = chunks_.find(chunk_id);
    if (spec == chunks_.end()) {
      return absl::InvalidArgumentError(fmt::format(
          "FetchWeights: chunk {} is not registered in the session of {}: call RegisterChunk first", chunk_id, Who()));
    }
    if (!spec->second.store_weights) {
      return absl::FailedPreconditionError(fmt::format(
          "FetchWeights: chunk {} of {} was registered without store_weights, so the daemon keeps no working "
          "weights for it; register it with ChunkSpec.store_weights (a new job for chunks created without)",
          chunk_id, Who()));
    }
    if (control_.active) {
      return absl::FailedPreconditionError(fmt::format(
          "FetchWeights of chunk {} of {}: an export or import request is in progress; fetch after it", chunk_id,
          Who()));
    }
    if (absl::Status status = slots_->BeginFlight(slot); !status.ok()) {
      return absl::Status(status.code(), fmt::format("FetchWeights of chunk {} of {}: {}", chunk_id, Who(),
                                                     std::string(status.message())));
    }
    PendingFetch fetch;
    fetch.slot = slot;
    fetches_[chunk_id].push_back(std::move(fetch));
  }
  v1::ClientMessage message;
  message.mutable_fetch_weights()->set_chunk_id(chunk_id);
  message.mutable_fetch_weights()->set_slot(slot);
  absl::Status status = Write(message, fmt::format("FetchWeights of chunk {} into slot {}", chunk_id, slot));
  if (!status.ok()) {
    std::lock_guard lock(mu_);
    auto it = fetches_.find(chunk_id);
    if (it != fetches_.end()) {
      auto mine = std::find_if(it->second.begin(), it->second.end(),
                               [&](const PendingFetch& f) { return f.slot == slot && !f.done; });
      if (mine != it->second.end()) it->second.erase(mine);
      if (it->second.empty()) fetches_.erase(it);
    }
    slots_->EndFlight(slot);  // the caller holds the slot again
  }
  return status;
}

absl::StatusOr<uint32_t> Session::Impl::WaitWeights(uint32_t chunk_id, std::chrono::milliseconds timeout) {
  std::unique_lock lock(mu_);
  if (closing_) return ClosedError();
  auto it = fetches_.find(chunk_id);
  if (it == fetches_.end()) {
    if (!lost_.ok()) return lost_;
    return absl::FailedPreconditionError(fmt::format(
        "chunk {} of {} has no weights fetch in flight: send one with SendFetchWeights first", chunk_id, Who()));
  }
  // The oldest fetch of the chunk, known by its slot (no two fetches in flight
  // share a slot); another thread may take it while this one waits.
  const uint32_t slot = it->second.front().slot;
  auto find = [&]() -> std::optional<std::pair<decltype(it), std::deque<PendingFetch>::iterator>> {
    auto chunk = fetches_.find(chunk_id);
    if (chunk == fetches_.end()) return std::nullopt;
    auto fetch = std::find_if(chunk->second.begin(), chunk->second.end(),
                              [&](const PendingFetch& f) { return f.slot == slot; });
    if (fetch == chunk->second.end()) return std::nullopt;
    return std::make_pair(chunk, fetch);
  };
  const bool answered = cv_.wait_for(lock, timeout, [&] {
    auto found = find();
    return !found || found->second->done;
  });
  auto found = find();
  if (!found) {
    return absl::FailedPreconditionError(
        fmt::format("chunk {} of {}: another thread took its fetched weights", chunk_id, Who()));
  }
  if (!answered) {
    return absl::DeadlineExceededError(fmt::format("no WeightsFetched for chunk {} (slot {}) of {} within {} ms",
                                                   chunk_id, slot, Who(), timeout.count()));
  }
  PendingFetch fetch = std::move(*found->second);
  found->first->second.erase(found->second);
  if (found->first->second.empty()) fetches_.erase(found->first);
  if (fetch.status.ok()) return fetch.slot;
  // Refused or lost: the slot comes back to the job and is freed here, since the
  // caller gets no slot to release.
  slots_->EndFlight(fetch.slot);
  slots_->Release(fetch.slot);
  return fetch.status;
}

absl::StatusOr<StepResult> Session::Impl::WaitStep(int64_t step, bool abort, AbortReason reason) {
  const char* verb = abort ? "AbortStep" : "EndStep";
  {
    std::lock_guard lock(mu_);
    if (absl::Status status = CheckUsableLocked(); !status.ok()) return status;
    if (steps_.contains(step)) {
      return absl::FailedPreconditionError(
          fmt::format("step {} of {} is already being ended or aborted", step, Who()));
    }
    steps_[step].abort = abort;
  }
  v1::ClientMessage message;
  if (abort) {
    message.mutable_abort_step()->set_step(step);
    message.mutable_abort_step()->set_reason(static_cast<v1::AbortReason>(reason));
  } else {
    message.mutable_end_step()->set_step(step);
  }
  absl::Status written = Write(message, fmt::format("{} of step {}", verb, step));
  std::unique_lock lock(mu_);
  if (!written.ok()) {
    steps_.erase(step);
    return written;
  }
  const bool answered = cv_.wait_for(lock, client_.rpc_timeout, [&] { return steps_[step].done; });
  StepWaiter waiter = std::move(steps_[step]);
  steps_.erase(step);
  if (!answered) {
    return absl::DeadlineExceededError(fmt::format("no answer to {} of step {} of {} within {} ms", verb,
                                                   step, Who(), client_.rpc_timeout.count()));
  }
  if (!waiter.status.ok()) return waiter.status;
  return waiter.result;
}

absl::StatusOr<StepResult> Session::Impl::EndStep(int64_t step) { return WaitStep(step, false); }

absl::Status Session::Impl::AbortStep(int64_t step, AbortReason reason) {
  return WaitStep(step, true, reason).status();
}

// ----------------------------------------------------------------------------
// Export and import

absl::Status Session::Impl::Close() {
  std::lock_guard close_lock(close_mu_);
  if (close_done_) return close_status_;
  absl::Status lost;
  {
    std::lock_guard lock(mu_);
    closing_ = true;
    lost = lost_;
  }
  cv_.notify_all();
  absl::Status result = lost;
  bool closed_by_daemon = false;
  if (lost.ok() && !session_id_.empty()) {
    v1::CloseSessionRequest request;
    request.set_session_id(session_id_);
    v1::CloseSessionResponse response;
    grpc::ClientContext context;
    SetDeadline(context, client_.rpc_timeout);
    grpc::Status rpc = stub_->CloseSession(&context, request, &response);
    if (rpc.ok()) {
      committed_step_ = response.committed_step();
      closed_by_daemon = true;
    } else {
      result = RpcError(rpc, fmt::format("CloseSession of {}", Who()), client_.rpc_timeout);
    }
  }
  if (stream_ != nullptr) {
    {
      std::lock_guard lock(write_mu_);
      if (!writes_closed_) {
        writes_closed_ = true;
        stream_->WritesDone();
      }
    }
    if (closed_by_daemon) {
      std::unique_lock lock(mu_);
      cv_.wait_for(lock, kStreamDrainTimeout, [&] { return reader_done_; });
    }
    stream_context_->TryCancel();
  }
  if (reader_.joinable()) reader_.join();
  {
    std::lock_guard lock(mu_);
    if (slots_ != nullptr) slots_->Fail(ClosedError());
  }
  base_ = nullptr;
  segment_.reset();
  close_done_ = true;
  close_status_ = result;
  return result;
}

// ----------------------------------------------------------------------------
// Session

absl::StatusOr<std::unique_ptr<Session>> Session::Open(const SessionOptions& options,
                                                       const ClientOptions& client) {
  if (options.job.empty()) return absl::InvalidArgumentError("SessionOptions.job is empty: name the job");
  if (options.num_slots == 0 || options.num_slots > kMaxSlots) {
    return absl::InvalidArgumentError(fmt::format("job '{}': num_slots is {}, must be 1..{}",
                                                  options.job, options.num_slots, kMaxSlots));
  }
  if (options.slot_bytes == 0) {
    return absl::InvalidArgumentError(fmt::format(
        "job '{}': slot_bytes is 0: set it to at least the largest chunk's bytes", options.job));
  }
  try {
    const std::string address = internal::ResolveAddress(client);
    absl::StatusOr<std::shared_ptr<grpc::Channel>> channel =
        internal::ConnectChannel(address, client.connect_timeout, internal::UsesDefaultAddress(client));
    if (!channel.ok()) return channel.status();
    auto impl = std::make_unique<Impl>(options, client, address, *std::move(channel));
    if (absl::Status status = impl->Start(); !status.ok()) return status;  // ~Impl cleans up
    return std::unique_ptr<Session>(new Session(std::move(impl)));
  } catch (const std::exception& e) {
    return absl::InternalError(fmt::format("opening a session of job '{}': {}", options.job, e.what()));
  }
}

Session::Session(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
Session::~Session() = default;

int64_t Session::committed_step() const { return impl_->committed_step(); }
uint32_t Session::num_slots() const { return impl_->num_slots(); }
uint64_t Session::slot_bytes() const { return impl_->slot_bytes(); }
const std::string& Session::session_id() const { return impl_->session_id(); }

absl::StatusOr<RegisterResult> Session::RegisterChunk(const ChunkSpec& spec, std::span<std::byte> weights) {
  return impl_->RegisterChunk(spec, weights);
}
absl::Status Session::PushGradients(uint32_t chunk_id, int64_t step, const AdamWHyper& hyper,
                                    std::span<const std::byte> gradients) {
  return impl_->PushGradients(chunk_id, step, hyper, gradients);
}
absl::Status Session::PullParams(uint32_t chunk_id, std::span<std::byte> weights) {
  return impl_->PullParams(chunk_id, weights);
}
absl::StatusOr<uint32_t> Session::AcquireSlot(std::chrono::milliseconds timeout) {
  return impl_->AcquireSlot(timeout);
}
std::span<std::byte> Session::GradRegion(uint32_t slot) { return impl_->GradRegion(slot); }
std::span<std::byte> Session::ParamRegion(uint32_t slot) { return impl_->ParamRegion(slot); }
absl::Status Session::SendGradReady(uint32_t chunk_id, uint32_t slot, int64_t step, const AdamWHyper& hyper) {
  return impl_->SendGradReady(chunk_id, slot, step, hyper, {});
}

absl::Status Session::SendGradReady(uint32_t chunk_id, uint32_t slot, int64_t step, const AdamWHyper& hyper,
                                    const GradReadyOptions& options) {
  return impl_->SendGradReady(chunk_id, slot, step, hyper, options);
}
std::optional<JournalStats> Session::GetJournalStats(uint32_t chunk_id) const {
  return impl_->GetJournalStats(chunk_id);
}
absl::StatusOr<uint32_t> Session::WaitParams(uint32_t chunk_id, std::chrono::milliseconds timeout) {
  return impl_->WaitParams(chunk_id, timeout);
}
void Session::ReleaseSlot(uint32_t slot) { impl_->ReleaseSlot(slot); }
absl::Status Session::SendFetchWeights(uint32_t chunk_id, uint32_t slot) {
  return impl_->SendFetchWeights(chunk_id, slot);
}
absl::StatusOr<uint32_t> Session::WaitWeights(uint32_t chunk_id, std::chrono::milliseconds timeout) {
  return impl_->WaitWeights(chunk_id, timeout);
}
absl::StatusOr<StepResult> Session::EndStep(int64_t step) { return impl_->EndStep(step); }
absl::Status Session::AbortStep(int64_t step, AbortReason reason) { return impl_->AbortStep(step, reason); }
absl::StatusOr<int64_t> Session::ReadState(uint32_t chunk_id, StateKind which, uint64_t first,
                                           std::span<float> out) {
  return impl_->ReadState(chunk_id, which, first, out);
}
absl::Status Session::WriteState(uint32_t chunk_id, StateKind which, uint64_t first,
                                 std::span<const float> values) {
  return impl_->WriteState(chunk_id, which, first, values);
}
absl::Status Session::SetUpdateCount(uint32_t chunk_id, int64_t update_count,
                                     std::span<const int64_t> segment_update_counts) {
  return impl_->SetUpdateCount(chunk_id, update_count, segment_update_counts);
}
absl::StatusOr<uint32_t> Session::CommitImport() { return impl_->CommitImport(); }
absl::Status Session::Close() { return impl_->Close(); }

}  // namespace fuyou
