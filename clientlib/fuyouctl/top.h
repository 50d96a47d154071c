// `fuyouctl top`: a live view of the daemon, one frame per second, rendered
// from two samples of GetStats and ListSessions taken an interval apart.
//
// A frame shows:
//   - the daemon: uptime, live sessions, steps committed, chunk updates/s;
//   - DRAM used of the budget, the cache hit rate since start, speculation and
//     redo counts (GetStats fields 19-23);
//   - per storage path: read and write GB/s (GetStats' own rates) and totals;
//   - per session: job, user, committed step, chunk updates/s, mean update
//     (kernel) and I/O latency over the interval, speculative/redone/rolled-back
//     updates since it opened; the ranks of a data-parallel job (the jobs
//     `<job>.rank<r>-of<w>`, ListSessionsResponse.data_parallel_jobs) as one
//     row with their totals (STEP: the step every rank committed; RANKS: live
//     of the world size) and their own rows beneath, indented. "I/O" is the part of each GradReady outside the
//     kernel: waiting for the chunk's states (from DRAM or storage) and
//     submitting the write-back (SessionInfo.state_wait_seconds).
// A user other than root and the daemon's own sees their own activity only
// (STATS_SCOPE_USER): no storage paths and no DRAM line.
#pragma once

#include <chrono>
#include <functional>
#include <string>

#include "fuyou/v1/admin.pb.h"

namespace fuyou::ctl {

struct TopSample {
  v1::GetStatsResponse stats;
  v1::ListSessionsResponse sessions;
  std::chrono::steady_clock::time_point when;
};

// The frame for `now`, with per-session rates from the difference to
// `previous` (a session not in `previous` is shown with "-" rates).
// `user_name` turns a uid into a name. Every line ends in '\n'.
std::string RenderTop(const TopSample& previous, const TopSample& now,
                      const std::function<std::string(uint32_t)>& user_name);

}  // namespace fuyou::ctl
