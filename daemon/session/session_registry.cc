#include "session/session_registry.h"

#include <optional>
#include <random>

#include "common/log.h"
#include "common/status_util.h"
#include "fmt/format.h"
#include "fuyou/printable_text.h"
#include "fuyou/segment_layout.h"
#include "jobs/job_registry.h"

namespace fuyou {
namespace {

std::string NewSessionId() {
  std::random_device device;
  return fmt::format("s-{:08x}{:08x}", device(), device());
}

}  // namespace

SessionRegistry::SessionRegistry(SessionServices services, uint64_t max_segment_bytes, SessionLimits limits)
    : services_(services), max_segment_bytes_(max_segment_bytes), quota_(limits) {
  services_.quota = &quota_;  // the sessions' journals charge their users here
}

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
  FUYOU_RETURN_IF_ERROR(quota_.CheckClientInfo(request.client_info().size()));
  auto hold = quota_.Take(uid, layout.TotalBytes());
  if (!hold.ok()) return hold.status();
  auto job = services_.jobs.Acquire(request.job(), uid);
  if (!job.ok()) return job.status();
  if (request.has_resume_at_step()) {
    absl::Status rolled = (*job)->created() ? absl::FailedPreconditionError(fmt::format(
                                                  "job '{}' does not exist; it cannot resume at step {}",
                                                  request.job(), request.resume_at_step()))
                                            : (*job)->RollBackTo(request.resume_at_step());
    if (!rolled.ok()) {
      services_.jobs.Release(**job);
      return rolled;
    }
  }
  // The segment comes later: the client creates it and hands it over.
  std::string id = NewSessionId();
  auto session = std::make_shared<Session>(services_, id, std::move(*job), layout, client,
                                           PrintableText(request.client_info(), Unprintable::kQuestionMark));
  {
    std::lock_guard lock(mutex_);
    sessions_[id] = Entry{session, std::chrono::steady_clock::now(), std::move(*hold), nullptr};
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
  Entry entry;
  {
    std::lock_guard lock(mutex_);
    auto it = sessions_.find(id);
    if (it == sessions_.end()) return absl::NotFoundError(fmt::format("no open session has id {}", QuoteForError(id)));
    entry = std::move(it->second);
    sessions_.erase(it);
  }
  int64_t committed = entry.session->Close();
  log::Info("session {} of job '{}' closed at step {}", id, entry.session->job_name(), committed);
  return committed;  // `entry.hold` gives the place back now that the segment is freed
}

absl::Status SessionRegistry::AdoptSegment(const std::string& id, uid_t caller, int fd) {
  auto session = Find(id);
  // Another user's session is answered exactly like an unknown one: ids are not
  // disclosed across users.
  if (!session.ok() || (*session)->uid() != caller) {
    return absl::NotFoundError(fmt::format("no open session has id {}", QuoteForError(id)));
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

std::shared_ptr<StreamActivity> SessionRegistry::WatchStream(const std::string& id, std::function<void()> cancel) {
  std::lock_guard lock(mutex_);
  auto it = sessions_.find(id);
  if (it == sessions_.end()) return nullptr;
  it->second.stream = std::make_shared<StreamActivity>(std::move(cancel));
  return it->second.stream;
}

std::shared_ptr<StreamActivity> SessionRegistry::ActivityOf(const std::string& id) const {
  std::lock_guard lock(mutex_);
  auto it = sessions_.find(id);
  return it == sessions_.end() ? nullptr : it->second.stream;
}

void SessionRegistry::ReapIdle(std::chrono::duration<double> timeout) {
  struct Idle {
    std::string id;
    std::shared_ptr<Session> session;
    std::shared_ptr<StreamActivity> stream;
    double seconds;
  };
  std::vector<Idle> idle;
  {
    std::lock_guard lock(mutex_);
    const auto now = std::chrono::steady_clock::now();
    for (const auto& [id, entry] : sessions_) {
      if (entry.stream == nullptr) continue;
      const std::chrono::duration<double> quiet = entry.stream->IdleFor(now);
      if (quiet > timeout) idle.push_back({id, entry.session, entry.stream, quiet.count()});
    }
  }
  for (const Idle& session : idle) {
    log::Warn("session {} of job '{}' (uid {}): no message on its stream for {:.0f} s, over [limits] "
              "idle_session_timeout = {} s; closing it and ending its stream (an uncommitted step rolls back)",
              session.id, session.session->job_name(), session.session->uid(), session.seconds, timeout.count());
    (void)Close(session.id);
    session.stream->Cancel();
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
