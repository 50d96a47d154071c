#include "lists_view.h"

#include <vector>

#include "fmt/format.h"
#include "format.h"

namespace fuyou::ctl {
namespace {

constexpr std::string_view kIndent = "  ";

std::vector<std::string> SessionRow(const v1::SessionInfo& s, std::string job, std::string ranks,
                                    const std::function<std::string(uint32_t)>& user_name) {
  return {s.session_id(), std::move(job), std::move(ranks), user_name(s.uid()), std::to_string(s.pid()),
          std::to_string(s.chunks()), std::to_string(s.committed_step()), FormatBytes(s.segment_bytes()),
          FormatDuration(s.age_seconds()), s.client_info()};
}

std::vector<std::string> JobRow(const v1::JobInfo& j, std::string name, std::string ranks,
                                const std::function<std::string(uint32_t)>& user_name,
                                const std::function<std::string(int64_t)>& ago) {
  if (!j.damaged().empty()) {
    return {std::move(name), std::move(ranks), user_name(j.owner_uid()), "-", "-", "-", "-", "-",
            "DAMAGED (delete-job only)"};
  }
  return {std::move(name), std::move(ranks), user_name(j.owner_uid()), std::to_string(j.chunks()),
          FormatCount(static_cast<double>(j.parameters())), FormatBytes(j.bytes_on_storage()),
          std::to_string(j.committed_step()), ago(j.last_used_unix()), j.open() ? "yes" : "no"};
}

bool IsRankOf(const v1::JobInfo& j, const v1::DataParallelJobInfo& group) {
  return j.world_size() == group.world_size() && j.owner_uid() == group.owner_uid() &&
         j.data_parallel_job() == group.name();
}

}  // namespace

std::string RanksCell(uint32_t present, uint32_t world_size) { return fmt::format("{}/{}", present, world_size); }
std::string RankCell(uint32_t rank) { return fmt::format("rank {}", rank); }

bool IsRankOf(const v1::SessionInfo& s, const v1::DataParallelJob& group) {
  return s.world_size() == group.world_size() && s.uid() == group.uid() && s.data_parallel_job() == group.job();
}

std::string RenderSessions(const v1::ListSessionsResponse& sessions,
                           const std::function<std::string(uint32_t)>& user_name) {
  if (sessions.sessions_size() == 0) return "no live sessions\n";
  Table table({"SESSION", "JOB", "RANKS", "USER", "PID", "CHUNKS", "STEP", "SEGMENT", "AGE", "CLIENT"});
  std::vector<bool> shown(sessions.sessions_size(), false);
  std::vector<std::vector<std::string>> grouped;
  for (const v1::DataParallelJob& group : sessions.data_parallel_jobs()) {
    grouped.push_back({"", group.job(), RanksCell(group.live_ranks(), group.world_size()), user_name(group.uid()),
                       "", std::to_string(group.chunks()), std::to_string(group.committed_step()), "", "", ""});
    for (const v1::DataParallelRank& rank : group.ranks()) {
      for (int i = 0; i < sessions.sessions_size(); ++i) {
        const v1::SessionInfo& s = sessions.sessions(i);
        if (shown[i] || !IsRankOf(s, group) || s.rank() != rank.rank()) continue;
        grouped.push_back(SessionRow(s, std::string(kIndent) + s.job(), RankCell(s.rank()), user_name));
        shown[i] = true;
      }
    }
  }
  for (int i = 0; i < sessions.sessions_size(); ++i) {
    if (!shown[i]) table.AddRow(SessionRow(sessions.sessions(i), sessions.sessions(i).job(), "-", user_name));
  }
  for (std::vector<std::string>& row : grouped) table.AddRow(std::move(row));
  return table.ToString();
}

std::string RenderJobs(const v1::ListJobsResponse& jobs, const std::function<std::string(uint32_t)>& user_name,
                       const std::function<std::string(int64_t)>& ago) {
  if (jobs.jobs_size() == 0) return "no jobs\n";
  Table table({"JOB", "RANKS", "OWNER", "CHUNKS", "PARAMS", "ON STORAGE", "STEP", "LAST USED", "OPEN"});
  std::vector<bool> shown(jobs.jobs_size(), false);
  std::vector<std::vector<std::string>> grouped;
  for (const v1::DataParallelJobInfo& group : jobs.data_parallel_jobs()) {
    std::string open = fmt::format("{} of {}", group.open_ranks(), group.ranks_size());
    if (group.damaged_ranks() > 0) open += fmt::format(", {} DAMAGED", group.damaged_ranks());
    grouped.push_back({group.name(), RanksCell(static_cast<uint32_t>(group.ranks_size()), group.world_size()),
                       user_name(group.owner_uid()), std::to_string(group.chunks()),
                       FormatCount(static_cast<double>(group.parameters())), FormatBytes(group.bytes_on_storage()),
                       std::to_string(group.committed_step()), ago(group.last_used_unix()), open});
    for (uint32_t rank : group.ranks()) {
      for (int i = 0; i < jobs.jobs_size(); ++i) {
        const v1::JobInfo& j = jobs.jobs(i);
        if (shown[i] || !IsRankOf(j, group) || j.rank() != rank) continue;
        grouped.push_back(JobRow(j, std::string(kIndent) + j.name(), RankCell(j.rank()), user_name, ago));
        shown[i] = true;
      }
    }
  }
  for (int i = 0; i < jobs.jobs_size(); ++i) {
    if (!shown[i]) table.AddRow(JobRow(jobs.jobs(i), jobs.jobs(i).name(), "-", user_name, ago));
  }
  for (std::vector<std::string>& row : grouped) table.AddRow(std::move(row));
  return table.ToString();
}

}  // namespace fuyou::ctl
