#include "state/fetch_order.h"

#include <gtest/gtest.h>

namespace fuyou {
namespace {

using Ids = std::vector<uint32_t>;

// One step of a streamed model: forward 1, 2, 3, then backward 3, 2, 1.
void FetchStep(FetchOrder& order, size_t window, std::vector<Ids>* read_ahead = nullptr) {
  for (uint32_t id : {1u, 2u, 3u, 3u, 2u, 1u}) {
    Ids next = order.Fetched(id, window);
    if (read_ahead != nullptr) read_ahead->push_back(std::move(next));
  }
}

TEST(FetchOrderTest, NothingIsPredictedBeforeAStepEnded) {
  FetchOrder order;
  std::vector<Ids> read_ahead;
  FetchStep(order, 2, &read_ahead);
  for (const Ids& ids : read_ahead) EXPECT_TRUE(ids.empty());
  EXPECT_TRUE(order.First(2).empty());
}

TEST(FetchOrderTest, TheSecondStepReadsAheadAlongForwardThenBackward) {
  FetchOrder order;
  FetchStep(order, 2);
  order.StepEnded();
  EXPECT_EQ(order.predicted(), (Ids{1, 2, 3, 3, 2, 1}));
  EXPECT_EQ(order.First(2), (Ids{1, 2}));
  std::vector<Ids> read_ahead;
  FetchStep(order, 2, &read_ahead);
  // The window is the next two fetches, each chunk once, without the one fetched.
  EXPECT_EQ(read_ahead[0], (Ids{2, 3}));  // after forward 1
  EXPECT_EQ(read_ahead[1], (Ids{3}));     // after forward 2: 3 forward, 3 backward
  EXPECT_EQ(read_ahead[2], (Ids{2}));     // after forward 3: 3 backward, 2
  EXPECT_EQ(read_ahead[3], (Ids{2, 1}));  // after backward 3: the second occurrence matched
  EXPECT_EQ(read_ahead[4], (Ids{1}));     // after backward 2: 1, then the next step's 1
  EXPECT_EQ(read_ahead[5], (Ids{2}));     // after backward 1: wraps to the next step's 1, 2
}

TEST(FetchOrderTest, AnUnpredictedFetchReadsNothingAheadAndAnEmptyStepKeepsThePrediction) {
  FetchOrder order;
  FetchStep(order, 2);
  order.StepEnded();
  EXPECT_TRUE(order.Fetched(9, 2).empty());
  order.StepEnded();  // a step that fetched only 9 replaces the prediction
  EXPECT_EQ(order.predicted(), (Ids{9}));
  order.StepEnded();  // a step without fetches keeps it
  EXPECT_EQ(order.predicted(), (Ids{9}));
}

}  // namespace
}  // namespace fuyou
