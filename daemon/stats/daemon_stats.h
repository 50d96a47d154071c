// DaemonStats: the one registry of counters that the admin API reads.
// Counters are atomics bumped on the hot path; rates are computed from the
// difference between two samples taken about a second apart.
//
// Two scopes of the same tickers (stats/ticker.h): the daemon-wide counts
// (with the storage traffic per path, every job's updates), which only
// administrators see, and one TickerCounts per uid, which count that user's
// sessions and jobs only and are what GetStats shows to that user. An event is
// bumped once into both (StatsScopes::Bump).
#pragma once

#include <sys/types.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <filesystem>
#include <map>
#include <memory>
#include <mutex>
#include <vector>

#include "fuyou/v1/admin.pb.h"
#include "stats/histogram.h"
#include "stats/ticker.h"
#include "storage/io_engine.h"

namespace fuyou {

// Per-second rates of a fixed list of monotonic counters, between the newest
// sample at least `min_window` old and the sample before it, so that a burst of
// calls does not turn noise into rates. Not thread-safe.
class RateWindow {
 public:
  // Starts with `totals` sampled at `now`; rates are 0 until the first window closes.
  RateWindow(std::vector<uint64_t> totals, std::chrono::steady_clock::time_point now);
  // Samples `totals` (same length and order every call) at `now` and returns the
  // rates of the last closed window.
  const std::vector<double>& Update(std::vector<uint64_t> totals, std::chrono::steady_clock::time_point now,
                                    std::chrono::milliseconds min_window);

 private:
  std::chrono::steady_clock::time_point when_;
  std::vector<uint64_t> totals_;
  std::vector<double> rates_;
};

struct StatsRates {
  std::vector<double> read_gbps;  // per storage path (daemon scope) or one entry (user scope)
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

  // The daemon-wide counts (its kBytesRead and kBytesWritten are not shown:
  // the daemon scope's traffic is the storage paths').
  TickerCounts tickers;
  // The kernel time of each chunk update (SegmentedUpdate of one GradReady, a
  // redo's included), and the time from one committed step to the next of the
  // same session (EndStep to EndStep; a session's first step is not observed).
  // Served as Prometheus histograms (metrics/metrics_text.h).
  Histogram chunk_update_seconds{Histogram::ChunkUpdateBounds()};
  Histogram step_seconds{Histogram::StepBounds()};

  // The counts of `uid`, created (zero) at first use. The reference stays valid
  // as long as this object. Thread-safe.
  TickerCounts& ForUser(uid_t uid);
  // What `uid`'s activity bumps: the daemon's counts and ForUser(uid).
  StatsScopes ScopesOf(uid_t uid) { return StatsScopes(tickers, ForUser(uid)); }

  // Daemon-wide rates: one read and one write rate per storage path. Thread-safe.
  StatsRates Rates(std::chrono::milliseconds min_window = std::chrono::milliseconds(1000));
  // The rates of `uid`'s activity: read_gbps and write_gbps have one entry, the
  // user's traffic over all paths. Thread-safe.
  StatsRates RatesForUser(uid_t uid, std::chrono::milliseconds min_window = std::chrono::milliseconds(1000));
  double uptime_seconds() const;

 private:
  struct User {
    TickerCounts counters;
    RateWindow window;
  };
  std::vector<uint64_t> DaemonTotals() const;
  static std::vector<uint64_t> UserTotals(const TickerCounts& counters);
  User& UserLocked(uid_t uid);

  std::vector<std::filesystem::path> storage_paths_;
  std::vector<std::unique_ptr<storage::IoCounters>> path_counters_;
  std::chrono::steady_clock::time_point start_;
  std::mutex mutex_;
  std::unique_ptr<RateWindow> daemon_window_;
  std::map<uid_t, std::unique_ptr<User>> users_;  // by uid; never erased (bounded by the system's uids)
};

}  // namespace fuyou
