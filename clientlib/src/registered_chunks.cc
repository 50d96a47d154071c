#include "registered_chunks.h"

namespace fuyou::internal {

const ChunkSpec* RegisteredChunks::Find(uint32_t chunk_id) const {
  auto found = specs_.find(chunk_id);
  return found == specs_.end() ? nullptr : &found->second;
}

void RegisteredChunks::RecordJournalStats(const v1::ParamsReady& ready) {
  if (ready.segment_sum_squares_size() != 0 || ready.segment_max_abs_size() != 0) {
    journal_stats_[ready.chunk_id()] =
        JournalStats{{ready.segment_sum_squares().begin(), ready.segment_sum_squares().end()},
                     {ready.segment_max_abs().begin(), ready.segment_max_abs().end()}};
  } else {
    journal_stats_.erase(ready.chunk_id());
  }
}

std::optional<JournalStats> RegisteredChunks::JournalStatsOf(uint32_t chunk_id) const {
  auto found = journal_stats_.find(chunk_id);
  if (found == journal_stats_.end()) return std::nullopt;
  return found->second;
}

}  // namespace fuyou::internal
