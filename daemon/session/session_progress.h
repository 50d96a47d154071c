// SessionProgress: what Session::Info reports of a session's work (chunks
// registered, the committed step, what its updates did), as of the last
// request the session finished. The session publishes it under its own lock
// after each request that may change it; Info reads it under this one's lock
// alone, so ListSessions, GetStats and /metrics never wait for a request in
// flight (an EndStep waiting for its write-backs, a GradReady for its states,
// a registration writing the job). Thread-safe.
#pragma once

#include <cstdint>
#include <mutex>

namespace fuyou {

// What a session's requests did (SessionInfo fields 10-15).
struct SessionActivity {
  uint64_t chunk_updates = 0;
  double update_seconds = 0;      // in the AdamW kernel
  double state_wait_seconds = 0;  // the rest of each GradReady: states read, write-back submitted
  uint64_t chunks_speculative = 0;
  uint64_t chunks_redone = 0;
  uint64_t chunks_rolled_back = 0;  // by AbortStep of a skipped step
};

class SessionProgress {
 public:
  struct Snapshot {
    uint32_t chunks = 0;  // registered in this session
    int64_t committed_step = 0;
    SessionActivity activity;
  };

  void Publish(const Snapshot& now) {
    std::lock_guard lock(mutex_);
    snapshot_ = now;
  }
  Snapshot Read() const {
    std::lock_guard lock(mutex_);
    return snapshot_;
  }

 private:
  mutable std::mutex mutex_;
  Snapshot snapshot_;
};

}  // namespace fuyou
