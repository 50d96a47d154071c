#include "top.h"

#include <map>

#include "fmt/format.h"
#include "format.h"

namespace fuyou::ctl {
namespace {

// Milliseconds per update over the interval, or "-" without updates in it.
std::string MeanMs(double seconds, uint64_t updates) {
  if (updates == 0) return "-";
  return fmt::format("{:.3f}", seconds * 1000 / static_cast<double>(updates));
}

}  // namespace

std::string RenderTop(const TopSample& previous, const TopSample& now,
                      const std::function<std::string(uint32_t)>& user_name) {
  const v1::GetStatsResponse& stats = now.stats;
  const bool user_scope = stats.scope() == v1::STATS_SCOPE_USER;
  std::string out = fmt::format(
      "fuyoud up {} · {} session{} · {} steps committed · {} chunk updates/s{}\n",
      FormatDuration(stats.uptime_seconds()), stats.live_sessions(), stats.live_sessions() == 1 ? "" : "s",
      stats.steps_committed(), FormatCount(stats.chunk_updates_per_second()),
      user_scope ? fmt::format(" (your activity only, uid {})", stats.uid()) : "");
  const uint64_t lookups = stats.cache_hits() + stats.cache_misses();
  const std::string cache =
      fmt::format("cache hit rate {} ({} hits, {} misses)",
                  FormatPercent(static_cast<double>(stats.cache_hits()), static_cast<double>(lookups)),
                  stats.cache_hits(), stats.cache_misses());
  if (user_scope) {
    out += cache + "\n";
  } else {
    out += fmt::format("DRAM {} of {} ({}) · {}\n", FormatBytes(stats.dram_bytes_in_use()),
                       FormatBytes(stats.dram_budget_bytes()),
                       FormatPercent(static_cast<double>(stats.dram_bytes_in_use()),
                                     static_cast<double>(stats.dram_budget_bytes())),
                       cache);
  }
  out += FormatRedoLine(stats.chunks_speculative(), stats.chunks_redone_changed(), stats.chunks_redone_clipped(),
                        stats.chunks_rolled_back_skipped_step(), stats.redo_seconds()) +
         "\n\n";

  if (user_scope) {
    Table traffic({"YOUR JOBS", "READ/S", "WRITE/S", "READ", "WRITTEN"});
    traffic.AddRow({"storage", FormatGbps(stats.read_gbps()), FormatGbps(stats.write_gbps()),
                    FormatBytes(stats.bytes_read()), FormatBytes(stats.bytes_written())});
    out += traffic.ToString() + "\n";
  } else {
    Table storage({"STORAGE PATH", "READ/S", "WRITE/S", "READ", "WRITTEN"});
    for (const v1::StoragePathStats& path : stats.storage()) {
      storage.AddRow({path.path(), FormatGbps(path.read_gbps()), FormatGbps(path.write_gbps()),
                      FormatBytes(path.bytes_read()), FormatBytes(path.bytes_written())});
    }
    out += storage.ToString() + "\n";
  }

  std::map<std::string, const v1::SessionInfo*> before;
  for (const v1::SessionInfo& s : previous.sessions.sessions()) before[s.session_id()] = &s;
  const double seconds = std::chrono::duration<double>(now.when - previous.when).count();
  Table sessions({"JOB", "USER", "STEP", "UPDATES/S", "UPDATE MS", "I/O MS", "SPECULATIVE", "REDONE",
                  "ROLLED BACK"});
  for (const v1::SessionInfo& s : now.sessions.sessions()) {
    std::string rate = "-", update_ms = "-", io_ms = "-";
    auto it = before.find(s.session_id());
    if (it != before.end() && seconds > 0 && s.chunk_updates() >= it->second->chunk_updates()) {
      const uint64_t updates = s.chunk_updates() - it->second->chunk_updates();
      rate = FormatCount(static_cast<double>(updates) / seconds);
      update_ms = MeanMs(s.update_seconds() - it->second->update_seconds(), updates);
      io_ms = MeanMs(s.state_wait_seconds() - it->second->state_wait_seconds(), updates);
    }
    sessions.AddRow({s.job(), user_name(s.uid()), std::to_string(s.committed_step()), rate, update_ms, io_ms,
                     std::to_string(s.chunks_speculative()), std::to_string(s.chunks_redone()),
                     std::to_string(s.chunks_rolled_back())});
  }
  if (sessions.rows() == 0) {
    out += "no live sessions\n";
  } else {
    out += sessions.ToString();
  }
  return out;
}

}  // namespace fuyou::ctl
