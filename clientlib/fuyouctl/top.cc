#include "top.h"

#include <map>
#include <optional>
#include <vector>

#include "fmt/format.h"
#include "format.h"
#include "lists_view.h"

namespace fuyou::ctl {
namespace {

// Milliseconds per update over the interval, or "-" without updates in it.
std::string MeanMs(double seconds, uint64_t updates) {
  if (updates == 0) return "-";
  return fmt::format("{:.3f}", seconds * 1000 / static_cast<double>(updates));
}

// One session's (or a data-parallel job's ranks') updates over the interval.
struct Interval {
  uint64_t updates = 0;
  double update_seconds = 0;
  double state_wait_seconds = 0;
};

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
  Table sessions({"JOB", "RANKS", "USER", "STEP", "UPDATES/S", "UPDATE MS", "I/O MS", "SPECULATIVE", "REDONE",
                  "ROLLED BACK"});
  // The interval's updates and seconds of each session that was in `previous`.
  const auto interval_of = [&](const v1::SessionInfo& s) -> std::optional<Interval> {
    auto it = before.find(s.session_id());
    if (it == before.end() || seconds <= 0 || s.chunk_updates() < it->second->chunk_updates()) return std::nullopt;
    return Interval{s.chunk_updates() - it->second->chunk_updates(),
                    s.update_seconds() - it->second->update_seconds(),
                    s.state_wait_seconds() - it->second->state_wait_seconds()};
  };
  const auto row = [&](std::string job, std::string ranks, uint32_t uid, int64_t step,
                       const std::optional<Interval>& interval, uint64_t speculative, uint64_t redone,
                       uint64_t rolled_back) {
    std::string rate = "-", update_ms = "-", io_ms = "-";
    if (interval) {
      rate = FormatCount(static_cast<double>(interval->updates) / seconds);
      update_ms = MeanMs(interval->update_seconds, interval->updates);
      io_ms = MeanMs(interval->state_wait_seconds, interval->updates);
    }
    sessions.AddRow({std::move(job), std::move(ranks), user_name(uid), std::to_string(step), rate, update_ms, io_ms,
                     std::to_string(speculative), std::to_string(redone), std::to_string(rolled_back)});
  };
  // Ordinary sessions first, then each data-parallel job: its totals (rates
  // over the ranks that were in `previous`), then its ranks, indented.
  std::vector<bool> in_group(now.sessions.sessions_size(), false);
  for (int i = 0; i < now.sessions.sessions_size(); ++i) {
    for (const v1::DataParallelJob& group : now.sessions.data_parallel_jobs()) {
      if (IsRankOf(now.sessions.sessions(i), group)) in_group[i] = true;
    }
  }
  for (int i = 0; i < now.sessions.sessions_size(); ++i) {
    const v1::SessionInfo& s = now.sessions.sessions(i);
    if (in_group[i]) continue;
    row(s.job(), "-", s.uid(), s.committed_step(), interval_of(s), s.chunks_speculative(), s.chunks_redone(),
        s.chunks_rolled_back());
  }
  for (const v1::DataParallelJob& group : now.sessions.data_parallel_jobs()) {
    std::vector<const v1::SessionInfo*> ranks;
    std::optional<Interval> total;
    for (const v1::DataParallelRank& rank : group.ranks()) {
      for (const v1::SessionInfo& s : now.sessions.sessions()) {
        if (!IsRankOf(s, group) || s.rank() != rank.rank()) continue;
        ranks.push_back(&s);
        if (const std::optional<Interval> interval = interval_of(s)) {
          if (!total) total = Interval{};
          total->updates += interval->updates;
          total->update_seconds += interval->update_seconds;
          total->state_wait_seconds += interval->state_wait_seconds;
        }
      }
    }
    row(group.job(), RanksCell(group.live_ranks(), group.world_size()), group.uid(), group.committed_step(), total,
        group.chunks_speculative(), group.chunks_redone(), group.chunks_rolled_back());
    for (const v1::SessionInfo* s : ranks) {
      row("  " + s->job(), RankCell(s->rank()), s->uid(), s->committed_step(), interval_of(*s),
          s->chunks_speculative(), s->chunks_redone(), s->chunks_rolled_back());
    }
  }
  if (sessions.rows() == 0) {
    out += "no live sessions\n";
  } else {
    out += sessions.ToString();
  }
  return out;
}

}  // namespace fuyou::ctl
