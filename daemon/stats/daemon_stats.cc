#include "stats/daemon_stats.h"

namespace fuyou {

DaemonStats::DaemonStats(std::vector<std::filesystem::path> storage_paths)
    : storage_paths_(std::move(storage_paths)), start_(std::chrono::steady_clock::now()) {
  for (size_t i = 0; i < storage_paths_.size(); ++i) {
    path_counters_.push_back(std::make_unique<storage::IoCounters>());
  }
  previous_ = current_ = TakeSample();
  last_rates_.read_gbps.assign(storage_paths_.size(), 0.0);
  last_rates_.write_gbps.assign(storage_paths_.size(), 0.0);
}

StatsSample DaemonStats::TakeSample() const {
  StatsSample sample;
  sample.when = std::chrono::steady_clock::now();
  for (const auto& counters : path_counters_) {
    sample.path_bytes_read.push_back(counters->bytes_read.load());
    sample.path_bytes_written.push_back(counters->bytes_written.load());
  }
  sample.chunk_updates = chunk_updates.load();
  sample.params_updated = params_updated.load();
  return sample;
}

StatsRates DaemonStats::Rates(std::chrono::milliseconds min_window) {
  std::lock_guard lock(mutex_);
  StatsSample now = TakeSample();
  // Sample windows are at least `min_window` long so a burst of GetStats calls
  // does not turn noise into rates.
  if (now.when - current_.when >= min_window) {
    previous_ = std::move(current_);
    current_ = std::move(now);
    double seconds = std::chrono::duration<double>(current_.when - previous_.when).count();
    StatsRates rates;
    for (size_t i = 0; i < path_counters_.size(); ++i) {
      rates.read_gbps.push_back((current_.path_bytes_read[i] - previous_.path_bytes_read[i]) / seconds / 1e9);
      rates.write_gbps.push_back((current_.path_bytes_written[i] - previous_.path_bytes_written[i]) / seconds / 1e9);
    }
    rates.chunk_updates_per_second = (current_.chunk_updates - previous_.chunk_updates) / seconds;
    rates.params_updated_per_second = (current_.params_updated - previous_.params_updated) / seconds;
    last_rates_ = rates;
  }
  return last_rates_;
}

double DaemonStats::uptime_seconds() const {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start_).count();
}

}  // namespace fuyou
