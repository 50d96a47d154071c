// CommittedStep: the latest step the daemon committed for a session, as the
// session last learned it (OpenSession, StepCommitted, CloseSession). Read
// without a lock. Private to clientlib. Thread-safe.
#pragma once

#include <atomic>
#include <cstdint>

namespace fuyou::internal {

class CommittedStep {
 public:
  int64_t get() const { return step_.load(); }
  // What the daemon said in an answer to a call that asks for it.
  void Set(int64_t step) { step_.store(step); }
  // A StepCommitted of `step`: moves the step forward, never back (answers to
  // EndSteps of several threads may come in any order).
  void Advance(int64_t step) {
    int64_t current = step_.load();
    while (step > current && !step_.compare_exchange_weak(current, step)) {
    }
  }

 private:
  std::atomic<int64_t> step_{0};
};

}  // namespace fuyou::internal
