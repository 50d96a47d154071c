// DaemonStats: the one registry of counters that the admin API reads.
// Counters are atomics bumped on the hot path; rates are computed from the
// difference between two samples taken about a second apart.
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <filesystem>
#include <memory>
#include <mutex>
#include <vector>

#include "storage/io_engine.h"

namespace fuyou {

struct StatsSample {
  std::chrono::steady_clock::time_point when;
  std::vector<uint64_t> path_bytes_read;
  std::vector<uint64_t> path_bytes_written;
  uint64_t chunk_updates = 0;
  uint64_t params_updated = 0;
};

struct StatsRates {
  std::vector<double> read_gbps;
  std::vector<double> write_gbps;
  double chunk_updates_per_second = 0;
  double params_updated_per_second = 0;
};

class DaemonStats {
 public:
  explicit DaemonStats(std::vector<std::filesystem::path> storage_paths);

  // Traffic counters of storage path `index` (owned here, stable address).
  storage::IoCounters* path_counters(size_t index) { return path_counters_[index].get(); }
  const std::vector<std::filesystem::path>& storage_paths() const { return storage_paths_; }

  std::atomic<uint64_t> chunk_updates{0};
  std::atomic<uint64_t> params_updated{0};
  std::atomic<uint64_t> cache_hits{0};
  std::atomic<uint64_t> cache_misses{0};
  std::atomic<uint64_t> steps_committed{0};

  // Rates between the newest sample at least `min_window` old and now. Thread-safe.
  StatsRates Rates(std::chrono::milliseconds min_window = std::chrono::milliseconds(1000));
  double uptime_seconds() const;

 private:
  StatsSample TakeSample() const;

  std::vector<std::filesystem::path> storage_paths_;
  std::vector<std::unique_ptr<storage::IoCounters>> path_counters_;
  std::chrono::steady_clock::time_point start_;
  std::mutex mutex_;
  StatsSample previous_;  // sample the last rates were computed against
  StatsSample current_;   // newest sample
  StatsRates last_rates_;
};

}  // namespace fuyou
