// Future<T> / Promise<T>: how fuyoud waits for work in flight.
//
// An asynchronous call returns a Future that says when the work is done and
// with what result: absl::Status for Future<void>, absl::StatusOr<T> otherwise
// (FutureResult<T>). The one who does the work holds the Promise and sets the
// result exactly once; any number of copies of the Future may wait for it
// (Wait), look at it (ready, result) or chain work onto it (Then). This is the
// shape of TensorStore's Future/Promise, cut down to what the daemon needs.
//
// Then(f) runs `f` on the thread that sets the result (an I/O completion
// thread, typically), or at once on the caller's thread when the result is
// already set, and returns the Future of what `f` returns. The returned Future
// is ready only after `f` has run: wait on it, not on the source, when `f`'s
// work must be finished (a checksum computed, a pin released).
//
// AllOf joins futures into one that is ready when all are, with the first
// error among them (in the order given) or OK; Countdown is the Promise of
// work split into a known number of parts. InFlight is a set of futures a
// caller started and must not outlive: Add, then WaitAll.
//
// Thread-safe: a Future may be waited on from any thread while its Promise is
// set on another. A Promise dropped without a result sets INTERNAL ("promise
// dropped"), so no waiter hangs on work that will never finish.
#pragma once

#include <cassert>
#include <condition_variable>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <span>
#include <type_traits>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace fuyou {

template <typename T>
struct FutureResultOf {
  using type = absl::StatusOr<T>;
};
template <>
struct FutureResultOf<void> {
  using type = absl::Status;
};
// What a Future<T> holds once ready.
template <typename T>
using FutureResult = typename FutureResultOf<T>::type;

// The status part of a result.
inline const absl::Status& StatusOf(const absl::Status& status) { return status; }
template <typename T>
const absl::Status& StatusOf(const absl::StatusOr<T>& result) {
  return result.status();
}

template <typename T>
class Future;
template <typename T>
class Promise;

namespace future_internal {

// The result shared by one Promise and its Futures.
template <typename T>
class State {
 public:
  using Result = FutureResult<T>;
  using Callback = std::function<void(const Result&)>;

  void Set(Result result) {
    std::vector<Callback> callbacks;
    {
      std::lock_guard lock(mutex_);
      assert(!result_.has_value() && "a Promise's result is set once");
      if (result_.has_value()) return;
      result_.emplace(std::move(result));
      callbacks.swap(callbacks_);
    }
    set_.notify_all();
    for (Callback& callback : callbacks) callback(*result_);  // result_ no longer changes
  }
  bool ready() const {
    std::lock_guard lock(mutex_);
    return result_.has_value();
  }
  const Result& Wait() const {
    std::unique_lock lock(mutex_);
    set_.wait(lock, [&] { return result_.has_value(); });
    return *result_;
  }
  // Runs `callback` when the result is set (now, on this thread, if it is).
  void OnReady(Callback callback) {
    {
      std::lock_guard lock(mutex_);
      if (!result_.has_value()) {
        callbacks_.push_back(std::move(callback));
        return;
      }
    }
    callback(*result_);
  }

 private:
  mutable std::mutex mutex_;
  mutable std::condition_variable set_;
  std::optional<Result> result_;  // guarded by mutex_; constant once set
  std::vector<Callback> callbacks_;
};

// The T of a Future whose continuation returns `R` (absl::Status or absl::StatusOr<U>).
template <typename R>
struct ValueOf;
template <>
struct ValueOf<absl::Status> {
  using type = void;
};
template <typename U>
struct ValueOf<absl::StatusOr<U>> {
  using type = U;
};

}  // namespace future_internal

// The writing end: sets the result of its Future once. Move-only.
template <typename T>
class Promise {
 public:
  using Result = FutureResult<T>;
  Promise() : state_(std::make_shared<future_internal::State<T>>()) {}
  ~Promise() {
    if (state_ != nullptr && !state_->ready()) state_->Set(Result(absl::InternalError("promise dropped")));
  }
  Promise(Promise&&) noexcept = default;
  Promise& operator=(Promise&& other) noexcept {
    if (this != &other) {
      Promise dropped(std::move(*this));
      state_ = std::move(other.state_);
    }
    return *this;
  }
  Promise(const Promise&) = delete;
  Promise& operator=(const Promise&) = delete;

  // The Future this promise sets; may be called more than once.
  Future<T> future() const { return Future<T>(state_); }
  // Sets the result and runs the continuations (Then) on this thread.
  // Precondition: not set before.
  void Set(Result result) {
    auto state = std::move(state_);
    state->Set(std::move(result));
  }

 private:
  std::shared_ptr<future_internal::State<T>> state_;
};

// The reading end. Copyable; an empty Future (default-constructed) holds
// nothing and must not be waited on.
template <typename T>
class Future {
 public:
  using Result = FutureResult<T>;
  Future() = default;

  bool valid() const { return state_ != nullptr; }
  // True once the result is set; never waits.
  bool ready() const { return state_->ready(); }
  // Waits until the result is set, then returns it.
  const Result& Wait() const { return state_->Wait(); }
  // The result; precondition: ready().
  const Result& result() const {
    assert(ready());
    return state_->Wait();
  }
  // The status part of the result, waiting for it.
  absl::Status status() const { return StatusOf(Wait()); }

  // Runs `f(const Result&)` once the result is set (see the file comment for
  // which thread) and returns the Future of what it returns: absl::Status
  // gives a Future<void>, absl::StatusOr<U> a Future<U>.
  template <typename F>
  auto Then(F f) const {
    using R = std::invoke_result_t<F&, const Result&>;
    using U = typename future_internal::ValueOf<R>::type;
    auto next = std::make_shared<Promise<U>>();
    Future<U> result = next->future();
    state_->OnReady([next, f = std::move(f)](const Result& result) mutable { next->Set(f(result)); });
    return result;
  }

 private:
  friend class Promise<T>;
  explicit Future(std::shared_ptr<future_internal::State<T>> state) : state_(std::move(state)) {}
  std::shared_ptr<future_internal::State<T>> state_;
};

// A Future that is ready with `result`.
template <typename T>
Future<T> MakeReadyFuture(FutureResult<T> result) {
  Promise<T> promise;
  Future<T> future = promise.future();
  promise.Set(std::move(result));
  return future;
}
inline Future<void> MakeReadyFuture() { return MakeReadyFuture<void>(absl::OkStatus()); }

// A Promise<void> shared by `count` parties: each one's end is one Arrive, and
// the last Arrive sets the future with the first error among them in the order
// they arrived (OK when none failed). With a count of 0 the future is ready at
// once. Exactly `count` Arrive calls; thread-safe; the future is set on the
// thread of the last Arrive (which runs its continuations).
class Countdown {
 public:
  explicit Countdown(size_t count) : remaining_(count) {
    if (count == 0) promise_.Set(absl::OkStatus());
  }
  Countdown(const Countdown&) = delete;
  Countdown& operator=(const Countdown&) = delete;

  Future<void> future() const { return future_; }
  void Arrive(absl::Status status = absl::OkStatus()) {
    absl::Status first;
    {
      std::lock_guard lock(mutex_);
      assert(remaining_ > 0 && "more Arrive calls than the count");
      if (!status.ok() && first_error_.ok()) first_error_ = std::move(status);
      if (--remaining_ > 0) return;
      first = std::move(first_error_);
    }
    promise_.Set(std::move(first));
  }

 private:
  std::mutex mutex_;
  size_t remaining_;          // guarded by mutex_
  absl::Status first_error_;  // guarded by mutex_
  Promise<void> promise_;
  const Future<void> future_ = promise_.future();
};

// A future ready when every one of `futures` is, with the first error among
// them in the order given (OK when none failed). Ready at once when empty.
template <typename T>
Future<void> AllOf(std::span<const Future<T>> futures) {
  if (futures.empty()) return MakeReadyFuture();
  auto arrived = std::make_shared<Countdown>(futures.size());
  for (const Future<T>& future : futures) {
    // Then's own Future is not needed: the countdown says when all are set.
    future.Then([arrived](const FutureResult<T>&) {
      arrived->Arrive();
      return absl::OkStatus();
    });
  }
  // Every one is ready when the countdown is: take the first error by position.
  return arrived->future().Then([all = std::vector<Future<T>>(futures.begin(), futures.end())](const absl::Status&) {
    for (const Future<T>& future : all) {
      if (!StatusOf(future.result()).ok()) return StatusOf(future.result());
    }
    return absl::OkStatus();
  });
}
template <typename T>
Future<void> AllOf(const std::vector<Future<T>>& futures) {
  return AllOf(std::span<const Future<T>>(futures));
}

// Waits for every one of `futures`; the first error in order, or OK.
template <typename T>
absl::Status WaitAll(std::span<const Future<T>> futures) {
  absl::Status first;
  for (const Future<T>& future : futures) {
    const absl::Status& status = StatusOf(future.Wait());
    if (first.ok() && !status.ok()) first = status;
  }
  return first;
}
template <typename T>
absl::Status WaitAll(const std::vector<Future<T>>& futures) {
  return WaitAll(std::span<const Future<T>>(futures));
}

// The work a caller started and must wait for before it goes (prefetches,
// read-aheads): Add each one's Future, WaitAll before the buffers or the
// caller go away. Futures already done are forgotten as new ones are added.
// Thread-safe.
class InFlight {
 public:
  void Add(Future<void> future) {
    std::lock_guard lock(mutex_);
    std::erase_if(futures_, [](const Future<void>& f) { return f.ready(); });
    futures_.push_back(std::move(future));
  }
  // Waits for every future added before the call; OK or the first error among them.
  absl::Status WaitAll() {
    std::vector<Future<void>> waiting;
    {
      std::lock_guard lock(mutex_);
      waiting.swap(futures_);
    }
    return fuyou::WaitAll(waiting);
  }

 private:
  std::mutex mutex_;
  std::vector<Future<void>> futures_;  // guarded by mutex_
};

}  // namespace fuyou
