#include "jobs/job_registry.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <charconv>

#include "common/log.h"
#include "common/status_util.h"
#include "fmt/format.h"
#include "jobs/job_copy.h"

namespace fuyou {
namespace fs = std::filesystem;
namespace {

// The uid a users/<uid> directory is named by, or nullopt for anything else.
std::optional<uid_t> ParseUid(const std::string& text) {
  uint32_t value = 0;
  auto [end, error] = std::from_chars(text.data(), text.data() + text.size(), value);
  if (error != std::errc() || end != text.data() + text.size() || text.empty() || text != std::to_string(value)) {
    return std::nullopt;
  }
  return static_cast<uid_t>(value);
}

// Moves the jobs of the layout before namespaces (<root>/jobs/<name>) of every
// root to <root>/users/<owner>/jobs/<name>.
void MigrateOldLayout(const std::vector<storage::DirFd>& roots) {
  auto old0 = roots[0].OpenDir("jobs");
  if (!old0.ok()) {
    if (!absl::IsNotFound(old0.status())) log::Error("job migration: {}", old0.status().message());
    return;
  }
  auto names = old0->List();
  if (!names.ok()) {
    log::Error("job migration: {}", names.status().message());
    return;
  }
  size_t moved = 0;
  for (const std::string& name : *names) {
    auto dir = old0->OpenDir(name);
    absl::StatusOr<v1::JobManifest> manifest =
        dir.ok() ? Job::ReadManifest(*dir, name) : absl::StatusOr<v1::JobManifest>(dir.status());
    if (!manifest.ok()) {
      log::Error("job migration: {} is left where it is: its manifest cannot be read ({}); delete it by hand "
                 "when it is not needed",
                 (old0->path() / name).string(), manifest.status().message());
      continue;
    }
    const uid_t owner = manifest->owner_uid();
    bool all_moved = true;
    for (const storage::DirFd& root : roots) {
      auto old = root.OpenDir("jobs");
      if (!old.ok()) continue;
      auto target = OpenUserJobsDir(root, owner, /*create=*/true);
      absl::Status status = target.ok() ? old->RenameTo(name, *target, name) : target.status();
      if (!status.ok() && absl::IsNotFound(status)) continue;  // this root never had a share
      if (!status.ok()) {
        all_moved = false;
        log::Error("job migration: cannot move job '{}' of uid {} on {}: {}", name, owner, root.path().string(),
                   status.message());
        continue;
      }
      // Round 1 made job directories 0755: make them private.
      if (auto moved_dir = target->OpenDir(name); moved_dir.ok()) ::fchmod(moved_dir->get(), 0700);
    }
    if (all_moved) {
      ++moved;
      log::Info("job migration: job '{}' moved to users/{}/jobs/{}", name, owner, name);
    }
  }
  for (const storage::DirFd& root : roots) root.RemoveDir("jobs").IgnoreError();  // only when empty
  if (moved > 0) log::Info("job migration: {} job(s) moved to the layout with a namespace per uid", moved);
}

}  // namespace

absl::StatusOr<std::unique_ptr<JobRegistry>> JobRegistry::Create(std::vector<fs::path> roots, storage::IoEngine& io,
                                                                  DaemonStats& stats, JobRegistryOptions options) {
  std::vector<storage::DirFd> root_dirs;
  for (const fs::path& root : roots) {
    std::error_code ec;
    fs::create_directories(root, ec);  // a configured path; the daemon's lock made it already
    auto dir = storage::DirFd::OpenRoot(root);
    absl::StatusOr<storage::DirFd> users =
        dir.ok() ? dir->OpenOrCreateDir("users", 0700) : absl::StatusOr<storage::DirFd>(dir.status());
    if (!users.ok()) {
      return absl::FailedPreconditionError(
          fmt::format("storage path {} is not usable: {}", root.string(), users.status().message()));
    }
    if (::faccessat(users->get(), ".", W_OK | X_OK, AT_EACCESS) != 0) {
      return absl::FailedPreconditionError(fmt::format("storage path {} is not writable", root.string()));
    }
    root_dirs.push_back(std::move(*dir));
  }
  MigrateOldLayout(root_dirs);
  return std::unique_ptr<JobRegistry>(new JobRegistry(std::move(roots), io, stats, options));
}

JobRegistry::JobRegistry(std::vector<fs::path> roots, storage::IoEngine& io, DaemonStats& stats,
                         JobRegistryOptions options)
    : roots_(std::move(roots)), io_(io), stats_(stats), options_(options), budget_(roots_, options.storage) {}

absl::Status JobRegistry::CheckNotCopyingLocked(const std::string& name, uid_t uid, std::string_view action) const {
  auto it = copying_.find(Job::Key(uid, name));
  if (it == copying_.end()) return absl::OkStatus();
  return absl::FailedPreconditionError(
      fmt::format("cannot {} job '{}': {}; try again when the copy is done", action, name, it->second));
}

size_t JobRegistry::CountJobs(uid_t uid) const {
  auto root = storage::DirFd::OpenRoot(roots_[0]);
  if (!root.ok()) return 0;
  auto jobs = OpenUserJobsDir(*root, uid, /*create=*/false);
  if (!jobs.ok()) return 0;
  auto names = jobs->List();
  return names.ok() ? names->size() : 0;
}

absl::StatusOr<std::shared_ptr<Job>> JobRegistry::Acquire(const std::string& name, uid_t uid) {
  if (std::string problem = JobNameProblem(name); !problem.empty()) return absl::InvalidArgumentError(problem);
  std::lock_guard lock(mutex_);
  const std::string key = Job::Key(uid, name);
  if (auto it = open_.find(key); it != open_.end()) {
    return absl::FailedPreconditionError(
        fmt::format("job '{}' is already open in another session; close it first (one session per job)", name));
  }
  FUYOU_RETURN_IF_ERROR(CheckNotCopyingLocked(name, uid, "open"));
  // The session that holds the job is one owner of the I/O queues, with its
  // scratch files (Session uses job->io_owner()), drawing on its uid's share.
  const storage::IoOwner io_owner = storage::IoOwner::Next(uid);
  auto job = Job::Open(roots_, name, uid, /*create=*/false, io_, stats_, io_owner);
  if (!job.ok() && absl::IsNotFound(job.status())) {
    if (const uint32_t limit = options_.max_jobs_per_user; limit != 0 && CountJobs(uid) >= limit) {
      return absl::ResourceExhaustedError(fmt::format(
          "cannot create job '{}': uid {} already has {} jobs, the limit of max_jobs_per_user ({}); delete a job "
          "(fuyouctl jobs delete) or raise [limits] max_jobs_per_user / --max-jobs-per-user",
          name, uid, CountJobs(uid), limit));
    }
    job = Job::Open(roots_, name, uid, /*create=*/true, io_, stats_, io_owner);
  }
  if (!job.ok()) return job.status();
  std::shared_ptr<Job> shared = std::move(*job);
  open_[key] = shared;
  return shared;
}

void JobRegistry::Release(const Job& job) {
  std::lock_guard lock(mutex_);
  open_.erase(job.key());
  if (job.created() && job.manifest().chunks_size() == 0) {
    // Made by this hold and never given a chunk: nothing worth keeping.
    if (absl::StatusOr<uint64_t> removed = RemoveLocked(job.name(), job.uid()); !removed.ok()) {
      log::Warn("job '{}' of uid {} was created empty and is not removed: {}", job.name(), job.uid(),
                removed.status().message());
    }
  }
}

bool JobRegistry::IsOpen(const std::string& name, uid_t uid) const {
  std::lock_guard lock(mutex_);
  return open_.count(Job::Key(uid, name)) != 0;
}

absl::StatusOr<std::vector<v1::JobInfo>> JobRegistry::List(std::optional<uid_t> uid) const {
  FUYOU_ASSIGN_OR_RETURN(storage::DirFd root, storage::DirFd::OpenRoot(roots_[0]));
  std::vector<uid_t> uids;
  if (uid.has_value()) {
    uids.push_back(*uid);
  } else {
    FUYOU_ASSIGN_OR_RETURN(storage::DirFd users, root.OpenDir("users"));
    FUYOU_ASSIGN_OR_RETURN(std::vector<std::string> names, users.List());
    for (const std::string& name : names) {
      if (auto parsed = ParseUid(name)) uids.push_back(*parsed);
    }
  }
  std::vector<v1::JobInfo> jobs;
  for (uid_t owner : uids) {
    auto jobs_dir = OpenUserJobsDir(root, owner, /*create=*/false);
    if (!jobs_dir.ok() && absl::IsNotFound(jobs_dir.status())) continue;
    if (!jobs_dir.ok()) return jobs_dir.status();
    FUYOU_ASSIGN_OR_RETURN(std::vector<std::string> names, jobs_dir->List());
    for (const std::string& name : names) {
      if (!JobNameProblem(name).empty()) continue;  // not a job of ours
      v1::JobInfo info;
      info.set_name(name);
      info.set_owner_uid(owner);
      auto dir = jobs_dir->OpenDir(name);
      auto manifest = dir.ok() ? Job::ReadManifest(*dir, name) : absl::StatusOr<v1::JobManifest>(dir.status());
      if (!manifest.ok()) {
        // Half created by a crash (the manifest is committed last) or damaged:
        // listed so that its owner can delete it.
        info.set_damaged(absl::IsNotFound(manifest.status())
                             ? "its creation was interrupted (it has no manifest.pb); open it to create it anew, "
                               "or delete it"
                             : std::string(manifest.status().message()));
        jobs.push_back(std::move(info));
        continue;
      }
      info.set_chunks(static_cast<uint32_t>(manifest->chunks_size()));
      uint64_t parameters = 0;
      for (const auto& chunk : manifest->chunks()) parameters += chunk.num_elements();
      info.set_parameters(parameters);
      uint64_t bytes = 0;
      for (uint64_t b : manifest->path_bytes()) bytes += b;
      info.set_bytes_on_storage(bytes);
      info.set_committed_step(manifest->committed_step());
      info.set_last_used_unix(manifest->last_used_unix());
      info.set_open(IsOpen(name, owner));
      jobs.push_back(std::move(info));
    }
  }
  return jobs;
}

absl::StatusOr<uint64_t> JobRegistry::Delete(const std::string& name, uid_t uid) {
  if (std::string problem = JobNameProblem(name); !problem.empty()) return absl::InvalidArgumentError(problem);
  std::lock_guard lock(mutex_);
  if (open_.count(Job::Key(uid, name)) != 0) {
    return absl::FailedPreconditionError(fmt::format("job '{}' is open in a session; close it before deleting", name));
  }
  FUYOU_RETURN_IF_ERROR(CheckNotCopyingLocked(name, uid, "delete"));
  return RemoveLocked(name, uid);
}

absl::StatusOr<uint64_t> JobRegistry::Copy(const std::string& src, const std::string& dst, uid_t uid) {
  if (std::string problem = JobNameProblem(src); !problem.empty()) return absl::InvalidArgumentError(problem);
  if (std::string problem = JobNameProblem(dst); !problem.empty()) return absl::InvalidArgumentError(problem);
  if (src == dst) return absl::InvalidArgumentError(fmt::format("cannot copy job '{}' onto itself", src));
  std::unique_lock lock(mutex_);
  FUYOU_RETURN_IF_ERROR(CheckNotCopyingLocked(src, uid, "copy"));
  FUYOU_RETURN_IF_ERROR(CheckNotCopyingLocked(dst, uid, "copy into"));
  if (open_.count(Job::Key(uid, src)) != 0) {
    return absl::FailedPreconditionError(fmt::format(
        "cannot copy job '{}': it is open in a session, whose steps change its committed states; close its "
        "optimizer (or let its session end) and copy again",
        src));
  }
  if (open_.count(Job::Key(uid, dst)) != 0) {
    return absl::FailedPreconditionError(
        fmt::format("cannot copy job '{}' into job '{}': '{}' is open in a session", src, dst, dst));
  }
  // The copy's transfers are one background owner of its uid: a low-priority
  // share of the I/O queues, beside the sessions' (storage/io_engine.h, "Owners").
  const storage::IoOwner io_owner = storage::IoOwner::Next(uid, storage::IoPriority::kBackground);
  FUYOU_ASSIGN_OR_RETURN(std::unique_ptr<Job> source,
                         Job::Open(roots_, src, uid, /*create=*/false, io_, stats_, io_owner));
  if (auto existing = Job::Open(roots_, dst, uid, /*create=*/false, io_, stats_); !absl::IsNotFound(existing.status())) {
    if (!existing.ok()) return existing.status();
    return absl::AlreadyExistsError(fmt::format(
        "cannot copy job '{}' into job '{}': '{}' already exists; delete it first (fuyouctl jobs delete) or choose "
        "another name",
        src, dst, dst));
  }
  if (const uint32_t limit = options_.max_jobs_per_user; limit != 0 && CountJobs(uid) >= limit) {
    return absl::ResourceExhaustedError(fmt::format(
        "cannot copy job '{}' into job '{}': uid {} already has {} jobs, the limit of max_jobs_per_user ({}); delete "
        "a job (fuyouctl jobs delete) or raise [limits] max_jobs_per_user / --max-jobs-per-user",
        src, dst, uid, CountJobs(uid), limit));
  }
  FUYOU_ASSIGN_OR_RETURN(std::unique_ptr<Job> target,
                         Job::Open(roots_, dst, uid, /*create=*/true, io_, stats_, io_owner));
  const std::string src_key = Job::Key(uid, src);
  const std::string dst_key = Job::Key(uid, dst);
  copying_[src_key] = fmt::format("it is being copied into job '{}'", dst);
  copying_[dst_key] = fmt::format("it is being created as a copy of job '{}'", src);
  lock.unlock();

  // The copy, outside the lock: only this call touches src and dst now.
  absl::StatusOr<uint64_t> copied = [&]() -> absl::StatusOr<uint64_t> {
    FUYOU_ASSIGN_OR_RETURN(StorageBudget::Grant grant,
                           budget_.Admit(uid, source->bytes_on_storage(), fmt::format("a copy of job '{}'", src)));
    return CopyJobStates(*source, *target);
  }();
  target.reset();
  source.reset();

  lock.lock();
  copying_.erase(src_key);
  copying_.erase(dst_key);
  if (!copied.ok()) {
    if (absl::StatusOr<uint64_t> removed = RemoveLocked(dst, uid); !removed.ok()) {
      log::Warn("job '{}' of uid {}: cannot remove what a failed copy left: {}", dst, uid,
                removed.status().message());
    }
  }
  return copied;
}

absl::StatusOr<uint64_t> JobRegistry::RemoveLocked(const std::string& name, uid_t uid) {
  FUYOU_ASSIGN_OR_RETURN(storage::DirFd root0, storage::DirFd::OpenRoot(roots_[0]));
  auto jobs0 = OpenUserJobsDir(root0, uid, /*create=*/false);
  absl::StatusOr<storage::DirFd> dir0 = jobs0.ok() ? jobs0->OpenDir(name) : jobs0.status();
  if (!dir0.ok() && absl::IsNotFound(dir0.status())) {
    return absl::NotFoundError(fmt::format("job '{}' does not exist", name));
  }
  if (!dir0.ok()) return dir0.status();
  if (auto manifest = Job::ReadManifest(*dir0, name); !manifest.ok() && !absl::IsNotFound(manifest.status())) {
    log::Warn("deleting job '{}' of uid {}, whose manifest is damaged: {}", name, uid, manifest.status().message());
  }
  uint64_t freed = 0;
  for (const fs::path& path : roots_) {
    FUYOU_ASSIGN_OR_RETURN(storage::DirFd root, storage::DirFd::OpenRoot(path));
    auto jobs = OpenUserJobsDir(root, uid, /*create=*/false);
    if (!jobs.ok() && absl::IsNotFound(jobs.status())) continue;
    if (!jobs.ok()) return jobs.status();
    FUYOU_RETURN_IF_ERROR(Job::RemoveFiles(*jobs, name, &freed));
  }
  RemoveEmptyUserDirsLocked(uid);
  return freed;
}

void JobRegistry::RemoveEmptyUserDirsLocked(uid_t uid) {
  // rmdir removes only an empty directory: a job created meanwhile (under this
  // lock, so none can be) or anything else in it keeps it.
  const std::string name = std::to_string(uid);
  for (const fs::path& path : roots_) {
    auto root = storage::DirFd::OpenRoot(path);
    auto users = root.ok() ? root->OpenDir("users") : absl::StatusOr<storage::DirFd>(root.status());
    auto user = users.ok() ? users->OpenDir(name) : absl::StatusOr<storage::DirFd>(users.status());
    if (!user.ok()) continue;
    if (user->RemoveDir("jobs").ok()) users->RemoveDir(name).IgnoreError();
  }
}

}  // namespace fuyou
