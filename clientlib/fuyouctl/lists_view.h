// `fuyouctl sessions` and `fuyouctl jobs`: the tables of ListSessions and
// ListJobs. The ranks of a data-parallel job (the jobs `<job>.rank<r>-of<w>`,
// admin.proto's DataParallelJob) are shown as one job: after the ordinary
// rows, one row per data-parallel job with the ranks' totals (its JOB cell is
// the job's name, its RANKS cell how many of the world size are there), and
// its ranks' own rows beneath it, indented. Rows of ordinary jobs have "-" as
// RANKS.
#pragma once

#include <cstdint>
#include <functional>
#include <string>

#include "fuyou/v1/admin.pb.h"

namespace fuyou::ctl {

// `user_name` turns a uid into a name. Every line ends in '\n'; "no live
// sessions" / "no jobs" when there is none.
std::string RenderSessions(const v1::ListSessionsResponse& sessions,
                           const std::function<std::string(uint32_t)>& user_name);
// `ago` turns a Unix time into "3m 2s ago" (or "-").
std::string RenderJobs(const v1::ListJobsResponse& jobs, const std::function<std::string(uint32_t)>& user_name,
                       const std::function<std::string(int64_t)>& ago);

// "2/2" (ranks of the world size present), the RANKS cell of a data-parallel
// job's row; "-" for an ordinary job's, "rank 1" for a rank's.
std::string RanksCell(uint32_t present, uint32_t world_size);
std::string RankCell(uint32_t rank);

// Whether `s` is one of `group`'s ranks (same uid, data-parallel job, world size).
bool IsRankOf(const v1::SessionInfo& s, const v1::DataParallelJob& group);

}  // namespace fuyou::ctl
