// Session::Impl, activation offload's storage tier: SpillActivation,
// RecallActivation and DropActivations (offload.proto). An activation larger
// than one slot goes in pieces of slot_bytes, piece i of key k under the
// daemon's key (k << kPieceBits) | i; each piece is one round trip through a
// held slot (its gradient region), so several threads may spill and recall at
// once, also while a step's gradients are in flight.
#include <algorithm>
#include <cstring>

#include "fmt/format.h"
#include "session_impl.h"

namespace fuyou {

using internal::RequestKind;

namespace {
constexpr unsigned kPieceBits = 20;  // at most 2^20 pieces of one activation
}  // namespace

absl::StatusOr<v1::DaemonMessage> Session::Impl::ActivationCall(RequestKind kind, uint32_t slot,
                                                                v1::ClientMessage& message, const std::string& what) {
  uint64_t id = 0;
  {
    std::lock_guard lock(mu_);
    if (absl::Status status = CheckUsableLocked(); !status.ok()) {
      slots().Release(slot);
      return status;
    }
    id = requests_.Add({.kind = kind, .slot = slot});
  }
  absl::StatusOr<v1::DaemonMessage> reply = Call(id, message, what, rpc_timeout());
  // On a timeout the daemon may still use the slot: it stays held.
  if (!reply.ok() && !absl::IsDeadlineExceeded(reply.status())) slots().Release(slot);
  return reply;
}

absl::Status Session::Impl::SpillActivation(uint64_t key, std::span<const std::byte> bytes) {
  if (bytes.empty()) return absl::InvalidArgumentError(fmt::format("SpillActivation {}: no bytes", key));
  if (key >= Session::kMaxActivationKey) {
    return absl::InvalidArgumentError(
        fmt::format("SpillActivation: key {} is not below {}", key, Session::kMaxActivationKey));
  }
  const uint64_t slot_bytes = memory_.slot_bytes();
  const uint64_t pieces = (bytes.size() + slot_bytes - 1) / slot_bytes;
  if (pieces > (uint64_t{1} << kPieceBits)) {
    return absl::InvalidArgumentError(fmt::format(
        "SpillActivation {}: {} bytes would be {} pieces of {} bytes, more than {}", key, bytes.size(), pieces,
        slot_bytes, uint64_t{1} << kPieceBits));
  }
  {
    std::lock_guard lock(mu_);
    if (!activations_.BeginSpill(key)) {
      return absl::InvalidArgumentError(fmt::format(
          "SpillActivation: activation {} of {} is already spilled; recall it or drop the activations first", key,
          Who()));
    }
  }
  for (uint64_t piece = 0; piece < pieces; ++piece) {
    const uint64_t offset = piece * slot_bytes;
    const uint64_t length = std::min<uint64_t>(slot_bytes, bytes.size() - offset);
    absl::StatusOr<uint32_t> slot = AcquireSlot(rpc_timeout());
    if (!slot.ok()) return slot.status();  // the key stays marked failed until the drop
    std::memcpy(GradRegion(*slot).data(), bytes.data() + offset, length);
    v1::ClientMessage message;
    v1::SpillActivation* spill = message.mutable_spill_activation();
    spill->set_key((key << kPieceBits) | piece);
    spill->set_slot(*slot);
    spill->set_bytes(length);
    absl::StatusOr<v1::DaemonMessage> reply = ActivationCall(
        RequestKind::kSpillActivation, *slot, message, fmt::format("SpillActivation {} piece {}", key, piece));
    if (!reply.ok()) return reply.status();
    slots().Release(*slot);
  }
  std::lock_guard lock(mu_);
  activations_.EndSpill(key, bytes.size());
  return absl::OkStatus();
}

absl::Status Session::Impl::RecallActivation(uint64_t key, std::span<std::byte> out) {
  {
    std::lock_guard lock(mu_);
    // Recalled once, whatever happens below.
    if (absl::Status taken = activations_.TakeForRecall(key, out.size(), Who()); !taken.ok()) return taken;
  }
  const uint64_t slot_bytes = memory_.slot_bytes();
  const uint64_t pieces = (out.size() + slot_bytes - 1) / slot_bytes;
  for (uint64_t piece = 0; piece < pieces; ++piece) {
    const uint64_t offset = piece * slot_bytes;
    const uint64_t length = std::min<uint64_t>(slot_bytes, out.size() - offset);
    absl::StatusOr<uint32_t> slot = AcquireSlot(rpc_timeout());
    if (!slot.ok()) return slot.status();
    v1::ClientMessage message;
    message.mutable_recall_activation()->set_key((key << kPieceBits) | piece);
    message.mutable_recall_activation()->set_slot(*slot);
    const uint32_t held = *slot;
    absl::StatusOr<v1::DaemonMessage> reply = ActivationCall(
        RequestKind::kRecallActivation, held, message, fmt::format("RecallActivation {} piece {}", key, piece));
    if (!reply.ok()) return reply.status();
    // Every byte from the daemon is hostile: the answer must be this piece.
    const v1::ActivationRecalled& recalled = reply->activation_recalled();
    if (recalled.bytes() != length || recalled.slot() != held) {
      slots().Release(held);
      return absl::InternalError(fmt::format(
          "RecallActivation {} piece {} of {}: the daemon answered {} bytes in slot {}, expected {} in slot {}", key,
          piece, Who(), recalled.bytes(), recalled.slot(), length, held));
    }
    std::memcpy(out.data() + offset, GradRegion(held).data(), length);
    slots().Release(held);
  }
  return absl::OkStatus();
}

absl::Status Session::Impl::DropActivations() {
  uint64_t id = 0;
  {
    std::lock_guard lock(mu_);
    if (absl::Status status = CheckUsableLocked(); !status.ok()) return status;
    activations_.Clear();
    id = requests_.Add({.kind = RequestKind::kDropActivations});
  }
  v1::ClientMessage message;
  message.mutable_drop_activations();
  return Call(id, message, "DropActivations", rpc_timeout()).status();
}

}  // namespace fuyou
