#include "common/fifo_mutex.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <mutex>
#include <thread>
#include <vector>

namespace fuyou {
namespace {

// While one caller waits for the lock, another that takes it in a loop (as a
// session sending update after update does) gets at most the turn it held
// and the one it was already in line for: the waiter is next. std::mutex lets
// the looping caller take the lock back at once, often hundreds of times in a
// row on a loaded machine, which this test catches.
TEST(FifoMutexTest, AWaiterIsServedBeforeALoopingCallerTakesAnotherTurn) {
  FifoMutex mutex;
  std::atomic<bool> stop{false};
  uint64_t loop_turns = 0;  // guarded by `mutex`
  std::atomic<uint64_t> seen{0};
  std::thread looping([&] {
    while (!stop.load()) {
      std::lock_guard guard(mutex);
      ++loop_turns;
      seen.store(loop_turns);
      // A little work in the critical section, as a chunk update has.
      volatile uint64_t work = 0;
      for (int i = 0; i < 2000; ++i) work = work + i;
    }
  });
  while (seen.load() < 10) std::this_thread::yield();
  uint64_t worst = 0;
  for (int i = 0; i < 500; ++i) {
    const uint64_t before = seen.load();
    std::lock_guard guard(mutex);
    worst = std::max(worst, loop_turns - before);
  }
  stop = true;
  looping.join();
  EXPECT_LE(worst, 2u) << "the looping caller took the lock again while another waited";
}

TEST(FifoMutexTest, ExcludesAndCountsEveryTurn) {
  FifoMutex mutex;
  int inside = 0, turns = 0;
  bool overlapped = false;
  std::vector<std::thread> callers;
  for (int t = 0; t < 4; ++t) {
    callers.emplace_back([&] {
      for (int i = 0; i < 1000; ++i) {
        std::lock_guard guard(mutex);
        if (++inside != 1) overlapped = true;
        ++turns;
        --inside;
      }
    });
  }
  for (std::thread& t : callers) t.join();
  EXPECT_FALSE(overlapped);
  EXPECT_EQ(turns, 4000);
}

}  // namespace
}  // namespace fuyou
