#include "server/data_parallel_groups.h"

#include <algorithm>
#include <map>
#include <string>
#include <tuple>

#include "jobs/data_parallel_name.h"

namespace fuyou {
namespace {

using GroupKey = std::tuple<uint32_t, std::string, uint32_t>;  // uid, job, world size

template <typename Info>
void Mark(Info& info, const std::string& job_name) {
  const std::optional<DataParallelName> name = ParseDataParallelName(job_name);
  if (!name) {
    info.clear_data_parallel_job();
    info.clear_rank();
    info.clear_world_size();
    return;
  }
  info.set_data_parallel_job(name->job);
  info.set_rank(name->rank);
  info.set_world_size(name->world_size);
}

v1::DataParallelRank RankRow(const v1::SessionInfo& s) {
  v1::DataParallelRank rank;
  rank.set_rank(s.rank());
  rank.set_job(s.job());
  rank.set_session_id(s.session_id());
  rank.set_chunks(s.chunks());
  rank.set_committed_step(s.committed_step());
  rank.set_chunk_updates(s.chunk_updates());
  rank.set_update_seconds(s.update_seconds());
  rank.set_state_wait_seconds(s.state_wait_seconds());
  rank.set_chunks_speculative(s.chunks_speculative());
  rank.set_chunks_redone(s.chunks_redone());
  rank.set_chunks_rolled_back(s.chunks_rolled_back());
  return rank;
}

}  // namespace

void MarkDataParallel(v1::SessionInfo& info) { Mark(info, info.job()); }
void MarkDataParallel(v1::JobInfo& info) { Mark(info, info.name()); }

std::vector<v1::DataParallelJob> GroupDataParallelSessions(const std::vector<v1::SessionInfo>& sessions) {
  std::map<GroupKey, std::vector<const v1::SessionInfo*>> members;
  for (const v1::SessionInfo& s : sessions) {
    if (s.world_size() == 0) continue;
    members[{s.uid(), s.data_parallel_job(), s.world_size()}].push_back(&s);
  }
  std::vector<v1::DataParallelJob> rows;
  for (auto& [key, ranks] : members) {
    std::stable_sort(ranks.begin(), ranks.end(),
                     [](const v1::SessionInfo* a, const v1::SessionInfo* b) { return a->rank() < b->rank(); });
    v1::DataParallelJob& row = rows.emplace_back();
    row.set_uid(std::get<0>(key));
    row.set_job(std::get<1>(key));
    row.set_world_size(std::get<2>(key));
    row.set_live_ranks(static_cast<uint32_t>(ranks.size()));
    row.set_committed_step(ranks.front()->committed_step());
    row.set_newest_committed_step(ranks.front()->committed_step());
    for (const v1::SessionInfo* s : ranks) {
      const v1::DataParallelRank rank = RankRow(*s);
      row.set_committed_step(std::min(row.committed_step(), rank.committed_step()));
      row.set_newest_committed_step(std::max(row.newest_committed_step(), rank.committed_step()));
      row.set_chunks(row.chunks() + rank.chunks());
      row.set_chunk_updates(row.chunk_updates() + rank.chunk_updates());
      row.set_update_seconds(row.update_seconds() + rank.update_seconds());
      row.set_state_wait_seconds(row.state_wait_seconds() + rank.state_wait_seconds());
      row.set_chunks_speculative(row.chunks_speculative() + rank.chunks_speculative());
      row.set_chunks_redone(row.chunks_redone() + rank.chunks_redone());
      row.set_chunks_rolled_back(row.chunks_rolled_back() + rank.chunks_rolled_back());
      *row.add_ranks() = rank;
    }
  }
  return rows;
}

std::vector<v1::DataParallelJobInfo> GroupDataParallelJobs(const google::protobuf::RepeatedPtrField<v1::JobInfo>& jobs) {
  std::map<GroupKey, std::vector<const v1::JobInfo*>> members;
  for (const v1::JobInfo& j : jobs) {
    if (j.world_size() == 0) continue;
    members[{j.owner_uid(), j.data_parallel_job(), j.world_size()}].push_back(&j);
  }
  std::vector<v1::DataParallelJobInfo> rows;
  for (auto& [key, ranks] : members) {
    std::stable_sort(ranks.begin(), ranks.end(),
                     [](const v1::JobInfo* a, const v1::JobInfo* b) { return a->rank() < b->rank(); });
    v1::DataParallelJobInfo& row = rows.emplace_back();
    row.set_owner_uid(std::get<0>(key));
    row.set_name(std::get<1>(key));
    row.set_world_size(std::get<2>(key));
    bool first_step = true;
    for (const v1::JobInfo* j : ranks) {
      row.add_ranks(j->rank());
      if (j->open()) row.set_open_ranks(row.open_ranks() + 1);
      if (!j->damaged().empty()) {
        row.set_damaged_ranks(row.damaged_ranks() + 1);
        continue;
      }
      row.set_chunks(row.chunks() + j->chunks());
      row.set_parameters(row.parameters() + j->parameters());
      row.set_bytes_on_storage(row.bytes_on_storage() + j->bytes_on_storage());
      row.set_last_used_unix(std::max(row.last_used_unix(), j->last_used_unix()));
      row.set_committed_step(first_step ? j->committed_step() : std::min(row.committed_step(), j->committed_step()));
      row.set_newest_committed_step(first_step ? j->committed_step()
                                               : std::max(row.newest_committed_step(), j->committed_step()));
      first_step = false;
    }
  }
  return rows;
}

}  // namespace fuyou
