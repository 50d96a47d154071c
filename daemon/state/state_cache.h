// StateCache: the DRAM tier of optimizer states, bounded by the daemon's budget.
//
// Every chunk state buffer the daemon holds (being read, updated, written back,
// or just kept for the next step) is an Entry here, so the budget bounds all of
// them together. A pinned entry is in use (by a read, an update or a write-back)
// and is never evicted; unpinned entries are the cache. Entries are keyed by
// (job, chunk); an entry records which extent version its bytes equal.
//
// Eviction follows the access pattern of training, where every chunk is used
// once a step in (nearly) the same order, a cyclic scan that defeats LRU. A
// store tells the cache the predicted order of a name's chunks (SetOrder, each
// step: LearnedOrder's prediction); the cache then keeps the **resident
// prefix**, the longest run of the order's first chunks that all have an entry
// when the step's first use comes (after SetOrder and the read-ahead the store
// starts there), and streams the rest through what the budget leaves (the
// optimal policy for a cyclic scan keeps a fixed subset and streams the
// others; the chunks needed first in the next step are that subset, and the
// read-ahead at a step's end fills it as far as the budget allows). When a use
// needs the room of one of its entries (the others pinned by write-backs),
// the rest stay protected; the prefix is taken anew each step. Unpinned entries are evicted in
// this order (ties: the greater rank, the later next use, first):
//   1. entries of jobs that no session has open (Demote), oldest first;
//   2. used entries not in a prediction (another space, an unknown chunk),
//      most recently released first;
//   3. used entries beyond the resident prefix used this step (since the last
//      SetOrder): their next use is in the next step;
//   4. used entries beyond the resident prefix not used yet this step;
//   5. the resident prefix, its last chunk first;
//   6. last, prefetched entries not used yet, oldest first.
// A prefetch (`loading` Create) evicts less (Belady's rule with the known
// order: an entry needed sooner is never evicted for one needed later): only
// from 1-3, and from 4 an entry of its own name ranked after the chunk it
// reads; never the resident prefix and never a prefetch not used yet. So a
// read-ahead as deep as the budget allows takes only free budget and what is
// being streamed, and what stays resident from step to step does not shrink.
// Fair shares (sessions side by side, daemon/README.md): with two names or
// more holding an order, each name's share is the budget divided by their
// number. A name's predicted entries past its share (taken in rank order,
// pinned ones counted) are, for a Create of another name under its own share,
// evicted before every other predicted entry, by a use or a prefetch alike
// (the resident prefix included); for any other Create, a prefix entry past
// its share goes before the prefixes within theirs (class 5 splits in two).
// With one name ordered there is no share: a job alone keeps the whole budget.
// Write-back completion order does not matter: victims go by rank, not by
// when they were released. Finding a victim walks the unpinned used entries
// (linear in the entries, as the cache is at most a few thousand chunks).
//
// Callers hold entries only through StatePin (RAII, move-only); the entry's
// bookkeeping (pins, eviction lists, the dropped flag) is private to the cache.
//
// Thread-safe. An entry's version, committed flag and load status are guarded
// by the cache's mutex; the bytes belong to whoever holds the pin that loads or
// updates them.
#pragma once

#include <condition_variable>
#include <cstdint>
#include <list>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "storage/aligned_buffer.h"
#include "storage/spare_buffers.h"

namespace fuyou {

class StateCache;

// One pin on a cache entry: while held, the entry's bytes stay in DRAM and are
// not evicted, and they belong to the holder (who loads or updates them).
// Move-only; destroying or Reset() releases the pin (an entry dropped or whose
// load failed is freed at its last release). An empty StatePin holds nothing.
// Must not outlive its cache.
class StatePin {
 public:
  StatePin() = default;
  ~StatePin() { Reset(); }
  StatePin(StatePin&& other) noexcept;
  StatePin& operator=(StatePin&& other) noexcept;
  StatePin(const StatePin&) = delete;
  StatePin& operator=(const StatePin&) = delete;

  explicit operator bool() const { return entry_ != nullptr; }
  // Releases the pin now; the StatePin is then empty.
  void Reset();

  // The entry's buffer (at least the bytes it was created with). Non-empty pins only.
  std::byte* data() const;
  uint64_t size() const;
  uint32_t chunk_id() const;
  // The extent version (0/1) whose contents the bytes hold, or will once loaded.
  uint32_t version() const;
  // False while the bytes are an update not yet committed (the step may abort).
  bool committed() const;
  // The result of the load that filled the bytes (OK for an entry made with its contents).
  absl::Status load_status() const;
  // False when only the states region was loaded (a chunk that stores working
  // weights, read for its update): the bytes after the states are not the
  // extent's weights (see SetContents).
  bool weights_valid() const;
  // True when this pin (from StateCache::Pin) is the first use of bytes a
  // prefetch read from storage: they are in DRAM now, but not because they
  // stayed there (the cache-hit counters tell the two apart).
  bool first_use_of_prefetch() const { return first_use_of_prefetch_; }

 private:
  friend class StateCache;
  struct Entry;
  StatePin(StateCache* cache, std::shared_ptr<Entry> entry) : cache_(cache), entry_(std::move(entry)) {}

  StateCache* cache_ = nullptr;
  std::shared_ptr<Entry> entry_;
  bool first_use_of_prefetch_ = false;
};

class StateCache {
 public:
  explicit StateCache(uint64_t budget_bytes);
  StateCache(const StateCache&) = delete;
  StateCache& operator=(const StateCache&) = delete;

  // The entry for (job, chunk) pinned, waiting while it is loading; an empty
  // pin when absent. The caller checks version(), committed() and load_status().
  // `use` false: a look that does not count as the entry's use (a prefetch not
  // used yet stays one: its first real use still reports first_use_of_prefetch).
  StatePin Pin(const std::string& job, uint32_t chunk_id, bool use = true);

  // A new pinned entry of `bytes` for (job, chunk), replacing an unpinned one;
  // it holds version 0, committed, until SetContents. Evicts unpinned entries to
  // make room (a `loading` entry, a prefetch, evicts only what the prefetch
  // rule above allows: never the resident prefix, an entry needed before it,
  // or another prefetch not used yet). When `wait`, waits (up to `timeout_ms`) for pinned entries to be
  // released; otherwise returns UNAVAILABLE at once. RESOURCE_EXHAUSTED when
  // `bytes` exceeds the budget. `loading` marks the entry as being filled by
  // this pin's holder (see FinishLoad); a loading entry counts as a prefetch.
  // The buffer may be one a dropped entry left (storage::SpareBuffers): its bytes
  // from `filled_bytes` on are zero, as a fresh mapping's, and the bytes before
  // are the caller's to fill (a read's length) before anyone reads them.
  static constexpr int64_t kCreateTimeoutMs = 600000;
  absl::StatusOr<StatePin> Create(const std::string& job, uint32_t chunk_id, uint64_t bytes, bool wait,
                                  bool loading = false, int64_t timeout_ms = kCreateTimeoutMs,
                                  uint64_t filled_bytes = 0);
  // True when (job, chunk) has an entry (loaded or loading); never waits.
  bool Contains(const std::string& job, uint32_t chunk_id) const;
  // True when (job, chunk) has an entry that holds extent `version`, committed,
  // and is loaded without error or still loading (and, when `whole`, whose
  // weights are valid); never waits, pins nothing.
  bool Holds(const std::string& job, uint32_t chunk_id, uint32_t version, bool whole = false) const;

  // Marks the load of a pinned entry finished (wakes those waiting in Pin). A
  // failed load is not kept: the entry is freed at its last release.
  void FinishLoad(const StatePin& pin, absl::Status status);
  // Records what the pinned entry's bytes now are: extent `version`, whether
  // that is committed, and whether the whole extent is there (`weights_valid`
  // false: only its states region, the rest is not the extent's).
  void SetContents(const StatePin& pin, uint32_t version, bool committed, bool weights_valid = true);
  // The update in the entry of (job, chunk) was committed as extent `version`:
  // if the entry holds that version, loaded, it is marked committed. Takes no
  // pin and leaves the eviction order as it is.
  void MarkCommitted(const std::string& job, uint32_t chunk_id, uint32_t version);
  // Drops the entry of (job, chunk); its memory is freed at its last release.
  void Drop(const std::string& job, uint32_t chunk_id);
  // Drops every entry of `job`.
  void DropJob(const std::string& job);
  // The job has no session any more: its entries are evicted before any other.
  void Demote(const std::string& job);
  // The order in which `job`'s chunks are predicted to be used next (the step
  // that starts now, then again each step): ranks the entries for eviction
  // (see above) and starts a new step for "used this step"; the step's first
  // use (Pin with `use`, or a Create not `loading`) takes the resident prefix. Chunks not in it are not
  // predicted; an empty order forgets the name's (its store closed).
  void SetOrder(const std::string& job, const std::vector<uint32_t>& order);
  // The length of the resident prefix of `job`'s order (0 without one). For
  // tests and figures.
  size_t resident_prefix(const std::string& job) const;

  uint64_t bytes_in_use() const;
  uint64_t budget_bytes() const { return budget_bytes_; }

  // Holds: DRAM a session keeps pinned across steps (states not yet durable,
  // see ChunkStore's durability interval). All holds together stay within half
  // the budget, so the other half always serves reads, prefetches and
  // write-backs. TryHold reserves `bytes` when that fits (true), else changes
  // nothing (false); ReleaseHold gives a reservation back. Bookkeeping only:
  // the pinned buffers themselves are counted by Create as usual.
  bool TryHold(uint64_t bytes);
  void ReleaseHold(uint64_t bytes);
  // The bytes reserved by TryHold, all sessions together.
  uint64_t held_bytes() const;

 private:
  friend class StatePin;
  using Entry = StatePin::Entry;
  using Key = std::pair<std::string, uint32_t>;
  // Releases one pin. Unpinned entries become evictable.
  void Unpin(Entry& entry);
  void DropLocked(std::map<Key, std::shared_ptr<Entry>>::iterator it);
  // One name's predicted order (SetOrder).
  struct Order {
    std::unordered_map<uint32_t, uint32_t> rank;  // chunk -> position in `chunks`
    std::vector<uint32_t> chunks;
    size_t prefix = 0;   // the resident prefix: chunks[0, prefix) all had an entry at the step's first use
                         // (those still there are protected until the next SetOrder)
    bool prefix_pending = true;  // SetOrder came, the step's first use not yet
    uint64_t step = 1;   // bumped by each SetOrder; an entry used in it has used_step == step
  };
  // What a Create evicts for: a prefetch of (job, chunk), or a use (null).
  struct Reader {
    const std::string* job = nullptr;
    uint32_t chunk_id = 0;
  };
  // Evicts one unpinned entry (the order above) for `reader`'s Create; for a
  // prefetch only what its rule allows. False when nothing could be evicted.
  bool EvictOneLocked(const Reader& reader, bool prefetch);
  // Each ordered name's fair share of the budget: the budget divided by the
  // names with an order, with two or more; else no limit (UINT64_MAX).
  uint64_t FairShareLocked() const;
  // Bytes of every entry of `job` (pinned ones included).
  uint64_t BytesOfLocked(const std::string& job) const;
  // The rank from which `job`'s predicted entries, taken in rank order, hold
  // more than its fair share (UINT64_MAX: they do not).
  uint64_t ShareEndLocked(const std::string& job) const;
  // The rank of (job, chunk) in its name's order, or null when not predicted.
  const uint32_t* RankLocked(const std::string& job, uint32_t chunk_id) const;
  // The first use of `job`'s entries since SetOrder: takes the resident prefix.
  void StepStartsLocked(const std::string& job);
  // The step count an entry's use is stamped with (Entry::used_step).
  uint64_t StepOfLocked(const std::string& job) const;
  void UnlistLocked(Entry& entry);
  void ListLocked(Entry& entry, std::list<Key>& list);
  // A dropped entry's buffer: kept in spares_, or freed.
  void RecycleLocked(storage::AlignedBuffer buffer);

  const uint64_t budget_bytes_;
  mutable std::mutex mutex_;
  std::condition_variable changed_;
  std::map<Key, std::shared_ptr<Entry>> entries_;
  std::map<std::string, Order> orders_;
  // Unpinned entries, in the order they were released (see eviction above).
  std::list<Key> cold_;
  std::list<Key> used_;
  std::list<Key> prefetched_;
  uint64_t bytes_in_use_ = 0;  // every live buffer, dropped-but-pinned included
  uint64_t held_bytes_ = 0;    // TryHold reservations
  // Buffers of dropped entries, kept for the next Create of their size or
  // less (cut to size: a model's chunks come in a few sizes, weights only,
  // states only, whole extents, modules of different widths). Their bytes are
  // not in bytes_in_use_, but in_use + spares stays within the budget (a Create
  // frees spares before it evicts); none are kept once no entry is.
  storage::SpareBuffers spares_{8};
};

}  // namespace fuyou
