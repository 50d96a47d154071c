#include "jobs/storage_budget.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <unistd.h>

#include <algorithm>
#include <charconv>
#include <optional>

#include "fmt/format.h"
#include "jobs/job.h"
#include "storage/dir_fd.h"

namespace fuyou {
namespace fs = std::filesystem;

StorageBudget::Grant& StorageBudget::Grant::operator=(Grant&& other) noexcept {
  if (this != &other) {
    Reset();
    budget_ = other.budget_;
    uid_ = other.uid_;
    bytes_ = other.bytes_;
    other.budget_ = nullptr;
  }
  return *this;
}

void StorageBudget::Grant::Reset() {
  if (budget_ != nullptr) budget_->Give(uid_, bytes_);
  budget_ = nullptr;
}

StorageBudget::StorageBudget(std::vector<fs::path> roots, StorageBudgetOptions options)
    : roots_(std::move(roots)), options_(options) {}

void StorageBudget::Give(uid_t uid, uint64_t bytes) {
  std::lock_guard lock(mutex_);
  auto it = pending_.find(uid);
  if (it != pending_.end()) {
    it->second -= std::min(it->second, bytes);
    if (it->second == 0) pending_.erase(it);
  }
  pending_total_ -= std::min(pending_total_, bytes);
}

void StorageBudget::HoldScratch(uid_t uid, uint64_t bytes) {
  if (bytes == 0) return;
  std::lock_guard lock(mutex_);
  scratch_[uid] += bytes;
}

void StorageBudget::GiveScratch(uid_t uid, uint64_t bytes) {
  std::lock_guard lock(mutex_);
  auto it = scratch_.find(uid);
  if (it == scratch_.end()) return;
  it->second -= std::min(it->second, bytes);
  if (it->second == 0) scratch_.erase(it);
}

namespace {

// Root and the daemon's own user: the free space reserved_free and the storage
// beyond max_bytes_all_users are kept for them.
bool IsAdministrator(uid_t uid) { return uid == 0 || uid == ::geteuid(); }

// Bytes allocated on disk by the states.bin of every job in `jobs`.
uint64_t JobsBytes(const storage::DirFd& jobs) {
  auto names = jobs.List();
  if (!names.ok()) return 0;
  uint64_t used = 0;
  for (const std::string& name : *names) {
    struct stat info {};
    const std::string file = name + "/states.bin";
    if (::fstatat(jobs.get(), file.c_str(), &info, AT_SYMLINK_NOFOLLOW) == 0 && S_ISREG(info.st_mode)) {
      used += static_cast<uint64_t>(info.st_blocks) * 512;
    }
  }
  return used;
}

// The uid a users/<name> directory belongs to; nullopt for anything else.
std::optional<uid_t> UidOfDir(const std::string& name) {
  uint32_t uid = 0;
  const char* end = name.data() + name.size();
  auto [last, error] = std::from_chars(name.data(), end, uid);
  if (error != std::errc() || last != end || std::to_string(uid) != name) return std::nullopt;
  return static_cast<uid_t>(uid);
}

}  // namespace

StorageBudget::DiskUse StorageBudget::Scan(uid_t uid, bool all_users) const {
  DiskUse use;
  for (const fs::path& path : roots_) {
    auto root = storage::DirFd::OpenRoot(path);
    if (!root.ok()) continue;
    if (!all_users) {
      auto jobs = OpenUserJobsDir(*root, uid, /*create=*/false);
      if (jobs.ok()) use.uid += JobsBytes(*jobs);
      continue;
    }
    auto users = root->OpenDir("users");
    if (!users.ok()) continue;
    auto names = users->List();
    if (!names.ok()) continue;
    for (const std::string& name : *names) {
      const std::optional<uid_t> owner = UidOfDir(name);
      if (!owner.has_value() || (IsAdministrator(*owner) && *owner != uid)) continue;
      auto mine = users->OpenDir(name);
      if (!mine.ok()) continue;
      auto jobs = mine->OpenDir("jobs");
      if (!jobs.ok()) continue;
      const uint64_t bytes = JobsBytes(*jobs);
      if (*owner == uid) use.uid += bytes;
      if (!IsAdministrator(*owner)) use.ordinary += bytes;
    }
  }
  return use;
}

uint64_t StorageBudget::UsedBy(uid_t uid) const { return Scan(uid, /*all_users=*/false).uid; }

uint64_t StorageBudget::UsedByAllUsers() const { return Scan(0, /*all_users=*/true).ordinary; }

absl::StatusOr<StorageBudget::Grant> StorageBudget::Admit(uid_t uid, uint64_t bytes, std::string_view what) {
  Grant grant;
  if (bytes == 0) return grant;
  const bool administrator = IsAdministrator(uid);
  const bool bound_all = options_.max_bytes_all_users != 0 && !administrator;
  // Outside the lock: one directory walk. Two Admits that race both see the
  // other's pending bytes below, which is what matters.
  const DiskUse disk = options_.max_bytes_per_user != 0 || bound_all ? Scan(uid, bound_all) : DiskUse{};
  const uint64_t used = disk.uid;
  std::lock_guard lock(mutex_);
  const uint64_t pending = pending_.count(uid) ? pending_[uid] : 0;
  const uint64_t scratch = scratch_.count(uid) ? scratch_[uid] : 0;
  if (const uint64_t limit = options_.max_bytes_per_user; limit != 0) {
    const uint64_t after = used + pending + scratch + bytes;
    if (after < bytes || after > limit) {
      return absl::ResourceExhaustedError(fmt::format(
          "{} of uid {} needs {} more bytes on storage, which would bring uid {}'s jobs{} to {} bytes, over the "
          "per-user storage limit max_storage_bytes_per_user ({} bytes; they reserve {} now{}); nothing was written. "
          "Delete jobs (fuyouctl jobs delete) or raise [limits] max_storage_bytes_per_user / --max-storage-per-user",
          what, uid, bytes, uid, scratch != 0 ? " and scratch" : "", after, limit, used + pending + scratch,
          scratch != 0 ? fmt::format(", {} of them scratch: spilled activations and gradient journals", scratch) : ""));
    }
  }
  if (const uint64_t limit = options_.max_bytes_all_users; bound_all) {
    uint64_t held = disk.ordinary;  // jobs on disk, then in flight and scratch
    for (const auto& [owner, owner_bytes] : pending_) held += IsAdministrator(owner) ? 0 : owner_bytes;
    for (const auto& [owner, owner_bytes] : scratch_) held += IsAdministrator(owner) ? 0 : owner_bytes;
    const uint64_t after = held + bytes;
    if (after < bytes || after > limit) {
      return absl::ResourceExhaustedError(fmt::format(
          "{} of uid {} needs {} more bytes on storage, which would bring the jobs and scratch of all users but "
          "root and the daemon's own to {} bytes, over the storage limit of all users together "
          "max_storage_bytes_all_users ({} bytes; they reserve {} now, {} of them uid {}'s); the rest is kept for "
          "administrators' jobs, so nothing was written. Delete jobs (fuyouctl jobs delete) or have the operator "
          "raise [limits] max_storage_bytes_all_users / --max-storage-all-users",
          what, uid, bytes, after, limit, held, used + pending + scratch, uid));
    }
  }
  const uint64_t share = (bytes + roots_.size() - 1) / roots_.size();
  const uint64_t pending_share = (pending_total_ + roots_.size() - 1) / roots_.size();
  const uint64_t keep = options_.commit_reserve_bytes + (administrator ? 0 : options_.reserved_free_bytes);
  for (const fs::path& path : roots_) {
    struct statvfs info {};
    if (::statvfs(path.c_str(), &info) != 0) continue;  // the reservation itself reports the error
    const uint64_t free = static_cast<uint64_t>(info.f_bavail) * info.f_frsize;
    const uint64_t available = free > pending_share ? free - pending_share : 0;
    if (available < keep || available - keep < share) {
      return absl::ResourceExhaustedError(fmt::format(
          "{} of uid {} needs {} more bytes on storage path {}, which has {} bytes free ({} of them promised to "
          "registrations in progress); {} bytes are kept free there ({}), so nothing was written. Free space on "
          "the path, delete jobs (fuyouctl jobs delete), or lower [storage] reserved_free / --reserved-free "
          "(now {} bytes)",
          what, uid, share, path.string(), free, std::min(free, pending_share), keep,
          administrator ? "for the commits of running jobs"
                        : "for the commits of running jobs and for administrators' jobs, reserved_free",
          options_.reserved_free_bytes));
    }
  }
  pending_[uid] += bytes;
  pending_total_ += bytes;
  grant.budget_ = this;
  grant.uid_ = uid;
  grant.bytes_ = bytes;
  return grant;
}

StorageDefaults StorageDefaultsFor(const std::vector<fs::path>& roots) {
  StorageDefaults defaults;
  uint64_t smallest = UINT64_MAX;
  for (const fs::path& path : roots) {
    struct statvfs info {};
    if (::statvfs(path.c_str(), &info) != 0) continue;
    const uint64_t size = static_cast<uint64_t>(info.f_blocks) * info.f_frsize;
    defaults.total_bytes += size;
    smallest = std::min(smallest, size);
  }
  if (defaults.total_bytes == 0) return defaults;
  defaults.job_quota_bytes = std::max<uint64_t>(defaults.total_bytes / 4, 1);
  defaults.max_bytes_per_user = std::max<uint64_t>(defaults.total_bytes / 4, 1);
  defaults.max_bytes_all_users = std::max<uint64_t>(defaults.total_bytes / 2, 1);
  defaults.reserved_free_bytes = std::clamp<uint64_t>(smallest / 100, uint64_t{64} << 20, uint64_t{4} << 30);
  return defaults;
}

}  // namespace fuyou
