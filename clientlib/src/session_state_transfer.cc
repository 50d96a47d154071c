// Session::Impl, part two: reading and writing a chunk's optimizer states
// through the session's slots (export to and import from checkpoints).
#include "channel.h"
#include "fmt/format.h"
#include "session_impl.h"

namespace fuyou {

absl::StatusOr<v1::DaemonMessage> Session::Impl::Control(const v1::ClientMessage& message, const std::string& what) {
  {
    std::lock_guard lock(mu_);
    if (absl::Status status = CheckUsableLocked(); !status.ok()) return status;
    if (!pending_.empty()) {
      return absl::FailedPreconditionError(fmt::format(
          "{} of {}: {} chunks have gradients in flight; states are read and written only between steps", what,
          Who(), pending_.size()));
    }
    if (!fetches_.empty()) {
      return absl::FailedPreconditionError(fmt::format(
          "{} of {}: weights fetches of {} chunks are in flight; states are read and written only between steps "
          "(take them with WaitWeights first)",
          what, Who(), fetches_.size()));
    }
    control_ = ControlWaiter{};
    control_.active = true;
  }
  absl::Status written = Write(message, what);
  std::unique_lock lock(mu_);
  if (!written.ok()) {
    control_ = ControlWaiter{};
    return written;
  }
  const bool answered = cv_.wait_for(lock, client_.rpc_timeout, [&] { return control_.done; });
  ControlWaiter waiter = std::exchange(control_, ControlWaiter{});
  if (!answered) {
    return absl::DeadlineExceededError(
        fmt::format("no answer to {} of {} within {} ms", what, Who(), client_.rpc_timeout.count()));
  }
  if (!waiter.status.ok()) return waiter.status;
  return std::move(waiter.reply);
}

absl::StatusOr<ChunkSpec> Session::Impl::CheckStateRange(uint32_t chunk_id, uint64_t first, uint64_t count,
                                                         const char* verb) {
  std::lock_guard lock(mu_);
  auto it = chunks_.find(chunk_id);
  if (it == chunks_.end()) {
    return absl::InvalidArgumentError(
        fmt::format("{}: chunk {} is not registered in the session of {}: call RegisterChunk first", verb, chunk_id,
                    Who()));
  }
  const uint64_t n = it->second.num_elements;
  if (count == 0 || first > n || count > n - first) {
    return absl::InvalidArgumentError(fmt::format(
        "{}: chunk {} of {}: elements [{}, {}) are not a non-empty range of its {} elements", verb, chunk_id, Who(),
        first, first + count, n));
  }
  return it->second;
}

absl::StatusOr<int64_t> Session::Impl::ReadState(uint32_t chunk_id, StateKind which, uint64_t first,
                                                 std::span<float> out) {
  absl::StatusOr<ChunkSpec> spec = CheckStateRange(chunk_id, first, out.size(), "ReadState");
  if (!spec.ok()) return spec.status();
  std::lock_guard control(control_mu_);
  absl::StatusOr<uint32_t> slot = AcquireSlot(client_.rpc_timeout);
  if (!slot.ok()) return slot.status();
  const uint64_t piece = slot_bytes_ / sizeof(float);
  int64_t update_count = 0;
  for (uint64_t done = 0; done < out.size();) {
    const uint64_t count = std::min<uint64_t>(piece, out.size() - done);
    v1::ClientMessage message;
    v1::ReadState* read = message.mutable_read_state();
    read->set_chunk_id(chunk_id);
    read->set_which(static_cast<v1::StateKind>(which));
    read->set_slot(*slot);
    read->set_first_element(first + done);
    read->set_num_elements(count);
    absl::StatusOr<v1::DaemonMessage> reply = Control(
        message, fmt::format("ReadState of chunk {} elements [{}, {})", chunk_id, first + done, first + done + count));
    if (!reply.ok()) {
      if (!absl::IsDeadlineExceeded(reply.status())) slots_->Release(*slot);
      return reply.status();
    }
    const v1::StateRead& answer = reply->state_read();
    if (!reply->has_state_read() || answer.chunk_id() != chunk_id || answer.slot() != *slot ||
        answer.first_element() != first + done || answer.num_elements() != count) {
      slots_->Release(*slot);
      return absl::InternalError(fmt::format(
          "ReadState of chunk {} of {}: fuyoud answered with a message for another request", chunk_id, Who()));
    }
    std::memcpy(out.data() + done, ParamRegion(*slot).data(), count * sizeof(float));
    update_count = answer.update_count();
    done += count;
  }
  slots_->Release(*slot);
  return update_count;
}

absl::Status Session::Impl::WriteState(uint32_t chunk_id, StateKind which, uint64_t first,
                                       std::span<const float> values) {
  absl::StatusOr<ChunkSpec> spec = CheckStateRange(chunk_id, first, values.size(), "WriteState");
  if (!spec.ok()) return spec.status();
  std::lock_guard control(control_mu_);
  absl::StatusOr<uint32_t> slot = AcquireSlot(client_.rpc_timeout);
  if (!slot.ok()) return slot.status();
  const uint64_t piece = slot_bytes_ / sizeof(float);
  for (uint64_t done = 0; done < values.size();) {
    const uint64_t count = std::min<uint64_t>(piece, values.size() - done);
    std::memcpy(GradRegion(*slot).data(), values.data() + done, count * sizeof(float));
    v1::ClientMessage message;
    v1::WriteState* write = message.mutable_write_state();
    write->set_chunk_id(chunk_id);
    write->set_which(static_cast<v1::StateKind>(which));
    write->set_slot(*slot);
    write->set_first_element(first + done);
    write->set_num_elements(count);
    absl::StatusOr<v1::DaemonMessage> reply = Control(
        message, fmt::format("WriteState of chunk {} elements [{}, {})", chunk_id, first + done, first + done + count));
    if (!reply.ok()) {
      if (!absl::IsDeadlineExceeded(reply.status())) slots_->Release(*slot);
      return reply.status();
    }
    if (!reply->has_state_written() || reply->state_written().chunk_id() != chunk_id) {
      slots_->Release(*slot);
      return absl::InternalError(fmt::format(
          "WriteState of chunk {} of {}: fuyoud answered with a message for another request", chunk_id, Who()));
    }
    done += count;
  }
  slots_->Release(*slot);
  return absl::OkStatus();
}

absl::Status Session::Impl::SetUpdateCount(uint32_t chunk_id, int64_t update_count,
                                           std::span<const int64_t> segment_update_counts) {
  std::lock_guard control(control_mu_);
  v1::ClientMessage message;
  message.mutable_set_update_count()->set_chunk_id(chunk_id);
  message.mutable_set_update_count()->set_update_count(update_count);
  for (int64_t count : segment_update_counts) message.mutable_set_update_count()->add_segment_update_counts(count);
  absl::StatusOr<v1::DaemonMessage> reply = Control(message, fmt::format("SetUpdateCount of chunk {}", chunk_id));
  if (!reply.ok()) return reply.status();
  if (!reply->has_update_count_set() || reply->update_count_set().chunk_id() != chunk_id) {
    return absl::InternalError(fmt::format(
        "SetUpdateCount of chunk {} of {}: fuyoud answered with a message for another request", chunk_id, Who()));
  }
  return absl::OkStatus();
}

absl::StatusOr<uint32_t> Session::Impl::CommitImport() {
  std::lock_guard control(control_mu_);
  v1::ClientMessage message;
  message.mutable_commit_import();
  absl::StatusOr<v1::DaemonMessage> reply = Control(message, "CommitImport");
  if (!reply.ok()) return reply.status();
  if (!reply->has_import_committed()) {
    return absl::InternalError(
        fmt::format("CommitImport of {}: fuyoud answered with a message for another request", Who()));
  }
  return reply->import_committed().chunks_changed();
}

// ----------------------------------------------------------------------------
// Closing

}  // namespace fuyou
