// AdminClient: typed access to fuyoud's admin API (fuyou.v1.Admin), used by
// fuyouctl and by tests. Every call has the client's deadline.
#pragma once

#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "fuyou/client.h"
#include "fuyou/v1/admin.pb.h"

namespace fuyou {

class AdminClient {
 public:
  static absl::StatusOr<std::unique_ptr<AdminClient>> Connect(const ClientOptions& options = {});
  ~AdminClient();

  absl::StatusOr<v1::HealthResponse> Health();
  absl::StatusOr<v1::GetStatsResponse> GetStats();
  absl::StatusOr<v1::ListSessionsResponse> ListSessions();
  // The caller's jobs; `all_users`: every user's (administrators only,
  // PERMISSION_DENIED for others).
  absl::StatusOr<v1::ListJobsResponse> ListJobs(bool all_users = false);
  absl::StatusOr<v1::DeleteJobResponse> DeleteJob(const std::string& name);
  // Forks the caller's job `src` into a new job `dst` inside the daemon (admin.proto CopyJob).
  absl::StatusOr<v1::CopyJobResponse> CopyJob(const std::string& src, const std::string& dst);

  class Impl;

 private:
  explicit AdminClient(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace fuyou
