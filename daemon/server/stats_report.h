// StatsReport: the daemon-wide figures of GetStats (STATS_SCOPE_DAEMON), filled
// in one place for the two readers that show them: AdminService::GetStats
// (fuyouctl) and the Prometheus endpoint (metrics/metrics_text.h), so that both
// show the same numbers.
#pragma once

#include <sys/types.h>

#include <optional>
#include <vector>

#include "fuyou/v1/admin.pb.h"
#include "session/session_registry.h"
#include "state/state_cache.h"
#include "stats/daemon_stats.h"

namespace fuyou {

class StatsReport {
 public:
  // All three outlive this object. `direct_io`: one entry per storage path.
  StatsReport(DaemonStats& stats, SessionRegistry& sessions, StateCache& cache, std::vector<bool> direct_io)
      : stats_(stats), sessions_(sessions), cache_(cache), direct_io_(std::move(direct_io)) {}

  // Fills every STATS_SCOPE_DAEMON field of `response`. With `rates` false the
  // *_gbps and *_per_second fields stay 0 and the rate window GetStats reads is
  // left alone (Prometheus computes rates from the counters itself).
  // Thread-safe.
  void FillDaemonScope(bool rates, v1::GetStatsResponse* response) const;

  // The live sessions (every user's, or those of `only`; with `ranks_only`
  // only the ranks of data-parallel jobs), each marked with its data-parallel
  // job, rank and world size (server/data_parallel_groups.h). Session::Info
  // waits for the request a session is handling; `ranks_only` skips the other
  // sessions by name, without waiting for them.
  std::vector<v1::SessionInfo> Sessions(std::optional<uid_t> only, bool ranks_only = false) const;
  // Sets response.data_parallel_jobs from the live ranks' sessions of every
  // user (or of `only`). FillDaemonScope calls it for every user. Thread-safe.
  void FillDataParallel(std::optional<uid_t> only, v1::GetStatsResponse* response) const;

  DaemonStats& stats() const { return stats_; }

 private:
  DaemonStats& stats_;
  SessionRegistry& sessions_;
  StateCache& cache_;
  const std::vector<bool> direct_io_;
};

}  // namespace fuyou
