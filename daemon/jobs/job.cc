#include "jobs/job.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <algorithm>
#include <set>

#include "common/checksum.h"
#include "common/crash_point.h"
#include "common/log.h"
#include "common/status_util.h"
#include "fmt/format.h"
#include "fuyou/checked_math.h"
#include "jobs/chunk_segments.h"
#include "stats/daemon_stats.h"

namespace fuyou {
namespace fs = std::filesystem;
namespace {

constexpr char kManifestFile[] = "manifest.pb";
constexpr char kManifestTemp[] = "manifest.tmp";
constexpr char kPreviousManifest[] = "manifest.prev.pb";
constexpr char kStatesFile[] = "states.bin";

int64_t NowUnix() {
  return std::chrono::duration_cast<std::chrono::seconds>(std::chrono::system_clock::now().time_since_epoch())
      .count();
}

// Largest manifest read: far above any real job (about 100 bytes per chunk).
constexpr size_t kMaxManifestBytes = size_t{256} << 20;
constexpr mode_t kDirMode = 0700;

}  // namespace

std::string JobNameProblem(const std::string& name) {
  if (name.empty()) return "the job name is empty";
  if (name.size() > 64) return fmt::format("the job name {} is longer than 64 characters", QuoteForError(name));
  if (name[0] == '.') return fmt::format("the job name {} starts with '.'", QuoteForError(name));
  for (char c : name) {
    bool ok = (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '.' || c == '_' ||
              c == '-';
    if (!ok) return fmt::format("the job name {} has a character outside [A-Za-z0-9._-]", QuoteForError(name));
  }
  return "";
}

absl::Status ValidateManifest(const v1::JobManifest& manifest) {
  const std::string job = QuoteForError(manifest.name());
  auto corrupt = [&](uint32_t chunk_id, const std::string& what) {
    return absl::DataLossError(fmt::format(
        "the manifest of job {} is corrupt: chunk {} {}; the job cannot be used (delete it, or restore its "
        "directory from a backup)",
        job, chunk_id, what));
  };
  struct Interval {
    uint64_t begin;
    uint64_t end;
    uint32_t chunk_id;
  };
  std::optional<uint64_t> path_total = 0;
  for (uint64_t bytes : manifest.path_bytes()) path_total = CheckedAdd(path_total, bytes);
  if (!path_total) {
    return absl::DataLossError(fmt::format(
        "the manifest of job {} is corrupt: its per-path byte counts add up to more than 2^64; the job cannot be "
        "used (delete it, or restore its directory from a backup)",
        job));
  }
  std::vector<Interval> extents;
  std::set<uint32_t> ids;
  for (const v1::ChunkRecord& record : manifest.chunks()) {
    const uint32_t id = record.chunk_id();
    if (!ids.insert(id).second) return corrupt(id, "is listed twice");
    const uint64_t n = record.num_elements();
    if (n == 0 || n > kMaxChunkElements) {
      return corrupt(id, fmt::format("has {} elements, outside 1..{}", n, kMaxChunkElements));
    }
    if (!IsValidDType(static_cast<DType>(record.param_dtype())) ||
        !IsValidDType(static_cast<DType>(record.grad_dtype()))) {
      return corrupt(id, fmt::format("has dtypes {} and {}, not FLOAT32, BFLOAT16 or FLOAT16",
                                     static_cast<int>(record.param_dtype()), static_cast<int>(record.grad_dtype())));
    }
    if (record.moments_dtype() != v1::DTYPE_UNSPECIFIED && record.moments_dtype() != v1::DTYPE_BFLOAT16 &&
        record.moments_dtype() != v1::DTYPE_BLOCK8) {
      return corrupt(id, fmt::format("has moments dtype {}, not unset (fp32), BFLOAT16 or BLOCK8",
                                     static_cast<int>(record.moments_dtype())));
    }
    if (record.update_count() < 0 || record.update_count() > kMaxUpdateCount) {
      return corrupt(id, fmt::format("has update count {}, outside 0..{}", record.update_count(), kMaxUpdateCount));
    }
    if (std::string problem = SegmentRecordProblem(record); !problem.empty()) return corrupt(id, problem);
    if (record.committed_version() > 1) {
      return corrupt(id, fmt::format("names committed version {}, not 0 or 1", record.committed_version()));
    }
    if (record.extents_size() != 2) return corrupt(id, fmt::format("has {} extents, not 2", record.extents_size()));
    // n <= kMaxChunkElements and the dtypes are valid: every size fits.
    const uint64_t needed = *RecordLayout(record).ExtentBytes();
    for (int version = 0; version < 2; ++version) {
      const v1::StateExtent& extent = record.extents(version);
      const std::optional<uint64_t> end = CheckedAdd(extent.offset(), extent.length());
      if (extent.path_index() != 0 || extent.offset() % storage::kBlockSize != 0 ||
          extent.length() % storage::kBlockSize != 0 || extent.length() < needed || !end ||
          *end > manifest.state_bytes()) {
        return corrupt(id, fmt::format("extent {} (path {}, offset {}, length {}) cannot hold {} elements of states{} "
                                       "inside the job's {} bytes of state space",
                                       version, extent.path_index(), extent.offset(), extent.length(), n,
                                       record.stores_weights() ? " and working weights" : "",
                                       manifest.state_bytes()));
      }
      if (!record.stores_weights() && extent.weights_checksum() != 0) {
        return corrupt(id, fmt::format("extent {} has a weights checksum but the chunk stores no working weights",
                                       version));
      }
      extents.push_back(Interval{extent.offset(), *end, id});
    }
  }
  std::sort(extents.begin(), extents.end(), [](const Interval& a, const Interval& b) { return a.begin < b.begin; });
  for (size_t i = 1; i < extents.size(); ++i) {
    if (extents[i].begin < extents[i - 1].end) {
      return corrupt(extents[i].chunk_id,
                     fmt::format("has an extent at offset {} that overlaps an extent of chunk {} ending at {}",
                                 extents[i].begin, extents[i - 1].chunk_id, extents[i - 1].end));
    }
  }
  return absl::OkStatus();
}

absl::StatusOr<storage::DirFd> OpenUserJobsDir(const storage::DirFd& root, uid_t uid, bool create) {
  auto step = [&](const storage::DirFd& parent, const std::string& name) {
    return create ? parent.OpenOrCreateDir(name, kDirMode) : parent.OpenDir(name);
  };
  FUYOU_ASSIGN_OR_RETURN(storage::DirFd users, step(root, "users"));
  FUYOU_ASSIGN_OR_RETURN(storage::DirFd mine, step(users, std::to_string(uid)));
  return step(mine, "jobs");
}

std::string Job::Key(uid_t uid, const std::string& name) { return fmt::format("{}/{}", uid, name); }

namespace {

// A manifest as stored: the XXH3-64 of the serialized message, then the message.
std::string ManifestBytes(const v1::JobManifest& manifest) {
  std::string body = manifest.SerializeAsString();
  const uint64_t checksum = Checksum64(body.data(), body.size());
  std::string bytes(8, '\0');
  std::memcpy(bytes.data(), &checksum, 8);
  bytes += body;
  return bytes;
}

absl::StatusOr<v1::JobManifest> ReadManifestFile(const storage::DirFd& job_dir, const char* file,
                                                 const std::string& name) {
  auto read = job_dir.ReadFile(file, kMaxManifestBytes);
  if (!read.ok() && absl::IsNotFound(read.status())) {
    return absl::NotFoundError(fmt::format("job '{}' does not exist", name));
  }
  if (!read.ok()) {
    return absl::Status(read.status().code(),
                        fmt::format("manifest of job '{}' cannot be read: {}", name, read.status().message()));
  }
  const std::string& bytes = *read;
  if (bytes.size() < 8) return absl::DataLossError(fmt::format("manifest of job '{}' is truncated", name));
  uint64_t stored = 0;
  std::memcpy(&stored, bytes.data(), 8);
  const uint64_t actual = Checksum64(bytes.data() + 8, bytes.size() - 8);
  if (stored != actual) {
    return absl::DataLossError(fmt::format("manifest of job '{}' ({}) fails its checksum", name,
                                           (job_dir.path() / file).string()));
  }
  v1::JobManifest manifest;
  if (!manifest.ParseFromArray(bytes.data() + 8, static_cast<int>(bytes.size() - 8))) {
    return absl::DataLossError(fmt::format("manifest of job '{}' cannot be parsed", name));
  }
  return manifest;
}

}  // namespace

absl::StatusOr<v1::JobManifest> Job::ReadManifest(const storage::DirFd& job_dir, const std::string& name) {
  return ReadManifestFile(job_dir, kManifestFile, name);
}

absl::Status Job::RemoveFiles(const storage::DirFd& jobs_dir, const std::string& name, uint64_t* freed) {
  auto dir = jobs_dir.OpenDir(name);
  if (!dir.ok() && absl::IsNotFound(dir.status())) return absl::OkStatus();
  if (!dir.ok()) return dir.status();
  FUYOU_ASSIGN_OR_RETURN(std::vector<std::string> entries, dir->List());
  for (const std::string& entry : entries) {
    if (entry != kManifestFile && entry != kManifestTemp && entry != kPreviousManifest && entry != kStatesFile) {
      return absl::FailedPreconditionError(
          fmt::format("{} holds {}, which fuyoud did not create; the job was not deleted: move it away and retry",
                      dir->path().string(), entry));
    }
  }
  for (const std::string& entry : entries) {
    struct stat st {};
    if (::fstatat(dir->get(), entry.c_str(), &st, AT_SYMLINK_NOFOLLOW) == 0 && S_ISREG(st.st_mode)) {
      *freed += static_cast<uint64_t>(st.st_size);
    }
    FUYOU_RETURN_IF_ERROR(dir->Unlink(entry));  // a link is removed, never followed
  }
  return jobs_dir.RemoveDir(name);
}

absl::StatusOr<std::unique_ptr<Job>> Job::Open(const std::vector<fs::path>& roots, const std::string& name, uid_t uid,
                                               bool create, storage::IoEngine& io, DaemonStats& stats,
                                               storage::IoOwner io_owner) {
  if (std::string problem = JobNameProblem(name); !problem.empty()) return absl::InvalidArgumentError(problem);
  std::vector<storage::DirFd> jobs_dirs;  // Ri/users/<uid>/jobs
  for (const fs::path& root : roots) {
    FUYOU_ASSIGN_OR_RETURN(storage::DirFd root_dir, storage::DirFd::OpenRoot(root));
    auto jobs = OpenUserJobsDir(root_dir, uid, create);
    if (!jobs.ok() && absl::IsNotFound(jobs.status())) {
      return absl::NotFoundError(fmt::format("job '{}' does not exist", name));
    }
    if (!jobs.ok()) return jobs.status();
    jobs_dirs.push_back(std::move(*jobs));
  }
  v1::JobManifest manifest;
  bool is_new = false;
  if (auto dir0 = jobs_dirs[0].OpenDir(name); dir0.ok()) {
    auto existing = ReadManifest(*dir0, name);
    is_new = !existing.ok() && absl::IsNotFound(existing.status());
    if (!existing.ok() && !is_new) return existing.status();
    if (!is_new) manifest = std::move(*existing);
  } else if (absl::IsNotFound(dir0.status())) {
    is_new = true;
  } else {
    return dir0.status();
  }
  if (is_new && !create) return absl::NotFoundError(fmt::format("job '{}' does not exist", name));
  if (!is_new) {
    FUYOU_RETURN_IF_ERROR(ValidateManifest(manifest));
    if (static_cast<size_t>(manifest.path_bytes_size()) != roots.size()) {
      return absl::FailedPreconditionError(
          fmt::format("job '{}' was created with {} storage paths but the daemon now has {}; restore the "
                      "original storage paths to use it",
                      name, manifest.path_bytes_size(), roots.size()));
    }
  } else {
    manifest.set_name(name);
    manifest.set_owner_uid(uid);
    manifest.set_created_unix(NowUnix());
    manifest.set_last_used_unix(NowUnix());
    for (size_t i = 0; i < roots.size(); ++i) manifest.add_path_bytes(0);
  }
  // A new job is made state files first, manifest last; whatever fails on the
  // way (EMFILE, ENOSPC, a planted link) removes what was made, so no state file
  // is ever left without the manifest that makes it visible.
  auto open_files = [&]() -> absl::StatusOr<std::unique_ptr<Job>> {
    std::vector<storage::DirFd> dirs;
    std::vector<std::unique_ptr<storage::StateFile>> files;
    for (size_t i = 0; i < roots.size(); ++i) {
      FUYOU_ASSIGN_OR_RETURN(storage::DirFd dir, is_new ? jobs_dirs[i].OpenOrCreateDir(name, kDirMode)
                                                        : jobs_dirs[i].OpenDir(name));
      auto file = io.OpenAt(dir, kStatesFile, /*create=*/is_new, stats.path_counters(i), io_owner);
      if (!file.ok()) return file.status();
      // A new job's manifest names no bytes: a states.bin left by an old crash is stale.
      if (is_new) FUYOU_RETURN_IF_ERROR((*file)->Truncate(0));
      dirs.push_back(std::move(dir));
      files.push_back(std::move(*file));
    }
    auto states = std::make_unique<storage::StripedFile>(std::move(files));
    auto job =
        std::unique_ptr<Job>(new Job(name, uid, std::move(dirs), std::move(states), std::move(manifest), io_owner));
    if (is_new) {
      FUYOU_RETURN_IF_ERROR(job->Commit(job->manifest()));
      job->created_ = true;
    }
    return job;
  };
  auto job = open_files();
  if (!job.ok() && is_new) {
    for (const storage::DirFd& jobs : jobs_dirs) {
      uint64_t ignored = 0;
      if (absl::Status removed = RemoveFiles(jobs, name, &ignored); !removed.ok()) {
        log::Warn("job '{}' of uid {}: cannot remove what a failed creation left: {}", name, uid,
                  removed.message());
      }
    }
  }
  return job;
}

Job::Job(std::string name, uid_t uid, std::vector<storage::DirFd> dirs, std::unique_ptr<storage::StripedFile> states,
         v1::JobManifest manifest, storage::IoOwner io_owner)
    : name_(std::move(name)),
      uid_(uid),
      key_(Key(uid, name_)),
      dirs_(std::move(dirs)),
      states_(std::move(states)),
      manifest_(std::move(manifest)),
      io_owner_(io_owner) {}

int Job::FindChunk(uint32_t chunk_id) const {
  for (int i = 0; i < manifest_.chunks_size(); ++i) {
    if (manifest_.chunks(i).chunk_id() == chunk_id) return i;
  }
  return -1;
}

const v1::ChunkRecord* Job::FindRecord(uint32_t chunk_id) const {
  const int index = FindChunk(chunk_id);
  return index < 0 ? nullptr : &manifest_.chunks(index);
}

absl::Status Job::AddChunk(v1::JobManifest& next, uint32_t chunk_id, uint64_t num_elements, DType param_dtype,
                           DType grad_dtype, bool stores_weights, DType moments_dtype) {
  ChunkLayout layout{num_elements};
  if (stores_weights) layout.weights_dtype = param_dtype;
  layout.moments_dtype = moments_dtype;
  const std::optional<uint64_t> state_bytes = layout.ExtentBytes();
  const uint64_t offset = next.state_bytes();
  const std::optional<uint64_t> checked_end = CheckedAdd(offset, CheckedMul(state_bytes, 2));
  if (!checked_end) {
    return absl::InvalidArgumentError(fmt::format(
        "job '{}': chunk {} of {} elements needs more state space than can be addressed; nothing was reserved",
        name_, chunk_id, num_elements));
  }
  const uint64_t length = *state_bytes;
  const uint64_t end = *checked_end;
  if (absl::Status reserved = states_->Reserve(end); !reserved.ok()) {
    GiveBackUncommitted();
    return absl::Status(reserved.code(), fmt::format("job '{}': cannot reserve {} bytes for chunk {}: {}", name_,
                                                     2 * length, chunk_id, reserved.message()));
  }
  next.set_state_bytes(end);
  for (size_t path = 0; path < states_->members(); ++path) {
    next.set_path_bytes(static_cast<int>(path), states_->MemberBytes(path, end));
  }
  v1::ChunkRecord* record = next.add_chunks();
  record->set_chunk_id(chunk_id);
  record->set_num_elements(num_elements);
  record->set_param_dtype(static_cast<v1::DType>(param_dtype));
  record->set_grad_dtype(static_cast<v1::DType>(grad_dtype));
  record->set_stores_weights(stores_weights);
  if (moments_dtype != DType::kFloat32) record->set_moments_dtype(static_cast<v1::DType>(moments_dtype));
  record->set_update_count(0);
  record->set_committed_version(0);
  for (uint64_t version = 0; version < 2; ++version) {
    v1::StateExtent* extent = record->add_extents();
    extent->set_path_index(0);
    extent->set_offset(offset + version * length);
    extent->set_length(length);
  }
  return absl::OkStatus();
}

void Job::GiveBackUncommitted() {
  if (states_->size() <= manifest_.state_bytes()) return;
  if (absl::Status status = states_->Truncate(manifest_.state_bytes()); !status.ok()) {
    log::Warn("job '{}': cannot give back uncommitted reservations: {}", name_, status.message());
  }
}

absl::Status Job::Commit(v1::JobManifest next) {
  absl::Status written = WriteManifest(next);
  if (written.ok() || absl::IsAborted(written)) Adopt(std::move(next));  // renamed: what a restart reads
  return written;
}

absl::Status Job::WriteManifest(v1::JobManifest& next) const {
  FUYOU_CRASH_POINT("before_state_sync");
  FUYOU_RETURN_IF_ERROR(states_->Sync());
  FUYOU_CRASH_POINT("after_state_sync");
  next.set_last_used_unix(NowUnix());
  const storage::DirFd& dir = dirs_[0];
  if (manifest_.chunks_size() != 0 && manifest_.committed_step() < next.committed_step()) {
    FUYOU_RETURN_IF_ERROR(dir.WriteNewFile(kPreviousManifest, ManifestBytes(manifest_)));
  }
  FUYOU_RETURN_IF_ERROR(dir.WriteNewFile(kManifestTemp, ManifestBytes(next)));
  FUYOU_CRASH_POINT("manifest_tmp_written");
  if (absl::Status renamed = dir.Rename(kManifestTemp, kManifestFile); !renamed.ok()) {
    return absl::Status(renamed.code(),
                        fmt::format("job '{}': cannot rename the new manifest into place: {}", name_, renamed.message()));
  }
  FUYOU_CRASH_POINT("manifest_renamed");
  if (absl::Status synced = dir.Sync(); !synced.ok()) {
    return absl::AbortedError(fmt::format(
        "job '{}': the new manifest is in place but its directory could not be synced ({}); the session is "
        "closed, reopen the job to go on from what is on disk",
        name_, synced.message()));
  }
  FUYOU_CRASH_POINT("dir_synced");
  return absl::OkStatus();
}

absl::Status Job::RollBackTo(int64_t step) {
  const int64_t now = manifest_.committed_step();
  if (step == now) return absl::OkStatus();
  auto previous = ReadManifestFile(dirs_[0], kPreviousManifest, name_);
  if (!previous.ok() && !absl::IsNotFound(previous.status())) return previous.status();
  if (step > now || !previous.ok() || previous->committed_step() != step) {
    return absl::FailedPreconditionError(fmt::format(
        "job '{}' is at step {}{}; it cannot resume at step {} (fuyoud keeps only the manifest before the last "
        "step's)",
        name_, now,
        previous.ok() ? fmt::format(", its previous manifest at step {}", previous->committed_step()) : "", step));
  }
  if (previous->name() != name_ || previous->owner_uid() != manifest_.owner_uid()) {
    return absl::DataLossError(fmt::format("job '{}': its previous manifest names job '{}' of uid {}", name_,
                                           previous->name(), previous->owner_uid()));
  }
  FUYOU_RETURN_IF_ERROR(ValidateManifest(*previous));
  if (previous->state_bytes() > manifest_.state_bytes()) {
    return absl::DataLossError(fmt::format("job '{}': its previous manifest reaches past its state files", name_));
  }
  log::Warn("job '{}': going back from step {} to step {} (its previous manifest), as the session asked", name_,
            now, step);
  return Commit(*std::move(previous));
}

uint64_t Job::bytes_on_storage() const {
  uint64_t total = 0;
  for (uint64_t bytes : manifest_.path_bytes()) total += bytes;
  return total;
}

}  // namespace fuyou
