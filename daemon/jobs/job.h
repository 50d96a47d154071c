// Job: a named, persistent set of optimizer states on the storage tier.
//
// Jobs live in a namespace per uid: user U's job <name> is, for storage roots
// R0..Rk-1,
//   R0/users/<U>/jobs/<name>/manifest.pb   the committed manifest (manifest.proto)
//   R0/users/<U>/jobs/<name>/manifest.tmp  the next manifest while it is written
//   R0/users/<U>/jobs/<name>/manifest.prev.pb  the last committed manifest of an
//                                          earlier step (RollBackTo)
//   Ri/users/<U>/jobs/<name>/states.bin    root i's share of the job's state space,
//                                          striped over all roots (storage/striped_file.h)
// Two users' jobs of the same name are two jobs; no request names another
// user's job (root's jobs are root's own). users/<U> and the job directories are
// 0700, files 0600, and everything under a root is reached through
// storage::DirFd (openat, O_NOFOLLOW): a symlink planted anywhere below a root
// fails the operation instead of being followed.
// Every chunk has two extents (committed and shadow). An update writes the
// shadow; Commit makes it the committed one by replacing the manifest
// atomically. So the last commit is never overwritten before the next commit is
// durable, and a crash at any instant leaves exactly the last commit.
//
// A Job is used by one session at a time (JobRegistry enforces it); its
// methods are not thread-safe.
#pragma once

#include <sys/types.h>

#include <cstdint>
#include <filesystem>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "fuyou/dtype.h"
#include "fuyou/v1/manifest.pb.h"
#include "jobs/chunk_layout.h"
#include "storage/dir_fd.h"
#include "storage/io_engine.h"
#include "storage/striped_file.h"

namespace fuyou {

class DaemonStats;

// The most updates (Adam's t) a chunk may count: 2^53, where t + 1 is still exact
// in fp64 (and fp32 bias corrections have long been exactly 1). SetUpdateCount
// above it is INVALID_ARGUMENT; a chunk at it takes no further update.
inline constexpr int64_t kMaxUpdateCount = int64_t{1} << 53;

// The commit scheme's one flip: a chunk's committed extent version is
// record.committed_version(); its shadow, where the next states are written, is
// the other one. Nothing else computes 1 - committed_version().
inline uint32_t ShadowVersion(const v1::ChunkRecord& record) { return 1 - record.committed_version(); }
inline const v1::StateExtent& CommittedExtent(const v1::ChunkRecord& record) {
  return record.extents(static_cast<int>(record.committed_version()));
}
inline const v1::StateExtent& ShadowExtent(const v1::ChunkRecord& record) {
  return record.extents(static_cast<int>(ShadowVersion(record)));
}
// The dtype of `record`'s m and v: its moments_dtype, fp32 when unset (every
// manifest written before bf16 moments).
inline DType RecordMomentsDType(const v1::ChunkRecord& record) {
  return record.moments_dtype() == v1::DTYPE_UNSPECIFIED ? DType::kFloat32
                                                          : static_cast<DType>(record.moments_dtype());
}
// The dtype a registration asks m and v to be kept in: ChunkSpec.moments_dtype,
// fp32 when unset. Precondition: the value was checked (fp32, bf16 or unset).
inline DType SpecMomentsDType(const v1::ChunkSpec& spec) {
  return spec.moments_dtype() == v1::DTYPE_UNSPECIFIED ? DType::kFloat32 : static_cast<DType>(spec.moments_dtype());
}
// The layout of `record`'s extents: its elements, its moments' dtype and, when
// it stores its working weights, their dtype (its param dtype).
inline ChunkLayout RecordLayout(const v1::ChunkRecord& record) {
  ChunkLayout layout{record.num_elements()};
  if (record.stores_weights()) layout.weights_dtype = static_cast<DType>(record.param_dtype());
  layout.moments_dtype = RecordMomentsDType(record);
  return layout;
}

// "" when `name` is a valid job name, else what is wrong with it (the name
// quoted and bounded, see QuoteForError).
std::string JobNameProblem(const std::string& name);

// The directory of `uid`'s jobs under a storage root, <root>/users/<uid>/jobs,
// made (0700 each) when `create`; NOT_FOUND when absent and not `create`.
absl::StatusOr<storage::DirFd> OpenUserJobsDir(const storage::DirFd& root, uid_t uid, bool create);
// OK when every chunk record of `manifest` describes states that can exist: 1 to
// kMaxChunkElements elements, valid dtypes, an update count in
// [0, kMaxUpdateCount], committed_version 0 or 1, exactly two extents, each
// block-aligned, at least RecordLayout(record).ExtentBytes() long (the states
// and, for a chunk that stores weights, the weights region after them), inside
// state_bytes and overlapping no other extent, no weights checksum on a chunk
// without weights, chunk ids unique, and the per-path byte counts summing
// without overflow. Otherwise DATA_LOSS naming the job and chunk. A manifest from disk
// is checked with it before any of its sizes is used.
absl::Status ValidateManifest(const v1::JobManifest& manifest);

class Job {
 public:
  // Key of job `name` of `uid` in daemon-wide maps (the state cache, the open
  // jobs): "<uid>/<name>".
  static std::string Key(uid_t uid, const std::string& name);

  // Loads job `name` of `uid` under `roots` or, when it does not exist and
  // `create` is set, creates it. NOT_FOUND when absent and not `create`;
  // DATA_LOSS when the manifest is corrupt. Creation is all or nothing: the state
  // files are made first and the manifest committed last, and on any failure
  // (EMFILE, ENOSPC, ...) everything this call made is removed again.
  // The state files' transfers are `io_owner`'s (storage/io_engine.h, "Owners"):
  // the session that holds the job, or the copy that reads or writes it.
  static absl::StatusOr<std::unique_ptr<Job>> Open(const std::vector<std::filesystem::path>& roots,
                                                   const std::string& name, uid_t uid, bool create,
                                                   storage::IoEngine& io, DaemonStats& stats,
                                                   storage::IoOwner io_owner = storage::IoOwner());
  // Reads only the manifest of the job in `job_dir` (for listings). NOT_FOUND
  // when absent, DATA_LOSS when damaged.
  static absl::StatusOr<v1::JobManifest> ReadManifest(const storage::DirFd& job_dir, const std::string& name);
  // Removes the job directory `name` under `jobs_dir`: only the files a job has
  // (manifest.pb, manifest.tmp, manifest.prev.pb, states.bin), each unlinked without following a
  // link, then the directory. Adds the bytes of the removed regular files to
  // `*freed`. FAILED_PRECONDITION when the directory holds anything else (it is
  // then left in place). OK when it does not exist.
  static absl::Status RemoveFiles(const storage::DirFd& jobs_dir, const std::string& name, uint64_t* freed);

  const std::string& name() const { return name_; }
  uid_t uid() const { return uid_; }
  const std::string& key() const { return key_; }
  // True when Open created this job (it had no manifest before).
  bool created() const { return created_; }
  // Whom the state files' transfers are for (Open's `io_owner`).
  storage::IoOwner io_owner() const { return io_owner_; }
  // The committed manifest. Changed only through Commit (JobEdit builds one).
  const v1::JobManifest& manifest() const { return manifest_; }
  // Index of chunk `chunk_id` in manifest().chunks(), or -1.
  int FindChunk(uint32_t chunk_id) const;
  // The committed record of chunk `chunk_id`, or null.
  const v1::ChunkRecord* FindRecord(uint32_t chunk_id) const;

  // Appends a chunk with two fresh extents to `next` (a copy of manifest() being
  // prepared for Commit), reserving their space now: RESOURCE_EXHAUSTED when the
  // storage path is full, before anything is written. `stores_weights`: the
  // extents also hold the working weights in `param_dtype` (ChunkLayout).
  // `moments_dtype` (fp32 or bf16, IsMomentsDType): m and v's dtype, recorded in
  // ChunkRecord.moments_dtype (left unset for fp32, as before bf16 moments).
  // A refused reservation gives back every reservation made since the last
  // Commit (GiveBackUncommitted), so the job is exactly as committed.
  absl::Status AddChunk(v1::JobManifest& next, uint32_t chunk_id, uint64_t num_elements, DType param_dtype,
                        DType grad_dtype, bool stores_weights = false, DType moments_dtype = DType::kFloat32);
  // Shrinks the state files to what the committed manifest names, giving back
  // space reserved by AddChunk for a `next` that will not be committed.
  void GiveBackUncommitted();

  // The job's state space: RAID-0 over one states.bin per storage path.
  storage::StateFile& states() { return *states_; }

  // Makes `next` the committed manifest: syncs the state files (data written so
  // far becomes durable), writes manifest.tmp, fsyncs it, renames it over
  // manifest.pb and fsyncs the directory. On an error before the rename the
  // committed manifest is unchanged. After the rename `next` is what a restart
  // reads, so it is adopted; if the directory sync then fails the result is
  // ABORTED: the commit happened but is not known to be durable, and the caller
  // must stop using the job (a restart resumes from what is on disk).
  absl::Status Commit(v1::JobManifest next);
  // Commit in two halves, for a commit that runs on a thread of its own while
  // the job's user goes on (state/background_commit.h). WriteManifest does
  // everything Commit does on disk (the same crash points, the same results:
  // OK, ABORTED after the rename, any other error before it) and stamps
  // `next.last_used_unix`; it reads only the state files and the directory, so
  // it may run while another thread reads manifest() or transfers state
  // bytes (not while one calls Commit, AddChunk or Truncate). Adopt then makes
  // `next` manifest(), on the job's thread, after an OK or ABORTED
  // WriteManifest.
  // A `next` of a later step than manifest() first keeps manifest() (what is
  // on disk) as manifest.prev.pb, written and fsynced before manifest.tmp, so
  // a crash at any instant leaves a previous manifest that was committed.
  absl::Status WriteManifest(v1::JobManifest& next) const;
  void Adopt(v1::JobManifest next) { manifest_ = std::move(next); }

  // Makes the committed manifest the one of step `step`: nothing to do when
  // the job is at `step`; when it is at a later step and manifest.prev.pb is
  // of `step` (and of this job and owner, and valid), that manifest is
  // committed again (Commit), which gives the job's later step up. The
  // previous step's extents are the shadows the step after it wrote to, so
  // its states are intact while no later step wrote its shadows since; when
  // one did, a read fails its checksum (DATA_LOSS). FAILED_PRECONDITION,
  // naming the steps, when there is no such manifest. Before any chunk of the
  // job is used (at open).
  absl::Status RollBackTo(int64_t step);

  // Total bytes reserved on storage.
  uint64_t bytes_on_storage() const;

 private:
  Job(std::string name, uid_t uid, std::vector<storage::DirFd> dirs, std::unique_ptr<storage::StripedFile> states,
      v1::JobManifest manifest, storage::IoOwner io_owner);

  std::string name_;
  uid_t uid_;
  std::string key_;
  bool created_ = false;
  std::vector<storage::DirFd> dirs_;  // Ri/users/<uid>/jobs/<name>
  std::unique_ptr<storage::StripedFile> states_;
  v1::JobManifest manifest_;
  storage::IoOwner io_owner_;
};

}  // namespace fuyou
