// SessionRegistry: the live sessions of the daemon, by id, and the limits on
// what they hold (SessionQuota). Thread-safe.
#pragma once

#include <sys/types.h>

#include <atomic>
#include <chrono>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "fuyou/v1/offload.pb.h"
#include "session/session.h"
#include "session/session_quota.h"
#include "session/stream_activity.h"

namespace fuyou {

class SessionRegistry {
 public:
  SessionRegistry(SessionServices services, uint64_t max_segment_bytes, SessionLimits limits = {});

  // Opens a session: validates the request, takes its place in the quota and
  // acquires the job. The session has no segment until the client hands one
  // over (AdoptSegment). UNAVAILABLE while draining; RESOURCE_EXHAUSTED over a
  // limit (SessionQuota); nothing is created then. The job and the segment
  // belong to `client.uid`. The client_info is stored with unprintable bytes
  // replaced by '?' (fuyou/printable_text.h).
  absl::StatusOr<std::shared_ptr<Session>> Open(const v1::OpenSessionRequest& request, ClientIdentity client);
  // NOT_FOUND for an unknown or closed id.
  absl::StatusOr<std::shared_ptr<Session>> Find(const std::string& id) const;
  // Gives session `id` the segment `fd` that uid `caller` handed over (the fd is
  // not taken; see SessionSegment::FromClientFd for what it must be). NOT_FOUND,
  // worded as for an unknown id, when the session belongs to another uid;
  // FAILED_PRECONDITION when it already has a segment. Never waits on a session
  // busy with I/O (the segment listener's thread calls it).
  absl::Status AdoptSegment(const std::string& id, uid_t caller, int fd);
  // Closes and forgets a session and gives its place in the quota back; returns
  // its last committed step.
  absl::StatusOr<int64_t> Close(const std::string& id);
  std::vector<std::shared_ptr<Session>> List() const;
  size_t size() const;
  // What `uid`'s live sessions hold.
  SessionQuota::Usage UsageOf(uid_t uid) const { return quota_.UsageOf(uid); }

  // The stream of session `id` was attached: `cancel` ends it. The handler reports
  // each message to the returned activity and detaches it before it returns.
  // Null when the session is gone.
  std::shared_ptr<StreamActivity> WatchStream(const std::string& id, std::function<void()> cancel);
  // The activity of session `id`'s stream, for calls outside the stream
  // (RegisterChunks) to report; null when it has none.
  std::shared_ptr<StreamActivity> ActivityOf(const std::string& id) const;

  // Closes sessions opened more than `grace` ago whose client never attached a
  // stream (it died between OpenSession and Stream, or never handed over its
  // segment, without which it cannot attach).
  void ReapUnattached(std::chrono::seconds grace);
  // Closes attached sessions whose stream carried no message for more than
  // `timeout` (the client hangs, or holds a session it does not use) and ends
  // their streams. Their uncommitted steps roll back, as when a client disconnects.
  void ReapIdle(std::chrono::duration<double> timeout);
  // Refuses new sessions from now on.
  void StartDraining() { draining_ = true; }
  bool draining() const { return draining_; }
  void CloseAll();

 private:
  SessionServices services_;
  const uint64_t max_segment_bytes_;
  SessionQuota quota_;  // outlives the holds in sessions_
  std::atomic<bool> draining_{false};
  mutable std::mutex mutex_;
  struct Entry {
    std::shared_ptr<Session> session;
    std::chrono::steady_clock::time_point opened;
    SessionQuota::Hold hold;
    std::shared_ptr<StreamActivity> stream;  // null until attached
  };
  std::map<std::string, Entry> sessions_;
};

}  // namespace fuyou
