// Session::Impl, the stream: writing requests with their ids, the reader
// thread, routing each answer to the request its id names (pending_requests.h),
// waiting for one, and the end of the stream.
#include <string>
#include <thread>
#include <utility>

#include "fmt/format.h"
#include "session_impl.h"

namespace fuyou {

using internal::PendingRequest;
using internal::RequestKind;

absl::Status Session::Impl::Attach() {
  stream_context_ = std::make_unique<grpc::ClientContext>();
  stream_ = stub_->Stream(stream_context_.get());
  reader_ = std::thread([this] { ReadLoop(); });
  uint64_t id = 0;
  {
    std::lock_guard lock(mu_);
    id = requests_.Add({.kind = RequestKind::kAttach});
  }
  v1::ClientMessage message;
  message.mutable_attach()->set_session_id(session_id_);
  return Call(id, message, "Attach", client_.rpc_timeout).status();
}

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
  {
    std::lock_guard lock(mu_);
    if (!protocol_error_.ok()) return;  // the stream is no longer trusted
    absl::StatusOr<internal::PendingRequests::Delivery> delivered = requests_.Deliver(message);
    if (!delivered.ok()) {
      BreakProtocolLocked(delivered.status());
    } else {
      if (message.has_error()) {
        const absl::Status status = internal::StatusFromError(message.error());
        if ((absl::IsAborted(status) || absl::IsInternal(status)) && fatal_.ok()) fatal_ = status;
        // A refusal of a request whose waiter gave up: the next call reports it (once).
        if (delivered->request == nullptr && session_error_.ok()) session_error_ = status;
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
    if (message.has_step_committed()) {
      const int64_t step = message.step_committed().step();
      int64_t current = committed_step_.load();
      while (step > current && !committed_step_.compare_exchange_weak(current, step)) {
      }
    }
    return;
  }
  switch (kind) {
    case RequestKind::kGradReady: {
      slots_->EndFlight(request->slot);  // the daemon is done with the slot either way
      if (!message.has_params_ready()) return;
      const v1::ParamsReady& ready = message.params_ready();
      if (ready.chunk_id() != request->chunk_id || ready.slot() != request->slot) {
        request->status = absl::InternalError(fmt::format(
            "fuyoud answered ParamsReady for chunk {} of {} in slot {}, but its gradients were sent for chunk "
            "{} in slot {}",
            ready.chunk_id(), Who(), ready.slot(), request->chunk_id, request->slot));
        return;
      }
      if (ready.segment_sum_squares_size() != 0 || ready.segment_max_abs_size() != 0) {
        journal_stats_[ready.chunk_id()] =
            JournalStats{{ready.segment_sum_squares().begin(), ready.segment_sum_squares().end()},
                         {ready.segment_max_abs().begin(), ready.segment_max_abs().end()}};
      } else {
        journal_stats_.erase(ready.chunk_id());
      }
      return;
    }
    case RequestKind::kFetchWeights: {
      slots_->EndFlight(request->slot);
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
      int64_t current = committed_step_.load();
      while (kind == RequestKind::kEndStep && step > current &&
             !committed_step_.compare_exchange_weak(current, step)) {
      }
      return;
    }
    default:
      return;  // Attach; the export/import calls check their answers themselves
  }
}

void Session::Impl::BreakProtocolLocked(const absl::Status& why) {
  protocol_error_ = absl::InternalError(
      fmt::format("protocol error on the stream of {}: {}; the session is unusable, close it", Who(),
                  std::string(why.message())));
  if (fatal_.ok()) fatal_ = protocol_error_;
  requests_.FailAll(protocol_error_);
  if (slots_ != nullptr) slots_->Fail(protocol_error_);
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
    requests_.FailAll(end);
    if (slots_ != nullptr) slots_->Fail(end);
  }
  cv_.notify_all();
}

}  // namespace fuyou
