// Session::Impl, export and import: reading and writing a chunk's optimizer
// states through the session's slots (checkpoints), one request at a time
// (control_mu_) and only between steps.
#include <set>

#include "fmt/format.h"
#include "session_impl.h"

namespace fuyou {

using internal::OfKind;
using internal::PendingRequest;
using internal::RequestKind;

absl::StatusOr<v1::DaemonMessage> Session::Impl::Control(RequestKind kind, uint32_t chunk_id,
                                                         v1::ClientMessage& message, const std::string& what) {
  uint64_t id = 0;
  {
    std::lock_guard lock(mu_);
    if (absl::Status status = CheckUsableLocked(); !status.ok()) return status;
    if (const size_t updates = requests_.Count(OfKind(RequestKind::kGradReady)); updates != 0) {
      return absl::FailedPreconditionError(fmt::format(
          "{} of {}: {} chunks have gradients in flight; states are read and written only between steps", what,
          Who(), updates));
    }
    std::set<uint32_t> fetched;
    for (const PendingRequest* fetch : requests_.Select(OfKind(RequestKind::kFetchWeights))) {
      fetched.insert(fetch->chunk_id);
    }
    if (!fetched.empty()) {
      return absl::FailedPreconditionError(fmt::format(
          "{} of {}: weights fetches of {} chunks are in flight; states are read and written only between steps "
          "(take them with WaitWeights first)",
          what, Who(), fetched.size()));
    }
    id = requests_.Add({.kind = kind, .chunk_id = chunk_id});
  }
  return Call(id, message, what, rpc_timeout());
}

absl::StatusOr<ChunkSpec> Session::Impl::CheckStateRange(uint32_t chunk_id, uint64_t first, uint64_t count,
                                                         const char* verb) {
  std::lock_guard lock(mu_);
  const ChunkSpec* spec = chunks_.Find(chunk_id);
  if (spec == nullptr) {
    return absl::InvalidArgumentError(
        fmt::format("{}: chunk {} is not registered in the session of {}: call RegisterChunk first", verb, chunk_id,
                    Who()));
  }
  const uint64_t n = spec->num_elements;
  if (count == 0 || first > n || count > n - first) {
    return absl::InvalidArgumentError(fmt::format(
        "{}: chunk {} of {}: elements [{}, {}) are not a non-empty range of its {} elements", verb, chunk_id, Who(),
        first, first + count, n));
  }
  return *spec;
}

absl::StatusOr<int64_t> Session::Impl::ReadState(uint32_t chunk_id, StateKind which, uint64_t first,
                                                 std::span<float> out) {
  absl::StatusOr<ChunkSpec> spec = CheckStateRange(chunk_id, first, out.size(), "ReadState");
  if (!spec.ok()) return spec.status();
  std::lock_guard control(control_mu_);
  absl::StatusOr<uint32_t> slot = AcquireSlot(rpc_timeout());
  if (!slot.ok()) return slot.status();
  const uint64_t piece = memory_.slot_bytes() / sizeof(float);
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
        RequestKind::kReadState, chunk_id, message, fmt::format("ReadState of chunk {} elements [{}, {})", chunk_id, first + done, first + done + count));
    if (!reply.ok()) {
      if (!absl::IsDeadlineExceeded(reply.status())) slots().Release(*slot);
      return reply.status();
    }
    const v1::StateRead& answer = reply->state_read();
    if (!reply->has_state_read() || answer.chunk_id() != chunk_id || answer.slot() != *slot ||
        answer.first_element() != first + done || answer.num_elements() != count) {
      slots().Release(*slot);
      return absl::InternalError(fmt::format(
          "ReadState of chunk {} of {}: fuyoud answered with a message for another request", chunk_id, Who()));
    }
    std::memcpy(out.data() + done, ParamRegion(*slot).data(), count * sizeof(float));
    update_count = answer.update_count();
    done += count;
  }
  slots().Release(*slot);
  return update_count;
}

absl::Status Session::Impl::WriteState(uint32_t chunk_id, StateKind which, uint64_t first,
                                       std::span<const float> values) {
  absl::StatusOr<ChunkSpec> spec = CheckStateRange(chunk_id, first, values.size(), "WriteState");
  if (!spec.ok()) return spec.status();
  std::lock_guard control(control_mu_);
  absl::StatusOr<uint32_t> slot = AcquireSlot(rpc_timeout());
  if (!slot.ok()) return slot.status();
  const uint64_t piece = memory_.slot_bytes() / sizeof(float);
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
        RequestKind::kWriteState, chunk_id, message, fmt::format("WriteState of chunk {} elements [{}, {})", chunk_id, first + done, first + done + count));
    if (!reply.ok()) {
      if (!absl::IsDeadlineExceeded(reply.status())) slots().Release(*slot);
      return reply.status();
    }
    if (!reply->has_state_written() || reply->state_written().chunk_id() != chunk_id) {
      slots().Release(*slot);
      return absl::InternalError(fmt::format(
          "WriteState of chunk {} of {}: fuyoud answered with a message for another request", chunk_id, Who()));
    }
    done += count;
  }
  slots().Release(*slot);
  return absl::OkStatus();
}

absl::Status Session::Impl::SetUpdateCount(uint32_t chunk_id, int64_t update_count,
                                           std::span<const int64_t> segment_update_counts) {
  std::lock_guard control(control_mu_);
  v1::ClientMessage message;
  message.mutable_set_update_count()->set_chunk_id(chunk_id);
  message.mutable_set_update_count()->set_update_count(update_count);
  for (int64_t count : segment_update_counts) message.mutable_set_update_count()->add_segment_update_counts(count);
  absl::StatusOr<v1::DaemonMessage> reply =
      Control(RequestKind::kSetUpdateCount, chunk_id, message, fmt::format("SetUpdateCount of chunk {}", chunk_id));
  if (!reply.ok()) return reply.status();
  if (!reply->has_update_count_set() || reply->update_count_set().chunk_id() != chunk_id) {
    return absl::InternalError(fmt::format(
        "SetUpdateCount of chunk {} of {}: fuyoud answered with a message for another request", chunk_id, Who()));
  }
  return absl::OkStatus();
}

absl::StatusOr<uint32_t> Session::Impl::CommitImport(int64_t resume_step) {
  std::lock_guard control(control_mu_);
  v1::ClientMessage message;
  message.mutable_commit_import()->set_resume_step(resume_step);
  absl::StatusOr<v1::DaemonMessage> reply = Control(RequestKind::kCommitImport, 0, message, "CommitImport");
  if (!reply.ok()) return reply.status();
  if (!reply->has_import_committed()) {
    return absl::InternalError(
        fmt::format("CommitImport of {}: fuyoud answered with a message for another request", Who()));
  }
  committed_step_.Advance(reply->import_committed().committed_step());
  return reply->import_committed().chunks_changed();
}

}  // namespace fuyou
