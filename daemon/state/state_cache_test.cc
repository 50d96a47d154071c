#include "state/state_cache.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <thread>
#include <vector>

namespace fuyou {
namespace {

constexpr uint64_t kMiB = 1 << 20;

TEST(StateCache, KeepsEntriesAndCountsBytes) {
  StateCache cache(8 * kMiB);
  auto entry = cache.Create("job", 1, 2 * kMiB, /*wait=*/true);
  ASSERT_TRUE(entry.ok());
  EXPECT_EQ(cache.bytes_in_use(), 2 * kMiB);
  const std::byte* bytes = entry->data();
  entry->Reset();
  EXPECT_TRUE(cache.Contains("job", 1));
  StatePin again = cache.Pin("job", 1);
  ASSERT_TRUE(again);
  EXPECT_EQ(again.data(), bytes);  // the same entry, kept
  again.Reset();
}

TEST(StateCache, AnEvictedBuffersMappingServesTheNextCreateOfItsSizeZeroBeyondTheRead) {
  StateCache cache(4 * kMiB);
  std::vector<const std::byte*> mappings;
  for (uint32_t chunk : {1u, 2u}) {
    auto entry = cache.Create("job", chunk, 2 * kMiB, /*wait=*/true);
    ASSERT_TRUE(entry.ok());
    std::memset(entry->data(), 0xab, entry->size());  // another job's bytes, say
    mappings.push_back(entry->data());
  }
  // One of them is evicted for chunk 3: its mapping is reused, not unmapped and mapped anew.
  auto third = cache.Create("job", 3, 2 * kMiB, /*wait=*/true, /*loading=*/false, StateCache::kCreateTimeoutMs,
                            /*filled_bytes=*/kMiB);
  ASSERT_TRUE(third.ok());
  const uint32_t kept = cache.Contains("job", 1) ? 1 : 2;
  EXPECT_FALSE(cache.Contains("job", 3 - kept));
  EXPECT_EQ(third->data(), mappings[2 - kept]);
  EXPECT_TRUE(std::all_of(third->data(), third->data() + kMiB, [](std::byte b) { return b == std::byte{0xab}; }))
      << "the part the caller fills is not zeroed first (a fresh mapping would be): the buffer was reused";
  EXPECT_TRUE(std::all_of(third->data() + kMiB, third->data() + third->size(), [](std::byte b) { return b == std::byte{0}; }))
      << "beyond what the caller fills, no byte of the buffer's last user";
  EXPECT_EQ(cache.bytes_in_use(), 4 * kMiB) << "within the budget, spares and all";
  // Without filled_bytes a reused buffer reads as all zeros, as a fresh one.
  cache.Drop("job", kept);
  auto fourth = cache.Create("job", 4, 2 * kMiB, /*wait=*/true);
  ASSERT_TRUE(fourth.ok());
  EXPECT_TRUE(std::all_of(fourth->data(), fourth->data() + fourth->size(), [](std::byte b) { return b == std::byte{0}; }));
  // A spare of another size is freed, not counted twice against the budget.
  third->Reset();
  fourth->Reset();
  cache.Drop("job", 3);
  auto big = cache.Create("job", 5, 3 * kMiB, /*wait=*/false);
  ASSERT_TRUE(big.ok()) << big.status();
  EXPECT_LE(cache.bytes_in_use(), 4 * kMiB);
}

TEST(StateCache, AnEntryLoadedStatesOnlyIsNotHeldWhole) {
  StateCache cache(8 * kMiB);
  auto entry = cache.Create("job", 1, kMiB, /*wait=*/true);
  ASSERT_TRUE(entry.ok());
  EXPECT_TRUE(entry->weights_valid());  // made with its contents
  cache.SetContents(*entry, 1, /*committed=*/true, /*weights_valid=*/false);
  EXPECT_FALSE(entry->weights_valid());
  EXPECT_TRUE(cache.Holds("job", 1, 1));
  EXPECT_FALSE(cache.Holds("job", 1, 1, /*whole=*/true));
  // The update wrote the whole buffer.
  cache.SetContents(*entry, 0, /*committed=*/true);
  EXPECT_TRUE(entry->weights_valid());
  EXPECT_TRUE(cache.Holds("job", 1, 0, /*whole=*/true));
  entry->Reset();
}

TEST(StateCache, APrefetchNeverEvictsAnotherPrefetchNotUsedYet) {
  StateCache cache(4 * kMiB);
  for (uint32_t chunk : {1u, 2u}) {  // two read-aheads fill the budget, neither used yet
    auto ahead = cache.Create("job", chunk, 2 * kMiB, /*wait=*/false, /*loading=*/true);
    ASSERT_TRUE(ahead.ok());
    cache.FinishLoad(*ahead, absl::OkStatus());
  }
  // A third read-ahead would only throw away one read for a sooner use.
  auto third = cache.Create("job", 3, 2 * kMiB, /*wait=*/false, /*loading=*/true);
  EXPECT_EQ(third.status().code(), absl::StatusCode::kUnavailable);
  EXPECT_TRUE(cache.Contains("job", 1));
  EXPECT_TRUE(cache.Contains("job", 2));
  // A use that needs the room now (not a prefetch) takes the oldest read-ahead.
  auto needed = cache.Create("job", 4, 2 * kMiB, /*wait=*/false);
  ASSERT_TRUE(needed.ok());
  EXPECT_FALSE(cache.Contains("job", 1));
  EXPECT_TRUE(cache.Contains("job", 2));
  needed->Reset();
  // Once used, a read-ahead may make room for the next one.
  cache.Pin("job", 2).Reset();
  auto next = cache.Create("job", 5, 2 * kMiB, /*wait=*/false, /*loading=*/true);
  EXPECT_TRUE(next.ok());
}

// One training step: every chunk used once, in order, as a session does.
void ScanOnce(StateCache& cache, uint32_t chunks, uint64_t bytes, int* reads) {
  for (uint32_t chunk = 0; chunk < chunks; ++chunk) {
    StatePin entry = cache.Pin("job", chunk);
    if (!entry) {
      ++*reads;
      auto created = cache.Create("job", chunk, bytes, /*wait=*/true);
      ASSERT_TRUE(created.ok());
      entry = std::move(*created);
    }
    entry.Reset();
  }
}

TEST(StateCache, ACyclicScanKeepsWhatFitsResidentInsteadOfThrashing) {
  // 10 chunks of 2 MiB through a 12 MiB cache: LRU would read all 10 every
  // step; keeping the most recently used evictable keeps 5 resident.
  StateCache cache(12 * kMiB);
  int reads = 0;
  ScanOnce(cache, 10, 2 * kMiB, &reads);
  EXPECT_EQ(reads, 10);
  for (int step = 0; step < 5; ++step) {
    reads = 0;
    ScanOnce(cache, 10, 2 * kMiB, &reads);
    EXPECT_LE(reads, 5) << "step " << step;
  }
  EXPECT_LE(cache.bytes_in_use(), 12 * kMiB);
}

TEST(StateCache, APrefetchNeverEvictsAnEntryNeededBeforeItNorTheResidentPrefix) {
  StateCache cache(3 * kMiB);
  const std::vector<uint32_t> order = {0, 1, 2, 3, 4, 5};
  cache.SetOrder("job", order);
  for (uint32_t chunk : {0u, 2u, 4u}) {
    auto used = cache.Create("job", chunk, kMiB, /*wait=*/true);
    ASSERT_TRUE(used.ok());
  }
  cache.SetOrder("job", order);  // the next step: 0 is its resident prefix (1 is missing)
  StatePin updating = cache.Pin("job", 0);  // the step's first use takes the prefix
  ASSERT_TRUE(updating);
  EXPECT_EQ(cache.resident_prefix("job"), 1u);
  // Reading 3 ahead may take 4 (needed after it), not 2 (needed before it).
  auto three = cache.Create("job", 3, kMiB, /*wait=*/false, /*loading=*/true);
  ASSERT_TRUE(three.ok()) << three.status();
  cache.FinishLoad(*three, absl::OkStatus());
  three->Reset();
  EXPECT_TRUE(cache.Contains("job", 2));
  EXPECT_FALSE(cache.Contains("job", 4));
  // Reading 5 ahead: 2 and 3 are needed before it, 0 is pinned: refused at
  // once, nothing evicted.
  EXPECT_EQ(cache.Create("job", 5, kMiB, /*wait=*/false, /*loading=*/true).status().code(),
            absl::StatusCode::kUnavailable);
  updating.Reset();  // 0 updated: used this step, but the resident prefix
  EXPECT_EQ(cache.Create("job", 5, kMiB, /*wait=*/false, /*loading=*/true).status().code(),
            absl::StatusCode::kUnavailable);
  for (uint32_t chunk : {0u, 2u, 3u}) EXPECT_TRUE(cache.Contains("job", chunk)) << chunk;
  // Once 2 is used this step its next use is in the next step, after 5.
  cache.Pin("job", 2).Reset();
  auto five = cache.Create("job", 5, kMiB, /*wait=*/false, /*loading=*/true);
  ASSERT_TRUE(five.ok()) << five.status();
  EXPECT_FALSE(cache.Contains("job", 2));
  cache.FinishLoad(*five, absl::OkStatus());
  five->Reset();
  // A use that needs the room now takes the prefix's last chunk before a
  // prefetch not used yet (those are needed this step).
  auto needed = cache.Create("job", 1, kMiB, /*wait=*/false);
  ASSERT_TRUE(needed.ok()) << needed.status();
  EXPECT_FALSE(cache.Contains("job", 0));
  EXPECT_TRUE(cache.Contains("job", 3));
  EXPECT_TRUE(cache.Contains("job", 5));
  EXPECT_EQ(cache.resident_prefix("job"), 1u);  // taken for the step: the rest of it stays protected
  needed->Reset();
  EXPECT_LE(cache.bytes_in_use(), cache.budget_bytes());
}

// Fills the budget with `job`'s chunks 0..count-1 (one step), then starts its
// next step: all of them are its resident prefix.
void FillAsResidentPrefix(StateCache& cache, const std::string& job, const std::vector<uint32_t>& order,
                          uint32_t count) {
  cache.SetOrder(job, order);
  for (uint32_t chunk = 0; chunk < count; ++chunk) {
    auto used = cache.Create(job, chunk, kMiB, /*wait=*/true);
    ASSERT_TRUE(used.ok()) << used.status();
  }
  cache.SetOrder(job, order);
  cache.Pin(job, 0).Reset();  // the step's first use takes the prefix
  ASSERT_EQ(cache.resident_prefix(job), count);
}

TEST(StateCache, TwoJobsSteppingAtOnceShareTheBudgetAndOneAloneKeepsItAll) {
  StateCache cache(8 * kMiB);
  const std::vector<uint32_t> order = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9};
  FillAsResidentPrefix(cache, "a", order, 8);
  // Alone, "a" keeps the whole budget: a prefetch of a job without an order
  // (not stepping yet) takes none of its prefix.
  EXPECT_EQ(cache.Create("b", 0, kMiB, /*wait=*/false, /*loading=*/true).status().code(),
            absl::StatusCode::kUnavailable);
  // "b" steps too (its order published): each name's share is half the
  // budget. b's read-ahead takes what a holds past its share, a's last chunks
  // first, and stops at its own share.
  cache.SetOrder("b", order);
  for (uint32_t chunk = 0; chunk < 4; ++chunk) {
    auto ahead = cache.Create("b", chunk, kMiB, /*wait=*/false, /*loading=*/true);
    ASSERT_TRUE(ahead.ok()) << "b's prefetch of chunk " << chunk << ": " << ahead.status();
    cache.FinishLoad(*ahead, absl::OkStatus());
  }
  for (uint32_t chunk = 0; chunk < 8; ++chunk) {
    EXPECT_EQ(cache.Contains("a", chunk), chunk < 4) << "a's chunk " << chunk;
  }
  EXPECT_EQ(cache.Create("b", 4, kMiB, /*wait=*/false, /*loading=*/true).status().code(),
            absl::StatusCode::kUnavailable)
      << "b at its share takes nothing of a's share";
  for (uint32_t chunk = 0; chunk < 4; ++chunk) EXPECT_TRUE(cache.Contains("a", chunk)) << chunk;
  EXPECT_LE(cache.bytes_in_use(), cache.budget_bytes());
}

TEST(StateCache, AUseTakesWhatAnotherJobHoldsPastItsShareBeforeAnyShare) {
  StateCache cache(8 * kMiB);
  const std::vector<uint32_t> order = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9};
  FillAsResidentPrefix(cache, "a", order, 8);
  cache.SetOrder("b", order);
  for (uint32_t chunk = 0; chunk < 5; ++chunk) {
    auto used = cache.Create("b", chunk, kMiB, /*wait=*/false);
    ASSERT_TRUE(used.ok()) << used.status();
  }
  // b's first four took a's chunks past a's share (7, 6, 5, 4); the fifth
  // streams through b's own (its chunk 3, used this step), not a's share.
  for (uint32_t chunk = 0; chunk < 8; ++chunk) {
    EXPECT_EQ(cache.Contains("a", chunk), chunk < 4) << "a's chunk " << chunk;
  }
  EXPECT_FALSE(cache.Contains("b", 3));
  EXPECT_TRUE(cache.Contains("b", 4));
}

TEST(StateCache, AUseEvictsTheLatestInTheOrderWhateverTheReleaseOrder) {
  // Write-backs complete in any order: the victim goes by rank, not release.
  StateCache cache(3 * kMiB);
  const std::vector<uint32_t> order = {0, 1, 2, 3};
  cache.SetOrder("job", order);
  std::vector<StatePin> pins;
  for (uint32_t chunk : {0u, 1u, 2u}) {
    auto used = cache.Create("job", chunk, kMiB, /*wait=*/true);
    ASSERT_TRUE(used.ok());
    pins.push_back(std::move(*used));
  }
  pins[2].Reset();  // 2's write-back completes first, 0's last
  pins[1].Reset();
  pins[0].Reset();
  auto three = cache.Create("job", 3, kMiB, /*wait=*/true);
  ASSERT_TRUE(three.ok());
  EXPECT_FALSE(cache.Contains("job", 2));
  EXPECT_TRUE(cache.Contains("job", 0));
  EXPECT_TRUE(cache.Contains("job", 1));
}

TEST(StateCache, PrefetchedEntriesOutliveUsedOnesAndClosedJobsGoFirst) {
  StateCache cache(6 * kMiB);
  auto used = cache.Create("job", 0, 2 * kMiB, true);
  ASSERT_TRUE(used.ok());
  used->Reset();
  auto prefetched = cache.Create("job", 1, 2 * kMiB, true, /*loading=*/true);
  ASSERT_TRUE(prefetched.ok());
  cache.FinishLoad(*prefetched, absl::OkStatus());
  prefetched->Reset();
  auto closed = cache.Create("old-job", 0, 2 * kMiB, true);
  ASSERT_TRUE(closed.ok());
  closed->Reset();
  cache.Demote("old-job");

  auto next = cache.Create("job", 2, 2 * kMiB, true);  // evicts the closed job's entry
  ASSERT_TRUE(next.ok());
  EXPECT_FALSE(cache.Contains("old-job", 0));
  EXPECT_TRUE(cache.Contains("job", 0));
  next->Reset();
  auto another = cache.Create("job", 3, 2 * kMiB, true);  // evicts a used entry, not the prefetch
  ASSERT_TRUE(another.ok());
  EXPECT_TRUE(cache.Contains("job", 1));
  another->Reset();
}

TEST(StateCache, NeverExceedsTheBudgetWithPinnedEntries) {
  StateCache cache(4 * kMiB);
  auto a = cache.Create("job", 0, 2 * kMiB, true);
  auto b = cache.Create("job", 1, 2 * kMiB, true);
  ASSERT_TRUE(a.ok() && b.ok());
  // Both pinned: a prefetch is refused at once, an update waits for a release.
  EXPECT_EQ(cache.Create("job", 2, 2 * kMiB, /*wait=*/false).status().code(), absl::StatusCode::kUnavailable);
  std::thread releaser([&] {
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
    a->Reset();
  });
  auto c = cache.Create("job", 2, 2 * kMiB, /*wait=*/true);
  releaser.join();
  ASSERT_TRUE(c.ok());
  EXPECT_LE(cache.bytes_in_use(), 4 * kMiB);
  b->Reset();
  c->Reset();
}

TEST(StateCache, RefusesAChunkLargerThanTheBudget) {
  StateCache cache(4 * kMiB);
  auto status = cache.Create("job", 7, 8 * kMiB, true).status();
  EXPECT_EQ(status.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_NE(status.message().find("chunk 7"), std::string::npos);
}

TEST(StateCache, DroppedPinnedEntryIsFreedAtLastUnpin) {
  StateCache cache(8 * kMiB);
  auto entry = cache.Create("job", 0, 2 * kMiB, true);
  ASSERT_TRUE(entry.ok());
  cache.DropJob("job");
  EXPECT_FALSE(cache.Contains("job", 0));
  EXPECT_EQ(cache.bytes_in_use(), 2 * kMiB);
  entry->Reset();
  EXPECT_EQ(cache.bytes_in_use(), 0u);
}

TEST(StateCache, PinWaitsForALoadToFinish) {
  StateCache cache(8 * kMiB);
  auto entry = cache.Create("job", 0, kMiB, true, /*loading=*/true);
  ASSERT_TRUE(entry.ok());
  std::thread loader([&] {
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
    cache.FinishLoad(*entry, absl::DataLossError("bad checksum"));
    entry->Reset();
  });
  StatePin pinned = cache.Pin("job", 0);
  loader.join();
  ASSERT_TRUE(pinned);
  EXPECT_EQ(pinned.load_status().code(), absl::StatusCode::kDataLoss);
  pinned.Reset();
  EXPECT_FALSE(cache.Contains("job", 0));  // a failed load is not kept
}

// The pin is RAII: leaving a scope releases it, moving hands it over without a
// second release, and a released entry becomes evictable.
TEST(StateCache, PinIsReleasedByItsHandleExactlyOnce) {
  StateCache cache(4 * kMiB);
  {
    auto a = cache.Create("job", 0, 2 * kMiB, true);
    ASSERT_TRUE(a.ok());
    StatePin moved = std::move(*a);
    EXPECT_FALSE(*a);  // NOLINT(bugprone-use-after-move): a moved-from pin is empty
    ASSERT_TRUE(moved);
    StatePin again = cache.Pin("job", 0);  // a second pin on the same entry
    moved.Reset();
    // Still pinned by `again`: neither evicted nor freed for a new entry.
    auto b = cache.Create("job", 1, 2 * kMiB, true);
    ASSERT_TRUE(b.ok());
    EXPECT_EQ(cache.Create("job", 2, 2 * kMiB, /*wait=*/false).status().code(), absl::StatusCode::kUnavailable);
    EXPECT_TRUE(cache.Contains("job", 0));
  }
  // Every pin left its scope: both entries are evictable, so two new ones fit.
  auto c = cache.Create("job", 3, 2 * kMiB, /*wait=*/false);
  auto d = cache.Create("job", 4, 2 * kMiB, /*wait=*/false);
  EXPECT_TRUE(c.ok() && d.ok());
  EXPECT_FALSE(cache.Contains("job", 0));
  EXPECT_LE(cache.bytes_in_use(), 4 * kMiB);
}

TEST(StateCache, ContentsAreRecordedPerEntry) {
  StateCache cache(4 * kMiB);
  auto a = cache.Create("job", 0, kMiB, true);
  ASSERT_TRUE(a.ok());
  EXPECT_EQ(a->version(), 0u);
  EXPECT_TRUE(a->committed());
  cache.SetContents(*a, 1, /*committed=*/false);
  a->Reset();
  StatePin pinned = cache.Pin("job", 0);
  ASSERT_TRUE(pinned);
  EXPECT_EQ(pinned.version(), 1u);
  EXPECT_FALSE(pinned.committed());
  EXPECT_EQ(pinned.chunk_id(), 0u);
  EXPECT_GE(pinned.size(), kMiB);
}


// Issue 12: a weights fetch looks at a chunk's states without taking the
// update's first use of a prefetch, and a read-ahead asks, without waiting,
// whether an entry holds a committed version.
TEST(StateCache, ALookIsNotAUseAndHoldsNeverWaits) {
  StateCache cache(8 * kMiB);
  auto prefetch = cache.Create("job", 1, kMiB, /*wait=*/true, /*loading=*/true);
  ASSERT_TRUE(prefetch.ok());
  cache.SetContents(*prefetch, 1, /*committed=*/true);
  EXPECT_TRUE(cache.Holds("job", 1, 1));  // loading: it will hold version 1
  EXPECT_FALSE(cache.Holds("job", 1, 0));
  EXPECT_FALSE(cache.Holds("job", 2, 1));
  cache.FinishLoad(*prefetch, absl::OkStatus());
  prefetch->Reset();
  StatePin look = cache.Pin("job", 1, /*use=*/false);
  ASSERT_TRUE(look);
  EXPECT_FALSE(look.first_use_of_prefetch());
  look.Reset();
  StatePin use = cache.Pin("job", 1);
  EXPECT_TRUE(use.first_use_of_prefetch());  // still the update's first use
  cache.SetContents(use, 0, /*committed=*/false);
  EXPECT_FALSE(cache.Holds("job", 1, 0));  // an uncommitted update
  use.Reset();
  auto failed = cache.Create("job", 3, kMiB, true, /*loading=*/true);
  ASSERT_TRUE(failed.ok());
  cache.FinishLoad(*failed, absl::DataLossError("bad"));
  EXPECT_FALSE(cache.Holds("job", 3, 0));
}

}  // namespace
}  // namespace fuyou
