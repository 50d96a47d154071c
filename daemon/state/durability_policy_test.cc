#include "state/durability_policy.h"

#include <gtest/gtest.h>

#include <cstring>

#include "state/state_test_env.h"

namespace fuyou {
namespace {
using testing_env::StateTestEnv;

TEST(DurabilityPolicyTest, EveryStepIsDurableWithAnIntervalOfOne) {
  StateTestEnv env;
  CommittedReader reader(env.context());
  env.Register(reader, 2);
  DurabilityPolicy policy(env.context(), DurabilityInterval{.every_steps = 1});
  policy.UpdateStarting();
  EXPECT_TRUE(policy.step_durable());
  EXPECT_FALSE(policy.HasAcknowledged());
}

TEST(DurabilityPolicyTest, EveryNthStepIsDurableAndTheOthersHoldDram) {
  StateTestEnv env;
  CommittedReader reader(env.context());
  env.Register(reader, 2);
  DurabilityPolicy policy(env.context(), DurabilityInterval{.every_steps = 3});
  std::vector<bool> durable;
  for (int step = 0; step < 3; ++step) {
    policy.UpdateStarting();
    policy.UpdateStarting();  // a second update of the same step decides nothing
    durable.push_back(policy.step_durable());
    if (!policy.step_durable()) policy.Acknowledged();
    policy.StepEnded();
  }
  EXPECT_EQ(durable, (std::vector<bool>{false, false, true}));
  // Twice the job's states (two 12288-byte extents) are held.
  EXPECT_FALSE(env.cache().TryHold(env.cache().budget_bytes() / 2 - 2 * 2 * 12288 + 1));
  policy.Durable();
  EXPECT_TRUE(env.cache().TryHold(env.cache().budget_bytes() / 2));
}

TEST(DurabilityPolicyTest, AJobThatDoesNotFitHalfTheBudgetIsAlwaysDurable) {
  StateTestEnv env(/*budget_bytes=*/3 * 12288);
  CommittedReader reader(env.context());
  env.Register(reader, 2);
  DurabilityPolicy policy(env.context(), DurabilityInterval{.every_steps = 8});
  policy.UpdateStarting();
  EXPECT_TRUE(policy.step_durable());
}

TEST(DurabilityPolicyTest, AnUndoCopyRestoresAPendingChunk) {
  StateTestEnv env;
  CommittedReader reader(env.context());
  env.Register(reader, 1, 2.0f);
  DurabilityPolicy policy(env.context(), DurabilityInterval{.every_steps = 4});
  auto states = reader.Acquire(*env.context().Find(0), false);
  ASSERT_TRUE(states.ok());
  // Not pending: no copy.
  auto none = policy.TakeUndo(0, *states);
  ASSERT_TRUE(none.ok());
  EXPECT_FALSE(*none);
  StatePin pending = std::move(*states);
  std::byte* bytes = pending.data();
  policy.Keep(0, std::move(pending));
  ASSERT_TRUE(policy.IsPending(0));
  ASSERT_NE(policy.Pending(0), nullptr);
  auto undo = policy.TakeUndo(0, *policy.Pending(0));
  ASSERT_TRUE(undo.ok());
  ASSERT_TRUE(*undo);
  float changed = 7.0f;
  std::memcpy(bytes, &changed, sizeof changed);  // the running step's update
  EXPECT_TRUE(policy.Restore(0, *undo));
  float restored = 0;
  std::memcpy(&restored, bytes, sizeof restored);
  EXPECT_EQ(restored, 2.0f);
  EXPECT_FALSE(*undo);
  EXPECT_TRUE(policy.HasAcknowledged());
}

}  // namespace
}  // namespace fuyou
