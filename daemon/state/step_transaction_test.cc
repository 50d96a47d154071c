#include "state/step_transaction.h"

#include <gtest/gtest.h>

#include <cerrno>

#include "state/state_test_env.h"

namespace fuyou {
namespace {
using testing_env::kElements;
using testing_env::StateTestEnv;

class StepTransactionTest : public ::testing::Test {
 protected:
  StepTransactionTest()
      : durability_(env_.context(), DurabilityInterval{}), step_(env_.context(), durability_, LearnedOrder({0, 1})),
        reader_(env_.context()) {
    env_.Register(reader_, 2, 1.0f);
  }
  // Stages chunk `chunk_id`'s update (as ChunkStore::BeginUpdate).
  StagedUpdate Begin(uint32_t chunk_id) {
    durability_.UpdateStarting();
    auto pin = reader_.Acquire(*env_.context().Find(chunk_id), false, /*states_only=*/true);
    EXPECT_TRUE(pin.ok()) << pin.status();
    return step_.Begin(*env_.context().Find(chunk_id), std::move(*pin), StatePin());
  }
  float CommittedMaster(uint32_t chunk_id) {
    auto pin = reader_.Acquire(*env_.context().Find(chunk_id), false);
    EXPECT_TRUE(pin.ok()) << pin.status();
    return pin.ok() ? ChunkStates(pin->data(), kElements).master()[0] : -1.0f;
  }

  StateTestEnv env_;
  DurabilityPolicy durability_;
  StepTransaction step_;
  CommittedReader reader_;
};

TEST_F(StepTransactionTest, ASubmittedUpdateIsCommittedInOneJobEdit) {
  StagedUpdate update = Begin(0);
  EXPECT_TRUE(step_.IsStaged(0));
  update.states().master()[0] = 5.0f;
  step_.Submit(std::move(update), {});
  EXPECT_TRUE(step_.WaitForWriteBacks().ok());
  auto committed = step_.Commit(1);
  ASSERT_TRUE(committed.ok()) << committed.status();
  EXPECT_EQ(*committed, 1u);
  EXPECT_EQ(env_.job().manifest().committed_step(), 1);
  EXPECT_EQ(env_.job().FindRecord(0)->update_count(), 1);
  EXPECT_EQ(env_.job().FindRecord(1)->update_count(), 0);
  EXPECT_EQ(step_.staged_count(), 0u);
  env_.cache().DropJob(env_.job().key());
  EXPECT_EQ(CommittedMaster(0), 5.0f);  // from the new committed extent
}

TEST_F(StepTransactionTest, AnUpdateDroppedWithoutSubmitIsRolledBack) {
  {
    StagedUpdate update = Begin(0);
    update.states().master()[0] = 9.0f;
  }
  EXPECT_FALSE(step_.IsStaged(0));
  EXPECT_EQ(CommittedMaster(0), 1.0f);  // read again from the untouched committed extent
}

TEST_F(StepTransactionTest, RollBackChunkAndRollBackForgetTheUpdates) {
  EXPECT_EQ(step_.RollBackChunk(0).code(), absl::StatusCode::kFailedPrecondition);
  StagedUpdate first = Begin(0);
  first.states().master()[0] = 2.0f;
  step_.Submit(std::move(first), {});
  ASSERT_TRUE(step_.RollBackChunk(0).ok());
  EXPECT_FALSE(step_.IsStaged(0));
  StagedUpdate second = Begin(1);
  second.states().master()[0] = 3.0f;
  step_.Submit(std::move(second), {});
  step_.RollBack();
  EXPECT_EQ(step_.staged_count(), 0u);
  EXPECT_EQ(CommittedMaster(0), 1.0f);
  EXPECT_EQ(CommittedMaster(1), 1.0f);
  EXPECT_EQ(env_.job().manifest().committed_step(), 0);
}

// Fails every write while `fail_writes` is set.
class WriteFailures final : public storage::FaultInjector {
 public:
  int64_t Adjust(Op op, const std::filesystem::path& /*file*/, uint64_t /*offset*/, uint64_t /*length*/,
                 int64_t result) override {
    return op == Op::kWrite && fail_writes ? -EIO : result;
  }
  bool fail_writes = false;
};

TEST(StepTransactionErrorTest, AFailedWriteBackIsTheStepErrorAndCommitRollsBack) {
  WriteFailures faults;
  StateTestEnv env(64 << 20, &faults);
  DurabilityPolicy durability(env.context(), DurabilityInterval{});
  StepTransaction step(env.context(), durability, LearnedOrder({0}));
  CommittedReader reader(env.context());
  env.Register(reader, 1);
  faults.fail_writes = true;
  durability.UpdateStarting();
  auto pin = reader.Acquire(*env.context().Find(0), false, true);
  ASSERT_TRUE(pin.ok());
  step.Submit(step.Begin(*env.context().Find(0), std::move(*pin), StatePin()), {});
  const absl::Status error = step.WaitForWriteBacks();
  EXPECT_EQ(error.code(), absl::StatusCode::kDataLoss) << error;
  EXPECT_NE(error.message().find("write-back of chunk 0"), std::string::npos) << error;
  EXPECT_EQ(step.StepError(), error);
  faults.fail_writes = false;
  EXPECT_EQ(step.Commit(1).status(), error);
  EXPECT_EQ(step.staged_count(), 0u);
  EXPECT_TRUE(step.StepError().ok());
  EXPECT_EQ(env.job().manifest().committed_step(), 0);
}

}  // namespace
}  // namespace fuyou
