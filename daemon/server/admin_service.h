// AdminService: fuyou.v1.Admin, what operators and fuyouctl read.
#pragma once

#include <string>

#include "fuyou/v1/admin.grpc.pb.h"
#include "jobs/job_registry.h"
#include "state/state_cache.h"
#include "server/peer_listener.h"
#include "server/stats_report.h"
#include "session/session_registry.h"
#include "stats/daemon_stats.h"

namespace fuyou {

class AdminService final : public v1::Admin::Service {
 public:
  // `listener` (may be null) tells who calls: a user other than root and the
  // daemon's own sees only their own sessions and jobs.
  // `report` fills the daemon-wide answer of GetStats (shared with /metrics).
  AdminService(const PeerListener* listener, const StatsReport& report, SessionRegistry& sessions,
               JobRegistry& jobs, StateCache& cache, std::string kernel_isa)
      : listener_(listener),
        report_(report),
        stats_(report.stats()),
        sessions_(sessions),
        jobs_(jobs),
        cache_(cache),
        kernel_isa_(std::move(kernel_isa)) {}

  grpc::Status Health(grpc::ServerContext*, const v1::HealthRequest*, v1::HealthResponse* response) override;
  // The whole daemon for an administrator (root, the daemon's uid); the caller's
  // own activity for anyone else (StatsScope in admin.proto).
  grpc::Status GetStats(grpc::ServerContext* context, const v1::GetStatsRequest*,
                        v1::GetStatsResponse* response) override;
  grpc::Status ListSessions(grpc::ServerContext* context, const v1::ListSessionsRequest*,
                            v1::ListSessionsResponse* response) override;
  grpc::Status ListJobs(grpc::ServerContext* context, const v1::ListJobsRequest*,
                        v1::ListJobsResponse* response) override;
  grpc::Status DeleteJob(grpc::ServerContext* context, const v1::DeleteJobRequest* request,
                         v1::DeleteJobResponse* response) override;
  // Forks a job of the caller into a new job of the caller (JobRegistry::Copy).
  grpc::Status CopyJob(grpc::ServerContext* context, const v1::CopyJobRequest* request,
                       v1::CopyJobResponse* response) override;

 private:
  const PeerListener* listener_;
  const StatsReport& report_;
  DaemonStats& stats_;
  SessionRegistry& sessions_;
  JobRegistry& jobs_;
  StateCache& cache_;
  const std::string kernel_isa_;
};

}  // namespace fuyou
