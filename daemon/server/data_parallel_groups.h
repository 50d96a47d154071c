// DataParallelGroups: the rows of the admin API that show the ranks of one
// data-parallel job as one job (issue 24 item 6). A rank trains the job
// `<job>.rank<r>-of<w>` (jobs/data_parallel_name.h); its session and its job on
// the storage tier stay rows of their own (SessionInfo, JobInfo, with the
// data-parallel job, rank and world size set), and the ranks of one user's
// (job, world size) become one more row with their totals and, for live
// sessions, one row per rank beneath (admin.proto: DataParallelJob,
// DataParallelJobInfo). GetStats, ListSessions, ListJobs and /metrics (through
// GetStats) use these functions and nothing else to group.
#pragma once

#include <vector>

#include "fuyou/v1/admin.pb.h"

namespace fuyou {

// Sets `info`'s data_parallel_job, rank and world_size from its job's name
// (cleared when the name is not a rank's).
void MarkDataParallel(v1::SessionInfo& info);
void MarkDataParallel(v1::JobInfo& info);

// One row per (uid, data-parallel job, world size) among `sessions` (each
// marked by MarkDataParallel first; unmarked ones are read as such), ordered by
// uid, job and world size, with the ranks' rows by rank. Sessions of ordinary
// jobs are in no row. Two sessions of the same rank (which the daemon's one
// session per job never has) would both be listed.
std::vector<v1::DataParallelJob> GroupDataParallelSessions(const std::vector<v1::SessionInfo>& sessions);

// The same for jobs on the storage tier: one row per (owner, data-parallel
// job, world size) among `jobs` (marked by MarkDataParallel), with totals.
std::vector<v1::DataParallelJobInfo> GroupDataParallelJobs(const google::protobuf::RepeatedPtrField<v1::JobInfo>& jobs);

}  // namespace fuyou
