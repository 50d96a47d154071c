#include "state/fetch_order.h"

#include <algorithm>
#include <unordered_set>

namespace fuyou {

std::vector<uint32_t> FetchOrder::Fetched(uint32_t chunk_id, size_t count) {
  if (current_.size() < kMaxFetchesPerStep) current_.push_back(chunk_id);
  if (predicted_.empty()) return {};
  // The next occurrence at or after the cursor, else the first one before it.
  const auto from_cursor = predicted_.begin() + static_cast<std::ptrdiff_t>(cursor_);
  auto found = std::find(from_cursor, predicted_.end(), chunk_id);
  if (found == predicted_.end()) {
    found = std::find(predicted_.begin(), from_cursor, chunk_id);
    if (found == from_cursor) return {};
  }
  cursor_ = static_cast<size_t>(found - predicted_.begin()) + 1;
  if (cursor_ == predicted_.size()) cursor_ = 0;
  return Window(cursor_, count, &chunk_id);
}

void FetchOrder::StepEnded() {
  if (!current_.empty()) predicted_ = std::move(current_);
  current_.clear();
  cursor_ = 0;
}

std::vector<uint32_t> FetchOrder::First(size_t count) const { return Window(0, count, nullptr); }

std::vector<uint32_t> FetchOrder::Window(size_t from, size_t count, const uint32_t* except) const {
  std::vector<uint32_t> chunks;
  std::unordered_set<uint32_t> taken;  // linear in `count`: the window may be thousands deep
  const size_t size = predicted_.size();
  for (size_t i = 0; i < std::min(count, size); ++i) {
    const uint32_t chunk_id = predicted_[(from + i) % size];
    if (except != nullptr && chunk_id == *except) continue;
    if (taken.insert(chunk_id).second) chunks.push_back(chunk_id);
  }
  return chunks;
}

}  // namespace fuyou
