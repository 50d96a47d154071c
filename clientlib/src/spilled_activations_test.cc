// SpilledActivations: a key is spilled once, recalled once at its own size,
// and a failed spill blocks the key until the activations are dropped.
#include "spilled_activations.h"

#include <gtest/gtest.h>

namespace fuyou::internal {
namespace {

constexpr const char* kWho = "job 'j' (session s)";

TEST(SpilledActivationsTest, AKeyIsRecalledOnceAtItsOwnSize) {
  SpilledActivations activations;
  ASSERT_TRUE(activations.BeginSpill(7));
  EXPECT_FALSE(activations.BeginSpill(7)) << "spilled twice";
  activations.EndSpill(7, 4096);
  const absl::Status wrong_size = activations.TakeForRecall(7, 100, kWho);
  EXPECT_EQ(wrong_size, absl::InvalidArgumentError(
                            "RecallActivation: activation 7 of job 'j' (session s) is 4096 bytes, not 100"));
  EXPECT_TRUE(activations.TakeForRecall(7, 4096, kWho).ok()) << "a wrong size changes nothing";
  const absl::Status again = activations.TakeForRecall(7, 4096, kWho);
  EXPECT_EQ(again.code(), absl::StatusCode::kNotFound);
  EXPECT_NE(again.message().find("activation 7 is not spilled in the session of job 'j' (session s)"),
            absl::string_view::npos)
      << again;
  EXPECT_TRUE(activations.BeginSpill(7)) << "a recalled key may be spilled again";
}

TEST(SpilledActivationsTest, AFailedSpillBlocksTheKeyUntilTheDrop) {
  SpilledActivations activations;
  ASSERT_TRUE(activations.BeginSpill(1));  // and never EndSpill: failed part-way
  EXPECT_EQ(activations.TakeForRecall(1, 10, kWho),
            absl::FailedPreconditionError("RecallActivation: the spill of activation 1 of job 'j' (session s) failed"));
  EXPECT_FALSE(activations.BeginSpill(1));
  activations.Clear();
  EXPECT_EQ(activations.size(), 0u);
  EXPECT_TRUE(activations.BeginSpill(1));
}

}  // namespace
}  // namespace fuyou::internal
