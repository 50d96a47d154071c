#include "slot_pool.h"

#include "fmt/format.h"

namespace fuyou::internal {

SlotPool::SlotPool(uint32_t num_slots) : state_(num_slots, State::kFree), free_count_(num_slots) {}

absl::StatusOr<uint32_t> SlotPool::Acquire(std::chrono::milliseconds timeout) {
  std::unique_lock lock(mu_);
  const bool woke = freed_.wait_for(lock, timeout, [&] { return !failed_.ok() || free_count_ > 0; });
  if (!failed_.ok()) return failed_;
  if (!woke) {
    return absl::DeadlineExceededError(fmt::format(
        "no free slot within {} ms: all {} slots hold chunks in flight or not yet released "
        "(call PullParams or ReleaseSlot, or open the session with more slots)",
        timeout.count(), state_.size()));
  }
  for (uint32_t slot = 0; slot < state_.size(); ++slot) {
    if (state_[slot] == State::kFree) {
      state_[slot] = State::kHeld;
      --free_count_;
      return slot;
    }
  }
  return absl::InternalError("slot pool: free count and slot states disagree");
}

bool SlotPool::Release(uint32_t slot) {
  {
    std::lock_guard lock(mu_);
    if (slot >= state_.size() || state_[slot] != State::kHeld) return false;
    state_[slot] = State::kFree;
    ++free_count_;
  }
  freed_.notify_one();
  return true;
}

absl::Status SlotPool::BeginFlight(uint32_t slot) {
  std::lock_guard lock(mu_);
  if (slot >= state_.size()) {
    return absl::InvalidArgumentError(
        fmt::format("slot {} does not exist: the session has {} slots", slot, state_.size()));
  }
  if (state_[slot] != State::kHeld) {
    return absl::FailedPreconditionError(fmt::format(
        "slot {} is {}: take a slot with AcquireSlot before sending GradReady or FetchWeights for it", slot,
        state_[slot] == State::kFree ? "free" : "already in flight to the daemon"));
  }
  state_[slot] = State::kInFlight;
  return absl::OkStatus();
}

bool SlotPool::EndFlight(uint32_t slot) {
  std::lock_guard lock(mu_);
  if (slot >= state_.size() || state_[slot] != State::kInFlight) return false;
  state_[slot] = State::kHeld;
  return true;
}

void SlotPool::Fail(absl::Status status) {
  {
    std::lock_guard lock(mu_);
    if (failed_.ok()) failed_ = std::move(status);
  }
  freed_.notify_all();
}

uint32_t SlotPool::free_slots() const {
  std::lock_guard lock(mu_);
  return free_count_;
}

}  // namespace fuyou::internal
