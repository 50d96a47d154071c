// StorageBudget: how much of the storage tier a registration may take (issue 20:
// one user registered chunks until 4 KiB were left and root's next job failed
// with ENOSPC). Three bounds, checked before anything is reserved:
//
//  - per user: the bytes all of a uid's jobs reserve (states.bin on every path,
//    CopyJob's copies included, as allocated on disk) plus what this request
//    adds must stay within max_bytes_per_user;
//  - all ordinary users together (issue 32: two users, each within a per-user
//    limit of half the storage, filled it to the reserve and root's next job
//    was refused): the same count summed over every uid but the
//    administrators' (root and the daemon's own user), plus this request, must
//    stay within max_bytes_all_users. Administrators are not bound by it: the
//    rest of the storage is theirs whatever the users hold;
//  - free space: on every storage path a registration must leave
//    commit_reserve_bytes free (manifests and commits of running jobs), and one
//    by an ordinary user also reserved_free_bytes (kept for administrators:
//    root and the daemon's own user).
//
// Registrations in flight count until their Grant is dropped (after the
// extents are fallocated, when the disk shows them), so two that race cannot
// both take the last bytes. Scratch outside the jobs (spilled activations and
// gradient journals: JournalSpillFiles::Allocate, journal/journal_scratch.h) is
// admitted the same way, and then held
// (HoldScratch) until it is freed: counted with the uid's jobs against
// max_bytes_per_user and max_bytes_all_users; the free space on the paths
// shows it already. An Admit walks the users' job directories once per path
// (only the uid's own when max_bytes_all_users does not bind it).
// Thread-safe.
#pragma once

#include <sys/types.h>

#include <cstdint>
#include <filesystem>
#include <map>
#include <mutex>
#include <string_view>
#include <vector>

#include "absl/status/statusor.h"

namespace fuyou {

struct StorageBudgetOptions {
  uint64_t max_bytes_per_user = 0;    // 0: no per-user bound
  uint64_t max_bytes_all_users = 0;   // ordinary uids together; 0: no such bound
  uint64_t reserved_free_bytes = 0;   // per path, for administrators only
  uint64_t commit_reserve_bytes = 16 << 20;  // per path, for nobody's registrations
};

class StorageBudget {
 public:
  // Bytes admitted and not yet on disk. Move-only; gives them back when
  // destroyed. Must not outlive its StorageBudget.
  class Grant {
   public:
    Grant() = default;
    Grant(Grant&& other) noexcept { *this = std::move(other); }
    Grant& operator=(Grant&& other) noexcept;
    ~Grant() { Reset(); }
    void Reset();

   private:
    friend class StorageBudget;
    StorageBudget* budget_ = nullptr;
    uid_t uid_ = 0;
    uint64_t bytes_ = 0;
  };

  StorageBudget(std::vector<std::filesystem::path> roots, StorageBudgetOptions options);

  // Admits `bytes` more on storage (striped evenly over the paths) for a job of
  // `uid` (`what` names it in messages: "job 'x'"). RESOURCE_EXHAUSTED naming
  // the limit, its value, the use and the setting when it would pass
  // max_storage_bytes_per_user, max_storage_bytes_all_users (ordinary uids
  // only) or eat into the free space kept.
  absl::StatusOr<Grant> Admit(uid_t uid, uint64_t bytes, std::string_view what);

  // Bytes the jobs of `uid` have allocated on every path (states.bin files).
  uint64_t UsedBy(uid_t uid) const;
  // The same summed over every ordinary uid (all but root and the daemon's own).
  uint64_t UsedByAllUsers() const;

  // `bytes` of `uid`'s scratch (admitted first) are now allocated on the
  // paths: they count against max_bytes_per_user (and, for an ordinary uid,
  // max_bytes_all_users) until given back.
  void HoldScratch(uid_t uid, uint64_t bytes);
  void GiveScratch(uid_t uid, uint64_t bytes);
  const StorageBudgetOptions& options() const { return options_; }

 private:
  struct DiskUse {
    uint64_t uid = 0;       // the uid's jobs
    uint64_t ordinary = 0;  // the jobs of every ordinary uid (`uid`'s included if ordinary)
  };
  // One walk of the jobs on every path: `uid`'s, and with `all_users` every
  // ordinary uid's too (else `ordinary` stays 0).
  DiskUse Scan(uid_t uid, bool all_users) const;
  void Give(uid_t uid, uint64_t bytes);

  const std::vector<std::filesystem::path> roots_;
  const StorageBudgetOptions options_;
  std::mutex mutex_;
  std::map<uid_t, uint64_t> pending_;  // admitted, not yet dropped
  uint64_t pending_total_ = 0;
  std::map<uid_t, uint64_t> scratch_;  // held scratch, on disk outside the jobs
};

// The auto values of issues 20 and 32 from the paths' sizes (statvfs): of
// their total size, a quarter for the per-job quota, a quarter for the per-user
// limit and half for all ordinary users together, and per path 1% of the
// smallest path's size, within 64 MiB..4 GiB, kept free. So however many users
// fill their limits at once, they hold at most half the storage and the other
// half stays reachable for administrators' jobs; one user leaves the others at
// least half of the users' share; one job of the largest quota fits a user.
struct StorageDefaults {
  uint64_t total_bytes = 0;
  uint64_t job_quota_bytes = 0;
  uint64_t max_bytes_per_user = 0;
  uint64_t max_bytes_all_users = 0;
  uint64_t reserved_free_bytes = 0;
};
StorageDefaults StorageDefaultsFor(const std::vector<std::filesystem::path>& roots);

}  // namespace fuyou
