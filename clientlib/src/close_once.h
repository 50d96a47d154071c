// CloseOnce: a close that runs once and whose result every later call gets.
// Private to clientlib. Thread-safe: a second caller waits for the first.
#pragma once

#include <mutex>
#include <utility>

#include "absl/status/status.h"

namespace fuyou::internal {

class CloseOnce {
 public:
  // Runs `close` unless it ran before; returns its result, now and on every later call.
  template <typename Close>
  absl::Status Run(Close&& close) {
    std::lock_guard lock(mu_);
    if (done_) return status_;
    status_ = std::forward<Close>(close)();
    done_ = true;
    return status_;
  }
  bool done() {
    std::lock_guard lock(mu_);
    return done_;
  }

 private:
  std::mutex mu_;
  bool done_ = false;
  absl::Status status_;
};

}  // namespace fuyou::internal
