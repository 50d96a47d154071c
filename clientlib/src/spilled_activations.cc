#include "spilled_activations.h"

#include "fmt/format.h"

namespace fuyou::internal {

absl::Status SpilledActivations::TakeForRecall(uint64_t key, uint64_t bytes, const std::string& who) {
  const auto found = sizes_.find(key);
  if (found == sizes_.end()) {
    return absl::NotFoundError(fmt::format(
        "RecallActivation: activation {} is not spilled in the session of {} (never spilled, already recalled, or "
        "dropped at the end of the step)",
        key, who));
  }
  if (!found->second) {
    return absl::FailedPreconditionError(
        fmt::format("RecallActivation: the spill of activation {} of {} failed", key, who));
  }
  if (*found->second != bytes) {
    return absl::InvalidArgumentError(fmt::format(
        "RecallActivation: activation {} of {} is {} bytes, not {}", key, who, *found->second, bytes));
  }
  sizes_.erase(found);
  return absl::OkStatus();
}

}  // namespace fuyou::internal
