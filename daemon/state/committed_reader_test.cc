#include "state/committed_reader.h"

#include <gtest/gtest.h>

#include "state/state_test_env.h"

namespace fuyou {
namespace {
using testing_env::kElements;
using testing_env::StateTestEnv;

TEST(CommittedReaderTest, ReadsOnAMissAndServesTheNextAcquireFromDram) {
  StateTestEnv env;
  CommittedReader reader(env.context());
  env.Register(reader, 1, 3.0f);
  env.cache().DropJob(env.job().key());  // cold
  const uint64_t misses = env.user().Get(Ticker::kCacheMisses);
  {
    auto pin = reader.Acquire(*env.context().Find(0), /*pending=*/false);
    ASSERT_TRUE(pin.ok()) << pin.status();
    EXPECT_EQ(ChunkStates(pin->data(), kElements).master()[17], 3.0f);
  }
  EXPECT_EQ(env.user().Get(Ticker::kCacheMisses), misses + 1);
  const uint64_t hits = env.user().Get(Ticker::kCacheHits);
  ASSERT_TRUE(reader.Acquire(*env.context().Find(0), false).ok());
  EXPECT_EQ(env.user().Get(Ticker::kCacheHits), hits + 1);
}

TEST(CommittedReaderTest, ACorruptExtentIsDataLossNamingTheChunk) {
  StateTestEnv env;
  CommittedReader reader(env.context());
  env.Register(reader, 2);
  env.cache().DropJob(env.job().key());
  env.Corrupt(1);
  auto pin = reader.Acquire(*env.context().Find(1), false);
  EXPECT_EQ(pin.status().code(), absl::StatusCode::kDataLoss);
  EXPECT_NE(pin.status().message().find("chunk 1"), std::string::npos) << pin.status();
  EXPECT_FALSE(env.cache().Contains(env.job().key(), 1));  // a failed load is not kept
}

TEST(CommittedReaderTest, APendingChunkNotInDramIsInternal) {
  StateTestEnv env;
  CommittedReader reader(env.context());
  env.Register(reader, 1);
  env.cache().DropJob(env.job().key());
  EXPECT_EQ(reader.Acquire(*env.context().Find(0), /*pending=*/true).status().code(), absl::StatusCode::kInternal);
}

TEST(CommittedReaderTest, APrefetchedChunkIsAMissTheReadAheadHid) {
  StateTestEnv env;
  CommittedReader reader(env.context());
  env.Register(reader, 3);
  env.cache().DropJob(env.job().key());
  reader.Prefetch({1, 2}, [](uint32_t chunk_id) { return chunk_id == 2; });  // 2: skipped (staged)
  reader.WaitForReads();
  EXPECT_TRUE(env.cache().Contains(env.job().key(), 1));
  EXPECT_FALSE(env.cache().Contains(env.job().key(), 2));
  const uint64_t misses = env.user().Get(Ticker::kCacheMisses);
  const uint64_t hits = env.user().Get(Ticker::kCacheHits);
  ASSERT_TRUE(reader.Acquire(*env.context().Find(1), false).ok());
  EXPECT_EQ(env.user().Get(Ticker::kCacheMisses), misses + 1);
  EXPECT_EQ(env.user().Get(Ticker::kCacheHits), hits);
}

// One chunk's extent in StateTestEnv: 12000 bytes of states padded to a block.
constexpr uint64_t kExtentBytes = 12288;

TEST(CommittedReaderTest, APrefetchTakesThePredictedChunksThatFitInItsWindowInOrder) {
  StateTestEnv env;
  CommittedReader reader(env.context());
  env.Register(reader, 6);
  env.cache().DropJob(env.job().key());
  const auto none = [](uint32_t) { return false; };
  reader.Prefetch({5, 4, 3, 2, 1, 0}, none, 3 * kExtentBytes);
  reader.WaitForReads();
  for (uint32_t chunk : {5u, 4u, 3u}) EXPECT_TRUE(env.cache().Contains(env.job().key(), chunk)) << chunk;
  for (uint32_t chunk : {2u, 1u, 0u}) EXPECT_FALSE(env.cache().Contains(env.job().key(), chunk)) << chunk;
  // Chunks already in DRAM (or skipped) are ahead too: a window of four more
  // than those three reads the fourth only.
  reader.Prefetch({5, 4, 3, 2, 1, 0}, [](uint32_t chunk) { return chunk == 4; }, 4 * kExtentBytes);
  reader.WaitForReads();
  EXPECT_TRUE(env.cache().Contains(env.job().key(), 2));
  EXPECT_FALSE(env.cache().Contains(env.job().key(), 1));
  // A window smaller than one chunk reads nothing.
  reader.Prefetch({1, 0}, none, kExtentBytes - 1);
  reader.WaitForReads();
  EXPECT_FALSE(env.cache().Contains(env.job().key(), 1));
}

TEST(CommittedReaderTest, APrefetchUnderASmallBudgetStopsWithoutEvictingPinnedOrUnusedEntriesOrWaiting) {
  // Room for three chunks; the window itself (unbounded here) never stops it.
  StateTestEnv env(3 * kExtentBytes);
  CommittedReader reader(env.context());
  env.Register(reader, 5);
  env.cache().DropJob(env.job().key());
  auto in_use = reader.Acquire(*env.context().Find(0), /*pending=*/false);  // an update's pin
  ASSERT_TRUE(in_use.ok()) << in_use.status();
  const auto none = [](uint32_t) { return false; };
  reader.Prefetch({1, 2, 3, 4}, none);  // returns: nothing waits for budget
  reader.WaitForReads();
  EXPECT_TRUE(env.cache().Contains(env.job().key(), 0));  // pinned: kept
  EXPECT_TRUE(env.cache().Contains(env.job().key(), 1));
  EXPECT_TRUE(env.cache().Contains(env.job().key(), 2));
  EXPECT_FALSE(env.cache().Contains(env.job().key(), 3));  // no budget: stopped here
  EXPECT_FALSE(env.cache().Contains(env.job().key(), 4));  // and not past it
  EXPECT_LE(env.cache().bytes_in_use(), env.cache().budget_bytes());
  // Prefetches not used yet are not evicted by later ones either.
  reader.Prefetch({3, 4}, none);
  reader.WaitForReads();
  EXPECT_TRUE(env.cache().Contains(env.job().key(), 1));
  EXPECT_TRUE(env.cache().Contains(env.job().key(), 2));
  EXPECT_FALSE(env.cache().Contains(env.job().key(), 3));
  // The pinned states are the committed ones, untouched.
  EXPECT_TRUE(in_use->load_status().ok());
  EXPECT_EQ(reinterpret_cast<const float*>(in_use->data())[0], 1.0f);
}

TEST(CommittedReaderTest, StatesOnlyLoadsLeaveTheWeightsInvalidUntilWantedWhole) {
  StateTestEnv env;
  CommittedReader reader(env.context());
  env.Register(reader, 1, 1.0f, /*store_weights=*/true);
  env.cache().DropJob(env.job().key());
  {
    auto pin = reader.Acquire(*env.context().Find(0), false, /*states_only=*/true);
    ASSERT_TRUE(pin.ok()) << pin.status();
    EXPECT_FALSE(pin->weights_valid());
  }
  auto whole = reader.Acquire(*env.context().Find(0), false);
  ASSERT_TRUE(whole.ok()) << whole.status();
  EXPECT_TRUE(whole->weights_valid());
  const ChunkStates states(whole->data(), RecordLayout(*env.context().Find(0)));
  EXPECT_EQ(reinterpret_cast<const uint16_t*>(states.weights())[5], 0x3f80);  // bf16 1.0
}

}  // namespace
}  // namespace fuyou
