#include "state/state_import.h"

#include <gtest/gtest.h>

#include "state/state_test_env.h"

namespace fuyou {
namespace {
using testing_env::kElements;
using testing_env::StateTestEnv;

class StateImportTest : public ::testing::Test {
 protected:
  StateImportTest()
      : reader_(env_.context()), durability_(env_.context(), DurabilityInterval{}),
        import_(env_.context(), reader_, durability_) {
    env_.Register(reader_, 2, 1.0f);
  }
  std::vector<float> Exported(uint32_t chunk_id, ChunkState which) {
    std::vector<float> values(kElements);
    EXPECT_TRUE(import_.Export(chunk_id, which, 0, std::span(values)).ok());
    return values;
  }

  StateTestEnv env_;
  CommittedReader reader_;
  DurabilityPolicy durability_;
  StateImport import_;
};

TEST_F(StateImportTest, AnImportIsCommittedInOneEditKeepingTheStep) {
  const std::vector<float> m(kElements, 0.5f);
  ASSERT_TRUE(import_.Import(1, ChunkState::kExpAvg, 0, std::span(m)).ok());
  import_.ImportUpdateCount(1, 7, {});
  EXPECT_TRUE(import_.HasPending(1));
  EXPECT_EQ(env_.job().FindRecord(1)->update_count(), 0);  // not yet
  auto changed = import_.Commit();
  ASSERT_TRUE(changed.ok()) << changed.status();
  EXPECT_EQ(*changed, 1u);
  EXPECT_EQ(import_.pending(), 0u);
  EXPECT_EQ(env_.job().FindRecord(1)->update_count(), 7);
  EXPECT_EQ(env_.job().manifest().committed_step(), 0);
  env_.cache().DropJob(env_.job().key());
  EXPECT_EQ(Exported(1, ChunkState::kExpAvg), m);
  EXPECT_EQ(Exported(1, ChunkState::kMaster), std::vector<float>(kElements, 1.0f));
}

TEST_F(StateImportTest, ADroppedImportLeavesTheCommittedStates) {
  const std::vector<float> master(kElements, 4.0f);
  ASSERT_TRUE(import_.Import(0, ChunkState::kMaster, 0, std::span(master)).ok());
  // A second write to the same chunk starts from the pending import.
  const std::vector<float> part(10, 8.0f);
  ASSERT_TRUE(import_.Import(0, ChunkState::kMaster, 0, std::span(part)).ok());
  import_.Drop();
  EXPECT_FALSE(import_.HasPending(0));
  EXPECT_EQ(Exported(0, ChunkState::kMaster), std::vector<float>(kElements, 1.0f));
  EXPECT_EQ(*import_.Commit(), 0u);  // nothing pending: nothing written
}

}  // namespace
}  // namespace fuyou
