#include "state/learned_order.h"

#include <gtest/gtest.h>

namespace fuyou {
namespace {

using Chunks = std::vector<uint32_t>;

TEST(LearnedOrder, BeforeAnyStepPredictsBackwardNewestRegisteredFirst) {
  LearnedOrder order({0, 1, 2});
  EXPECT_EQ(order.predicted(), (Chunks{2, 1, 0}));
  order.Registered(3);
  order.Registered(1);  // already known: stays where it is
  EXPECT_EQ(order.predicted(), (Chunks{3, 2, 1, 0}));
  EXPECT_EQ(order.After(2, 2), (Chunks{1, 0}));
  EXPECT_EQ(order.After(0, 2), Chunks{});
  EXPECT_EQ(order.After(9, 2), Chunks{});
  EXPECT_EQ(order.First(2), (Chunks{3, 2}));
}

TEST(LearnedOrder, ACommittedStepsArrivalsAreTheNextPrediction) {
  LearnedOrder order({0, 1, 2, 3});
  order.Arrived(1);
  order.Arrived(3);
  order.StepCommitted();
  // Arrivals first, then the chunks that did not come, in their old order.
  EXPECT_EQ(order.predicted(), (Chunks{1, 3, 2, 0}));
  EXPECT_TRUE(order.arrivals().empty());
}

TEST(LearnedOrder, RolledBackArrivalsAreForgotten) {
  LearnedOrder order({0, 1, 2});
  order.Arrived(0);
  order.StepRolledBack();
  order.Arrived(2);
  order.Arrived(1);
  order.Forget(2);  // one chunk's update rolled back
  order.Arrived(2);
  order.StepCommitted();
  EXPECT_EQ(order.predicted(), (Chunks{1, 2, 0}));
}

}  // namespace
}  // namespace fuyou
