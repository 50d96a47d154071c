// FetchOrder: the order a job's weight fetches (FetchWeights) are expected in.
//
// A model that streams its weights fetches every chunk twice a step: forward
// in module order (A..Z), then backward in reverse (Z..A), and a loop with
// gradient accumulation repeats that several times before its step ends. So
// the prediction is the whole sequence of the last step's fetches, repeats
// included (a chunk id alone does not say where in the step a fetch is); a
// cursor follows the fetches of the running step through it, and the fetches
// predicted after the cursor are the ones to read ahead. Before any step
// ended there is no prediction (no read-ahead).
//
// Bounded: a step records at most kMaxFetchesPerStep fetches (a loop that
// never ends a step, e.g. evaluation only, keeps its first ones).
//
// Not thread-safe (ChunkStore's calls are serialised).
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

namespace fuyou {

class FetchOrder {
 public:
  static constexpr size_t kMaxFetchesPerStep = size_t{1} << 20;

  // A fetch of `chunk_id` in the running step: recorded, and the cursor moves
  // just past its next predicted occurrence (wrapping to the start of the
  // sequence: the next step begins as this one did). Returns the chunks of up
  // to `count` predicted fetches after it, each once, without `chunk_id`;
  // empty when the fetch is not predicted at all.
  std::vector<uint32_t> Fetched(uint32_t chunk_id, size_t count);
  // The step ended (committed or rolled back: a skipped step fetched in the
  // same order): its fetches, when it had any, are the next prediction, and
  // the cursor goes back to its start.
  void StepEnded();
  // The chunks of the first `count` predicted fetches of a step, each once.
  std::vector<uint32_t> First(size_t count) const;
  const std::vector<uint32_t>& predicted() const { return predicted_; }

 private:
  // The chunks of the `count` predicted fetches from position `from`
  // (wrapping), each once, leaving out `except`.
  std::vector<uint32_t> Window(size_t from, size_t count, const uint32_t* except) const;

  std::vector<uint32_t> predicted_;  // the last step's fetches, in order
  std::vector<uint32_t> current_;    // the running step's fetches, in order
  size_t cursor_ = 0;                // in predicted_: just past the last fetch matched
};

}  // namespace fuyou
