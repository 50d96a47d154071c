// Session::Impl, the stream: writing requests with their ids, the reader
// thread, routing each answer to the request its id names (pending_requests.h),
// waiting for one, and the end of the stream.
#include <string>
#include <utility>

#include "fmt/format.h"
#include "session_impl.h"

namespace fuyou {

using internal::PendingRequest;
using internal::RequestKind;

absl::Status Session::Impl::Attach() {
  connection_.StartStream([this](const v1::DaemonMessage& message) { Dispatch(message); },
                          [this](const grpc::Status& status) { OnStreamEnd(status); });
  uint64_t id = 0;
  {
    std::lock_guard lock(mu_);
    id = requests_.Add({.kind = RequestKind::kAttach});
  }
  v1::ClientMessage message;
  message.mutable_attach()->set_session_id(name_.id);
  return Call(id, message, "Attach", rpc_timeout()).status();
}

absl::Status Session::Impl::Write(const v1::ClientMessage& message, std::string_view what) {
  if (connection_.Write(message)) return absl::OkStatus();
  // The stream is broken: give the reader a moment to learn gRPC's reason.
  std::unique_lock lock(mu_);
  cv_.wait_for(lock, std::chrono::seconds(1), [&] { return health_.stream_ended(); });
  if (health_.closing()) return ClosedError();
  if (!health_.lost().ok()) return health_.lost();
  return absl::UnavailableError(
      fmt::format("connection to fuyoud lost: cannot send {} of {}", what, Who()));
}

absl::Status Session::Impl::WriteRequest(uint64_t id, v1::ClientMessage& message, std::string_view what) {
  message.set_request_id(id);
  absl::Status status = Write(message, what);
  if (!status.ok()) {
    std::lock_guard lock(mu_);
    (void)requests_.Take(id);
  }
  return status;
}

Session::Impl::Awaited Session::Impl::AwaitLocked(std::unique_lock<std::mutex>& lock, uint64_t id,
                                                  std::chrono::milliseconds timeout) {
  cv_.wait_for(lock, timeout, [&] {
    const PendingRequest* request = requests_.Find(id);
    return request == nullptr || request->answered;
  });
  const PendingRequest* request = requests_.Find(id);
  if (request == nullptr) return Awaited::kTakenByAnother;
  return request->answered ? Awaited::kAnswered : Awaited::kTimedOut;
}

absl::StatusOr<v1::DaemonMessage> Session::Impl::Call(uint64_t id, v1::ClientMessage& message,
                                                      const std::string& what, std::chrono::milliseconds timeout) {
  if (absl::Status written = WriteRequest(id, message, what); !written.ok()) return written;
  std::unique_lock lock(mu_);
  const Awaited awaited = AwaitLocked(lock, id, timeout);
  if (awaited == Awaited::kTimedOut) {
    requests_.Abandon(id);
    return absl::DeadlineExceededError(
        fmt::format("no answer to {} of {} within {} ms", what, Who(), timeout.count()));
  }
  std::optional<PendingRequest> request = requests_.Take(id);
  if (awaited == Awaited::kTakenByAnother || !request) {
    return absl::InternalError(fmt::format("{} of {}: its answer was taken by another call", what, Who()));
  }
  if (!request->status.ok()) return request->status;
  return std::move(request->answer);
}

void Session::Impl::Dispatch(const v1::DaemonMessage& message) {
  {
    std::lock_guard lock(mu_);
    if (!health_.trusts_stream()) return;  // the stream is no longer trusted
    absl::StatusOr<internal::PendingRequests::Delivery> delivered = requests_.Deliver(message);
    if (!delivered.ok()) {
      BreakProtocolLocked(delivered.status());
    } else {
      if (message.has_error()) {
        // A refusal of a request whose waiter gave up: the next call reports it (once).
        health_.OnDaemonError(internal::StatusFromError(message.error()), delivered->request != nullptr);
      }
      OnAnswerLocked(delivered->kind, delivered->request, message);
    }
  }
  cv_.notify_all();
}

void Session::Impl::OnAnswerLocked(RequestKind kind, PendingRequest* request, const v1::DaemonMessage& message) {
  if (request == nullptr) {
    // Only calls that wait for their own answer give up on it; a late commit
    // still moves the committed step.
    if (message.has_step_committed()) committed_step_.Advance(message.step_committed().step());
    return;
  }
  switch (kind) {
    case RequestKind::kGradReady: {
      slots().EndFlight(request->slot);  // the daemon is done with the slot either way
      if (!message.has_params_ready()) return;
      const v1::ParamsReady& ready = message.params_ready();
      if (ready.chunk_id() != request->chunk_id || ready.slot() != request->slot) {
        request->status = absl::InternalError(fmt::format(
            "fuyoud answered ParamsReady for chunk {} of {} in slot {}, but its gradients were sent for chunk "
            "{} in slot {}",
            ready.chunk_id(), Who(), ready.slot(), request->chunk_id, request->slot));
        return;
      }
      chunks_.RecordJournalStats(ready);
      return;
    }
    case RequestKind::kFetchWeights: {
      slots().EndFlight(request->slot);
      if (!message.has_weights_fetched()) return;
      const v1::WeightsFetched& fetched = message.weights_fetched();
      if (fetched.chunk_id() != request->chunk_id || fetched.slot() != request->slot) {
        request->status = absl::InternalError(fmt::format(
            "fuyoud answered FetchWeights of chunk {} of {} in slot {}, but the fetch named chunk {} in slot {}",
            fetched.chunk_id(), Who(), fetched.slot(), request->chunk_id, request->slot));
      }
      return;
    }
    case RequestKind::kEndStep:
    case RequestKind::kAbortStep: {
      if (message.has_error()) return;
      const int64_t step = kind == RequestKind::kEndStep ? message.step_committed().step()
                                                         : message.step_aborted().step();
      if (step != request->step) {
        request->status = absl::InternalError(fmt::format("fuyoud answered {} of step {} of {} for step {}",
                                                          RequestName(kind), request->step, Who(), step));
        return;
      }
      if (kind == RequestKind::kEndStep) committed_step_.Advance(step);
      return;
    }
    case RequestKind::kWaitDurable: {
      if (!message.has_step_durable()) return;
      const v1::StepDurable& durable = message.step_durable();
      if (durable.step() != request->step || durable.durable_step() < request->step) {
        request->status = absl::InternalError(fmt::format(
            "fuyoud answered WaitDurable of step {} of {} with step {} durable at step {}", request->step, Who(),
            durable.step(), durable.durable_step()));
      }
      return;
    }
    default:
      return;  // Attach; the export/import calls check their answers themselves
  }
}

void Session::Impl::BreakProtocolLocked(const absl::Status& why) {
  const absl::Status broken = health_.BreakProtocol(Who(), why);
  requests_.FailAll(broken);
  if (memory_.pool() != nullptr) memory_.pool()->Fail(broken);
}

void Session::Impl::OnStreamEnd(const grpc::Status& grpc_status) {
  {
    std::lock_guard lock(mu_);
    const absl::Status end = health_.OnStreamEnd(grpc_status, Who(), ClosedError());
    requests_.FailAll(end);
    if (memory_.pool() != nullptr) memory_.pool()->Fail(end);
  }
  cv_.notify_all();
}

}  // namespace fuyou
