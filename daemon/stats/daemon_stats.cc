#include "stats/daemon_stats.h"

namespace fuyou {

RateWindow::RateWindow(std::vector<uint64_t> totals, std::chrono::steady_clock::time_point now)
    : when_(now), totals_(std::move(totals)), rates_(totals_.size(), 0.0) {}

const std::vector<double>& RateWindow::Update(std::vector<uint64_t> totals, std::chrono::steady_clock::time_point now,
                                              std::chrono::milliseconds min_window) {
  if (now - when_ < min_window || totals.size() != totals_.size()) return rates_;
  const double seconds = std::chrono::duration<double>(now - when_).count();
  for (size_t i = 0; i < totals.size(); ++i) {
    // Counters only grow; a difference is never negative.
    rates_[i] = static_cast<double>(totals[i] - totals_[i]) / seconds;
  }
  when_ = now;
  totals_ = std::move(totals);
  return rates_;
}

DaemonStats::DaemonStats(std::vector<std::filesystem::path> storage_paths)
    : storage_paths_(std::move(storage_paths)), start_(std::chrono::steady_clock::now()) {
  for (size_t i = 0; i < storage_paths_.size(); ++i) {
    path_counters_.push_back(std::make_unique<storage::IoCounters>());
  }
  daemon_window_ = std::make_unique<RateWindow>(DaemonTotals(), start_);
}

// Bytes read per path, bytes written per path, chunk updates, parameters updated.
std::vector<uint64_t> DaemonStats::DaemonTotals() const {
  std::vector<uint64_t> totals;
  for (const auto& counters : path_counters_) totals.push_back(counters->bytes_read.load());
  for (const auto& counters : path_counters_) totals.push_back(counters->bytes_written.load());
  totals.push_back(tickers.Get(Ticker::kChunkUpdates));
  totals.push_back(tickers.Get(Ticker::kParamsUpdated));
  return totals;
}

// Bytes read, bytes written, chunk updates, parameters updated.
std::vector<uint64_t> DaemonStats::UserTotals(const TickerCounts& counters) {
  return {counters.Get(Ticker::kBytesRead), counters.Get(Ticker::kBytesWritten), counters.Get(Ticker::kChunkUpdates),
          counters.Get(Ticker::kParamsUpdated)};
}

DaemonStats::User& DaemonStats::UserLocked(uid_t uid) {
  std::unique_ptr<User>& user = users_[uid];
  if (user == nullptr) {
    user.reset(new User{{}, RateWindow(std::vector<uint64_t>(4, 0), std::chrono::steady_clock::now())});
  }
  return *user;
}

TickerCounts& DaemonStats::ForUser(uid_t uid) {
  std::lock_guard lock(mutex_);
  return UserLocked(uid).counters;
}

StatsRates DaemonStats::Rates(std::chrono::milliseconds min_window) {
  std::lock_guard lock(mutex_);
  const std::vector<double>& per_second =
      daemon_window_->Update(DaemonTotals(), std::chrono::steady_clock::now(), min_window);
  const size_t paths = path_counters_.size();
  StatsRates rates;
  for (size_t i = 0; i < paths; ++i) {
    rates.read_gbps.push_back(per_second[i] / 1e9);
    rates.write_gbps.push_back(per_second[paths + i] / 1e9);
  }
  rates.chunk_updates_per_second = per_second[2 * paths];
  rates.params_updated_per_second = per_second[2 * paths + 1];
  return rates;
}

StatsRates DaemonStats::RatesForUser(uid_t uid, std::chrono::milliseconds min_window) {
  std::lock_guard lock(mutex_);
  User& user = UserLocked(uid);
  const std::vector<double>& per_second =
      user.window.Update(UserTotals(user.counters), std::chrono::steady_clock::now(), min_window);
  StatsRates rates;
  rates.read_gbps = {per_second[0] / 1e9};
  rates.write_gbps = {per_second[1] / 1e9};
  rates.chunk_updates_per_second = per_second[2];
  rates.params_updated_per_second = per_second[3];
  return rates;
}

double DaemonStats::uptime_seconds() const {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start_).count();
}

}  // namespace fuyou
