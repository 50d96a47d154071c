// SessionQuota: what the live sessions hold, per user and in all, against the
// [limits] of the daemon's config. Thread-safe.
//
// SessionRegistry::Open takes a Hold before it creates anything for a session
// and keeps it as long as the session is registered, so two Opens that race
// cannot both take the last place, and a refused Open has changed nothing.
// Every user is bound, root and the daemon's own user included: the limits
// protect the daemon's memory and file descriptors, which are finite whoever
// asks, and a runaway root job is better refused with a message naming the limit
// than allowed to starve every other user.
#pragma once

#include <sys/types.h>

#include <cstdint>
#include <map>
#include <mutex>

#include "absl/status/statusor.h"

namespace fuyou {

struct SessionLimits {
  uint32_t max_sessions = 256;                               // live sessions, all users together
  uint32_t max_sessions_per_user = 8;                        // live sessions of one uid
  uint64_t max_segment_bytes_per_user = uint64_t{16} << 30;  // segment bytes of one uid's live sessions
  uint64_t max_client_info_bytes = 1024;                     // client_info of one session
  uint64_t max_journal_bytes_per_user = uint64_t{256} << 30; // gradient journals of one uid's live sessions
  uint64_t max_activation_bytes_per_user = uint64_t{256} << 30;  // activation scratch of one uid's live sessions
};

class SessionQuota {
 public:
  // One session's place: its user, its segment's bytes. Move-only; gives the
  // place back when destroyed. Must not outlive its SessionQuota.
  class Hold {
   public:
    Hold() = default;
    Hold(Hold&& other) noexcept { *this = std::move(other); }
    Hold& operator=(Hold&& other) noexcept;
    ~Hold() { Reset(); }
    void Reset();

   private:
    friend class SessionQuota;
    Hold(SessionQuota* quota, uid_t uid, uint64_t segment_bytes)
        : quota_(quota), uid_(uid), segment_bytes_(segment_bytes) {}
    SessionQuota* quota_ = nullptr;
    uid_t uid_ = 0;
    uint64_t segment_bytes_ = 0;
  };

  struct Usage {
    uint32_t sessions = 0;
    uint64_t segment_bytes = 0;
  };

  explicit SessionQuota(SessionLimits limits) : limits_(limits) {}

  // A place for one more session of `uid` whose segment is `segment_bytes`.
  // RESOURCE_EXHAUSTED when it would pass max_sessions_per_user,
  // max_segment_bytes_per_user or max_sessions; the message names the limit, its
  // value, the current use and the setting that raises it.
  absl::StatusOr<Hold> Take(uid_t uid, uint64_t segment_bytes);
  // Gradient journal bytes (DRAM and spilled) of `uid`'s sessions: TakeJournal
  // adds `bytes` when the user stays within max_journal_bytes_per_user, else
  // RESOURCE_EXHAUSTED naming the limit and its use; GiveJournal gives back
  // what a TakeJournal took. Independent of the session holds.
  absl::Status TakeJournal(uid_t uid, uint64_t bytes);
  void GiveJournal(uid_t uid, uint64_t bytes);
  uint64_t JournalBytesOf(uid_t uid) const;
  // Activation scratch bytes (SpillActivation) of `uid`'s sessions, the same
  // way against max_activation_bytes_per_user.
  absl::Status TakeActivations(uid_t uid, uint64_t bytes);
  void GiveActivations(uid_t uid, uint64_t bytes);
  uint64_t ActivationBytesOf(uid_t uid) const;

  // RESOURCE_EXHAUSTED when a client_info of `bytes` is over max_client_info_bytes.
  absl::Status CheckClientInfo(uint64_t bytes) const;

  Usage UsageOf(uid_t uid) const;
  uint32_t total_sessions() const;
  const SessionLimits& limits() const { return limits_; }

 private:
  void Give(uid_t uid, uint64_t segment_bytes);

  const SessionLimits limits_;
  mutable std::mutex mutex_;
  std::map<uid_t, Usage> users_;  // only users with a live session
  std::map<uid_t, uint64_t> journal_bytes_;  // only users with journal bytes
  std::map<uid_t, uint64_t> activation_bytes_;  // only users with activation scratch
  uint32_t total_sessions_ = 0;
};

}  // namespace fuyou
