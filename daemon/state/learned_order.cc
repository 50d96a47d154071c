#include "state/learned_order.h"

#include <algorithm>
#include <set>

namespace fuyou {

LearnedOrder::LearnedOrder(const std::vector<uint32_t>& registered)
    : predicted_(registered.rbegin(), registered.rend()) {}

void LearnedOrder::Registered(uint32_t chunk_id) {
  if (std::find(predicted_.begin(), predicted_.end(), chunk_id) == predicted_.end()) {
    predicted_.insert(predicted_.begin(), chunk_id);  // newest registered: first in backward
  }
}

void LearnedOrder::Arrived(uint32_t chunk_id) { arrivals_.push_back(chunk_id); }

void LearnedOrder::Forget(uint32_t chunk_id) { std::erase(arrivals_, chunk_id); }

void LearnedOrder::StepCommitted() {
  const std::set<uint32_t> arrived(arrivals_.begin(), arrivals_.end());
  std::vector<uint32_t> next = std::move(arrivals_);
  for (uint32_t chunk_id : predicted_) {
    if (arrived.count(chunk_id) == 0) next.push_back(chunk_id);
  }
  predicted_ = std::move(next);
  arrivals_.clear();
}

void LearnedOrder::StepRolledBack() { arrivals_.clear(); }

std::vector<uint32_t> LearnedOrder::After(uint32_t chunk_id, size_t count) const {
  auto position = std::find(predicted_.begin(), predicted_.end(), chunk_id);
  if (position == predicted_.end()) return {};
  ++position;
  const auto end = position + static_cast<std::ptrdiff_t>(
                                  std::min(count, static_cast<size_t>(predicted_.end() - position)));
  return std::vector<uint32_t>(position, end);
}

std::vector<uint32_t> LearnedOrder::First(size_t count) const {
  return std::vector<uint32_t>(predicted_.begin(),
                               predicted_.begin() + static_cast<std::ptrdiff_t>(std::min(count, predicted_.size())));
}

}  // namespace fuyou
