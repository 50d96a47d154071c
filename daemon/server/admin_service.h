// AdminService: fuyou.v1.Admin, what operators and fuyouctl read.
#pragma once

#include <string>

#include "fuyou/v1/admin.grpc.pb.h"
#include "jobs/job_registry.h"
#include "scheduler/state_cache.h"
#include "session/session_registry.h"
#include "stats/daemon_stats.h"

namespace fuyou {

class AdminService final : public v1::Admin::Service {
 public:
  AdminService(DaemonStats& stats, SessionRegistry& sessions, JobRegistry& jobs, StateCache& cache,
               std::string kernel_isa, std::vector<bool> direct_io)
      : stats_(stats),
        sessions_(sessions),
        jobs_(jobs),
        cache_(cache),
        kernel_isa_(std::move(kernel_isa)),
        direct_io_(std::move(direct_io)) {}

  grpc::Status Health(grpc::ServerContext*, const v1::HealthRequest*, v1::HealthResponse* response) override;
  grpc::Status GetStats(grpc::ServerContext*, const v1::GetStatsRequest*, v1::GetStatsResponse* response) override;
  grpc::Status ListSessions(grpc::ServerContext*, const v1::ListSessionsRequest*,
                            v1::ListSessionsResponse* response) override;
  grpc::Status ListJobs(grpc::ServerContext*, const v1::ListJobsRequest*, v1::ListJobsResponse* response) override;
  grpc::Status DeleteJob(grpc::ServerContext*, const v1::DeleteJobRequest* request,
                         v1::DeleteJobResponse* response) override;

 private:
  DaemonStats& stats_;
  SessionRegistry& sessions_;
  JobRegistry& jobs_;
  StateCache& cache_;
  const std::string kernel_isa_;
  const std::vector<bool> direct_io_;  // per storage path
};

}  // namespace fuyou
