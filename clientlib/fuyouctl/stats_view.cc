#include "stats_view.h"

#include <cstdint>
#include <vector>

#include "fmt/format.h"
#include "format.h"
#include "google/protobuf/descriptor.h"
#include "google/protobuf/message.h"

namespace fuyou::ctl {
namespace {

using google::protobuf::FieldDescriptor;

std::string OptimizerLine(const v1::GetStatsResponse& stats) {
  return fmt::format("{} chunk updates/s, {} params/s ({} updates, {} params since start)",
                     FormatCount(stats.chunk_updates_per_second()), FormatCount(stats.params_updated_per_second()),
                     FormatCount(static_cast<double>(stats.chunk_updates())),
                     FormatCount(static_cast<double>(stats.params_updated())));
}

std::string CacheLine(const v1::GetStatsResponse& stats) {
  const uint64_t lookups = stats.cache_hits() + stats.cache_misses();
  return fmt::format("{} hits ({} hits, {} misses)",
                     FormatPercent(static_cast<double>(stats.cache_hits()), static_cast<double>(lookups)),
                     stats.cache_hits(), stats.cache_misses());
}

std::string SpeculationLine(const v1::GetStatsResponse& stats) {
  return FormatRedoLine(stats.chunks_speculative(), stats.chunks_redone_changed(), stats.chunks_redone_clipped(),
                        stats.chunks_rolled_back_skipped_step(), stats.redo_seconds());
}

std::string WeightsLine(const v1::GetStatsResponse& stats) {
  return FormatWeightsLine(stats.weights_fetches(), stats.weights_fetch_cache_hits(), stats.weights_bytes_read());
}

std::string JournalLine(const v1::GetStatsResponse& stats) {
  return FormatJournalLine(stats.journal_bytes_total(), stats.journal_spilled_bytes_total(),
                           stats.journal_replays_total(), stats.journal_replay_seconds_total());
}

// A summary row: its name, how it is drawn, and the fields it shows.
struct SummaryRow {
  std::string_view name;
  std::string (*line)(const v1::GetStatsResponse&);
  std::vector<std::string_view> fields;
  bool daemon_scope_only = false;
};

// In the order they are shown.
const std::vector<SummaryRow>& SummaryRows() {
  static const std::vector<SummaryRow> rows = {
      {"optimizer", OptimizerLine,
       {"chunk_updates_per_second", "params_updated_per_second", "chunk_updates", "params_updated"}},
      {"speculation", SpeculationLine,
       {"chunks_speculative", "chunks_redone_changed", "chunks_redone_clipped", "chunks_rolled_back_skipped_step",
        "redo_seconds"}},
      {"weights", WeightsLine, {"weights_fetches", "weights_fetch_cache_hits", "weights_bytes_read"}},
      {"journal", JournalLine,
       {"journal_bytes_total", "journal_spilled_bytes_total", "journal_replays_total",
        "journal_replay_seconds_total"}},
      {"DRAM", DramLine, {"dram_bytes_in_use", "dram_budget_bytes"}, /*daemon_scope_only=*/true},
      {"cache", CacheLine, {"cache_hits", "cache_misses"}},
  };
  return rows;
}

// A field no hand-made part shows, by its type and name: bytes in binary
// units, seconds with two decimals, other numbers as they are.
std::string FieldValue(const v1::GetStatsResponse& stats, const FieldDescriptor& field) {
  const google::protobuf::Reflection& reflection = *stats.GetReflection();
  const bool bytes = field.name().find("bytes") != std::string::npos;
  switch (field.cpp_type()) {
    case FieldDescriptor::CPPTYPE_UINT64: {
      const uint64_t value = reflection.GetUInt64(stats, &field);
      return bytes ? FormatBytes(value) : std::to_string(value);
    }
    case FieldDescriptor::CPPTYPE_UINT32: return std::to_string(reflection.GetUInt32(stats, &field));
    case FieldDescriptor::CPPTYPE_INT64: return std::to_string(reflection.GetInt64(stats, &field));
    case FieldDescriptor::CPPTYPE_INT32: return std::to_string(reflection.GetInt32(stats, &field));
    case FieldDescriptor::CPPTYPE_DOUBLE: {
      const double value = reflection.GetDouble(stats, &field);
      if (field.name().find("seconds") != std::string::npos) return fmt::format("{:.2f} s", value);
      return fmt::format("{:g}", value);
    }
    case FieldDescriptor::CPPTYPE_FLOAT: return fmt::format("{:g}", reflection.GetFloat(stats, &field));
    case FieldDescriptor::CPPTYPE_BOOL: return reflection.GetBool(stats, &field) ? "yes" : "no";
    case FieldDescriptor::CPPTYPE_ENUM: return std::string(reflection.GetEnum(stats, &field)->name());
    case FieldDescriptor::CPPTYPE_STRING: return reflection.GetString(stats, &field);
    case FieldDescriptor::CPPTYPE_MESSAGE: break;
  }
  return "";
}

// The summary's rows for `stats`'s scope, without a header line.
std::string SummaryText(const v1::GetStatsResponse& stats) {
  Table summary({"", ""});
  for (const SummaryRow& row : SummaryRows()) {
    if (row.daemon_scope_only && IsUserScope(stats)) continue;
    summary.AddRow({std::string(row.name), row.line(stats)});
  }
  std::string rows = summary.ToString();
  return rows.substr(rows.find('\n') + 1);
}

// After a blank line, a row for every scalar field no hand-made part shows, in
// the descriptor's order; nothing when there is none. A table of its own, so
// that a long proto name leaves the summary's columns as they are.
std::string OtherFieldsText(const v1::GetStatsResponse& stats) {
  Table others({"COUNTER", "VALUE"});
  const google::protobuf::Descriptor& descriptor = *stats.GetDescriptor();
  for (int i = 0; i < descriptor.field_count(); ++i) {
    const FieldDescriptor& field = *descriptor.field(i);
    if (field.is_repeated() || field.cpp_type() == FieldDescriptor::CPPTYPE_MESSAGE) continue;
    if (ShownFields().contains(std::string_view(field.name()))) continue;
    others.AddRow({std::string(field.name()), FieldValue(stats, field)});
  }
  if (others.rows() == 0) return "";
  return "\n" + others.ToString();
}

// After a blank line, the data-parallel jobs (GetStatsResponse.data_parallel_jobs):
// one row each with the ranks' totals, its ranks' rows beneath, indented;
// nothing when there is none.
std::string DataParallelText(const v1::GetStatsResponse& stats) {
  if (stats.data_parallel_jobs_size() == 0) return "";
  Table table({"DATA-PARALLEL JOB", "RANKS", "UID", "STEP", "CHUNKS", "UPDATES", "UPDATE S", "I/O S", "SPECULATIVE",
               "REDONE", "ROLLED BACK"});
  for (const v1::DataParallelJob& job : stats.data_parallel_jobs()) {
    std::string step = std::to_string(job.committed_step());
    if (job.newest_committed_step() != job.committed_step()) {
      step += fmt::format(" (newest {})", job.newest_committed_step());
    }
    table.AddRow({job.job(), fmt::format("{}/{}", job.live_ranks(), job.world_size()), std::to_string(job.uid()),
                  step, std::to_string(job.chunks()), std::to_string(job.chunk_updates()),
                  fmt::format("{:.2f}", job.update_seconds()), fmt::format("{:.2f}", job.state_wait_seconds()),
                  std::to_string(job.chunks_speculative()), std::to_string(job.chunks_redone()),
                  std::to_string(job.chunks_rolled_back())});
    for (const v1::DataParallelRank& rank : job.ranks()) {
      table.AddRow({"  " + rank.job(), fmt::format("rank {}", rank.rank()), "", std::to_string(rank.committed_step()),
                    std::to_string(rank.chunks()), std::to_string(rank.chunk_updates()),
                    fmt::format("{:.2f}", rank.update_seconds()), fmt::format("{:.2f}", rank.state_wait_seconds()),
                    std::to_string(rank.chunks_speculative()), std::to_string(rank.chunks_redone()),
                    std::to_string(rank.chunks_rolled_back())});
    }
  }
  return "\n" + table.ToString();
}

}  // namespace

bool IsUserScope(const v1::GetStatsResponse& stats) { return stats.scope() == v1::STATS_SCOPE_USER; }

std::string DramLine(const v1::GetStatsResponse& stats) {
  return fmt::format("{} of {} ({})", FormatBytes(stats.dram_bytes_in_use()),
                     FormatBytes(stats.dram_budget_bytes()),
                     FormatPercent(static_cast<double>(stats.dram_bytes_in_use()),
                                   static_cast<double>(stats.dram_budget_bytes())));
}

const std::set<std::string_view>& ShownFields() {
  static const std::set<std::string_view> shown = [] {
    // The header line, and the scope it is drawn for.
    std::set<std::string_view> fields = {"scope", "uid", "uptime_seconds", "live_sessions", "steps_committed"};
    // The storage table (daemon) or the traffic table (user).
    fields.insert({"storage", "bytes_read", "bytes_written", "read_gbps", "write_gbps"});
    // The data-parallel jobs' table.
    fields.insert("data_parallel_jobs");
    for (const SummaryRow& row : SummaryRows()) fields.insert(row.fields.begin(), row.fields.end());
    return fields;
  }();
  return shown;
}

std::string RenderStats(const v1::GetStatsResponse& stats) {
  if (IsUserScope(stats)) {
    // A user other than root and the daemon's own sees their own activity only.
    std::string out = fmt::format("your sessions (uid {}): {} live, {} steps committed; fuyoud up {}\n\n",
                                  stats.uid(), stats.live_sessions(), stats.steps_committed(),
                                  FormatDuration(stats.uptime_seconds()));
    Table traffic({"YOUR JOBS", "READ", "WRITTEN", "READ RATE", "WRITE RATE"});
    traffic.AddRow({"storage", FormatBytes(stats.bytes_read()), FormatBytes(stats.bytes_written()),
                    FormatGbps(stats.read_gbps()), FormatGbps(stats.write_gbps())});
    out += traffic.ToString() + "\n";
    out += SummaryText(stats);
    out += OtherFieldsText(stats);
    out += DataParallelText(stats);
    out += "(storage paths, DRAM and other users' activity are shown to root and the daemon's user only)\n";
    return out;
  }
  std::string out = fmt::format("fuyoud up {}, {} live session{}, {} steps committed\n\n",
                                FormatDuration(stats.uptime_seconds()), stats.live_sessions(),
                                stats.live_sessions() == 1 ? "" : "s", stats.steps_committed());
  Table storage({"STORAGE PATH", "READ", "WRITTEN", "READ RATE", "WRITE RATE", "I/O"});
  uint64_t read = 0, written = 0;
  double read_gbps = 0, write_gbps = 0;
  for (const v1::StoragePathStats& path : stats.storage()) {
    storage.AddRow({path.path(), FormatBytes(path.bytes_read()), FormatBytes(path.bytes_written()),
                    FormatGbps(path.read_gbps()), FormatGbps(path.write_gbps()),
                    path.direct_io() ? "direct" : "buffered"});
    read += path.bytes_read();
    written += path.bytes_written();
    read_gbps += path.read_gbps();
    write_gbps += path.write_gbps();
  }
  if (stats.storage_size() > 1) {
    storage.AddRow({"(all paths)", FormatBytes(read), FormatBytes(written), FormatGbps(read_gbps),
                    FormatGbps(write_gbps), ""});
  }
  if (stats.storage_size() == 0) storage.AddRow({"(no storage paths)"});
  out += storage.ToString() + "\n";
  out += SummaryText(stats);
  out += OtherFieldsText(stats);
  out += DataParallelText(stats);
  return out;
}

}  // namespace fuyou::ctl
