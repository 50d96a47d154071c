// ActivationSpill: one session's activations spilled to the storage tier
// (activation offload's `ssd` tier, issue 23: SpillActivation,
// RecallActivation, DropActivations in offload.proto).
//
// The bytes live in the session's activation scratch files
// (JournalScratch::ForSession of the scratch made with kActivationDirName, so
// <root>/activations/<session>.spill, one file per storage path, emptied when
// the daemon starts): each spill is padded to whole blocks and goes to the next
// storage path in turn (RAID-0 by activation), with the XXH3 of its bytes kept
// here. Nothing of it is ever committed or part of a job.
//
// Lifetime: a recalled activation is forgotten at once, but its blocks stay
// allocated (and charged to the user) until Drop, which frees the whole
// scratch; the session drops at EndStep, AbortStep, DropActivations and Close,
// and the destructor unlinks the files (a killed client's session is closed by
// the registry's reaping, so it leaves nothing). The activations of a step are
// all spilled in forward before any is recalled in backward, so freeing at the
// drop does not raise the peak.
//
// Limits: at most kMaxActivations spilled at once, every byte of scratch
// charged to the user through `quota` (SessionQuota::TakeActivations) before it
// is allocated, and admitted by the daemon's StorageBudget (`storage`): the
// scratch and the user's jobs stay within max_storage_bytes_per_user, and a
// spill leaves the free space kept on the paths (commits, reserved_free) as a
// registration must. Each spill is admitted as if striped over the paths, as
// the spills together are; from its allocation to Drop it is held
// (StorageBudget::HoldScratch).
//
// The bounce buffer (O_DIRECT needs aligned memory; the bytes are copied out
// of the client's slot first, so a client that changes its slot during the
// write cannot make the checksum disagree with what was written) is as large
// as the largest request so far, at most one slot.
//
// Not thread-safe: the session serialises its use.
#pragma once

#include <cstdint>
#include <filesystem>
#include <memory>
#include <span>
#include <string>
#include <unordered_map>

#include "absl/status/statusor.h"
#include "jobs/storage_budget.h"
#include "journal/grad_journal.h"
#include "journal/journal_scratch.h"
#include "storage/aligned_buffer.h"

namespace fuyou {

// Where an ActivationSpill's scratch is admitted besides its quota: `budget`
// (null: not checked) for `uid`, `what` naming it in refusals.
struct ActivationStorageCharge {
  StorageBudget* budget = nullptr;
  uid_t uid = 0;
  std::string what = "the activation scratch";
};

class ActivationSpill {
 public:
  // Most activations one session has spilled at once.
  static constexpr size_t kMaxActivations = 65536;

  using StorageCharge = ActivationStorageCharge;

  // `files` may be null (the daemon has no scratch): every Spill is then
  // FAILED_PRECONDITION. `quota.take`/`give` (may be empty: no limit) are
  // charged the scratch bytes (whole blocks), and so is `storage`.
  ActivationSpill(std::unique_ptr<JournalSpillFiles> files, JournalQuotaHooks quota, StorageCharge storage = {});
  ~ActivationSpill();  // Drop(), then the files are unlinked
  ActivationSpill(const ActivationSpill&) = delete;
  ActivationSpill& operator=(const ActivationSpill&) = delete;

  // Writes `bytes` (not empty) to the scratch under `key` and returns when it
  // is written. Refused, with nothing kept:
  //   INVALID_ARGUMENT    `key` is already spilled, or `bytes` is empty;
  //   RESOURCE_EXHAUSTED  kMaxActivations are spilled, the user's limit
  //                       (max_activation_bytes_per_user), the storage budget
  //                       (max_storage_bytes_per_user, the free space kept),
  //                       or a full device;
  //   FAILED_PRECONDITION the daemon has no scratch;
  //   the engine's code   the write failed (the blocks stay charged until Drop).
  absl::Status Spill(uint64_t key, std::span<const std::byte> bytes);

  // Reads `key`'s bytes into the start of `out` and forgets the key; returns
  // their length. NOT_FOUND: `key` is not spilled (never, or already
  // recalled or dropped); INVALID_ARGUMENT: `out` is shorter than the
  // activation; DATA_LOSS: what was read back does not match its checksum
  // (file and offset named; the key is forgotten). An I/O error forgets it too.
  absl::StatusOr<uint64_t> Recall(uint64_t key, std::span<std::byte> out);

  struct Dropped {
    uint32_t activations = 0;  // spilled, not recalled
    uint64_t scratch_bytes = 0;
  };
  // Forgets every activation, frees the scratch (the files are truncated) and
  // gives its charge back.
  Dropped Drop();

  // Scratch bytes allocated now (whole blocks, recalled activations included).
  uint64_t scratch_bytes() const { return charged_; }
  size_t spilled() const { return entries_.size(); }

  // Where `key`'s bytes lie (tests: corrupting them). NOT_FOUND as Recall.
  struct Where {
    std::filesystem::path file;
    uint64_t offset = 0;
  };
  absl::StatusOr<Where> Locate(uint64_t key) const;

 private:
  struct Entry {
    JournalSpillFiles::Location location;
    uint64_t bytes = 0;
    uint64_t checksum = 0;
  };
  // An aligned buffer of at least `bytes`.
  absl::StatusOr<std::span<std::byte>> Bounce(uint64_t bytes);

  std::unique_ptr<JournalSpillFiles> files_;
  JournalQuotaHooks quota_;
  StorageCharge storage_;
  std::unordered_map<uint64_t, Entry> entries_;
  uint64_t charged_ = 0;  // taken from the quota and held in the budget, given back at Drop
  storage::AlignedBuffer bounce_;
};

}  // namespace fuyou
