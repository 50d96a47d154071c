// Session::Impl, steps: a chunk's GradReady and its ParamsReady (one in
// flight per chunk), EndStep and AbortStep, WaitDurable.
#include <algorithm>
#include <optional>

#include "fmt/format.h"
#include "fmt/ranges.h"
#include "session_impl.h"

namespace fuyou {

using internal::OfChunk;
using internal::PendingRequest;
using internal::RequestKind;

absl::Status Session::Impl::SendGradReady(uint32_t chunk_id, uint32_t slot, int64_t step,
                                          const AdamWHyper& hyper, const GradReadyOptions& options) {
  uint64_t id = 0;
  {
    std::lock_guard lock(mu_);
    if (absl::Status status = CheckUsableLocked(); !status.ok()) return status;
    if (!options.segments_without_grad.empty()) {
      const ChunkSpec* spec = chunks_.Find(chunk_id);
      const uint64_t segments = spec == nullptr ? 0 : std::max<uint64_t>(1, spec->segment_elements.size());
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
    if (std::optional<uint64_t> sent = requests_.FindOldest(OfChunk(RequestKind::kGradReady, chunk_id))) {
      const PendingRequest& in_flight = *requests_.Find(*sent);
      return absl::FailedPreconditionError(fmt::format(
          "chunk {} of {} already has gradients of step {} in slot {}: take its parameters with "
          "PullParams or WaitParams before sending it again",
          chunk_id, Who(), in_flight.step, in_flight.slot));
    }
    if (absl::Status status = slots().BeginFlight(slot); !status.ok()) {
      return absl::Status(status.code(), fmt::format("chunk {} of {}: {}", chunk_id, Who(), std::string(status.message())));
    }
    id = requests_.Add({.kind = RequestKind::kGradReady, .chunk_id = chunk_id, .slot = slot, .step = step});
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
  absl::Status status = WriteRequest(id, message, fmt::format("GradReady of chunk {} step {}", chunk_id, step));
  if (!status.ok()) slots().EndFlight(slot);  // the caller holds the slot again
  return status;
}


absl::StatusOr<uint32_t> Session::Impl::WaitParams(uint32_t chunk_id, std::chrono::milliseconds timeout) {
  std::unique_lock lock(mu_);
  if (health_.closing()) return ClosedError();
  const std::optional<uint64_t> id = requests_.FindOldest(OfChunk(RequestKind::kGradReady, chunk_id));
  if (!id) {
    if (!health_.lost().ok()) return health_.lost();
    return absl::FailedPreconditionError(fmt::format(
        "chunk {} of {} has no gradients in flight: send them with PushGradients or "
        "SendGradReady first",
        chunk_id, Who()));
  }
  switch (AwaitLocked(lock, *id, timeout)) {
    case Awaited::kTakenByAnother:
      return absl::FailedPreconditionError(
          fmt::format("chunk {} of {}: another thread took its parameters", chunk_id, Who()));
    case Awaited::kTimedOut: {
      const PendingRequest& pending = *requests_.Find(*id);
      return absl::DeadlineExceededError(fmt::format(
          "no ParamsReady for chunk {} (slot {}, step {}) of {} within {} ms", chunk_id,
          pending.slot, pending.step, Who(), timeout.count()));
    }
    case Awaited::kAnswered:
      break;
  }
  PendingRequest pending = *requests_.Take(*id);
  if (pending.status.ok()) return pending.slot;
  // Refused or lost: the slot comes back to the job and is freed here, since the
  // caller gets no slot to release.
  slots().EndFlight(pending.slot);
  slots().Release(pending.slot);
  return pending.status;
}

absl::StatusOr<StepResult> Session::Impl::WaitStep(int64_t step, bool abort, AbortReason reason) {
  const RequestKind kind = abort ? RequestKind::kAbortStep : RequestKind::kEndStep;
  uint64_t id = 0;
  {
    std::lock_guard lock(mu_);
    if (absl::Status status = CheckUsableLocked(); !status.ok()) return status;
    const bool ending = requests_.FindOldest([step](const PendingRequest& request) {
      return (request.kind == RequestKind::kEndStep || request.kind == RequestKind::kAbortStep) &&
             request.step == step;
    }).has_value();
    if (ending) {
      return absl::FailedPreconditionError(
          fmt::format("step {} of {} is already being ended or aborted", step, Who()));
    }
    id = requests_.Add({.kind = kind, .step = step});
  }
  v1::ClientMessage message;
  if (abort) {
    message.mutable_abort_step()->set_step(step);
    message.mutable_abort_step()->set_reason(static_cast<v1::AbortReason>(reason));
  } else {
    message.mutable_end_step()->set_step(step);
  }
  absl::StatusOr<v1::DaemonMessage> answer =
      Call(id, message, fmt::format("{} of step {}", RequestName(kind), step), rpc_timeout());
  {
    // The daemon drops the session's spilled activations with the step (a
    // request refused as out of order keeps them there; keys are not reused).
    std::lock_guard lock(mu_);
    activations_.Clear();
  }
  if (!answer.ok()) return answer.status();
  if (abort) return StepResult{step, 0};
  const v1::StepCommitted& committed = answer->step_committed();
  return StepResult{committed.step(), committed.chunks_updated(), committed.durable_step()};
}

absl::StatusOr<StepResult> Session::Impl::EndStep(int64_t step) { return WaitStep(step, false); }

absl::StatusOr<int64_t> Session::Impl::WaitDurable(int64_t step) {
  uint64_t id = 0;
  {
    std::lock_guard lock(mu_);
    if (absl::Status status = CheckUsableLocked(); !status.ok()) return status;
    id = requests_.Add({.kind = RequestKind::kWaitDurable, .step = step});
  }
  v1::ClientMessage message;
  message.mutable_wait_durable()->set_step(step);
  absl::StatusOr<v1::DaemonMessage> answer =
      Call(id, message, fmt::format("WaitDurable of step {}", step), rpc_timeout());
  if (!answer.ok()) return answer.status();
  return answer->step_durable().durable_step();  // checked against the request (OnAnswerLocked)
}

absl::Status Session::Impl::AbortStep(int64_t step, AbortReason reason) {
  return WaitStep(step, true, reason).status();
}

}  // namespace fuyou
