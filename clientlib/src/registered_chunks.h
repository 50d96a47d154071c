// RegisteredChunks: the chunks registered in one session (their specs, as the
// job gave them) and what the daemon last reported of each one's update: the
// journal stats of its latest ParamsReady that used a gradient journal.
// Private to clientlib. Not thread-safe: the session guards it with its mutex.
#pragma once

#include <cstdint>
#include <map>
#include <optional>

#include "fuyou/client.h"
#include "fuyou/v1/offload.pb.h"

namespace fuyou::internal {

class RegisteredChunks {
 public:
  // The spec of chunk `chunk_id`, or null when it is not registered; valid
  // until the next Add.
  const ChunkSpec* Find(uint32_t chunk_id) const;
  bool contains(uint32_t chunk_id) const { return specs_.contains(chunk_id); }
  // Registers `spec` (replacing a spec of the same chunk id).
  void Add(const ChunkSpec& spec) { specs_[spec.chunk_id] = spec; }

  // Keeps the journal stats `ready` carries for its chunk; a ParamsReady with
  // none (an update without a journal) forgets the chunk's earlier ones.
  void RecordJournalStats(const v1::ParamsReady& ready);
  std::optional<JournalStats> JournalStatsOf(uint32_t chunk_id) const;

 private:
  std::map<uint32_t, ChunkSpec> specs_;
  std::map<uint32_t, JournalStats> journal_stats_;  // of each chunk's latest update that used a journal
};

}  // namespace fuyou::internal
