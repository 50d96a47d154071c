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
// is allocated, and admitted by the daemon's StorageBudget through the
// scratch files' charge (JournalSpillFiles::Allocate, journal_scratch.h): the
// scratch and the user's jobs stay within max_storage_bytes_per_user, and a
// spill leaves the free space kept on the paths (commits, reserved_free) as a
// registration must.
//
// Asynchronous (issue 23: a spill must not hold up the session's stream):
// Spill and Recall check, charge and place on the caller's thread, then start
// the transfer through the io engine and return its Future, which is set on
// an I/O completion thread. A spill's bytes are copied out of the caller's
// memory (the client's slot) into a bounce buffer before Spill returns, so a
// client that changes its slot during the write cannot make the checksum
// disagree with what was written; a recall's continuation checks the checksum
// and copies into `out` on the completion thread. Bounce buffers (O_DIRECT
// needs aligned memory) come from a pool of kMaxTransfers, each as large as
// the largest request so far (at most one slot): a transfer beyond that waits
// on the caller's thread for one to come back. Drop (and the destructor) wait
// for every transfer in flight first.
//
// Not thread-safe: the session serialises its calls; completions touch only
// the bounce pool, which has its own lock.
#pragma once

#include <condition_variable>
#include <cstdint>
#include <filesystem>
#include <mutex>
#include <vector>
#include <memory>
#include <span>
#include <string>
#include <unordered_map>

#include "absl/status/statusor.h"
#include "common/future.h"
#include "journal/grad_journal.h"
#include "journal/journal_scratch.h"
#include "storage/aligned_buffer.h"

namespace fuyou {

// The bounce buffers of one ActivationSpill's transfers in flight: at most
// `capacity` lent at once. Thread-safe (Give runs on completion threads).
class BounceBuffers {
 public:
  explicit BounceBuffers(size_t capacity) : buffers_(capacity) {}
  struct Lent {
    size_t index = 0;
    std::span<std::byte> bytes;  // aligned, exactly the bytes asked for
  };
  // A buffer of at least `bytes`, waiting while all are lent; RESOURCE_EXHAUSTED
  // when the memory cannot be had.
  absl::StatusOr<Lent> Take(uint64_t bytes);
  void Give(size_t index);
  // Frees the memory of the buffers not lent.
  void Trim();

 private:
  struct Buffer {
    storage::AlignedBuffer memory;
    bool lent = false;
  };
  std::mutex mutex_;
  std::condition_variable returned_;
  std::vector<Buffer> buffers_;  // guarded by mutex_
};

class ActivationSpill {
 public:
  // Most activations one session has spilled at once.
  static constexpr size_t kMaxActivations = 65536;
  // Most transfers (spills and recalls) of one session in flight at once.
  static constexpr size_t kMaxTransfers = 4;

  // `files` may be null (the daemon has no scratch): every Spill is then
  // FAILED_PRECONDITION. `quota.take`/`give` (may be empty: no limit) are
  // charged the scratch bytes (whole blocks); the files' own charge admits
  // them in the storage budget.
  ActivationSpill(std::unique_ptr<JournalSpillFiles> files, JournalQuotaHooks quota);
  ~ActivationSpill();  // Drop(), then the files are unlinked
  ActivationSpill(const ActivationSpill&) = delete;
  ActivationSpill& operator=(const ActivationSpill&) = delete;

  // Starts writing `bytes` (not empty) to the scratch under `key`; `bytes`
  // may be reused once Spill returns. The Future is ready when they are
  // written (OK), or holds the engine's error (the key is then forgotten at
  // the next Spill or Recall of it; the blocks stay charged until Drop).
  // Refused at once (a ready Future), with nothing kept:
  //   INVALID_ARGUMENT    `key` is already spilled, or `bytes` is empty;
  //   RESOURCE_EXHAUSTED  kMaxActivations are spilled, the user's limit
  //                       (max_activation_bytes_per_user), the storage budget
  //                       (max_storage_bytes_per_user, the free space kept),
  //                       or a full device;
  //   FAILED_PRECONDITION the daemon has no scratch.
  Future<void> Spill(uint64_t key, std::span<const std::byte> bytes);

  // Starts reading `key`'s bytes into the start of `out` and forgets the key;
  // the Future holds their length once they are in `out` (which must stay
  // alive until it is ready). A key whose spill is still being written waits
  // for that write first, on the caller's thread (clientlib never sends one:
  // it recalls only what was answered). NOT_FOUND: `key` is not spilled
  // (never, already recalled, or dropped); INVALID_ARGUMENT: `out` is shorter
  // than the activation (the key is kept); DATA_LOSS: what was read back does
  // not match its checksum (file and offset named). Any error but
  // INVALID_ARGUMENT forgets the key.
  Future<uint64_t> Recall(uint64_t key, std::span<std::byte> out);

  struct Dropped {
    uint32_t activations = 0;  // spilled, not recalled
    uint64_t scratch_bytes = 0;
  };
  // Waits for the transfers in flight, forgets every activation, frees the
  // scratch (the files are truncated) and gives its charge back.
  Dropped Drop();
  // Waits for the transfers in flight (their Futures and continuations).
  void WaitForTransfers();

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
    Future<void> written;  // the spill's write
  };

  std::unique_ptr<JournalSpillFiles> files_;
  JournalQuotaHooks quota_;
  std::unordered_map<uint64_t, Entry> entries_;
  uint64_t charged_ = 0;  // taken from the quota (and held by the files' charge), given back at Drop
  // Declared before in_flight_: destroyed after every transfer was waited for.
  std::shared_ptr<BounceBuffers> bounce_ = std::make_shared<BounceBuffers>(kMaxTransfers);
  InFlight in_flight_;  // every transfer started, until Drop
};

}  // namespace fuyou
