#include "session/session_quota.h"

#include <algorithm>

#include "fmt/format.h"

namespace fuyou {

SessionQuota::Hold& SessionQuota::Hold::operator=(Hold&& other) noexcept {
  if (this != &other) {
    Reset();
    quota_ = other.quota_;
    uid_ = other.uid_;
    segment_bytes_ = other.segment_bytes_;
    other.quota_ = nullptr;
  }
  return *this;
}

void SessionQuota::Hold::Reset() {
  if (quota_ != nullptr) quota_->Give(uid_, segment_bytes_);
  quota_ = nullptr;
}

absl::StatusOr<SessionQuota::Hold> SessionQuota::Take(uid_t uid, uint64_t segment_bytes) {
  std::lock_guard lock(mutex_);
  const auto found = users_.find(uid);
  const Usage usage = found == users_.end() ? Usage{} : found->second;
  if (usage.sessions >= limits_.max_sessions_per_user) {
    return absl::ResourceExhaustedError(fmt::format(
        "uid {} already has {} live sessions, the most that [limits] max_sessions_per_user = {} allows; close one "
        "(`fuyouctl sessions` lists them) or have the operator raise max_sessions_per_user in fuyoud.toml "
        "(--max-sessions-per-user)",
        uid, usage.sessions, limits_.max_sessions_per_user));
  }
  const uint64_t limit = limits_.max_segment_bytes_per_user;
  if (segment_bytes > limit || usage.segment_bytes > limit - segment_bytes) {
    return absl::ResourceExhaustedError(fmt::format(
        "a segment of {} bytes would bring the shared memory of uid {}'s sessions over [limits] "
        "max_segment_bytes_per_user = {} bytes ({} bytes are in use by {} live session(s)); ask for fewer or "
        "smaller slots, close a session, or have the operator raise max_segment_bytes_per_user in fuyoud.toml "
        "(--max-segment-bytes-per-user)",
        segment_bytes, uid, limit, usage.segment_bytes, usage.sessions));
  }
  if (total_sessions_ >= limits_.max_sessions) {
    return absl::ResourceExhaustedError(fmt::format(
        "fuyoud already has {} live sessions, the most that [limits] max_sessions = {} allows; retry when one "
        "closes, or have the operator raise max_sessions in fuyoud.toml (--max-sessions)",
        total_sessions_, limits_.max_sessions));
  }
  Usage& entry = users_[uid];
  ++entry.sessions;
  entry.segment_bytes += segment_bytes;
  ++total_sessions_;
  return Hold(this, uid, segment_bytes);
}

absl::Status SessionQuota::CheckClientInfo(uint64_t bytes) const {
  if (bytes <= limits_.max_client_info_bytes) return absl::OkStatus();
  return absl::ResourceExhaustedError(fmt::format(
      "client_info is {} bytes, over [limits] max_client_info_bytes = {}; send a shorter description, or have the "
      "operator raise max_client_info_bytes in fuyoud.toml (--max-client-info-bytes)",
      bytes, limits_.max_client_info_bytes));
}

absl::Status SessionQuota::TakeJournal(uid_t uid, uint64_t bytes) {
  std::lock_guard lock(mutex_);
  const auto found = journal_bytes_.find(uid);
  const uint64_t used = found == journal_bytes_.end() ? 0 : found->second;
  const uint64_t limit = limits_.max_journal_bytes_per_user;
  if (bytes > limit || used > limit - bytes) {
    return absl::ResourceExhaustedError(fmt::format(
        "a gradient journal of {} bytes would bring uid {}'s journals over [limits] max_journal_bytes_per_user = "
        "{} bytes ({} bytes are journaled by its live sessions); journal fewer chunks, end the step sooner, or "
        "have the operator raise max_journal_bytes_per_user in fuyoud.toml (--max-journal-bytes-per-user)",
        bytes, uid, limit, used));
  }
  journal_bytes_[uid] = used + bytes;
  return absl::OkStatus();
}

void SessionQuota::GiveJournal(uid_t uid, uint64_t bytes) {
  std::lock_guard lock(mutex_);
  auto found = journal_bytes_.find(uid);
  if (found == journal_bytes_.end()) return;
  found->second -= std::min(found->second, bytes);
  if (found->second == 0) journal_bytes_.erase(found);
}

uint64_t SessionQuota::JournalBytesOf(uid_t uid) const {
  std::lock_guard lock(mutex_);
  const auto found = journal_bytes_.find(uid);
  return found == journal_bytes_.end() ? 0 : found->second;
}

absl::Status SessionQuota::TakeActivations(uid_t uid, uint64_t bytes) {
  std::lock_guard lock(mutex_);
  const auto found = activation_bytes_.find(uid);
  const uint64_t used = found == activation_bytes_.end() ? 0 : found->second;
  const uint64_t limit = limits_.max_activation_bytes_per_user;
  if (bytes > limit || used > limit - bytes) {
    return absl::ResourceExhaustedError(fmt::format(
        "spilling an activation of {} scratch bytes would bring uid {}'s activation scratch over [limits] "
        "max_activation_bytes_per_user = {} bytes ({} bytes are spilled by its live sessions); give the host tier "
        "more (host_budget), recompute more, or have the operator raise max_activation_bytes_per_user in "
        "fuyoud.toml (--max-activation-bytes-per-user)",
        bytes, uid, limit, used));
  }
  activation_bytes_[uid] = used + bytes;
  return absl::OkStatus();
}

void SessionQuota::GiveActivations(uid_t uid, uint64_t bytes) {
  std::lock_guard lock(mutex_);
  auto found = activation_bytes_.find(uid);
  if (found == activation_bytes_.end()) return;
  found->second -= std::min(found->second, bytes);
  if (found->second == 0) activation_bytes_.erase(found);
}

uint64_t SessionQuota::ActivationBytesOf(uid_t uid) const {
  std::lock_guard lock(mutex_);
  const auto found = activation_bytes_.find(uid);
  return found == activation_bytes_.end() ? 0 : found->second;
}

void SessionQuota::Give(uid_t uid, uint64_t segment_bytes) {
  std::lock_guard lock(mutex_);
  auto found = users_.find(uid);
  if (found == users_.end()) return;
  Usage& usage = found->second;
  usage.sessions -= 1;
  usage.segment_bytes -= segment_bytes;
  if (usage.sessions == 0) users_.erase(found);
  --total_sessions_;
}

SessionQuota::Usage SessionQuota::UsageOf(uid_t uid) const {
  std::lock_guard lock(mutex_);
  const auto found = users_.find(uid);
  return found == users_.end() ? Usage{} : found->second;
}

uint32_t SessionQuota::total_sessions() const {
  std::lock_guard lock(mutex_);
  return total_sessions_;
}

}  // namespace fuyou
