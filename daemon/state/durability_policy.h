// DurabilityPolicy: which steps are made durable, and the states of the others.
//
// [durability] commit_every_steps N, commit_every_seconds (DurabilityInterval).
// With N = 1 every step is durable: its commit writes the manifest. With N > 1
// a step is either durable (every Nth, or once the seconds passed) or
// acknowledged only: its updated states stay pinned in DRAM ("pending"), not
// written, and the manifest (the durable step) is not touched; a crash loses at
// most the N-1 acknowledged steps after the last durable one. A chunk's
// committed extent holds the durable states and is never written before the
// next durable commit, which writes each pending chunk's states to its shadow
// extent (WritePending) and flips it. A step that updates a pending chunk first
// copies its acknowledged states (TakeUndo) so that a redo or a roll-back
// returns to them (Restore).
//
// Pending states are never evicted, so the interval applies only while twice
// the job's states fit in half the DRAM budget (StateCache::TryHold, held from
// the first acknowledged step until the next durable commit); otherwise every
// step is durable, as with N = 1.
//
// Not thread-safe (the store's calls are serialised).
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <map>
#include <vector>

#include "absl/status/statusor.h"
#include "jobs/job_edit.h"
#include "state/store_context.h"

namespace fuyou {

class DurabilityPolicy {
 public:
  DurabilityPolicy(StoreContext& context, DurabilityInterval interval);
  // Clear(): the hold is given back.
  ~DurabilityPolicy() { Clear(); }
  DurabilityPolicy(const DurabilityPolicy&) = delete;
  DurabilityPolicy& operator=(const DurabilityPolicy&) = delete;

  // ---- The step.
  // At each update: the step's first decides whether the step is durable.
  void UpdateStarting();
  // Whether the running step commits durably (decided at its first update).
  bool step_durable() const { return step_durable_; }
  // The step was committed (durably or not) or rolled back.
  void StepEnded() { step_begun_ = false; }

  // ---- Pending chunks: acknowledged states not yet durable, pinned in DRAM.
  bool IsPending(uint32_t chunk_id) const { return pending_.count(chunk_id) != 0; }
  // The pending states of `chunk_id`, or null.
  const StatePin* Pending(uint32_t chunk_id) const;
  bool HasPending() const { return !pending_.empty(); }
  // True when some acknowledged step is not durable yet.
  bool HasAcknowledged() const;
  // A copy of the pending chunk's acknowledged states `states` (its pinned
  // entry, about to be updated) in an undo entry; an empty pin when the chunk
  // is not pending. The error of the cache when it cannot make the copy.
  absl::StatusOr<StatePin> TakeUndo(uint32_t chunk_id, const StatePin& states);
  // Gives the pending chunk `chunk_id` its acknowledged states back from
  // `undo` (a roll-back of its update); drops the undo entry either way.
  // False (nothing restored) when the chunk is not pending.
  bool Restore(uint32_t chunk_id, StatePin& undo);
  // Drops the undo entry `undo` of `chunk_id`.
  void DropUndo(uint32_t chunk_id, StatePin& undo);
  // A step acknowledged only: `states` (marked committed as the chunk's shadow
  // version) become the chunk's pending states.
  void Keep(uint32_t chunk_id, StatePin states);
  // One more step acknowledged and not durable.
  void Acknowledged() { ++steps_since_durable_; }

  // ---- The durable commit.
  // Writes the states of every pending chunk that `skip` does not name to its
  // shadow extent (synchronously), recording each in `edit` and in `changed`.
  // The I/O error (naming the chunk and `step`) on a failed write; `edit` then
  // holds what was written before it.
  absl::Status WritePending(JobEdit& edit, int64_t step, const std::function<bool(uint32_t)>& skip,
                            std::vector<uint32_t>& changed);
  // The acknowledged steps are durable now: the pending states become
  // committed entries the cache may evict, and the hold is given back.
  void Durable();
  // Gives back the DRAM hold (the job's size may change, or the store closes).
  void ReleaseHold();
  // Forgets the pending states and gives back the hold (the store closes).
  void Clear();

 private:
  StoreContext& context_;
  const DurabilityInterval interval_;
  std::map<uint32_t, StatePin> pending_;
  uint32_t steps_since_durable_ = 0;
  std::chrono::steady_clock::time_point last_durable_;
  bool step_begun_ = false;    // an update started in this step
  bool step_durable_ = true;   // this step commits durably
  uint64_t held_bytes_ = 0;    // StateCache::TryHold reservation
};

}  // namespace fuyou
