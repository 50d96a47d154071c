#include "common/fair_mutex.h"

#include <chrono>
#include <mutex>
#include <thread>
#include <vector>

#include "gtest/gtest.h"

namespace fuyou {
namespace {

constexpr uint64_t kQuantum = 1 << 20;

// Waits (without a time limit on the outcome) until `count` callers wait.
void AwaitWaiting(const FairMutex& mutex, size_t count) {
  while (mutex.waiting() < count) std::this_thread::sleep_for(std::chrono::microseconds(100));
}

TEST(FairMutexTest, UncontendedLockAndUnlock) {
  FairMutex mutex(kQuantum);
  for (int i = 0; i < 3; ++i) {
    mutex.Lock(FairKey{1, 1}, kQuantum);
    EXPECT_EQ(mutex.waiting(), 0u);
    mutex.Unlock();
  }
}

// The kernel's finding of issue 32: three sessions of a hog user ask before a
// small user's session; a FIFO (the ticket lock the kernel had) would grant the
// small user last. The fair mutex grants it after one turn of the hog.
TEST(FairMutexTest, ASmallUserIsGrantedAfterOneTurnOfAHog) {
  FairMutex mutex(kQuantum);
  mutex.Lock(FairKey{0, 0}, 0);  // held while the waiters line up
  std::mutex order_mu;
  std::vector<int> order;
  std::vector<std::thread> threads;
  auto ask = [&](int who, FairKey key, uint64_t cost) {
    threads.emplace_back([&, who, key, cost] {
      mutex.Lock(key, cost);
      {
        std::lock_guard guard(order_mu);
        order.push_back(who);
      }
      mutex.Unlock();
    });
  };
  for (int session = 1; session <= 3; ++session) {
    ask(session, FairKey{65534, static_cast<uint64_t>(session)}, kQuantum);
    AwaitWaiting(mutex, static_cast<size_t>(session));
  }
  ask(100, FairKey{1000, 7}, kQuantum / 16);
  AwaitWaiting(mutex, 4);
  mutex.Unlock();
  for (std::thread& t : threads) t.join();
  EXPECT_EQ(order, (std::vector<int>{1, 100, 2, 3}));
}

// Under contention every caller gets through, each holding the mutex alone.
TEST(FairMutexTest, MutualExclusionUnderContention) {
  FairMutex mutex(kQuantum);
  int inside = 0;
  int most_inside = 0;
  int64_t total = 0;
  std::vector<std::thread> threads;
  for (int t = 0; t < 6; ++t) {
    threads.emplace_back([&, t] {
      for (int i = 0; i < 2000; ++i) {
        mutex.Lock(FairKey{static_cast<uint64_t>(t % 3), static_cast<uint64_t>(t)}, kQuantum / (t + 1));
        most_inside = std::max(most_inside, ++inside);
        ++total;
        --inside;
        mutex.Unlock();
      }
    });
  }
  for (std::thread& t : threads) t.join();
  EXPECT_EQ(most_inside, 1);
  EXPECT_EQ(total, 6 * 2000);
  EXPECT_EQ(mutex.waiting(), 0u);
}

}  // namespace
}  // namespace fuyou
