#include "state/committed_reader.h"

#include <gtest/gtest.h>

#include <cstdio>
#include <string>
#include <vector>

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

// One step as ChunkStore runs it, without the write-backs: each chunk of
// `order` is acquired for its update and, while still pinned (the update and
// its write-back hold it), the chunks after it are read ahead as deep as the
// budget allows; at the step's end the order is published again and the read
// ahead starts from its first chunks. Every read-ahead is waited for before
// the next chunk, so nothing depends on timing. Checks on the way that no
// prefetch evicts a chunk needed before one it read, that the pinned chunk
// stays and that the budget holds. Returns the bytes read from storage.
uint64_t RunCyclicStep(StateTestEnv& env, CommittedReader& reader, const std::vector<uint32_t>& order) {
  const std::string& job = env.job().key();
  const auto none = [](uint32_t) { return false; };
  // Prefetches `ahead`; `used`: the chunks of `order` used so far this step.
  const auto prefetch = [&](const std::vector<uint32_t>& ahead, size_t used) {
    std::vector<bool> before(order.size());
    for (size_t i = 0; i < order.size(); ++i) before[i] = env.cache().Contains(job, order[i]);
    reader.Prefetch(ahead, none, env.context().ReadAheadBytes(/*writing_bytes=*/0));
    reader.WaitForReads();
    size_t last_read = 0;  // one past the position of the last chunk read ahead
    for (size_t i = 0; i < order.size(); ++i) {
      if (!before[i] && env.cache().Contains(job, order[i])) last_read = i + 1;
    }
    for (size_t i = used; i < order.size(); ++i) {  // not used yet this step: needed this step at i
      const bool evicted = before[i] && !env.cache().Contains(job, order[i]);
      EXPECT_FALSE(evicted && i < last_read) << "chunk " << order[i] << " was evicted for one needed after it";
    }
    EXPECT_LE(env.cache().bytes_in_use(), env.cache().budget_bytes());
  };
  const uint64_t read_before = env.user().Get(Ticker::kBytesRead);
  for (size_t i = 0; i < order.size(); ++i) {
    auto pin = reader.Acquire(*env.context().Find(order[i]), /*pending=*/false, /*states_only=*/true);
    EXPECT_TRUE(pin.ok()) << pin.status();
    prefetch(std::vector<uint32_t>(order.begin() + static_cast<std::ptrdiff_t>(i) + 1, order.end()), i + 1);
    EXPECT_TRUE(env.cache().Contains(job, order[i])) << "the pinned chunk " << order[i] << " was evicted";
  }
  env.context().cache.SetStatesOrder(order);  // the step committed: the next one starts
  prefetch(order, 0);
  return env.user().Get(Ticker::kBytesRead) - read_before;
}

TEST(CommittedReaderTest, ADeepReadAheadOverACyclicOrderReadsOnlyWhatDoesNotFit) {
  // Eight chunks every step in the same order, room for five: one slot streams
  // the chunk being updated, so four stay resident and four are read a step
  // (the optimum for a fixed order). LRU, or a read-ahead that evicts what
  // the next step needs first, reads all eight.
  constexpr uint32_t kChunks = 8;
  StateTestEnv env(5 * kExtentBytes);
  CommittedReader reader(env.context());
  env.Register(reader, kChunks);
  env.cache().DropJob(env.job().key());  // cold
  const std::vector<uint32_t> order = {3, 1, 4, 0, 5, 2, 7, 6};
  env.context().cache.SetStatesOrder(order);
  EXPECT_GE(RunCyclicStep(env, reader, order), kChunks * kExtentBytes);  // cold: all of them
  for (int step = 2; step <= 5; ++step) {
    const uint64_t read = RunCyclicStep(env, reader, order);
    std::printf("[figures] step %d: %llu of %u chunks read\n", step,
                static_cast<unsigned long long>(read / kExtentBytes), kChunks);
    EXPECT_EQ(read, 4 * kExtentBytes) << "step " << step;
  }
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
