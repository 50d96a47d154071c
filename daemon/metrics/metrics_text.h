// MetricsText: the daemon's figures in the Prometheus text exposition format
// 0.0.4 (what GET /metrics answers, see metrics_http.h).
//
// Every figure comes from a STATS_SCOPE_DAEMON GetStatsResponse, filled by the
// same code as GetStats (server/stats_report.h), plus the two latency
// histograms of DaemonStats. The metrics, all daemon-wide (an administrator's
// view of every user's activity):
//
//   fuyou_build_info{version}                 gauge, always 1
//   fuyou_uptime_seconds                      gauge
//   fuyou_storage_read_bytes_total{path}      counter, per configured storage path
//   fuyou_storage_written_bytes_total{path}   counter
//   every ticker with a metric name           counter, its name, labels and help from
//                                             the tickers' table (stats/ticker.cc), its
//                                             value from its GetStatsResponse field:
//                                             fuyou_chunk_updates_total, fuyou_cache_hits_total,
//                                             fuyou_chunks_redone_total{reason}, ...
//   fuyou_dram_budget_bytes                   gauge
//   fuyou_dram_bytes_in_use                   gauge
//   fuyou_sessions                            gauge, live sessions
//   fuyou_chunk_update_seconds                histogram: the AdamW kernel time of one chunk update
//   fuyou_step_seconds                        histogram: EndStep to EndStep of one session
//   fuyou_data_parallel_live_ranks{uid,data_parallel_job,world_size}           gauge, per data-parallel job
//   fuyou_data_parallel_committed_step{uid,data_parallel_job,world_size}       gauge, the step every live rank committed
//   fuyou_data_parallel_rank_committed_step{uid,data_parallel_job,world_size,rank}   gauge, per rank
//   fuyou_data_parallel_rank_chunk_updates_total{...,rank}       counter, the rank's session's
//   fuyou_data_parallel_rank_update_seconds_total{...,rank}      counter (kernel seconds)
//   fuyou_data_parallel_rank_state_wait_seconds_total{...,rank}  counter (I/O seconds)
//   fuyou_data_parallel_jobs_not_shown        gauge, data-parallel jobs past the cap below
//
// The data-parallel job's label is `data_parallel_job`, not `job`, which
// Prometheus sets to the scrape job's name (a scraped `job` would become
// `exported_job` without honor_labels).
//
// Labels are only ones whose values stay few: the configured storage paths,
// fixed reasons, and the data-parallel jobs with live sessions
// (GetStatsResponse.data_parallel_jobs: a job only while a rank has a session,
// so bounded by the live sessions, which the per-user session limit bounds as
// it bounds the per-user counts; and at most kMaxDataParallelJobsInMetrics
// jobs and kMaxDataParallelRanksInMetrics rank samples a family, the first in
// uid, job, world size order; the rest are counted in
// fuyou_data_parallel_jobs_not_shown). The per-rank counters are the rank's
// session's: they start at 0 when a rank opens a new session (Prometheus reads
// that as a counter reset). There is no label for an ordinary job or a session
// (job names are chosen by users; `fuyouctl top` shows sessions).
#pragma once

#include <string>
#include <string_view>

#include "fuyou/v1/admin.pb.h"
#include "stats/histogram.h"

namespace fuyou::metrics {

struct MetricsInput {
  const v1::GetStatsResponse& stats;  // STATS_SCOPE_DAEMON
  HistogramSnapshot chunk_update_seconds;
  HistogramSnapshot step_seconds;
  std::string_view version;
};

// The caps on the data-parallel jobs' samples (see above).
inline constexpr int kMaxDataParallelJobsInMetrics = 64;
inline constexpr int kMaxDataParallelRanksInMetrics = 1024;

// The exposition, HELP and TYPE lines first in each family, every line ending
// in '\n'.
std::string RenderMetrics(const MetricsInput& input);

// The Content-Type of RenderMetrics' text.
inline constexpr std::string_view kContentType = "text/plain; version=0.0.4; charset=utf-8";

// `value` escaped for a label value: backslash, double quote and newline.
std::string EscapeLabelValue(std::string_view value);

}  // namespace fuyou::metrics
