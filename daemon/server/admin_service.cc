#include "server/admin_service.h"

#include <unistd.h>

#include "common/status_util.h"
#include "server/data_parallel_groups.h"

namespace fuyou {

grpc::Status AdminService::Health(grpc::ServerContext*, const v1::HealthRequest*, v1::HealthResponse* response) {
  response->set_status(sessions_.draining() ? "DRAINING" : "SERVING");
  response->set_version(FUYOU_VERSION);
  response->set_uptime_seconds(stats_.uptime_seconds());
  response->set_kernel_isa(kernel_isa_);
  return grpc::Status::OK;
}

grpc::Status AdminService::GetStats(grpc::ServerContext* context, const v1::GetStatsRequest*,
                                    v1::GetStatsResponse* response) {
  response->set_uptime_seconds(stats_.uptime_seconds());
  const uid_t caller = Caller(listener_, context->peer()).uid;
  if (!IsAdministrator(caller)) {
    // The caller's own activity only: no storage paths, DRAM or other users.
    const TickerCounts& mine = stats_.ForUser(caller);
    const StatsRates rates = stats_.RatesForUser(caller);
    response->set_scope(v1::STATS_SCOPE_USER);
    response->set_uid(caller);
    FillTickers(mine, v1::STATS_SCOPE_USER, *response);
    response->set_read_gbps(rates.read_gbps[0]);
    response->set_write_gbps(rates.write_gbps[0]);
    response->set_chunk_updates_per_second(rates.chunk_updates_per_second);
    response->set_params_updated_per_second(rates.params_updated_per_second);
    response->set_live_sessions(sessions_.UsageOf(caller).sessions);
    report_.FillDataParallel(caller, response);
    return grpc::Status::OK;
  }
  report_.FillDaemonScope(/*rates=*/true, response);
  return grpc::Status::OK;
}

grpc::Status AdminService::ListSessions(grpc::ServerContext* context, const v1::ListSessionsRequest*,
                                        v1::ListSessionsResponse* response) {
  const uid_t caller = Caller(listener_, context->peer()).uid;
  const std::vector<v1::SessionInfo> infos =
      report_.Sessions(IsAdministrator(caller) ? std::nullopt : std::optional<uid_t>(caller));
  for (const v1::SessionInfo& info : infos) *response->add_sessions() = info;
  for (v1::DataParallelJob& row : GroupDataParallelSessions(infos)) *response->add_data_parallel_jobs() = std::move(row);
  return grpc::Status::OK;
}

grpc::Status AdminService::ListJobs(grpc::ServerContext* context, const v1::ListJobsRequest* request,
                                    v1::ListJobsResponse* response) {
  // Jobs live in a namespace per uid: a caller lists its own; an administrator
  // may ask for everyone's.
  const uid_t caller = Caller(listener_, context->peer()).uid;
  if (request->all_users() && !IsAdministrator(caller)) {
    return grpc::Status(grpc::StatusCode::PERMISSION_DENIED,
                        "listing the jobs of all users (all_users, fuyouctl jobs --all-users) is for root and the "
                        "daemon's user; list your own jobs without it");
  }
  auto jobs = jobs_.List(request->all_users() ? std::nullopt : std::optional<uid_t>(caller));
  if (!jobs.ok()) return ToGrpcStatus(jobs.status());
  for (auto& job : *jobs) MarkDataParallel(*response->add_jobs() = std::move(job));
  for (v1::DataParallelJobInfo& row : GroupDataParallelJobs(response->jobs())) {
    *response->add_data_parallel_jobs() = std::move(row);
  }
  return grpc::Status::OK;
}

grpc::Status AdminService::DeleteJob(grpc::ServerContext* context, const v1::DeleteJobRequest* request,
                                     v1::DeleteJobResponse* response) {
  // Only in the caller's namespace: another user's job of that name is untouched.
  const uid_t caller = Caller(listener_, context->peer()).uid;
  auto freed = jobs_.Delete(request->name(), caller);
  if (!freed.ok()) return ToGrpcStatus(freed.status());
  cache_.DropJob(Job::Key(caller, request->name()));
  response->set_bytes_freed(*freed);
  return grpc::Status::OK;
}

grpc::Status AdminService::CopyJob(grpc::ServerContext* context, const v1::CopyJobRequest* request,
                                   v1::CopyJobResponse* response) {
  // Both jobs in the caller's namespace: another user's job is never read.
  const uid_t caller = Caller(listener_, context->peer()).uid;
  auto copied = jobs_.Copy(request->src(), request->dst(), caller);
  if (!copied.ok()) return ToGrpcStatus(copied.status());
  cache_.DropJob(Job::Key(caller, request->dst()));  // nothing cached of a job of that name
  response->set_bytes_copied(*copied);
  auto listed = jobs_.List(caller);
  if (listed.ok()) {
    for (const v1::JobInfo& info : *listed) {
      if (info.name() == request->dst()) response->set_committed_step(info.committed_step());
    }
  }
  return grpc::Status::OK;
}

}  // namespace fuyou
