#include "metrics/metrics_text.h"

#include <cmath>

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

  w.Histogram("fuyou_chunk_update_seconds", "AdamW kernel time of one chunk update.", input.chunk_update_seconds);
  w.Histogram("fuyou_step_seconds",
              "Time from one committed step to the next of the same session (EndStep to EndStep).",
              input.step_seconds);
  return w.Take();
}

}  // namespace fuyou::metrics
