// StreamActivity: what the idle reaper knows of an attached session's stream:
// when it last carried a message, whether a message is being handled, and how
// to end it. Shared by the stream's handler (OffloadService::Stream), which
// reports each message and detaches before it returns, and the SessionRegistry,
// which ends a stream idle for too long. Thread-safe.
#pragma once

#include <chrono>
#include <functional>
#include <mutex>
#include <utility>

namespace fuyou {

class StreamActivity {
 public:
  using Clock = std::chrono::steady_clock;

  // `cancel` ends the stream (ServerContext::TryCancel): the handler's pending
  // and next Read return false.
  explicit StreamActivity(std::function<void()> cancel) : cancel_(std::move(cancel)), last_(Clock::now()) {}

  // A message of the session (on the stream, or a RegisterChunks call) arrived
  // and is handled; then it was answered. Calls may overlap.
  void BeginMessage() {
    std::lock_guard lock(mutex_);
    ++busy_;
    last_ = Clock::now();
  }
  void EndMessage() {
    std::lock_guard lock(mutex_);
    --busy_;
    last_ = Clock::now();
  }
  // How long the session has gone without a message at `now`; zero while one is
  // being handled (an EndStep that waits for its writes is not idle).
  Clock::duration IdleFor(Clock::time_point now) const {
    std::lock_guard lock(mutex_);
    return busy_ > 0 || now < last_ ? Clock::duration::zero() : now - last_;
  }
  // Ends the stream, unless the handler has detached.
  void Cancel() {
    std::lock_guard lock(mutex_);
    if (cancel_) cancel_();
  }
  // The handler is returning: its context is about to go, Cancel must not touch it.
  void Detach() {
    std::lock_guard lock(mutex_);
    cancel_ = nullptr;
  }

 private:
  mutable std::mutex mutex_;
  std::function<void()> cancel_;
  Clock::time_point last_;
  int busy_ = 0;  // messages being handled
};

}  // namespace fuyou
