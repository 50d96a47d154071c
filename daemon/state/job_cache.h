// JobCache: one job's view of the StateCache, its entries named by CacheSpace.
//
// A job keeps three kinds of entries in the DRAM tier, one space each:
//   kStates   a chunk's states (committed, staged, or pending: see
//             DurabilityPolicy), as StateCache has always held them;
//   kUndo     a copy of a pending chunk's acknowledged states, taken before the
//             running step updates it (DurabilityPolicy::TakeUndo);
//   kWeights  weights-only entries: the weights region of a chunk's committed
//             extent (version = that extent's), read by FetchWeights or its
//             read-ahead, dropped whenever the committed extent changes.
// The cache itself knows entries by (name, chunk); the names are made here and
// nowhere else. The pins are StateCache's own (StatePin, RAII).
//
// Thread-safe as StateCache is; the JobCache itself is immutable.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "state/state_cache.h"

namespace fuyou {

enum class CacheSpace { kStates, kUndo, kWeights };

class JobCache {
 public:
  // `job_key`: Job::key(), the cache's name of the job's states.
  JobCache(StateCache& cache, std::string job_key);

  StatePin Pin(CacheSpace space, uint32_t chunk_id, bool use = true) const {
    return cache_.Pin(Name(space), chunk_id, use);
  }
  // `filled_bytes`: see StateCache::Create (a read's length; 0: all zero).
  absl::StatusOr<StatePin> Create(CacheSpace space, uint32_t chunk_id, uint64_t bytes, bool wait,
                                  bool loading = false, uint64_t filled_bytes = 0) const {
    return cache_.Create(Name(space), chunk_id, bytes, wait, loading, StateCache::kCreateTimeoutMs, filled_bytes);
  }
  bool Contains(CacheSpace space, uint32_t chunk_id) const { return cache_.Contains(Name(space), chunk_id); }
  bool Holds(CacheSpace space, uint32_t chunk_id, uint32_t version, bool whole = false) const {
    return cache_.Holds(Name(space), chunk_id, version, whole);
  }
  void MarkCommitted(uint32_t chunk_id, uint32_t version) const {
    cache_.MarkCommitted(Name(CacheSpace::kStates), chunk_id, version);
  }
  void Drop(CacheSpace space, uint32_t chunk_id) const { cache_.Drop(Name(space), chunk_id); }
  // Drops every entry of `space`.
  void DropAll(CacheSpace space) const { cache_.DropJob(Name(space)); }
  // The job's states go first when the cache evicts (no session has it open).
  void Demote() const { cache_.Demote(Name(CacheSpace::kStates)); }
  // The predicted order of the states' next uses (StateCache::SetOrder): a new
  // step starts for the cache's eviction ranks.
  void SetStatesOrder(const std::vector<uint32_t>& order) const {
    cache_.SetOrder(Name(CacheSpace::kStates), order);
  }

  // The cache itself: pins' contents, loads, holds.
  StateCache& cache() const { return cache_; }

 private:
  const std::string& Name(CacheSpace space) const;

  StateCache& cache_;
  const std::string states_name_;   // Job::key()
  const std::string undo_name_;     // <key>#undo
  const std::string weights_name_;  // <key>#weights
};

}  // namespace fuyou
