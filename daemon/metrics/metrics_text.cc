#include "metrics/metrics_text.h"

#include <cmath>
#include <string>
#include <vector>

#include "fmt/format.h"
#include "stats/ticker.h"

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

// The data-parallel jobs' families (see metrics_text.h): the first
// kMaxDataParallelJobsInMetrics jobs, and of their ranks as many as keep every
// per-rank family within kMaxDataParallelRanksInMetrics samples.
void DataParallelFamilies(const v1::GetStatsResponse& stats, Writer& w) {
  std::vector<const v1::DataParallelJob*> shown;
  std::vector<std::string> labels;  // uid, data_parallel_job and world_size of each shown job
  int rank_samples = 0;
  for (const v1::DataParallelJob& job : stats.data_parallel_jobs()) {
    if (static_cast<int>(shown.size()) == kMaxDataParallelJobsInMetrics ||
        rank_samples + job.ranks_size() > kMaxDataParallelRanksInMetrics) {
      break;
    }
    shown.push_back(&job);
    labels.push_back(fmt::format("uid=\"{}\",data_parallel_job=\"{}\",world_size=\"{}\"", job.uid(),
                                 EscapeLabelValue(job.job()), job.world_size()));
    rank_samples += job.ranks_size();
  }
  w.Family("fuyou_data_parallel_live_ranks", "gauge",
           "Ranks of a data-parallel job (the jobs <job>.rank<r>-of<w> of one user) with a live session.");
  for (size_t i = 0; i < shown.size(); ++i) {
    w.Sample("fuyou_data_parallel_live_ranks", labels[i], uint64_t{shown[i]->live_ranks()});
  }
  w.Family("fuyou_data_parallel_committed_step", "gauge",
           "The step every live rank of a data-parallel job has committed (the least of theirs).");
  for (size_t i = 0; i < shown.size(); ++i) {
    w.Sample("fuyou_data_parallel_committed_step", labels[i], static_cast<double>(shown[i]->committed_step()));
  }
  struct RankFamily {
    std::string_view name, type, help;
    double (*value)(const v1::DataParallelRank&);
  };
  static const RankFamily kRankFamilies[] = {
      {"fuyou_data_parallel_rank_committed_step", "gauge", "The step a rank of a data-parallel job has committed.",
       [](const v1::DataParallelRank& r) { return static_cast<double>(r.committed_step()); }},
      {"fuyou_data_parallel_rank_chunk_updates_total", "counter",
       "Chunk updates of a data-parallel job's rank, by its live session (redone ones included).",
       [](const v1::DataParallelRank& r) { return static_cast<double>(r.chunk_updates()); }},
      {"fuyou_data_parallel_rank_update_seconds_total", "counter",
       "Seconds a data-parallel job's rank's updates spent in the AdamW kernel, by its live session.",
       [](const v1::DataParallelRank& r) { return r.update_seconds(); }},
      {"fuyou_data_parallel_rank_state_wait_seconds_total", "counter",
       "Seconds a data-parallel job's rank's updates spent outside the kernel (states read, write-back "
       "submitted), by its live session.",
       [](const v1::DataParallelRank& r) { return r.state_wait_seconds(); }},
  };
  for (const RankFamily& family : kRankFamilies) {
    w.Family(family.name, family.type, family.help);
    for (size_t i = 0; i < shown.size(); ++i) {
      for (const v1::DataParallelRank& rank : shown[i]->ranks()) {
        w.Sample(family.name, fmt::format("{},rank=\"{}\"", labels[i], rank.rank()), family.value(rank));
      }
    }
  }
  w.Family("fuyou_data_parallel_jobs_not_shown", "gauge",
           "Data-parallel jobs with live sessions left out of the fuyou_data_parallel_* families (their cap).");
  w.Sample("fuyou_data_parallel_jobs_not_shown", "",
           static_cast<uint64_t>(stats.data_parallel_jobs_size() - static_cast<int>(shown.size())));
}

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

  // The tickers, from their table (stats/ticker.h): the same fields GetStats shows.
  const google::protobuf::Reflection* reflection = stats.GetReflection();
  for (const TickerInfo& info : AllTickers()) {
    const google::protobuf::FieldDescriptor* field = ProtoFieldOf(info);
    if (info.metric.empty() || field == nullptr) continue;
    if (!info.help.empty()) w.Family(info.metric, "counter", info.help);
    if (info.unit == TickerUnit::kNanoseconds) {
      w.Sample(info.metric, info.labels, reflection->GetDouble(stats, field));
    } else {
      w.Sample(info.metric, info.labels, reflection->GetUInt64(stats, field));
    }
  }

  w.Family("fuyou_dram_budget_bytes", "gauge", "The configured DRAM budget for optimizer states.");
  w.Sample("fuyou_dram_budget_bytes", "", stats.dram_budget_bytes());
  w.Family("fuyou_dram_bytes_in_use", "gauge", "Bytes of optimizer states held in DRAM now.");
  w.Sample("fuyou_dram_bytes_in_use", "", stats.dram_bytes_in_use());
  w.Family("fuyou_sessions", "gauge", "Live sessions, all users.");
  w.Sample("fuyou_sessions", "", uint64_t{stats.live_sessions()});

  DataParallelFamilies(stats, w);
  w.Histogram("fuyou_chunk_update_seconds", "AdamW kernel time of one chunk update.", input.chunk_update_seconds);
  w.Histogram("fuyou_step_seconds",
              "Time from one committed step to the next of the same session (EndStep to EndStep).",
              input.step_seconds);
  return w.Take();
}

}  // namespace fuyou::metrics
