// Session: the client side of one offload session (see fuyou/client.h); the
// public calls over Session::Impl (session_impl.h says which file implements
// what), Open and Close.
#include "channel.h"
#include "fmt/format.h"
#include "fuyou/client.h"
#include "session_impl.h"

namespace fuyou {
namespace {

using internal::RpcError;
using internal::SetDeadline;

// How long Close waits for the daemon to end the stream after CloseSession
// before it cancels the stream (the session is already closed by then).
constexpr std::chrono::milliseconds kStreamDrainTimeout{2000};

}  // namespace

absl::Status Session::Impl::Close() {
  return close_.Run([this] { return CloseNow(); });
}

absl::Status Session::Impl::CloseNow() {
  absl::Status lost;
  {
    std::lock_guard lock(mu_);
    health_.BeginClose();
    lost = health_.lost();
  }
  cv_.notify_all();
  absl::Status result = lost;
  bool closed_by_daemon = false;
  if (lost.ok() && !name_.id.empty()) {
    v1::CloseSessionRequest request;
    request.set_session_id(name_.id);
    v1::CloseSessionResponse response;
    grpc::ClientContext context;
    SetDeadline(context, rpc_timeout());
    grpc::Status rpc = connection_.stub().CloseSession(&context, request, &response);
    if (rpc.ok()) {
      committed_step_.Set(response.committed_step());
      closed_by_daemon = true;
    } else {
      result = RpcError(rpc, fmt::format("CloseSession of {}", Who()), rpc_timeout());
    }
  }
  if (connection_.has_stream()) {
    connection_.CloseWrites();
    if (closed_by_daemon) {
      std::unique_lock lock(mu_);
      cv_.wait_for(lock, kStreamDrainTimeout, [&] { return health_.stream_ended(); });
    }
    connection_.Cancel();
  }
  connection_.JoinReader();
  {
    std::lock_guard lock(mu_);
    if (memory_.pool() != nullptr) memory_.pool()->Fail(ClosedError());
  }
  memory_.Unmap();
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
    absl::StatusOr<internal::DaemonChannel> daemon =
        internal::ConnectChannel(address, client.connect_timeout, internal::NeedsTrustCheck(client));
    if (!daemon.ok()) return daemon.status();
    auto impl = std::make_unique<Impl>(options, client, std::move(daemon->channel), daemon->peer_uid);
    if (absl::Status status = impl->Start(options); !status.ok()) return status;  // ~Impl cleans up
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
absl::Status Session::SpillActivation(uint64_t key, std::span<const std::byte> bytes) {
  return impl_->SpillActivation(key, bytes);
}
absl::Status Session::RecallActivation(uint64_t key, std::span<std::byte> out) {
  return impl_->RecallActivation(key, out);
}
absl::Status Session::DropActivations() { return impl_->DropActivations(); }
absl::StatusOr<int64_t> Session::WaitDurable(int64_t step) { return impl_->WaitDurable(step); }
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
absl::StatusOr<uint32_t> Session::CommitImport(int64_t resume_step) { return impl_->CommitImport(resume_step); }
absl::Status Session::Close() { return impl_->Close(); }

}  // namespace fuyou
