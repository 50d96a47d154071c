// JobRegistry: the jobs on this daemon's storage tier, and which are open.
// Thread-safe. A job is open in at most one session at a time.
#pragma once

#include <sys/types.h>

#include <filesystem>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "fuyou/v1/admin.pb.h"
#include "jobs/job.h"
#include "storage/io_engine.h"

namespace fuyou {

class DaemonStats;

class JobRegistry {
 public:
  // Creates <root>/jobs under every root; FAILED_PRECONDITION when a root is not
  // a writable directory.
  static absl::StatusOr<std::unique_ptr<JobRegistry>> Create(std::vector<std::filesystem::path> roots,
                                                             storage::IoEngine& io, DaemonStats& stats);

  // Opens `name` for a session, creating it when absent. FAILED_PRECONDITION when
  // the job is already open; PERMISSION_DENIED when it belongs to another uid.
  absl::StatusOr<std::shared_ptr<Job>> Acquire(const std::string& name, uid_t uid);
  // Ends the session's hold on `name`.
  void Release(const std::string& name);
  bool IsOpen(const std::string& name) const;

  absl::StatusOr<std::vector<v1::JobInfo>> List() const;
  // Deletes the job's files on every root; returns the bytes freed.
  // FAILED_PRECONDITION while the job is open.
  absl::StatusOr<uint64_t> Delete(const std::string& name, uid_t uid);

  const std::vector<std::filesystem::path>& roots() const { return roots_; }

 private:
  JobRegistry(std::vector<std::filesystem::path> roots, storage::IoEngine& io, DaemonStats& stats);

  std::vector<std::filesystem::path> roots_;
  storage::IoEngine& io_;
  DaemonStats& stats_;
  mutable std::mutex mutex_;
  std::map<std::string, std::weak_ptr<Job>> open_;
};

}  // namespace fuyou
