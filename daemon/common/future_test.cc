#include "common/future.h"

#include <gtest/gtest.h>

#include <atomic>
#include <string>
#include <thread>
#include <vector>

namespace fuyou {
namespace {

TEST(FutureTest, WaitReturnsTheResultSetOnAnotherThread) {
  Promise<int> promise;
  Future<int> future = promise.future();
  EXPECT_FALSE(future.ready());
  std::thread setter([&] { promise.Set(42); });
  EXPECT_EQ(*future.Wait(), 42);
  EXPECT_TRUE(future.ready());
  setter.join();
}

TEST(FutureTest, VoidFutureCarriesAStatus) {
  Promise<void> promise;
  Future<void> future = promise.future();
  promise.Set(absl::DataLossError("torn"));
  EXPECT_EQ(future.status().code(), absl::StatusCode::kDataLoss);
  EXPECT_EQ(future.result().message(), "torn");
}

TEST(FutureTest, DroppedPromiseSetsInternal) {
  Future<int> future;
  {
    Promise<int> promise;
    future = promise.future();
  }
  ASSERT_TRUE(future.ready());
  EXPECT_EQ(future.status().code(), absl::StatusCode::kInternal);
}

TEST(FutureTest, ThenRunsOnTheSettingThreadAndChains) {
  Promise<void> promise;
  std::thread::id ran_on;
  Future<std::string> next = promise.future().Then([&](const absl::Status& status) -> absl::StatusOr<std::string> {
    ran_on = std::this_thread::get_id();
    if (!status.ok()) return status;
    return std::string("done");
  });
  EXPECT_FALSE(next.ready());
  std::thread setter([&] { promise.Set(absl::OkStatus()); });
  setter.join();
  ASSERT_TRUE(next.ready());  // set only after the continuation ran
  EXPECT_EQ(*next.result(), "done");
  EXPECT_NE(ran_on, std::this_thread::get_id());
}

TEST(FutureTest, ThenOnAReadyFutureRunsAtOnceAndPassesErrors) {
  Future<void> failed = MakeReadyFuture<void>(absl::UnavailableError("busy"));
  bool ran = false;
  Future<int> next = failed.Then([&](const absl::Status& status) -> absl::StatusOr<int> {
    ran = true;
    return status;
  });
  EXPECT_TRUE(ran);
  EXPECT_EQ(next.status().code(), absl::StatusCode::kUnavailable);
}

TEST(FutureTest, AllOfIsReadyWhenEveryOneIsWithTheFirstErrorInOrder) {
  std::vector<Promise<void>> promises(3);
  std::vector<Future<void>> futures;
  for (Promise<void>& promise : promises) futures.push_back(promise.future());
  Future<void> all = AllOf(futures);
  promises[2].Set(absl::InternalError("third"));
  promises[1].Set(absl::DataLossError("second"));
  EXPECT_FALSE(all.ready());
  promises[0].Set(absl::OkStatus());
  ASSERT_TRUE(all.ready());
  EXPECT_EQ(all.status().message(), "second");
  EXPECT_TRUE(AllOf(std::vector<Future<void>>{}).ready());
}

TEST(FutureTest, CountdownIsSetByTheLastArriveWithTheFirstErrorInArrivalOrder) {
  Countdown countdown(3);
  Future<void> done = countdown.future();
  countdown.Arrive(absl::DataLossError("first"));
  EXPECT_FALSE(done.ready());
  countdown.Arrive();
  EXPECT_FALSE(done.ready());
  countdown.Arrive(absl::InternalError("second"));
  ASSERT_TRUE(done.ready());
  EXPECT_EQ(done.status().message(), "first");
}

TEST(FutureTest, CountdownOfZeroIsReadyAtOnce) {
  Countdown countdown(0);
  ASSERT_TRUE(countdown.future().ready());
  EXPECT_TRUE(countdown.future().status().ok());
}

TEST(FutureTest, CountdownJoinsThreadsAndRunsContinuationsOnTheLast) {
  constexpr int kThreads = 8;
  Countdown countdown(kThreads);
  std::atomic<int> arrived{0};
  std::atomic<int> seen_at_continuation{-1};
  Future<void> after = countdown.future().Then([&](const absl::Status& status) {
    seen_at_continuation = arrived.load();
    return status;
  });
  std::vector<std::thread> threads;
  for (int i = 0; i < kThreads; ++i) {
    threads.emplace_back([&] {
      arrived.fetch_add(1);
      countdown.Arrive();
    });
  }
  EXPECT_TRUE(after.status().ok());
  EXPECT_EQ(seen_at_continuation.load(), kThreads);
  for (std::thread& thread : threads) thread.join();
}

TEST(FutureTest, WaitAllWaitsForEveryFuture) {
  std::vector<Promise<int>> promises(4);
  std::vector<Future<int>> futures;
  for (Promise<int>& promise : promises) futures.push_back(promise.future());
  std::thread setter([&] {
    for (int i = 0; i < 4; ++i) promises[i].Set(i);
  });
  EXPECT_TRUE(WaitAll(futures).ok());
  for (const Future<int>& future : futures) EXPECT_TRUE(future.ready());
  setter.join();
}

TEST(FutureTest, InFlightWaitsForWhatWasAddedAndForgetsWhatIsDone) {
  InFlight in_flight;
  std::atomic<int> finished{0};
  std::vector<std::thread> workers;
  for (int i = 0; i < 8; ++i) {
    Promise<void> promise;
    in_flight.Add(promise.future().Then([&](const absl::Status& status) {
      finished.fetch_add(1);
      return status;
    }));
    workers.emplace_back([promise = std::move(promise)]() mutable { promise.Set(absl::OkStatus()); });
  }
  EXPECT_TRUE(in_flight.WaitAll().ok());
  EXPECT_EQ(finished.load(), 8);  // every continuation ran before WaitAll returned
  for (std::thread& worker : workers) worker.join();
  in_flight.Add(MakeReadyFuture<void>(absl::AbortedError("x")));
  EXPECT_EQ(in_flight.WaitAll().code(), absl::StatusCode::kAborted);
  EXPECT_TRUE(in_flight.WaitAll().ok());  // emptied
}

}  // namespace
}  // namespace fuyou
