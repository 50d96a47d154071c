#include "fuyou/admin_client.h"

#include "channel.h"
#include "fmt/format.h"
#include "fuyou/v1/admin.grpc.pb.h"

namespace fuyou {

class AdminClient::Impl {
 public:
  Impl(std::string address, std::shared_ptr<grpc::Channel> channel, std::chrono::milliseconds timeout)
      : address_(std::move(address)), stub_(v1::Admin::NewStub(channel)), timeout_(timeout) {}

  // Calls one unary method of the Admin service with the client's deadline.
  template <typename Request, typename Response, typename Method>
  absl::StatusOr<Response> Call(Method method, const Request& request, std::string_view what) {
    Response response;
    grpc::ClientContext context;
    internal::SetDeadline(context, timeout_);
    grpc::Status status = (stub_.get()->*method)(&context, request, &response);
    if (!status.ok()) {
      return internal::RpcError(status, fmt::format("{} at {}", what, internal::SocketPathOf(address_)),
                                timeout_);
    }
    return response;
  }

  std::string address_;
  std::unique_ptr<v1::Admin::Stub> stub_;
  std::chrono::milliseconds timeout_;
};

absl::StatusOr<std::unique_ptr<AdminClient>> AdminClient::Connect(const ClientOptions& options) {
  const std::string address = internal::ResolveAddress(options);
  absl::StatusOr<std::shared_ptr<grpc::Channel>> channel =
      internal::ConnectChannel(address, options.connect_timeout, internal::UsesDefaultAddress(options));
  if (!channel.ok()) return channel.status();
  return std::unique_ptr<AdminClient>(
      new AdminClient(std::make_unique<Impl>(address, *std::move(channel), options.rpc_timeout)));
}

AdminClient::AdminClient(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
AdminClient::~AdminClient() = default;

absl::StatusOr<v1::HealthResponse> AdminClient::Health() {
  return impl_->Call<v1::HealthRequest, v1::HealthResponse>(&v1::Admin::Stub::Health, {}, "Health");
}

absl::StatusOr<v1::GetStatsResponse> AdminClient::GetStats() {
  return impl_->Call<v1::GetStatsRequest, v1::GetStatsResponse>(&v1::Admin::Stub::GetStats, {}, "GetStats");
}

absl::StatusOr<v1::ListSessionsResponse> AdminClient::ListSessions() {
  return impl_->Call<v1::ListSessionsRequest, v1::ListSessionsResponse>(&v1::Admin::Stub::ListSessions, {},
                                                                        "ListSessions");
}

absl::StatusOr<v1::ListJobsResponse> AdminClient::ListJobs(bool all_users) {
  v1::ListJobsRequest request;
  request.set_all_users(all_users);
  return impl_->Call<v1::ListJobsRequest, v1::ListJobsResponse>(&v1::Admin::Stub::ListJobs, request, "ListJobs");
}

absl::StatusOr<v1::DeleteJobResponse> AdminClient::DeleteJob(const std::string& name) {
  v1::DeleteJobRequest request;
  request.set_name(name);
  return impl_->Call<v1::DeleteJobRequest, v1::DeleteJobResponse>(
      &v1::Admin::Stub::DeleteJob, request, fmt::format("DeleteJob of job '{}'", name));
}

absl::StatusOr<v1::CopyJobResponse> AdminClient::CopyJob(const std::string& src, const std::string& dst) {
  v1::CopyJobRequest request;
  request.set_src(src);
  request.set_dst(dst);
  return impl_->Call<v1::CopyJobRequest, v1::CopyJobResponse>(
      &v1::Admin::Stub::CopyJob, request, fmt::format("CopyJob of job '{}' into '{}'", src, dst));
}

}  // namespace fuyou
