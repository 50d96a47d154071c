#include "state/weights_reader.h"

#include <gtest/gtest.h>

#include "state/state_test_env.h"

namespace fuyou {
namespace {
using testing_env::kElements;
using testing_env::StateTestEnv;

class WeightsReaderTest : public ::testing::Test {
 protected:
  WeightsReaderTest()
      : durability_(env_.context(), DurabilityInterval{}),
        step_(env_.context(), durability_, LearnedOrder({0, 1, 2})),
        reader_(env_.context()),
        weights_(env_.context(), step_, durability_) {
    env_.Register(reader_, 3, 1.0f, /*store_weights=*/true);
    env_.cache().DropJob(env_.job().key());  // cold
  }
  absl::StatusOr<FetchSource> Fetch(uint32_t chunk_id) {
    std::vector<std::byte> out(kElements * 2);
    auto fetched = weights_.Fetch(chunk_id, std::span(out));
    if (fetched.ok()) {
      EXPECT_EQ(reinterpret_cast<const uint16_t*>(out.data())[3], 0x3f80);  // bf16 1.0
    }
    return fetched;
  }

  StateTestEnv env_;
  DurabilityPolicy durability_;
  StepTransaction step_;
  CommittedReader reader_;
  WeightsReader weights_;
};

TEST_F(WeightsReaderTest, ReadsOnlyTheWeightsRegionThenServesFromDram) {
  auto first = Fetch(0);
  ASSERT_TRUE(first.ok()) << first.status();
  EXPECT_FALSE(first->from_dram);
  EXPECT_EQ(first->bytes_read, 4096u);  // the weights region, never master, m or v
  auto again = Fetch(0);
  ASSERT_TRUE(again.ok());
  EXPECT_TRUE(again->from_dram);
  EXPECT_EQ(again->bytes_read, 0u);
  EXPECT_EQ(env_.user().Get(Ticker::kWeightsFetches), 2u);
  EXPECT_EQ(env_.user().Get(Ticker::kWeightsFetchCacheHits), 1u);
}

TEST_F(WeightsReaderTest, TheLearnedOrderIsReadAhead) {
  ASSERT_TRUE(Fetch(0).ok());
  ASSERT_TRUE(Fetch(1).ok());
  ASSERT_TRUE(Fetch(2).ok());
  weights_.StepEnded();
  env_.context().cache.DropAll(CacheSpace::kWeights);
  ASSERT_TRUE(Fetch(0).ok());  // reads 1 and 2 ahead
  weights_.WaitForReads();
  auto next = Fetch(1);
  ASSERT_TRUE(next.ok());
  EXPECT_TRUE(next->from_dram);
}

TEST_F(WeightsReaderTest, RefusesChunksWithoutWeightsAndWrongSizes) {
  std::vector<std::byte> small(10);
  EXPECT_EQ(weights_.Fetch(0, std::span(small)).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(weights_.Fetch(9, std::span(small)).status().code(), absl::StatusCode::kFailedPrecondition);
}

TEST_F(WeightsReaderTest, CorruptWeightsAreDataLoss) {
  env_.Corrupt(2, /*at=*/12288);  // the weights region
  EXPECT_EQ(Fetch(2).status().code(), absl::StatusCode::kDataLoss);
}

}  // namespace
}  // namespace fuyou
