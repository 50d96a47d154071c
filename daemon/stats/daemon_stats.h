// DaemonStats: the one registry of counters that the admin API reads.
// Counters are atomics bumped on the hot path; rates are computed from the
// difference between two samples taken about a second apart.
//
// Two scopes: the daemon-wide counters (storage traffic per path, every job's
// updates), which only administrators see, and one UserCounters per uid, which
// count that user's sessions and jobs only and are what GetStats shows to that
// user. A session bumps both.
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
#include "storage/io_engine.h"

namespace fuyou {

// Speculative updates and what undoing them cost (GetStatsResponse fields
// 19-23): chunk updates sent while backward ran, updates done again in the same
// step (GradReady.redo) by reason, updates rolled back because the loop skipped
// the step (AbortStep.reason SKIPPED_STEP or OVERFLOW), and the time the redos
// took (reading the committed states again, the kernel, the write-back's
// submission).
struct RedoCounters {
  std::atomic<uint64_t> chunks_speculative{0};
  std::atomic<uint64_t> chunks_redone_changed{0};
  std::atomic<uint64_t> chunks_redone_clipped{0};
  std::atomic<uint64_t> chunks_rolled_back_skipped_step{0};
  std::atomic<uint64_t> redo_nanoseconds{0};

  // Sets fields 19-23 of `response` from these counters.
  void Fill(v1::GetStatsResponse& response) const;
};

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

// Working weights streamed to clients (FetchWeights, GetStatsResponse fields
// 24-26): fetches answered, those answered from DRAM (a cached chunk, or a
// read-ahead that had finished or was in flight), and the bytes read from
// storage for them and their read-aheads (weights regions only).
struct WeightsCounters {
  std::atomic<uint64_t> weights_fetches{0};
  std::atomic<uint64_t> weights_fetch_cache_hits{0};
  std::atomic<uint64_t> weights_bytes_read{0};
};

// Gradient journals (GradReady.journal; GetStatsResponse fields 27-30): bytes
// journaled (each KEEP, ADD or REPLAY that wrote a chunk's journal), the bytes
// of those that went to the storage tier's scratch files, updates made from a
// journal (ADD and REPLAY) and the time they took (journal read, ops and add,
// kernel, write-back's submission).
struct JournalCounters {
  std::atomic<uint64_t> journal_bytes{0};
  std::atomic<uint64_t> journal_spilled_bytes{0};
  std::atomic<uint64_t> journal_replays{0};
  std::atomic<uint64_t> journal_replay_nanoseconds{0};

  // Sets fields 27-30 of `response` from these counters.
  void Fill(v1::GetStatsResponse& response) const;
};

// What one user's sessions did since the daemon started.
struct UserCounters {
  std::atomic<uint64_t> bytes_read{0};     // optimizer states read from storage for the user's jobs
  std::atomic<uint64_t> bytes_written{0};  // and written
  std::atomic<uint64_t> chunk_updates{0};
  std::atomic<uint64_t> params_updated{0};
  std::atomic<uint64_t> cache_hits{0};
  std::atomic<uint64_t> cache_misses{0};
  std::atomic<uint64_t> steps_committed{0};
  RedoCounters redo;
  WeightsCounters weights;
  JournalCounters journal;
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

  // Daemon-wide counters.
  std::atomic<uint64_t> chunk_updates{0};
  std::atomic<uint64_t> params_updated{0};
  std::atomic<uint64_t> cache_hits{0};
  std::atomic<uint64_t> cache_misses{0};
  std::atomic<uint64_t> steps_committed{0};
  RedoCounters redo;
  WeightsCounters weights;
  JournalCounters journal;
  // The kernel time of each chunk update (SegmentedUpdate of one GradReady, a
  // redo's included), and the time from one committed step to the next of the
  // same session (EndStep to EndStep; a session's first step is not observed).
  // Served as Prometheus histograms (metrics/metrics_text.h).
  Histogram chunk_update_seconds{Histogram::ChunkUpdateBounds()};
  Histogram step_seconds{Histogram::StepBounds()};

  // The counters of `uid`, created (zero) at first use. The reference stays valid
  // as long as this object. Thread-safe.
  UserCounters& ForUser(uid_t uid);

  // Daemon-wide rates: one read and one write rate per storage path. Thread-safe.
  StatsRates Rates(std::chrono::milliseconds min_window = std::chrono::milliseconds(1000));
  // The rates of `uid`'s activity: read_gbps and write_gbps have one entry, the
  // user's traffic over all paths. Thread-safe.
  StatsRates RatesForUser(uid_t uid, std::chrono::milliseconds min_window = std::chrono::milliseconds(1000));
  double uptime_seconds() const;

 private:
  struct User {
    UserCounters counters;
    RateWindow window;
  };
  std::vector<uint64_t> DaemonTotals() const;
  static std::vector<uint64_t> UserTotals(const UserCounters& counters);
  User& UserLocked(uid_t uid);

  std::vector<std::filesystem::path> storage_paths_;
  std::vector<std::unique_ptr<storage::IoCounters>> path_counters_;
  std::chrono::steady_clock::time_point start_;
  std::mutex mutex_;
  std::unique_ptr<RateWindow> daemon_window_;
  std::map<uid_t, std::unique_ptr<User>> users_;  // by uid; never erased (bounded by the system's uids)
};

}  // namespace fuyou
