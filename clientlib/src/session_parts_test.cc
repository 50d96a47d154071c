// The session's smallest parts: CommittedStep never moves back on a
// StepCommitted, CloseOnce runs its close once and repeats its result, and
// SessionName names the session.
#include <gtest/gtest.h>

#include <thread>
#include <vector>

#include "close_once.h"
#include "committed_step.h"
#include "session_name.h"

namespace fuyou::internal {
namespace {

TEST(CommittedStepTest, AdvanceNeverMovesBackButSetDoes) {
  CommittedStep step;
  EXPECT_EQ(step.get(), 0);
  step.Advance(5);
  step.Advance(3);
  EXPECT_EQ(step.get(), 5);
  step.Set(2);  // the daemon's own word (OpenSession, CloseSession)
  EXPECT_EQ(step.get(), 2);
}

TEST(CommittedStepTest, ConcurrentAdvancesKeepTheHighest) {
  CommittedStep step;
  std::vector<std::thread> threads;
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&step, t] {
      for (int64_t s = t; s < 4000; s += 4) step.Advance(s);
    });
  }
  for (std::thread& thread : threads) thread.join();
  EXPECT_EQ(step.get(), 3999);
}

TEST(CloseOnceTest, RunsOnceAndRepeatsItsResult) {
  CloseOnce close;
  int runs = 0;
  EXPECT_FALSE(close.done());
  EXPECT_EQ(close.Run([&] {
    ++runs;
    return absl::UnavailableError("lost");
  }),
            absl::UnavailableError("lost"));
  EXPECT_TRUE(close.done());
  EXPECT_EQ(close.Run([&] {
    ++runs;
    return absl::OkStatus();
  }),
            absl::UnavailableError("lost"));
  EXPECT_EQ(runs, 1);
}

TEST(SessionNameTest, NamesJobAndSession) {
  EXPECT_EQ((SessionName{.job = "llama", .id = "s-1"}).Who(), "job 'llama' (session s-1)");
}

}  // namespace
}  // namespace fuyou::internal
