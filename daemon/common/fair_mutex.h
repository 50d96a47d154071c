// FairMutex: a mutex whose waiters are granted it in FairQueue's order (by the
// bytes of work, per user, then per flow: common/fair_queue.h).
//
// Each Lock names who asks (a FairKey) and what its turn will cost (the bytes
// the holder will work through before Unlock). While the mutex is free, Lock
// takes it at once; otherwise the caller waits in the queue, and each Unlock
// hands the mutex straight to the queue's next waiter (never to a thread that
// comes later and finds it free). So a caller that works in many short turns
// (the AdamW kernel's slices of a big chunk, optimizer/adamw_kernel.h) lets
// the other users' waiters in between its turns, each user getting its
// quantum of bytes per round. A caller holds at most one place in line (Lock
// blocks). Uncontended, Lock and Unlock cost one std::mutex lock each.
#pragma once

#include <condition_variable>
#include <cstdint>
#include <mutex>

#include "common/fair_queue.h"

namespace fuyou {

class FairMutex {
 public:
  // quantum: FairQueue's; the cost of a typical turn.
  explicit FairMutex(uint64_t quantum) : waiting_(quantum) {}
  FairMutex(const FairMutex&) = delete;
  FairMutex& operator=(const FairMutex&) = delete;

  // Waits for the mutex; `key` and `cost` place the caller in the queue.
  void Lock(FairKey key, uint64_t cost) {
    std::unique_lock guard(mutex_);
    if (!held_) {
      held_ = true;
      return;
    }
    Waiter me;
    waiting_.PushBack(key, cost, &me);
    me.granted_cv.wait(guard, [&] { return me.granted; });
  }
  // Hands the mutex to the next waiter, or frees it. Only the holder calls it.
  void Unlock() {
    std::lock_guard guard(mutex_);
    if (waiting_.empty()) {
      held_ = false;
      return;
    }
    Waiter* next = waiting_.PopNext();
    next->granted = true;
    // Under mutex_: the waiter cannot return (and destroy its Waiter) before
    // this thread releases mutex_.
    next->granted_cv.notify_one();
  }

  // Callers waiting (not the holder). For tests.
  size_t waiting() const {
    std::lock_guard guard(mutex_);
    return waiting_.size();
  }

 private:
  struct Waiter {
    std::condition_variable granted_cv;
    bool granted = false;
  };

  mutable std::mutex mutex_;
  bool held_ = false;
  FairQueue<Waiter*> waiting_;
};

}  // namespace fuyou
