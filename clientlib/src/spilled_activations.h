// SpilledActivations: the activations one session has spilled to the daemon
// (SpillActivation) and may recall, each by its key with its size in bytes.
// Private to clientlib. Not thread-safe: the session guards it with its mutex.
//
// A key moves  absent -> spilling (BeginSpill) -> spilled (EndSpill) -> absent
// (TakeForRecall, or Clear at the end of the step or DropActivations). A spill
// that failed part-way leaves its key spilling until the Clear: its pieces stay
// at the daemon until the drop, so the key can be neither spilled again nor
// recalled before.
#pragma once

#include <cstdint>
#include <map>
#include <optional>
#include <string>

#include "absl/status/status.h"

namespace fuyou::internal {

class SpilledActivations {
 public:
  // Marks `key` as spilling; false (nothing changed) when the key is spilled
  // or spilling already.
  bool BeginSpill(uint64_t key) { return sizes_.emplace(key, std::nullopt).second; }
  // The spill of `key` is complete: `bytes` bytes.
  void EndSpill(uint64_t key, uint64_t bytes) { sizes_[key] = bytes; }
  // Takes `key` for a recall into `bytes` bytes and forgets it, whatever the
  // recall then does. NOT_FOUND when it is not spilled, FAILED_PRECONDITION
  // when its spill failed, INVALID_ARGUMENT when it has another size (those
  // three change nothing); `who` names the session in their messages.
  absl::Status TakeForRecall(uint64_t key, uint64_t bytes, const std::string& who);
  // Forgets every key (the daemon drops them with the step).
  void Clear() { sizes_.clear(); }
  size_t size() const { return sizes_.size(); }

 private:
  std::map<uint64_t, std::optional<uint64_t>> sizes_;  // nullopt: spilling (or failed)
};

}  // namespace fuyou::internal
