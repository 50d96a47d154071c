// GradJournal: one session's gradient journals of the current step
// (GradReady.journal in offload.proto): per chunk, a copy of the gradients the
// daemon received, so that a redo (a clip, an unscale, one more backward pass)
// needs nothing from a client that freed them.
//
// Placement. A journal's bytes (num_elements x grad dtype size, padded to a
// storage block) live in DRAM when the budget can hold them: a pinned entry of
// the StateCache (so they count against the DRAM budget like states) under a
// StateCache hold (so journals and the durability interval's holds together
// keep to half the budget, and reads and write-backs always have the other
// half). Beyond that, the journal is spilled to the session's scratch files
// (JournalScratch) with an XXH3-64 checksum that every read-back verifies
// (DATA_LOSS on mismatch); an access then reads it into a transient cache entry.
// Every journal's bytes also count against the user's journal quota, and a
// spilled one's blocks against the storage budget (the scratch files' charge,
// journal_scratch.h: max_storage_bytes_per_user and the free space kept): a
// journal neither DRAM nor the budget admits is RESOURCE_EXHAUSTED, nothing kept.
//
// Lifetime. Journals belong to the step: Clear() (EndStep, AbortStep, the end
// of the session) drops them all, gives the DRAM, the holds and the quota back
// and truncates the scratch files. Nothing is ever committed.
//
// Not thread-safe: the session serialises its calls.
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "journal/journal_scratch.h"
#include "state/state_cache.h"

namespace fuyou {

// How a journal's bytes are charged to its user ([limits]
// max_journal_bytes_per_user): `take` reserves (RESOURCE_EXHAUSTED when over),
// `give` returns. Either may be empty (no quota).
struct JournalQuotaHooks {
  std::function<absl::Status(uint64_t)> take;
  std::function<void(uint64_t)> give;
};

struct JournalOptions {
  // Most bytes of this session's journals kept in DRAM (besides the cache's
  // own half-budget bound on holds). Beyond: spilled. A test knob.
  uint64_t max_dram_bytes = UINT64_MAX;
};

// An open journal: its bytes in DRAM while the access is held (the chunk's
// DRAM journal itself, or a transient copy of a spilled one). Move-only.
class JournalAccess {
 public:
  JournalAccess() = default;
  JournalAccess(JournalAccess&&) = default;
  JournalAccess& operator=(JournalAccess&&) = default;

  std::byte* data() const { return data_; }
  uint32_t chunk_id() const { return chunk_id_; }
  // True when the journal lives in the scratch files (Save writes it back).
  bool spilled() const { return transient_.operator bool(); }

 private:
  friend class GradJournal;
  uint32_t chunk_id_ = 0;
  std::byte* data_ = nullptr;
  StatePin transient_;  // a spilled journal's bytes while accessed
};

class GradJournal {
 public:
  // `cache_key` names this session's entries in `cache` (must not be a job
  // name). `spill` may be null (then a journal beyond DRAM is RESOURCE_EXHAUSTED).
  GradJournal(StateCache& cache, std::string cache_key, std::unique_ptr<JournalSpillFiles> spill,
              JournalQuotaHooks quota, JournalOptions options = {});
  ~GradJournal();  // Clear()
  GradJournal(const GradJournal&) = delete;
  GradJournal& operator=(const GradJournal&) = delete;

  // True when `chunk_id` has a journal of this step whose bytes are valid.
  bool Has(uint32_t chunk_id) const;

  // A journal-to-be of `bytes` for `chunk_id` (JOURNAL_USE_KEEP), replacing the
  // chunk's journal (its place is reused). Its contents are unspecified until
  // the caller fills them and calls Save. RESOURCE_EXHAUSTED (the user's
  // quota; DRAM budget and scratch both unable to hold it) or the scratch's
  // I/O errors; on any error the chunk has no journal.
  absl::StatusOr<JournalAccess> Begin(uint32_t chunk_id, uint64_t bytes);
  // The chunk's journal (JOURNAL_USE_ADD, _REPLAY): FAILED_PRECONDITION when it
  // has none; a spilled one is read back and verified (DATA_LOSS when its
  // checksum does not match; the journal is then dropped).
  absl::StatusOr<JournalAccess> Open(uint32_t chunk_id);
  // Makes the access's bytes the chunk's journal; `changed` false: they are as
  // Open found them (nothing is written). A spilled journal is checksummed and
  // written back; on failure the chunk has no journal any more.
  absl::Status Save(JournalAccess& access, bool changed = true);

  // Drops every journal (the step ended).
  void Clear();

  // Bytes of the journals now: all, and those spilled.
  uint64_t bytes() const;
  uint64_t spilled_bytes() const;
  // Bytes written to the scratch files since the session began.
  uint64_t spill_written_bytes() const { return spill_written_bytes_; }
  // The scratch files (null without scratch); for tests.
  const JournalSpillFiles* spill_files() const { return spill_.get(); }

 private:
  struct Entry {
    uint64_t bytes = 0;          // journal bytes (quota charge)
    uint64_t padded = 0;         // bytes rounded up to a storage block
    bool valid = false;          // Save succeeded since Begin
    StatePin dram;               // the bytes, when in DRAM
    bool held = false;           // a StateCache hold of `padded` goes with `dram`
    bool spilled = false;        // else in `dram`
    JournalSpillFiles::Location location;  // when spilled
    uint64_t checksum = 0;       // XXH3-64 of the `bytes` first bytes, when spilled
  };
  // Gives back what `entry` holds (DRAM, hold, quota).
  void Release(uint32_t chunk_id, Entry& entry);
  // A transient pinned buffer for a spilled journal of `padded` bytes.
  absl::StatusOr<StatePin> Transient(uint32_t chunk_id, uint64_t padded);

  StateCache& cache_;
  const std::string cache_key_;
  std::unique_ptr<JournalSpillFiles> spill_;
  JournalQuotaHooks quota_;
  const JournalOptions options_;
  std::map<uint32_t, Entry> entries_;
  uint64_t dram_bytes_ = 0;
  uint64_t spill_written_bytes_ = 0;
};

}  // namespace fuyou
