#include "state/state_cache.h"

#include <algorithm>
#include <chrono>
#include <optional>

#include "fmt/format.h"

namespace fuyou {

// The cache's record of one chunk's buffer. Every field but the buffer's bytes
// is guarded by the cache's mutex.
struct StatePin::Entry {
  std::string job;
  uint32_t chunk_id = 0;
  storage::AlignedBuffer buffer;
  uint32_t version = 0;  // extent version the bytes hold, or will once loaded
  bool loading = false;  // a read fills the buffer; load_status is its result afterwards
  absl::Status load_status;
  bool uncommitted = false;  // the bytes are an update not yet committed
  bool weights_valid = true;  // false: only the states region was loaded
  int pins = 0;
  bool discarded = false;  // dropped from the map; freed at the last unpin
  // True once the entry has been used (pinned by a reader, or created with its
  // contents); false for a prefetch not yet used.
  bool used = true;
  uint64_t used_step = 0;  // the Order::step of its last use (0: none known)
  std::list<std::pair<std::string, uint32_t>>* eviction_list = nullptr;  // null while pinned
  std::list<std::pair<std::string, uint32_t>>::iterator eviction_position;
};

StatePin::StatePin(StatePin&& other) noexcept
    : cache_(other.cache_), entry_(std::move(other.entry_)), first_use_of_prefetch_(other.first_use_of_prefetch_) {
  other.cache_ = nullptr;
}

StatePin& StatePin::operator=(StatePin&& other) noexcept {
  if (this != &other) {
    Reset();
    cache_ = other.cache_;
    entry_ = std::move(other.entry_);
    first_use_of_prefetch_ = other.first_use_of_prefetch_;
    other.cache_ = nullptr;
  }
  return *this;
}

void StatePin::Reset() {
  if (entry_ == nullptr) return;
  cache_->Unpin(*entry_);
  entry_.reset();
  cache_ = nullptr;
}

std::byte* StatePin::data() const { return entry_->buffer.data(); }
uint64_t StatePin::size() const { return entry_->buffer.size(); }
uint32_t StatePin::chunk_id() const { return entry_->chunk_id; }

uint32_t StatePin::version() const {
  std::lock_guard lock(cache_->mutex_);
  return entry_->version;
}

bool StatePin::committed() const {
  std::lock_guard lock(cache_->mutex_);
  return !entry_->uncommitted;
}

bool StatePin::weights_valid() const {
  std::lock_guard lock(cache_->mutex_);
  return entry_->weights_valid;
}

absl::Status StatePin::load_status() const {
  std::lock_guard lock(cache_->mutex_);
  return entry_->load_status;
}

StateCache::StateCache(uint64_t budget_bytes) : budget_bytes_(budget_bytes) {}

StatePin StateCache::Pin(const std::string& job, uint32_t chunk_id, bool use) {
  std::unique_lock lock(mutex_);
  auto it = entries_.find({job, chunk_id});
  if (it == entries_.end()) return StatePin();
  std::shared_ptr<Entry> entry = it->second;
  UnlistLocked(*entry);
  const bool first_use_of_prefetch = use && !entry->used;
  if (use) {
    StepStartsLocked(job);
    entry->used = true;
    entry->used_step = StepOfLocked(job);
  }
  ++entry->pins;
  changed_.wait(lock, [&] { return !entry->loading; });
  StatePin pin(this, std::move(entry));
  pin.first_use_of_prefetch_ = first_use_of_prefetch;
  return pin;
}

absl::StatusOr<StatePin> StateCache::Create(const std::string& job, uint32_t chunk_id, uint64_t bytes, bool wait,
                                            bool loading, int64_t timeout_ms, uint64_t filled_bytes) {
  if (bytes > budget_bytes_) {
    return absl::ResourceExhaustedError(fmt::format(
        "chunk {} of job '{}' needs {} bytes of states, more than the daemon's whole DRAM budget of {} bytes",
        chunk_id, job, bytes, budget_bytes_));
  }
  std::unique_lock lock(mutex_);
  if (auto it = entries_.find({job, chunk_id}); it != entries_.end()) DropLocked(it);
  if (!loading) StepStartsLocked(job);
  const Reader prefetch{.job = &job, .chunk_id = chunk_id};  // the reader, a prefetch when `loading`
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::milliseconds(timeout_ms);
  const size_t size = storage::AlignedBuffer::RoundedSize(bytes);
  // Room first. The spares are memory no entry uses, so only the entries count
  // here (a spare is never a reason to evict); what is left of them past the
  // budget is freed below.
  while (bytes_in_use_ + bytes > budget_bytes_) {
    // A prefetch evicts only entries needed after it (never another prefetch
    // not used yet: that one was read for a use that comes sooner, and
    // evicting it only reads it twice) and never the resident prefix. The
    // victim's buffer becomes a spare.
    if (EvictOneLocked(prefetch, loading)) continue;
    if (!wait) return absl::UnavailableError("no DRAM budget free for a prefetch");
    if (changed_.wait_until(lock, deadline) == std::cv_status::timeout) {
      return absl::DeadlineExceededError(fmt::format(
          "waited {} ms for {} bytes of the DRAM budget for chunk {} of job '{}'", timeout_ms, bytes, chunk_id, job));
    }
  }
  // Cut from a spare when one is large enough: its pages are not faulted in anew.
  std::optional<storage::AlignedBuffer> reused = spares_.Take(size);
  const uint64_t taking = reused ? reused->size() : bytes;
  while (bytes_in_use_ + taking + spares_.bytes() > budget_bytes_ && spares_.FreeOne()) {
  }
  storage::AlignedBuffer buffer;
  if (reused) {
    buffer = *std::move(reused);
    bytes_in_use_ += buffer.size();
    // Not yet published: zeroed outside the lock, as a fresh mapping's pages would be.
    lock.unlock();
    storage::SpareBuffers::ZeroFrom(buffer, filled_bytes);
    lock.lock();
  } else {
    bytes_in_use_ += bytes;  // reserved before the allocation, released on failure
    lock.unlock();
    auto allocated = storage::AlignedBuffer::Allocate(bytes);
    lock.lock();
    if (!allocated.ok()) {
      bytes_in_use_ -= bytes;
      changed_.notify_all();
      return allocated.status();
    }
    buffer = *std::move(allocated);
    // Account for the rounded size the buffer really takes.
    bytes_in_use_ += buffer.size() - bytes;
  }
  auto entry = std::make_shared<Entry>();
  entry->job = job;
  entry->chunk_id = chunk_id;
  entry->buffer = std::move(buffer);
  entry->pins = 1;
  entry->loading = loading;
  entry->used = !loading;
  if (entry->used) entry->used_step = StepOfLocked(job);
  if (auto it = entries_.find({job, chunk_id}); it != entries_.end()) DropLocked(it);
  entries_[{job, chunk_id}] = entry;
  return StatePin(this, std::move(entry));
}

void StateCache::FinishLoad(const StatePin& pin, absl::Status status) {
  std::lock_guard lock(mutex_);
  pin.entry_->loading = false;
  pin.entry_->load_status = std::move(status);
  changed_.notify_all();
}

void StateCache::SetContents(const StatePin& pin, uint32_t version, bool committed, bool weights_valid) {
  std::lock_guard lock(mutex_);
  pin.entry_->version = version;
  pin.entry_->uncommitted = !committed;
  pin.entry_->weights_valid = weights_valid;
}

void StateCache::MarkCommitted(const std::string& job, uint32_t chunk_id, uint32_t version) {
  std::lock_guard lock(mutex_);
  auto it = entries_.find({job, chunk_id});
  if (it == entries_.end()) return;
  Entry& entry = *it->second;
  if (!entry.loading && entry.load_status.ok() && entry.version == version) entry.uncommitted = false;
}

void StateCache::Unpin(Entry& entry) {
  std::lock_guard lock(mutex_);
  if (--entry.pins > 0) return;
  if (entry.discarded || !entry.load_status.ok()) {
    if (!entry.discarded) {
      entries_.erase({entry.job, entry.chunk_id});
      entry.discarded = true;
    }
    bytes_in_use_ -= entry.buffer.size();
    RecycleLocked(std::move(entry.buffer));
  } else {
    ListLocked(entry, entry.used ? used_ : prefetched_);
  }
  changed_.notify_all();
}

void StateCache::DropLocked(std::map<Key, std::shared_ptr<Entry>>::iterator it) {
  std::shared_ptr<Entry> entry = it->second;
  entries_.erase(it);
  entry->discarded = true;
  UnlistLocked(*entry);
  if (entry->pins == 0) {
    bytes_in_use_ -= entry->buffer.size();
    RecycleLocked(std::move(entry->buffer));
  }
  changed_.notify_all();
}

void StateCache::RecycleLocked(storage::AlignedBuffer buffer) {
  spares_.Put(std::move(buffer));
  if (entries_.empty()) spares_.Clear();  // nothing cached: the memory goes back
}

void StateCache::UnlistLocked(Entry& entry) {
  if (entry.eviction_list == nullptr) return;
  entry.eviction_list->erase(entry.eviction_position);
  entry.eviction_list = nullptr;
}

void StateCache::ListLocked(Entry& entry, std::list<Key>& list) {
  UnlistLocked(entry);
  list.push_back({entry.job, entry.chunk_id});
  entry.eviction_list = &list;
  entry.eviction_position = std::prev(list.end());
}

namespace {

// How readily an unpinned used entry goes (the classes 2-5 of the header's
// eviction order): the greater, the sooner.
// With fair shares (two names or more ordered, FairShareLocked): kOverShare, a
// resident-prefix entry past its name's share; kTheirsPastShare, an entry
// past the share of a name other than the reader's, when the reader's name is
// under its own.
enum class Standing {
  kPrefix = 1,
  kOverShare = 2,
  kStreamedLater = 3,
  kStreamedDone = 4,
  kTheirsPastShare = 5,
  kUnpredicted = 6
};

}  // namespace

const uint32_t* StateCache::RankLocked(const std::string& job, uint32_t chunk_id) const {
  auto order = orders_.find(job);
  if (order == orders_.end()) return nullptr;
  auto rank = order->second.rank.find(chunk_id);
  return rank == order->second.rank.end() ? nullptr : &rank->second;
}

uint64_t StateCache::StepOfLocked(const std::string& job) const {
  auto order = orders_.find(job);
  return order == orders_.end() ? 0 : order->second.step;
}

uint64_t StateCache::FairShareLocked() const {
  return orders_.size() < 2 ? UINT64_MAX : budget_bytes_ / orders_.size();
}

uint64_t StateCache::BytesOfLocked(const std::string& job) const {
  uint64_t bytes = 0;
  for (auto it = entries_.lower_bound({job, 0}); it != entries_.end() && it->first.first == job; ++it) {
    bytes += it->second->buffer.size();
  }
  return bytes;
}

uint64_t StateCache::ShareEndLocked(const std::string& job) const {
  const uint64_t share = FairShareLocked();
  std::vector<std::pair<uint32_t, uint64_t>> ranked;  // (rank, bytes) of the name's predicted entries
  for (auto it = entries_.lower_bound({job, 0}); it != entries_.end() && it->first.first == job; ++it) {
    if (const uint32_t* rank = RankLocked(job, it->first.second)) ranked.emplace_back(*rank, it->second->buffer.size());
  }
  std::sort(ranked.begin(), ranked.end());
  uint64_t bytes = 0;
  for (const auto& [rank, size] : ranked) {
    bytes += size;
    if (bytes > share) return rank;
  }
  return UINT64_MAX;
}

bool StateCache::EvictOneLocked(const Reader& reader, bool prefetch) {
  if (!cold_.empty()) {
    DropLocked(entries_.find(cold_.front()));
    return true;
  }
  const uint32_t* prefetch_rank = prefetch ? RankLocked(*reader.job, reader.chunk_id) : nullptr;
  // Fair shares, with two names or more ordered: where each name's share ends
  // (computed at its first entry met), and whether the reader's own name
  // (ordered) is under its share.
  const bool shared = orders_.size() >= 2;
  std::map<std::string_view, uint64_t> share_end;
  const bool reader_under_share =
      shared && orders_.count(*reader.job) != 0 && BytesOfLocked(*reader.job) < FairShareLocked();
  // The best victim so far: its standing, then its rank (or, unpredicted, its
  // place in used_: the most recently released wins).
  const Key* victim = nullptr;
  std::pair<int, uint64_t> best{0, 0};
  uint64_t place = 0;
  for (const Key& key : used_) {
    ++place;
    const Entry& entry = *entries_.find(key)->second;
    const uint32_t* rank = RankLocked(key.first, key.second);
    Standing standing;
    if (rank == nullptr) {
      standing = Standing::kUnpredicted;
    } else if (*rank < orders_.find(key.first)->second.prefix) {
      standing = Standing::kPrefix;
    } else if (entry.used_step == StepOfLocked(key.first)) {
      standing = Standing::kStreamedDone;
    } else {
      standing = Standing::kStreamedLater;
    }
    bool over_share = false;
    if (shared && rank != nullptr) {
      auto end = share_end.find(key.first);
      if (end == share_end.end()) end = share_end.emplace(key.first, ShareEndLocked(key.first)).first;
      over_share = *rank >= end->second;
    }
    if (over_share && reader_under_share && key.first != *reader.job) {
      standing = Standing::kTheirsPastShare;  // a name under its share takes it first
    } else if (over_share && standing == Standing::kPrefix) {
      standing = Standing::kOverShare;  // before any prefix within its share
    }
    if (prefetch) {
      // Belady's rule with the known order: only what is needed after the
      // chunk being read (and never the resident prefix); but a name under its
      // fair share takes what another name holds past its own.
      if (standing == Standing::kPrefix || standing == Standing::kOverShare) continue;
      if (standing == Standing::kStreamedLater &&
          (prefetch_rank == nullptr || key.first != *reader.job || *rank <= *prefetch_rank)) {
        continue;
      }
    }
    const std::pair<int, uint64_t> score{static_cast<int>(standing), rank == nullptr ? place : *rank};
    if (score > best) {
      best = score;
      victim = &key;
    }
  }
  if (victim == nullptr && !prefetch && !prefetched_.empty()) victim = &prefetched_.front();
  if (victim == nullptr) return false;
  DropLocked(entries_.find(*victim));
  return true;
}

void StateCache::SetOrder(const std::string& job, const std::vector<uint32_t>& order) {
  std::lock_guard lock(mutex_);
  if (order.empty()) {
    orders_.erase(job);
    return;
  }
  Order& o = orders_[job];
  ++o.step;
  o.chunks = order;
  o.rank.clear();
  for (uint32_t i = 0; i < order.size(); ++i) o.rank.emplace(order[i], i);  // a repeated chunk keeps its first
  o.prefix = 0;  // taken at the step's first use (StepStartsLocked)
  o.prefix_pending = true;
}

void StateCache::StepStartsLocked(const std::string& job) {
  auto order = orders_.find(job);
  if (order == orders_.end() || !order->second.prefix_pending) return;
  Order& o = order->second;
  o.prefix_pending = false;
  while (o.prefix < o.chunks.size() && entries_.count({job, o.chunks[o.prefix]}) != 0) ++o.prefix;
}

size_t StateCache::resident_prefix(const std::string& job) const {
  std::lock_guard lock(mutex_);
  auto order = orders_.find(job);
  return order == orders_.end() ? 0 : order->second.prefix;
}

void StateCache::Demote(const std::string& job) {
  std::lock_guard lock(mutex_);
  for (auto it = entries_.lower_bound({job, 0}); it != entries_.end() && it->first.first == job; ++it) {
    if (it->second->eviction_list != nullptr) ListLocked(*it->second, cold_);
  }
}

void StateCache::Drop(const std::string& job, uint32_t chunk_id) {
  std::lock_guard lock(mutex_);
  if (auto it = entries_.find({job, chunk_id}); it != entries_.end()) DropLocked(it);
}

void StateCache::DropJob(const std::string& job) {
  std::lock_guard lock(mutex_);
  for (auto it = entries_.lower_bound({job, 0}); it != entries_.end() && it->first.first == job;) {
    DropLocked(it++);
  }
}

bool StateCache::Contains(const std::string& job, uint32_t chunk_id) const {
  std::lock_guard lock(mutex_);
  return entries_.count({job, chunk_id}) != 0;
}

bool StateCache::Holds(const std::string& job, uint32_t chunk_id, uint32_t version, bool whole) const {
  std::lock_guard lock(mutex_);
  auto it = entries_.find({job, chunk_id});
  if (it == entries_.end()) return false;
  const Entry& entry = *it->second;
  return entry.version == version && !entry.uncommitted && (entry.loading || entry.load_status.ok()) &&
         (!whole || entry.weights_valid);
}

bool StateCache::TryHold(uint64_t bytes) {
  std::lock_guard lock(mutex_);
  if (bytes > budget_bytes_ / 2 || held_bytes_ > budget_bytes_ / 2 - bytes) return false;
  held_bytes_ += bytes;
  return true;
}

uint64_t StateCache::held_bytes() const {
  std::lock_guard lock(mutex_);
  return held_bytes_;
}

void StateCache::ReleaseHold(uint64_t bytes) {
  std::lock_guard lock(mutex_);
  held_bytes_ -= std::min(bytes, held_bytes_);
}

uint64_t StateCache::bytes_in_use() const {
  std::lock_guard lock(mutex_);
  return bytes_in_use_;
}

}  // namespace fuyou
