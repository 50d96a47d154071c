// FifoMutex: a mutex granted in the order lock() was called (a ticket lock).
//
// std::mutex lets the thread that just unlocked take the lock again before a
// waiter wakes up, so a caller in a loop can keep the lock for as long as it
// loops. FifoMutex hands it to the longest waiter instead: with callers that
// each hold at most one place in line (the daemon's sessions, each calling the
// AdamW kernel from its one thread, see optimizer/adamw_kernel.h), they are
// served round-robin. Uncontended, it costs one std::mutex lock and unlock
// more than a std::mutex. Meets Lockable's lock/unlock (std::lock_guard);
// not try_lock.
#pragma once

#include <condition_variable>
#include <cstdint>
#include <mutex>

namespace fuyou {

class FifoMutex {
 public:
  FifoMutex() = default;
  FifoMutex(const FifoMutex&) = delete;
  FifoMutex& operator=(const FifoMutex&) = delete;

  // Waits until every earlier lock() has had its turn and unlocked.
  void lock() {
    std::unique_lock guard(mutex_);
    const uint64_t ticket = next_ticket_++;
    turn_.wait(guard, [&] { return serving_ == ticket; });
  }
  // Gives the lock to the next in line. Only the holder calls it.
  void unlock() {
    {
      std::lock_guard guard(mutex_);
      ++serving_;
      if (serving_ == next_ticket_) return;  // nobody waits: no wake-up
    }
    turn_.notify_all();
  }

 private:
  std::mutex mutex_;
  std::condition_variable turn_;
  uint64_t next_ticket_ = 0;  // the ticket the next lock() takes
  uint64_t serving_ = 0;      // the ticket that holds the lock (or may take it)
};

}  // namespace fuyou
