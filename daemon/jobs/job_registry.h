// JobRegistry: the jobs on this daemon's storage tier, and which are open.
// Thread-safe. A job is open in at most one session at a time.
//
// Jobs live in a namespace per uid (see job.h): every call names a job by
// (name, uid) and only ever sees the jobs of that uid. Another user's job of the
// same name is a different job; nothing here reveals that it exists, who owns it
// or whether it is open.
#pragma once

#include <sys/types.h>

#include <filesystem>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "fuyou/v1/admin.pb.h"
#include "jobs/job.h"
#include "jobs/storage_budget.h"
#include "storage/io_engine.h"

namespace fuyou {

class DaemonStats;

struct JobRegistryOptions {
  // Jobs one uid may have on the storage tier; one more is RESOURCE_EXHAUSTED.
  // 0: no limit. ([limits] max_jobs_per_user, --max-jobs-per-user)
  uint32_t max_jobs_per_user = 64;
  // The per-user storage limit, the share of all ordinary users together and
  // the free space kept (jobs/storage_budget.h), for registrations and copies.
  StorageBudgetOptions storage;
};

class JobRegistry {
 public:
  // Makes <root>/users (0700) under every root and moves the jobs of the old
  // layout (<root>/jobs/<name>, before jobs had a namespace per uid) to
  // <root>/users/<owner>/jobs/<name>, the owner read from each manifest; a job
  // whose manifest cannot be read is left where it is, with an error logged.
  // FAILED_PRECONDITION when a root is not a writable directory.
  static absl::StatusOr<std::unique_ptr<JobRegistry>> Create(std::vector<std::filesystem::path> roots,
                                                             storage::IoEngine& io, DaemonStats& stats,
                                                             JobRegistryOptions options = {});

  // Opens job `name` of `uid` for a session, creating it when absent.
  // FAILED_PRECONDITION when it is already open or a copy reads or writes it;
  // RESOURCE_EXHAUSTED when creating it would exceed max_jobs_per_user.
  absl::StatusOr<std::shared_ptr<Job>> Acquire(const std::string& name, uid_t uid);
  // Ends the session's hold on `job`. A job that this hold created and that
  // never got a chunk committed is removed: a session that failed (or did
  // nothing) leaves no empty job behind.
  void Release(const Job& job);
  bool IsOpen(const std::string& name, uid_t uid) const;

  // The jobs of `uid`, or of every uid when `uid` is nullopt. A job whose
  // manifest cannot be read is listed by name with `damaged` set, so that its
  // owner can see it and delete it.
  absl::StatusOr<std::vector<v1::JobInfo>> List(std::optional<uid_t> uid) const;
  // Deletes job `name` of `uid` on every root (only the files a job has; links
  // are removed, never followed); returns the bytes freed. NOT_FOUND when `uid`
  // has no such job, FAILED_PRECONDITION while it is open. A job whose manifest
  // is damaged can be deleted (it is in the caller's own namespace), not one a
  // copy reads or writes (FAILED_PRECONDITION). With its owner's last job go
  // the empty users/<uid>/jobs/ and users/<uid>/ directories.
  absl::StatusOr<uint64_t> Delete(const std::string& name, uid_t uid);
  // Forks job `src` of `uid` into a new job `dst` of the same uid (jobs/job_copy.h):
  // returns the bytes of states copied. NOT_FOUND when src does not exist;
  // ALREADY_EXISTS when dst does; FAILED_PRECONDITION while src or dst is open
  // in a session (src's committed states change with its steps);
  // RESOURCE_EXHAUSTED past max_jobs_per_user, the per-user storage limit or
  // when storage is full. A failed copy leaves no dst behind.
  // Only the checks and the creation of dst happen under the registry's lock;
  // the states are copied outside it, with src and dst marked busy: meanwhile
  // an Acquire, Delete or Copy naming either is FAILED_PRECONDITION ("being
  // copied"), and every other job and user goes on unhindered.
  absl::StatusOr<uint64_t> Copy(const std::string& src, const std::string& dst, uid_t uid);

  // What registrations may take on storage (Session's ChunkStore::Register).
  StorageBudget& storage_budget() { return budget_; }

  const std::vector<std::filesystem::path>& roots() const { return roots_; }

 private:
  JobRegistry(std::vector<std::filesystem::path> roots, storage::IoEngine& io, DaemonStats& stats,
              JobRegistryOptions options);
  // Jobs (directories) `uid` has under the first root.
  size_t CountJobs(uid_t uid) const;
  absl::StatusOr<uint64_t> RemoveLocked(const std::string& name, uid_t uid);
  // Removes users/<uid>/jobs and users/<uid> on every root when they are empty.
  void RemoveEmptyUserDirsLocked(uid_t uid);
  // FAILED_PRECONDITION when a copy reads or writes job `name` of `uid`.
  absl::Status CheckNotCopyingLocked(const std::string& name, uid_t uid, std::string_view action) const;

  std::vector<std::filesystem::path> roots_;
  storage::IoEngine& io_;
  DaemonStats& stats_;
  const JobRegistryOptions options_;
  mutable std::mutex mutex_;
  std::map<std::string, std::weak_ptr<Job>> open_;  // by Job::Key(uid, name)
  // Jobs a Copy in progress reads (src) or writes (dst), by Job::Key, with what
  // an Acquire, Delete or Copy naming them is told.
  std::map<std::string, std::string> copying_;
  StorageBudget budget_;
};

}  // namespace fuyou
