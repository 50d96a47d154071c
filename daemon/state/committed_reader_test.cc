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
