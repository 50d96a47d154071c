#include "metrics/metrics_text.h"

#include <cmath>

#include "fmt/format.h"

namespace fuyou::metrics {
namespace {

// A sample value: integers exactly, other numbers in the shortest form that
// reads back to the same double (fmt's default), infinities as Prometheus
// spells them.
std::string Number(double value) {
  if (std::isinf(value)) return value > 0 ? "+Inf" : "-Inf";
  if (std::isnan(value)) return "NaN";
  return fmt::format("{}", value);
}

class Writer {
 public:
  void Family(std::string_view name, std::string_view type, std::string_view help) {
    fmt::format_to(std::back_inserter(out_), "# HELP {} {}\n# TYPE {} {}\n", name, help, name, type);
  }
  void Sample(std::string_view name, std::string_view labels, uint64_t value) {
    Line(name, labels, fmt::format("{}", value));
  }
  void Sample(std::string_view name, std::string_view labels, double value) { Line(name, labels, Number(value)); }
  void Histogram(std::string_view name, std::string_view help, const HistogramSnapshot& snapshot) {
    Family(name, "histogram", help);
    const std::string bucket = fmt::format("{}_bucket", name);
    for (size_t i = 0; i < snapshot.upper_bounds.size(); ++i) {
      Sample(bucket, fmt::format("le=\"{}\"", Number(snapshot.upper_bounds[i])), snapshot.cumulative_counts[i]);
    }
    Sample(bucket, "le=\"+Inf\"", snapshot.count);
    Sample(fmt::format("{}_sum", name), "", snapshot.sum_seconds);
    Sample(fmt::format("{}_count", name), "", snapshot.count);
  }
  std::string Take() { return std::move(out_); }

 private:
  void Line(std::string_view name, std::string_view labels, const std::string& value) {
    if (labels.empty()) {
      fmt::format_to(std::back_inserter(out_), "{} {}\n", name, value);
    } else {
      fmt::format_to(std::back_inserter(out_), "{}{{{}}} {}\n", name, labels, value);
    }
  }
  std::string out_;
};

}  // namespace

std::string EscapeLabelValue(std::string_view value) {
  std::string escaped;
  for (char c : value) {
    if (c == '\\') {
      escaped += "\\\\";
    } else if (c == '"') {
      escaped += "\\\"";
    } else if (c == '\n') {
      escaped += "\\n";
    } else {
      escaped += c;
    }
  }
  return escaped;
}

std::string RenderMetrics(const MetricsInput& input) {
  const v1::GetStatsResponse& stats = input.stats;
  Writer w;
  w.Family("fuyou_build_info", "gauge", "The fuyoud version serving these metrics; always 1.");
  w.Sample("fuyou_build_info", fmt::format("version=\"{}\"", EscapeLabelValue(input.version)), uint64_t{1});
  w.Family("fuyou_uptime_seconds", "gauge", "Seconds since fuyoud started.");
  w.Sample("fuyou_uptime_seconds", "", stats.uptime_seconds());

  w.Family("fuyou_storage_read_bytes_total", "counter",
           "Bytes of optimizer states read from the state files under each storage path.");
  for (const v1::StoragePathStats& path : stats.storage()) {
    w.Sample("fuyou_storage_read_bytes_total", fmt::format("path=\"{}\"", EscapeLabelValue(path.path())),
             path.bytes_read());
  }
  w.Family("fuyou_storage_written_bytes_total", "counter",
           "Bytes of optimizer states written to the state files under each storage path.");
  for (const v1::StoragePathStats& path : stats.storage()) {
    w.Sample("fuyou_storage_written_bytes_total", fmt::format("path=\"{}\"", EscapeLabelValue(path.path())),
             path.bytes_written());
  }

  w.Family("fuyou_chunk_updates_total", "counter", "AdamW updates of one chunk (redone ones included).");
  w.Sample("fuyou_chunk_updates_total", "", stats.chunk_updates());
  w.Family("fuyou_params_updated_total", "counter", "Parameters updated by AdamW.");
  w.Sample("fuyou_params_updated_total", "", stats.params_updated());
  w.Family("fuyou_steps_committed_total", "counter", "Training steps committed, over all jobs.");
  w.Sample("fuyou_steps_committed_total", "", stats.steps_committed());
  w.Family("fuyou_cache_hits_total", "counter", "State reads served from the DRAM tier without touching storage.");
  w.Sample("fuyou_cache_hits_total", "", stats.cache_hits());
  w.Family("fuyou_cache_misses_total", "counter", "State reads that went to storage.");
  w.Sample("fuyou_cache_misses_total", "", stats.cache_misses());
  w.Family("fuyou_dram_budget_bytes", "gauge", "The configured DRAM budget for optimizer states.");
  w.Sample("fuyou_dram_budget_bytes", "", stats.dram_budget_bytes());
  w.Family("fuyou_dram_bytes_in_use", "gauge", "Bytes of optimizer states held in DRAM now.");
  w.Sample("fuyou_dram_bytes_in_use", "", stats.dram_bytes_in_use());
  w.Family("fuyou_sessions", "gauge", "Live sessions, all users.");
  w.Sample("fuyou_sessions", "", uint64_t{stats.live_sessions()});

  w.Family("fuyou_chunks_speculative_total", "counter",
           "Chunk updates sent while backward was still running (a subset of fuyou_chunk_updates_total).");
  w.Sample("fuyou_chunks_speculative_total", "", stats.chunks_speculative());
  w.Family("fuyou_chunks_redone_total", "counter",
           "Chunk updates done again in the same step: the gradients changed after they were sent, or "
           "max_grad_norm clipped them.");
  w.Sample("fuyou_chunks_redone_total", "reason=\"changed\"", stats.chunks_redone_changed());
  w.Sample("fuyou_chunks_redone_total", "reason=\"clipped\"", stats.chunks_redone_clipped());
  w.Family("fuyou_chunks_rolled_back_total", "counter",
           "Chunk updates rolled back because the training loop skipped the step.");
  w.Sample("fuyou_chunks_rolled_back_total", "reason=\"skipped_step\"", stats.chunks_rolled_back_skipped_step());
  w.Family("fuyou_redo_seconds_total", "counter",
           "Seconds spent on redone updates (reading the committed states again, the kernel, the write-back).");
  w.Sample("fuyou_redo_seconds_total", "", stats.redo_seconds());

  w.Family("fuyou_weights_fetches_total", "counter",
           "Working weights of a chunk fetched by a client (FetchWeights of a chunk with store_weights).");
  w.Sample("fuyou_weights_fetches_total", "", stats.weights_fetches());
  w.Family("fuyou_weights_fetch_cache_hits_total", "counter",
           "Weights fetches answered from DRAM (a cached chunk, or a read-ahead done or in flight).");
  w.Sample("fuyou_weights_fetch_cache_hits_total", "", stats.weights_fetch_cache_hits());
  w.Family("fuyou_weights_read_bytes_total", "counter",
           "Bytes of working weights read from storage for fetches and their read-aheads (weights only).");
  w.Sample("fuyou_weights_read_bytes_total", "", stats.weights_bytes_read());

  w.Family("fuyou_journal_bytes_total", "counter",
           "Bytes of gradients journaled for redos in the streamed mode (GradReady.journal KEEP, ADD, REPLAY).");
  w.Sample("fuyou_journal_bytes_total", "", stats.journal_bytes_total());
  w.Family("fuyou_journal_spilled_bytes_total", "counter",
           "Bytes of journaled gradients spilled to the storage tier's scratch files (beyond the DRAM budget).");
  w.Sample("fuyou_journal_spilled_bytes_total", "", stats.journal_spilled_bytes_total());
  w.Family("fuyou_journal_replays_total", "counter",
           "Chunk updates made from a gradient journal (JOURNAL_USE_ADD and JOURNAL_USE_REPLAY).");
  w.Sample("fuyou_journal_replays_total", "", stats.journal_replays_total());
  w.Family("fuyou_journal_replay_seconds_total", "counter",
           "Seconds spent on updates from a gradient journal (journal read, ops and add, kernel).");
  w.Sample("fuyou_journal_replay_seconds_total", "", stats.journal_replay_seconds_total());

  w.Histogram("fuyou_chunk_update_seconds", "AdamW kernel time of one chunk update.", input.chunk_update_seconds);
  w.Histogram("fuyou_step_seconds",
              "Time from one committed step to the next of the same session (EndStep to EndStep).",
              input.step_seconds);
  return w.Take();
}

}  // namespace fuyou::metrics
