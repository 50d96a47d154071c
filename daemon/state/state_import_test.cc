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

// Issue 22: bf16 moments are exported widened to fp32 (exactly) and imported
// rounded to nearest even; the master stays fp32.
TEST(StateImportBf16Test, MomentsAreWidenedOnExportAndRoundedOnImport) {
  StateTestEnv env;
  CommittedReader reader(env.context());
  DurabilityPolicy durability(env.context(), DurabilityInterval{});
  StateImport import(env.context(), reader, durability);
  env.Register(reader, 1, 1.0f, /*store_weights=*/false, DType::kBFloat16);
  std::vector<float> values(kElements, 1.0f + 0x1p-12f);  // not a bf16 value: rounds to 1.0
  values[1] = 1.0f + 0x1p-7f + 0x1p-8f;                   // a tie: to even, 1 + 2^-6
  ASSERT_TRUE(import.Import(0, ChunkState::kExpAvgSq, 0, std::span(values)).ok());
  ASSERT_TRUE(import.Import(0, ChunkState::kMaster, 0, std::span(values)).ok());
  ASSERT_TRUE(import.Commit().ok());
  env.cache().DropJob(env.job().key());
  std::vector<float> v(kElements), master(kElements), m(kElements, -1.0f);
  ASSERT_TRUE(import.Export(0, ChunkState::kExpAvgSq, 0, std::span(v)).ok());
  ASSERT_TRUE(import.Export(0, ChunkState::kMaster, 0, std::span(master)).ok());
  ASSERT_TRUE(import.Export(0, ChunkState::kExpAvg, 0, std::span(m)).ok());
  EXPECT_EQ(v[0], 1.0f);
  EXPECT_EQ(v[1], 1.0f + 0x1p-6f);
  EXPECT_EQ(master, values);  // fp32: kept exactly
  EXPECT_EQ(m, std::vector<float>(kElements, 0.0f));
  // A part from an offset lands on its own elements (2 bytes each).
  std::vector<float> tail(3, 0.25f);
  ASSERT_TRUE(import.Import(0, ChunkState::kExpAvg, 997, std::span(tail)).ok());
  ASSERT_TRUE(import.Commit().ok());
  std::vector<float> back(3);
  ASSERT_TRUE(import.Export(0, ChunkState::kExpAvg, 996, std::span(back)).ok());
  EXPECT_EQ(back, (std::vector<float>{0.0f, 0.25f, 0.25f}));
}

// Issue 36: 8-bit moments are exported decoded to fp32 and imported encoded
// (each block written with a new scale); what was exported imports to the
// same bytes; a part from an offset lands on its own elements.
TEST(StateImportBlock8Test, MomentsAreDecodedOnExportAndEncodedOnImport) {
  StateTestEnv env;
  CommittedReader reader(env.context());
  DurabilityPolicy durability(env.context(), DurabilityInterval{});
  StateImport import(env.context(), reader, durability);
  env.Register(reader, 1, 1.0f, /*store_weights=*/false, DType::kBlock8);
  std::vector<float> values(kElements);
  for (size_t i = 0; i < kElements; ++i) values[i] = 1e-3f * static_cast<float>(i % 37 + 1);
  ASSERT_TRUE(import.Import(0, ChunkState::kExpAvgSq, 0, std::span(values)).ok());
  ASSERT_TRUE(import.Import(0, ChunkState::kMaster, 0, std::span(values)).ok());
  ASSERT_TRUE(import.Commit().ok());
  env.cache().DropJob(env.job().key());
  std::vector<float> v(kElements), master(kElements), m(kElements, -1.0f);
  ASSERT_TRUE(import.Export(0, ChunkState::kExpAvgSq, 0, std::span(v)).ok());
  ASSERT_TRUE(import.Export(0, ChunkState::kMaster, 0, std::span(master)).ok());
  ASSERT_TRUE(import.Export(0, ChunkState::kExpAvg, 0, std::span(m)).ok());
  for (size_t i = 0; i < kElements; ++i) EXPECT_NEAR(v[i], values[i], values[i] / 16) << i;
  EXPECT_NE(v, values);  // rounded to 8-bit codes
  EXPECT_EQ(master, values);  // fp32: kept exactly
  EXPECT_EQ(m, std::vector<float>(kElements, 0.0f));
  // Re-importing the export changes no bit.
  ASSERT_TRUE(import.Import(0, ChunkState::kExpAvgSq, 0, std::span(v)).ok());
  ASSERT_TRUE(import.Commit().ok());
  std::vector<float> again(kElements);
  ASSERT_TRUE(import.Export(0, ChunkState::kExpAvgSq, 0, std::span(again)).ok());
  EXPECT_EQ(again, v);
  std::vector<float> tail(3, 0.25f);
  ASSERT_TRUE(import.Import(0, ChunkState::kExpAvg, 997, std::span(tail)).ok());
  ASSERT_TRUE(import.Commit().ok());
  std::vector<float> back(3);
  ASSERT_TRUE(import.Export(0, ChunkState::kExpAvg, 996, std::span(back)).ok());
  EXPECT_EQ(back, (std::vector<float>{0.0f, 0.25f, 0.25f}));
}

}  // namespace
}  // namespace fuyou
