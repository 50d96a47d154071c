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
//
// Labels are only ones whose values stay few: the configured storage paths and
// fixed reasons. There is no per-job or per-session label (job names are chosen
// by users and unbounded; `fuyouctl top` shows sessions).
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

// The exposition, HELP and TYPE lines first in each family, every line ending
// in '\n'.
std::string RenderMetrics(const MetricsInput& input);

// The Content-Type of RenderMetrics' text.
inline constexpr std::string_view kContentType = "text/plain; version=0.0.4; charset=utf-8";

// `value` escaped for a label value: backslash, double quote and newline.
std::string EscapeLabelValue(std::string_view value);

}  // namespace fuyou::metrics
