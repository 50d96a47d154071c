// StateCache: the DRAM tier of optimizer states, bounded by the daemon's budget.
//
// Every chunk state buffer the daemon holds (being read, updated, written back,
// or just kept for the next step) is an Entry here, so the budget bounds all of
// them together. A pinned entry is in use (by a read, an update or a write-back)
// and is never evicted; unpinned entries are the cache. Entries are keyed by
// (job, chunk); an entry records which extent version its bytes equal.
//
// Eviction follows the access pattern of training, where every chunk is used
// once a step in (nearly) the same order, a cyclic scan that defeats LRU:
//   1. first, entries of jobs that no session has open (Demote), oldest first;
//   2. then used entries, most recently released first: in a cyclic scan the
//      chunk just updated is the one needed furthest in the future, so the
//      chunks that fit in the budget beyond the pipeline window stay resident
//      step after step instead of being flushed by the scan;
//   3. last, prefetched entries not used yet, oldest first.
//
// Thread-safe. Entry fields other than the buffer's bytes are guarded by the
// cache's mutex; the bytes belong to whoever holds the pin that loads or
// updates them.
#pragma once

#include <condition_variable>
#include <cstdint>
#include <list>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <utility>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "storage/aligned_buffer.h"

namespace fuyou {

class DaemonStats;

struct CacheEntry {
  std::string job;
  uint32_t chunk_id = 0;
  storage::AlignedBuffer buffer;
  // Extent version (0/1) whose contents the buffer holds, or will once loaded.
  uint32_t version = 0;
  // True while a read fills the buffer; `load_status` is its result afterwards.
  bool loading = false;
  absl::Status load_status;
  // True when the bytes are an update not yet committed (the step may abort).
  bool uncommitted = false;

  // Guarded by the cache mutex.
  int pins = 0;
  bool discarded = false;  // dropped from the map; freed at the last unpin
  // True once the entry has been used (pinned by a reader, or created with its
  // contents); false for a prefetch not yet used.
  bool used = true;
  std::list<std::pair<std::string, uint32_t>>* eviction_list = nullptr;  // null while pinned
  std::list<std::pair<std::string, uint32_t>>::iterator eviction_position;
};

using CacheEntryPtr = std::shared_ptr<CacheEntry>;

class StateCache {
 public:
  explicit StateCache(uint64_t budget_bytes);
  StateCache(const StateCache&) = delete;
  StateCache& operator=(const StateCache&) = delete;

  // The entry for (job, chunk) pinned, waiting while it is loading; nullptr when
  // absent. The caller checks version, uncommitted and load_status.
  CacheEntryPtr Pin(const std::string& job, uint32_t chunk_id);

  // A new pinned entry of `bytes` for (job, chunk), replacing an unpinned one.
  // Evicts unpinned entries to make room. When `wait`, waits (up to `timeout_ms`)
  // for pinned entries to be released; otherwise returns UNAVAILABLE at once.
  // RESOURCE_EXHAUSTED when `bytes` exceeds the budget.
  // `loading` marks the entry as being filled (see FinishLoad).
  absl::StatusOr<CacheEntryPtr> Create(const std::string& job, uint32_t chunk_id, uint64_t bytes, bool wait,
                                       bool loading = false, int64_t timeout_ms = 600000);
  // True when (job, chunk) has an entry (loaded or loading); never waits.
  bool Contains(const std::string& job, uint32_t chunk_id) const;

  // Marks a load finished (wakes those waiting in Pin).
  void FinishLoad(const CacheEntryPtr& entry, absl::Status status);
  // Releases one pin. Unpinned entries become evictable.
  void Unpin(const CacheEntryPtr& entry);
  // Drops the entry of (job, chunk); its memory is freed at its last unpin.
  void Drop(const std::string& job, uint32_t chunk_id);
  // Drops every entry of `job`.
  void DropJob(const std::string& job);
  // The job has no session any more: its entries are evicted before any other.
  void Demote(const std::string& job);
  // Marks an entry's bytes as committed.
  void MarkCommitted(const CacheEntryPtr& entry);

  uint64_t bytes_in_use() const;
  uint64_t budget_bytes() const { return budget_bytes_; }

 private:
  using Key = std::pair<std::string, uint32_t>;
  void DropLocked(std::map<Key, CacheEntryPtr>::iterator it);
  bool EvictOneLocked();
  void UnlistLocked(CacheEntry& entry);
  void ListLocked(CacheEntry& entry, std::list<Key>& list);

  const uint64_t budget_bytes_;
  mutable std::mutex mutex_;
  std::condition_variable changed_;
  std::map<Key, CacheEntryPtr> entries_;
  // Unpinned entries, in the order they were released (see eviction above).
  std::list<Key> cold_;
  std::list<Key> used_;
  std::list<Key> prefetched_;
  uint64_t bytes_in_use_ = 0;  // every live buffer, dropped-but-pinned included
};

}  // namespace fuyou
