// SessionRegistry: the live sessions of the daemon, by id. Thread-safe.
#pragma once

#include <sys/types.h>

#include <atomic>
#include <chrono>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "fuyou/v1/offload.pb.h"
#include "session/session.h"

namespace fuyou {

class SessionRegistry {
 public:
  SessionRegistry(SessionServices services, uint64_t max_segment_bytes);

  // Opens a session: validates the request and acquires the job. The session
  // has no segment until the client hands one over (Session::AdoptSegment).
  // UNAVAILABLE while draining.
  // The job and the segment belong to `client.uid`.
  absl::StatusOr<std::shared_ptr<Session>> Open(const v1::OpenSessionRequest& request, ClientIdentity client);
  // NOT_FOUND for an unknown or closed id.
  absl::StatusOr<std::shared_ptr<Session>> Find(const std::string& id) const;
  // Gives session `id` the segment `fd` that uid `caller` handed over (the fd is
  // not taken; see SessionSegment::FromClientFd for what it must be). NOT_FOUND,
  // worded as for an unknown id, when the session belongs to another uid;
  // FAILED_PRECONDITION when it already has a segment. Never waits on a session
  // busy with I/O (the segment listener's thread calls it).
  absl::Status AdoptSegment(const std::string& id, uid_t caller, int fd);
  // Closes and forgets a session; returns its last committed step.
  absl::StatusOr<int64_t> Close(const std::string& id);
  std::vector<std::shared_ptr<Session>> List() const;
  size_t size() const;

  // Closes sessions opened more than `grace` ago whose client never attached a
  // stream (it died between OpenSession and Stream, or never handed over its
  // segment, without which it cannot attach).
  void ReapUnattached(std::chrono::seconds grace);
  // Refuses new sessions from now on.
  void StartDraining() { draining_ = true; }
  bool draining() const { return draining_; }
  void CloseAll();

 private:
  SessionServices services_;
  const uint64_t max_segment_bytes_;
  std::atomic<bool> draining_{false};
  mutable std::mutex mutex_;
  struct Entry {
    std::shared_ptr<Session> session;
    std::chrono::steady_clock::time_point opened;
  };
  std::map<std::string, Entry> sessions_;
};

}  // namespace fuyou
