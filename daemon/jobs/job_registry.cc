#include "jobs/job_registry.h"

#include <unistd.h>

#include "common/status_util.h"
#include "fmt/format.h"

namespace fuyou {
namespace fs = std::filesystem;

absl::StatusOr<std::unique_ptr<JobRegistry>> JobRegistry::Create(std::vector<fs::path> roots, storage::IoEngine& io,
                                                                  DaemonStats& stats) {
  for (const fs::path& root : roots) {
    std::error_code ec;
    fs::create_directories(root / "jobs", ec);
    if (ec) {
      return absl::FailedPreconditionError(
          fmt::format("storage path {} is not usable: cannot create {}: {}", root.string(),
                      (root / "jobs").string(), ec.message()));
    }
    if (::access((root / "jobs").c_str(), W_OK | X_OK) != 0) {
      return absl::FailedPreconditionError(fmt::format("storage path {} is not writable", root.string()));
    }
  }
  return std::unique_ptr<JobRegistry>(new JobRegistry(std::move(roots), io, stats));
}

JobRegistry::JobRegistry(std::vector<fs::path> roots, storage::IoEngine& io, DaemonStats& stats)
    : roots_(std::move(roots)), io_(io), stats_(stats) {}

absl::StatusOr<std::shared_ptr<Job>> JobRegistry::Acquire(const std::string& name, uid_t uid) {
  std::lock_guard lock(mutex_);
  if (auto it = open_.find(name); it != open_.end()) {
    return absl::FailedPreconditionError(
        fmt::format("job '{}' is already open in another session; close it first (one session per job)", name));
  }
  auto job = Job::Open(roots_, name, uid, /*create=*/true, io_, stats_);
  if (!job.ok()) return job.status();
  if ((*job)->manifest().owner_uid() != uid && uid != 0) {
    return absl::PermissionDeniedError(
        fmt::format("job '{}' belongs to uid {}, not to uid {}", name, (*job)->manifest().owner_uid(), uid));
  }
  std::shared_ptr<Job> shared = std::move(*job);
  open_[name] = shared;
  return shared;
}

void JobRegistry::Release(const std::string& name) {
  std::lock_guard lock(mutex_);
  open_.erase(name);
}

bool JobRegistry::IsOpen(const std::string& name) const {
  std::lock_guard lock(mutex_);
  return open_.count(name) != 0;
}

absl::StatusOr<std::vector<v1::JobInfo>> JobRegistry::List() const {
  std::vector<v1::JobInfo> jobs;
  std::error_code ec;
  for (const auto& entry : fs::directory_iterator(roots_[0] / "jobs", ec)) {
    const std::string name = entry.path().filename().string();
    auto manifest = Job::ReadManifest(roots_[0], name);
    if (!manifest.ok()) continue;  // a half-created or foreign directory
    v1::JobInfo info;
    info.set_name(name);
    info.set_owner_uid(manifest->owner_uid());
    info.set_chunks(static_cast<uint32_t>(manifest->chunks_size()));
    uint64_t parameters = 0;
    for (const auto& chunk : manifest->chunks()) parameters += chunk.num_elements();
    info.set_parameters(parameters);
    uint64_t bytes = 0;
    for (uint64_t b : manifest->path_bytes()) bytes += b;
    info.set_bytes_on_storage(bytes);
    info.set_committed_step(manifest->committed_step());
    info.set_last_used_unix(manifest->last_used_unix());
    info.set_open(IsOpen(name));
    jobs.push_back(std::move(info));
  }
  if (ec) return absl::InternalError(fmt::format("cannot list {}: {}", (roots_[0] / "jobs").string(), ec.message()));
  return jobs;
}

absl::StatusOr<uint64_t> JobRegistry::Delete(const std::string& name, uid_t uid) {
  if (std::string problem = JobNameProblem(name); !problem.empty()) return absl::InvalidArgumentError(problem);
  std::lock_guard lock(mutex_);
  if (open_.count(name) != 0) {
    return absl::FailedPreconditionError(fmt::format("job '{}' is open in a session; close it before deleting", name));
  }
  auto manifest = Job::ReadManifest(roots_[0], name);
  if (!manifest.ok() && absl::IsNotFound(manifest.status())) return manifest.status();
  if (manifest.ok() && manifest->owner_uid() != uid && uid != 0) {
    return absl::PermissionDeniedError(
        fmt::format("job '{}' belongs to uid {}, not to uid {}", name, manifest->owner_uid(), uid));
  }
  uint64_t freed = 0;
  for (const fs::path& root : roots_) {
    fs::path dir = root / "jobs" / name;
    std::error_code ec;
    for (const auto& entry : fs::recursive_directory_iterator(dir, ec)) {
      if (entry.is_regular_file()) freed += entry.file_size();
    }
    fs::remove_all(dir, ec);
    if (ec) return absl::InternalError(fmt::format("cannot delete {}: {}", dir.string(), ec.message()));
  }
  return freed;
}

}  // namespace fuyou
