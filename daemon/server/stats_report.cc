#include "server/stats_report.h"

#include "jobs/data_parallel_name.h"
#include "server/data_parallel_groups.h"

namespace fuyou {

void StatsReport::FillDaemonScope(bool rates, v1::GetStatsResponse* response) const {
  response->set_uptime_seconds(stats_.uptime_seconds());
  response->set_scope(v1::STATS_SCOPE_DAEMON);
  StatsRates window;
  if (rates) window = stats_.Rates();
  uint64_t bytes_read = 0, bytes_written = 0;
  double read_gbps = 0, write_gbps = 0;
  for (size_t i = 0; i < stats_.storage_paths().size(); ++i) {
    v1::StoragePathStats* path = response->add_storage();
    storage::IoCounters* counters = stats_.path_counters(i);
    path->set_path(stats_.storage_paths()[i].string());
    path->set_bytes_read(counters->bytes_read.load());
    path->set_bytes_written(counters->bytes_written.load());
    if (rates) {
      path->set_read_gbps(window.read_gbps[i]);
      path->set_write_gbps(window.write_gbps[i]);
    }
    path->set_direct_io(i < direct_io_.size() && direct_io_[i]);
    bytes_read += path->bytes_read();
    bytes_written += path->bytes_written();
    read_gbps += path->read_gbps();
    write_gbps += path->write_gbps();
  }
  response->set_bytes_read(bytes_read);
  response->set_bytes_written(bytes_written);
  response->set_read_gbps(read_gbps);
  response->set_write_gbps(write_gbps);
  FillTickers(stats_.tickers, v1::STATS_SCOPE_DAEMON, *response);
  response->set_chunk_updates_per_second(window.chunk_updates_per_second);
  response->set_params_updated_per_second(window.params_updated_per_second);
  response->set_dram_bytes_in_use(cache_.bytes_in_use());
  response->set_dram_budget_bytes(cache_.budget_bytes());
  response->set_live_sessions(static_cast<uint32_t>(sessions_.size()));
  FillDataParallel(std::nullopt, response);
}

std::vector<v1::SessionInfo> StatsReport::Sessions(std::optional<uid_t> only, bool ranks_only) const {
  std::vector<v1::SessionInfo> infos;
  for (const auto& session : sessions_.List()) {
    if (only && session->uid() != *only) continue;
    // The name first: only the ranks' sessions are read.
    if (ranks_only && !ParseDataParallelName(session->job_name())) continue;
    MarkDataParallel(infos.emplace_back(session->Info()));
  }
  return infos;
}

void StatsReport::FillDataParallel(std::optional<uid_t> only, v1::GetStatsResponse* response) const {
  response->clear_data_parallel_jobs();
  for (v1::DataParallelJob& row : GroupDataParallelSessions(Sessions(only, /*ranks_only=*/true))) {
    *response->add_data_parallel_jobs() = std::move(row);
  }
}

}  // namespace fuyou
