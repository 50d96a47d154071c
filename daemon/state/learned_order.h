// LearnedOrder: the order a job's chunks are expected to arrive in a step.
//
// Training sends every chunk once a step in (nearly) the same order, so the
// prediction for a step is the order the last committed step's chunks arrived
// in, followed by the chunks that did not come. Before any step it is the
// reverse of registration (the order backward produces gradients), newest
// registered first. ChunkStore prefetches along it.
//
// Not thread-safe (ChunkStore's calls are serialised).
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

namespace fuyou {

class LearnedOrder {
 public:
  // `registered`: the job's chunks in registration order (the manifest's order).
  explicit LearnedOrder(const std::vector<uint32_t>& registered);

  // A chunk registered now: predicted first, unless it is already known.
  void Registered(uint32_t chunk_id);
  // The chunk's update arrived in the current step (once per chunk and step).
  void Arrived(uint32_t chunk_id);
  // The chunk's arrival in the current step is undone (its update rolled back).
  void Forget(uint32_t chunk_id);
  // The current step committed: its arrivals, then the chunks that did not come
  // in their predicted order, are the next prediction.
  void StepCommitted();
  // The current step rolled back: its arrivals are forgotten, the prediction stays.
  void StepRolledBack();

  // Up to `count` chunks predicted right after `chunk_id`; empty when it is not predicted.
  std::vector<uint32_t> After(uint32_t chunk_id, size_t count) const;
  // The first `count` chunks predicted.
  std::vector<uint32_t> First(size_t count) const;
  const std::vector<uint32_t>& predicted() const { return predicted_; }
  const std::vector<uint32_t>& arrivals() const { return arrivals_; }

 private:
  std::vector<uint32_t> predicted_;
  std::vector<uint32_t> arrivals_;  // the current step's chunks in arrival order
};

}  // namespace fuyou
