// Session: activation offload's SSD tier (SpillActivation, RecallActivation,
// DropActivations) against the fake daemon.
#include <gtest/gtest.h>

#include "session_test_fixture.h"

namespace fuyou::session_test {
namespace {

std::vector<std::byte> Pattern(size_t n, uint8_t seed) {
  std::vector<std::byte> out(n);
  for (size_t i = 0; i < n; ++i) out[i] = static_cast<std::byte>(seed + i * 31);
  return out;
}

TEST_F(SessionTest, SpillAndRecallGiveBackTheBytesInPiecesOfASlot) {
  absl::StatusOr<std::unique_ptr<Session>> session = Open(/*slots=*/2, /*slot_bytes=*/4096);
  ASSERT_TRUE(session.ok()) << session.status();
  Session& s = **session;
  const std::vector<std::byte> big = Pattern(3 * 4096 + 100, 1);  // four pieces
  const std::vector<std::byte> small = Pattern(10, 2);
  ASSERT_TRUE(s.SpillActivation(5, big).ok());
  ASSERT_TRUE(s.SpillActivation(6, small).ok());
  EXPECT_EQ(fake_.ActivationsHeld(), 5u);
  EXPECT_EQ(s.SpillActivation(5, small).code(), absl::StatusCode::kInvalidArgument);  // already spilled
  EXPECT_EQ(s.SpillActivation(Session::kMaxActivationKey, small).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(s.SpillActivation(9, {}).code(), absl::StatusCode::kInvalidArgument);

  std::vector<std::byte> wrong(11);
  EXPECT_EQ(s.RecallActivation(6, wrong).code(), absl::StatusCode::kInvalidArgument);  // not its size
  std::vector<std::byte> out(big.size());
  ASSERT_TRUE(s.RecallActivation(5, out).ok());
  EXPECT_EQ(out, big);
  EXPECT_EQ(s.RecallActivation(5, out).code(), absl::StatusCode::kNotFound);  // recalled once
  EXPECT_EQ(fake_.ActivationsHeld(), 1u);
  ASSERT_TRUE(s.DropActivations().ok());
  EXPECT_EQ(fake_.ActivationsHeld(), 0u);
  std::vector<std::byte> out_small(small.size());
  EXPECT_EQ(s.RecallActivation(6, out_small).code(), absl::StatusCode::kNotFound);  // dropped
  // Every slot is free again: a spill of two pieces at once still goes through.
  ASSERT_TRUE(s.SpillActivation(7, Pattern(8192, 3)).ok());
}

TEST_F(SessionTest, EndStepForgetsTheSpilledActivations) {
  absl::StatusOr<std::unique_ptr<Session>> session = Open();
  ASSERT_TRUE(session.ok()) << session.status();
  Session& s = **session;
  const std::vector<std::byte> bytes = Pattern(100, 4);
  ASSERT_TRUE(s.SpillActivation(1, bytes).ok());
  ASSERT_TRUE(s.EndStep(1).ok());
  std::vector<std::byte> out(bytes.size());
  // The client forgets them with the step, as fuyoud drops them (the fake keeps its copy).
  EXPECT_EQ(s.RecallActivation(1, out).code(), absl::StatusCode::kNotFound);
}

}  // namespace
}  // namespace fuyou::session_test
