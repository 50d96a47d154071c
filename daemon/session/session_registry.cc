#include "session/session_registry.h"

#include <optional>
#include <random>

#include "common/log.h"
#include "common/status_util.h"
#include "fmt/format.h"
#include "fuyou/segment_layout.h"
#include "jobs/job_registry.h"

namespace fuyou {
namespace {

std::string NewSessionId() {
  std::random_device device;
  return fmt::format("s-{:08x}{:08x}", device(), device());
}

}  // namespace

SessionRegistry::SessionRegistry(SessionServices services, uint64_t max_segment_bytes)
    : services_(services), max_segment_bytes_(max_segment_bytes) {}

absl::StatusOr<std::shared_ptr<Session>> SessionRegistry::Open(const v1::OpenSessionRequest& request, ClientIdentity client) {
  const uid_t uid = client.uid;
  if (draining_) return absl::UnavailableError("fuyoud is shutting down and accepts no new session");
  if (std::string problem = JobNameProblem(request.job()); !problem.empty()) {
    return absl::InvalidArgumentError(problem);
  }
  if (request.num_slots() == 0 || request.num_slots() > kMaxSlots) {
    return absl::InvalidArgumentError(
        fmt::format("num_slots {} is outside 1..{}", request.num_slots(), kMaxSlots));
  }
  if (request.slot_bytes() == 0) return absl::InvalidArgumentError("slot_bytes must be > 0");
  const std::optional<SegmentLayout> checked_layout =
      SegmentLayout::Checked(request.num_slots(), request.slot_bytes(), max_segment_bytes_);
  if (!checked_layout) {
    return absl::InvalidArgumentError(fmt::format(
        "a segment of {} slots x 2 x {} bytes plus a {}-byte header exceeds the daemon's max_segment_bytes of {}; "
        "ask for fewer or smaller slots",
        request.num_slots(), request.slot_bytes(), kSegmentHeaderBytes, max_segment_bytes_));
  }
  const SegmentLayout layout = *checked_layout;
  auto job = services_.jobs.Acquire(request.job(), uid);
  if (!job.ok()) return job.status();
  // The segment comes later: the client creates it and hands it over.
  std::string id = NewSessionId();
  auto session = std::make_shared<Session>(services_, id, std::move(*job), layout, client, request.client_info());
  {
    std::lock_guard lock(mutex_);
    sessions_[id] = Entry{session, std::chrono::steady_clock::now()};
  }
  log::Info("session {} opened job '{}' at step {} ({} slots of {} bytes)", id, request.job(),
            session->committed_step(), layout.num_slots, layout.slot_bytes);
  return session;
}

absl::StatusOr<std::shared_ptr<Session>> SessionRegistry::Find(const std::string& id) const {
  std::lock_guard lock(mutex_);
  auto it = sessions_.find(id);
  if (it == sessions_.end()) return absl::NotFoundError(fmt::format("no open session has id {}", QuoteForError(id)));
  return it->second.session;
}

absl::StatusOr<int64_t> SessionRegistry::Close(const std::string& id) {
  std::shared_ptr<Session> session;
  {
    std::lock_guard lock(mutex_);
    auto it = sessions_.find(id);
    if (it == sessions_.end()) return absl::NotFoundError(fmt::format("no open session has id {}", QuoteForError(id)));
    session = std::move(it->second.session);
    sessions_.erase(it);
  }
  int64_t committed = session->Close();
  log::Info("session {} of job '{}' closed at step {}", id, session->job_name(), committed);
  return committed;
}

absl::Status SessionRegistry::AdoptSegment(const std::string& id, uid_t caller, int fd) {
  auto session = Find(id);
  // Another user's session is answered exactly like an unknown one: ids are not
  // disclosed across users.
  if (!session.ok() || (*session)->uid() != caller) {
    return absl::NotFoundError(fmt::format("no open session has id '{}'", id));
  }
  // Checked without the session's lock, which RegisterChunks holds across I/O.
  if ((*session)->has_segment()) {
    return absl::FailedPreconditionError(
        fmt::format("session {} already has its segment; a segment is handed over once per session", id));
  }
  auto segment = SessionSegment::FromClientFd(fd, (*session)->layout());
  if (!segment.ok()) return segment.status();
  FUYOU_RETURN_IF_ERROR((*session)->AdoptSegment(std::move(*segment)));
  log::Info("session {} of job '{}' received its segment ({} bytes)", id, (*session)->job_name(),
            (*session)->layout().TotalBytes());
  return absl::OkStatus();
}

std::vector<std::shared_ptr<Session>> SessionRegistry::List() const {
  std::lock_guard lock(mutex_);
  std::vector<std::shared_ptr<Session>> sessions;
  for (const auto& [id, entry] : sessions_) sessions.push_back(entry.session);
  return sessions;
}

size_t SessionRegistry::size() const {
  std::lock_guard lock(mutex_);
  return sessions_.size();
}

void SessionRegistry::ReapUnattached(std::chrono::seconds grace) {
  std::vector<std::string> stale;
  {
    std::lock_guard lock(mutex_);
    const auto now = std::chrono::steady_clock::now();
    for (const auto& [id, entry] : sessions_) {
      if (!entry.session->attached() && now - entry.opened > grace) stale.push_back(id);
    }
  }
  for (const std::string& id : stale) {
    log::Warn("session {}: no segment handed over or no stream attached within {} s; closing it", id, grace.count());
    (void)Close(id);
  }
}

void SessionRegistry::CloseAll() {
  std::vector<std::string> ids;
  {
    std::lock_guard lock(mutex_);
    for (const auto& [id, entry] : sessions_) ids.push_back(id);
  }
  for (const std::string& id : ids) (void)Close(id);
}

}  // namespace fuyou
