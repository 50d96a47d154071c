#include "scheduler/state_cache.h"

#include <gtest/gtest.h>

#include <thread>

namespace fuyou {
namespace {

constexpr uint64_t kMiB = 1 << 20;

TEST(StateCache, KeepsEntriesAndCountsBytes) {
  StateCache cache(8 * kMiB);
  auto entry = cache.Create("job", 1, 2 * kMiB, /*wait=*/true);
  ASSERT_TRUE(entry.ok());
  EXPECT_EQ(cache.bytes_in_use(), 2 * kMiB);
  cache.Unpin(*entry);
  EXPECT_TRUE(cache.Contains("job", 1));
  CacheEntryPtr again = cache.Pin("job", 1);
  ASSERT_NE(again, nullptr);
  EXPECT_EQ(again.get(), entry->get());
  cache.Unpin(again);
}

TEST(StateCache, EvictsLeastRecentlyUsedUnpinnedEntries) {
  StateCache cache(6 * kMiB);
  for (uint32_t chunk = 0; chunk < 3; ++chunk) {
    auto entry = cache.Create("job", chunk, 2 * kMiB, true);
    ASSERT_TRUE(entry.ok());
    cache.Unpin(*entry);
  }
  // Touch chunk 0 so chunk 1 is the least recently used.
  cache.Unpin(cache.Pin("job", 0));
  auto fourth = cache.Create("job", 3, 2 * kMiB, true);
  ASSERT_TRUE(fourth.ok());
  EXPECT_TRUE(cache.Contains("job", 0));
  EXPECT_FALSE(cache.Contains("job", 1));
  EXPECT_TRUE(cache.Contains("job", 2));
  EXPECT_LE(cache.bytes_in_use(), 6 * kMiB);
  cache.Unpin(*fourth);
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
    cache.Unpin(*a);
  });
  auto c = cache.Create("job", 2, 2 * kMiB, /*wait=*/true);
  releaser.join();
  ASSERT_TRUE(c.ok());
  EXPECT_LE(cache.bytes_in_use(), 4 * kMiB);
  cache.Unpin(*b);
  cache.Unpin(*c);
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
  cache.Unpin(*entry);
  EXPECT_EQ(cache.bytes_in_use(), 0u);
}

TEST(StateCache, PinWaitsForALoadToFinish) {
  StateCache cache(8 * kMiB);
  auto entry = cache.Create("job", 0, kMiB, true, /*loading=*/true);
  ASSERT_TRUE(entry.ok());
  std::thread loader([&] {
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
    cache.FinishLoad(*entry, absl::DataLossError("bad checksum"));
    cache.Unpin(*entry);
  });
  CacheEntryPtr pinned = cache.Pin("job", 0);
  loader.join();
  ASSERT_NE(pinned, nullptr);
  EXPECT_FALSE(pinned->loading);
  EXPECT_EQ(pinned->load_status.code(), absl::StatusCode::kDataLoss);
  cache.Unpin(pinned);
  EXPECT_FALSE(cache.Contains("job", 0));  // a failed load is not kept
}

}  // namespace
}  // namespace fuyou
