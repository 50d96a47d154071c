// LogThrottle: lets a repeated message through at most once per period, and
// says how many were held back since. For events an attacker can repeat at will
// (refused connections, accept failures), so that the log stays small.
//
//   static LogThrottle throttle(std::chrono::seconds(10));
//   if (auto held_back = throttle.Allow()) log::Warn("... ({} more not logged)", *held_back);
#pragma once

#include <chrono>
#include <cstdint>
#include <mutex>
#include <optional>

namespace fuyou {

class LogThrottle {
 public:
  using Clock = std::chrono::steady_clock;
  explicit LogThrottle(Clock::duration period) : period_(period) {}

  // The count of events held back since the last one let through, when this
  // one may be logged; nullopt when it is to be dropped (and counted).
  std::optional<uint64_t> Allow(Clock::time_point now = Clock::now()) {
    std::lock_guard lock(mutex_);
    if (logged_once_ && now - last_ < period_) {
      ++held_back_;
      return std::nullopt;
    }
    logged_once_ = true;
    last_ = now;
    const uint64_t held_back = held_back_;
    held_back_ = 0;
    return held_back;
  }

 private:
  const Clock::duration period_;
  std::mutex mutex_;
  bool logged_once_ = false;
  Clock::time_point last_{};
  uint64_t held_back_ = 0;
};

}  // namespace fuyou
