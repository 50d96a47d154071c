// Job: a named, persistent set of optimizer states on the storage tier.
//
// On disk, for storage roots R0..Rk-1:
//   R0/jobs/<name>/manifest.pb     the committed manifest (see manifest.proto)
//   Ri/jobs/<name>/states.bin      root i's share of the job's state space,
//                                  striped over all roots (storage/striped_file.h)
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
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "fuyou/dtype.h"
#include "fuyou/v1/manifest.pb.h"
#include "storage/io_engine.h"
#include "storage/striped_file.h"

namespace fuyou {

class DaemonStats;

// Bytes of one extent for a chunk of n elements: fp32 master, m, v, padded.
uint64_t ChunkStateBytes(uint64_t num_elements);
// The bytes that hold data (and are checksummed): 12 * n.
inline uint64_t ChunkPayloadBytes(uint64_t num_elements) { return 12 * num_elements; }
// The checksum an extent carries: XXH3-64 of the payload of `states`.
uint64_t ChunkPayloadChecksum(const std::byte* states, uint64_t num_elements);

// "" when `name` is a valid job name, else what is wrong with it.
std::string JobNameProblem(const std::string& name);

class Job {
 public:
  // Loads the job under `roots` or, when it does not exist and `create` is set,
  // creates it owned by `owner_uid`. NOT_FOUND when absent and not `create`;
  // DATA_LOSS when the manifest is corrupt.
  static absl::StatusOr<std::unique_ptr<Job>> Open(const std::vector<std::filesystem::path>& roots,
                                                   const std::string& name, uid_t owner_uid, bool create,
                                                   storage::IoEngine& io, DaemonStats& stats);
  // Reads only the manifest (for listings). NOT_FOUND when absent.
  static absl::StatusOr<v1::JobManifest> ReadManifest(const std::filesystem::path& root0, const std::string& name);

  const std::string& name() const { return name_; }
  // The committed manifest.
  const v1::JobManifest& manifest() const { return manifest_; }
  // Index of chunk `chunk_id` in manifest().chunks(), or -1.
  int FindChunk(uint32_t chunk_id) const;

  // Appends a chunk with two fresh extents to `next` (a copy of manifest() being
  // prepared for Commit), reserving their space now: RESOURCE_EXHAUSTED when the
  // storage path is full, before anything is written.
  absl::Status AddChunk(v1::JobManifest& next, uint32_t chunk_id, uint64_t num_elements, DType param_dtype,
                        DType grad_dtype);

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

  // Total bytes reserved on storage.
  uint64_t bytes_on_storage() const;

 private:
  Job(std::string name, std::vector<std::filesystem::path> dirs, std::unique_ptr<storage::StripedFile> states,
      v1::JobManifest manifest);

  std::string name_;
  std::vector<std::filesystem::path> dirs_;  // Ri/jobs/<name>
  std::unique_ptr<storage::StripedFile> states_;
  v1::JobManifest manifest_;
};

}  // namespace fuyou
