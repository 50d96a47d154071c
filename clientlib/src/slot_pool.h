// SlotPool: which slots of a session's segment are free, held by the job, or
// handed to the daemon. Private to clientlib. Thread-safe.
//
// A slot moves  free -> held (Acquire) -> in flight (BeginFlight, when GradReady
// or FetchWeights is sent) -> held (EndFlight, when ParamsReady, WeightsFetched
// or an Error came back) -> free (Release). Once Fail() is called every waiting
// and later Acquire returns its status.
#pragma once

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <mutex>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace fuyou::internal {

class SlotPool {
 public:
  explicit SlotPool(uint32_t num_slots);

  // Takes a free slot, waiting up to `timeout`; DEADLINE_EXCEEDED when none
  // became free. The lowest free slot is taken first.
  absl::StatusOr<uint32_t> Acquire(std::chrono::milliseconds timeout);
  // Held -> free. Returns false (and changes nothing) for a slot that is not held.
  bool Release(uint32_t slot);
  // Held -> in flight. FAILED_PRECONDITION when the job does not hold `slot`.
  absl::Status BeginFlight(uint32_t slot);
  // In flight -> held. Returns false for a slot that was not in flight.
  bool EndFlight(uint32_t slot);
  // Wakes every waiter; later Acquire calls return `status`.
  void Fail(absl::Status status);

  uint32_t num_slots() const { return static_cast<uint32_t>(state_.size()); }
  uint32_t free_slots() const;

 private:
  enum class State : uint8_t { kFree, kHeld, kInFlight };

  mutable std::mutex mu_;
  std::condition_variable freed_;
  std::vector<State> state_;
  uint32_t free_count_;
  absl::Status failed_;
};

}  // namespace fuyou::internal
