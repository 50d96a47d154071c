#include "slot_pool.h"

#include <gtest/gtest.h>

#include <chrono>
#include <thread>

namespace fuyou::internal {
namespace {

using std::chrono::milliseconds;

TEST(SlotPoolTest, HandsOutEachSlotOnceThenTimesOut) {
  SlotPool pool(2);
  EXPECT_EQ(*pool.Acquire(milliseconds(10)), 0u);
  EXPECT_EQ(*pool.Acquire(milliseconds(10)), 1u);
  absl::StatusOr<uint32_t> none = pool.Acquire(milliseconds(50));
  EXPECT_EQ(none.status().code(), absl::StatusCode::kDeadlineExceeded);
  EXPECT_NE(none.status().message().find("no free slot within 50 ms"), absl::string_view::npos);
  EXPECT_TRUE(pool.Release(1));
  EXPECT_EQ(*pool.Acquire(milliseconds(10)), 1u);
}

TEST(SlotPoolTest, ReleaseWakesAWaiter) {
  SlotPool pool(1);
  ASSERT_TRUE(pool.Acquire(milliseconds(10)).ok());
  std::thread releaser([&] {
    std::this_thread::sleep_for(milliseconds(100));
    pool.Release(0);
  });
  EXPECT_EQ(*pool.Acquire(milliseconds(5000)), 0u);
  releaser.join();
}

TEST(SlotPoolTest, InFlightSlotCannotBeReleasedOrSentTwice) {
  SlotPool pool(2);
  EXPECT_EQ(pool.BeginFlight(0).code(), absl::StatusCode::kFailedPrecondition);  // free
  EXPECT_EQ(pool.BeginFlight(7).code(), absl::StatusCode::kInvalidArgument);     // no such slot
  ASSERT_EQ(*pool.Acquire(milliseconds(10)), 0u);
  ASSERT_TRUE(pool.BeginFlight(0).ok());
  EXPECT_EQ(pool.BeginFlight(0).code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_FALSE(pool.Release(0));  // the daemon owns it
  EXPECT_EQ(pool.free_slots(), 1u);
  EXPECT_TRUE(pool.EndFlight(0));
  EXPECT_FALSE(pool.EndFlight(0));
  EXPECT_TRUE(pool.Release(0));
  EXPECT_FALSE(pool.Release(0));
  EXPECT_EQ(pool.free_slots(), 2u);
}

TEST(SlotPoolTest, FailWakesWaitersWithTheStatus) {
  SlotPool pool(1);
  ASSERT_TRUE(pool.Acquire(milliseconds(10)).ok());
  std::thread failer([&] {
    std::this_thread::sleep_for(milliseconds(100));
    pool.Fail(absl::UnavailableError("gone"));
  });
  const auto start = std::chrono::steady_clock::now();
  absl::StatusOr<uint32_t> slot = pool.Acquire(milliseconds(10000));
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(5));
  EXPECT_EQ(slot.status(), absl::UnavailableError("gone"));
  failer.join();
  pool.Release(0);
  EXPECT_EQ(pool.Acquire(milliseconds(10)).status(), absl::UnavailableError("gone"));
}

}  // namespace
}  // namespace fuyou::internal
