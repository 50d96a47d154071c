// Session: activation offload's storage tier (issue 23).
//
// SpillActivation copies the first `bytes` bytes of a slot's gradient region
// to the session's activation scratch (journal/activation_spill.h: striped over
// the storage paths, checksummed, never committed) and answers when they are
// written; RecallActivation copies them back into a slot's gradient region
// after checking their checksum and forgets them. Both answer when their
// transfer completes, from the I/O completion thread (Session::Handle), so
// the session's other messages are served meanwhile; DropActivations (and EndStep,
// AbortStep, the session's end) frees them all. None of them touches the job or
// the step: they are served at any time while the session is attached.
#include <optional>

#include "common/status_util.h"  // fmt formats absl::string_view (Status::message)
#include "fmt/format.h"
#include "session/session.h"
#include "session/stream_replies.h"
#include "stats/daemon_stats.h"

namespace fuyou {
namespace {

// INVALID_ARGUMENT unless `slot` exists in `layout` (and, when `bytes` is
// given, 1 <= bytes <= slot_bytes).
absl::Status CheckActivationSlot(const SegmentLayout& layout, const char* verb, uint64_t key, uint32_t slot,
                                 std::optional<uint64_t> bytes) {
  if (slot >= layout.num_slots) {
    return absl::InvalidArgumentError(fmt::format("{} of activation {}: slot {} does not exist (the session has {} slots)",
                                                  verb, key, slot, layout.num_slots));
  }
  if (bytes && (*bytes == 0 || *bytes > layout.slot_bytes)) {
    return absl::InvalidArgumentError(
        fmt::format("{} of activation {}: {} bytes is not in 1..{} (the session's slot size)", verb, key, *bytes,
                    layout.slot_bytes));
  }
  return absl::OkStatus();
}

}  // namespace

Future<v1::DaemonMessage> Session::OnSpillActivation(const v1::SpillActivation& request) {
  const uint64_t key = request.key();
  if (absl::Status bad = CheckActivationSlot(identity_.layout, "SpillActivation", key, request.slot(), request.bytes());
      !bad.ok()) {
    return MakeReadyFuture<v1::DaemonMessage>(ErrorReply(bad));
  }
  // The bytes are copied out of the slot before Spill returns; the answer
  // comes when they are written (on the completion thread: no session lock).
  const std::span<const std::byte> bytes = held_.segment->GradRegion(request.slot()).first(request.bytes());
  Future<void> written = held_.activations->Spill(key, bytes);
  return written.Then([counters = counters_, key, bytes = request.bytes(),
                       scratch_bytes = held_.activations->scratch_bytes(),
                       who = fmt::format("session {}, job '{}'", identity_.id, identity_.job_name)](
                          const absl::Status& spilled) -> absl::StatusOr<v1::DaemonMessage> {
    if (!spilled.ok()) {
      return ErrorReply(
          absl::Status(spilled.code(), fmt::format("SpillActivation ({}): {}", who, spilled.message())));
    }
    counters.Bump(Ticker::kActivationSpilledBytes, bytes);
    v1::DaemonMessage reply;
    v1::ActivationSpilled* done = reply.mutable_activation_spilled();
    done->set_key(key);
    done->set_bytes(bytes);
    done->set_session_scratch_bytes(scratch_bytes);
    return reply;
  });
}

Future<v1::DaemonMessage> Session::OnRecallActivation(const v1::RecallActivation& request) {
  const uint64_t key = request.key();
  if (absl::Status bad = CheckActivationSlot(identity_.layout, "RecallActivation", key, request.slot(), std::nullopt);
      !bad.ok()) {
    return MakeReadyFuture<v1::DaemonMessage>(ErrorReply(bad));
  }
  // The slot (the session's segment) outlives the read: Close waits for it.
  Future<uint64_t> recalled = held_.activations->Recall(key, held_.segment->GradRegion(request.slot()));
  return recalled.Then([counters = counters_, key, slot = request.slot(),
                        who = fmt::format("session {}, job '{}'", identity_.id, identity_.job_name)](
                           const absl::StatusOr<uint64_t>& result) -> absl::StatusOr<v1::DaemonMessage> {
    if (!result.ok()) {
      return ErrorReply(absl::Status(result.status().code(),
                                     fmt::format("RecallActivation ({}): {}", who, result.status().message())));
    }
    counters.Bump(Ticker::kActivationRecalledBytes, *result);
    v1::DaemonMessage reply;
    v1::ActivationRecalled* done = reply.mutable_activation_recalled();
    done->set_key(key);
    done->set_slot(slot);
    done->set_bytes(*result);
    return reply;
  });
}

ActivationSpill::Dropped Session::DropActivationsLocked() {
  activation_answers_.WaitAll().IgnoreError();
  return held_.activations->Drop();
}

v1::DaemonMessage Session::OnDropActivations() {
  const ActivationSpill::Dropped dropped = DropActivationsLocked();
  v1::DaemonMessage reply;
  reply.mutable_activations_dropped()->set_activations(dropped.activations);
  reply.mutable_activations_dropped()->set_scratch_bytes(dropped.scratch_bytes);
  return reply;
}

}  // namespace fuyou
