#include "fuyou/admin_client.h"

#include <mutex>

#include "channel.h"
#include "fmt/format.h"
#include "fuyou/v1/admin.grpc.pb.h"

namespace fuyou {

// The admin stub over one DaemonChannel. A checked channel (a default address)
// lives on one connection and does not reconnect by itself, so the Impl does:
// after a call that found the connection gone (UNAVAILABLE), the next call first
// connects again through ConnectChannel's checks; a call that only reads is
// retried once at once on the new connection, one that changes something
// (DeleteJob, CopyJob) is not (it may have been done before the connection went).
class AdminClient::Impl {
 public:
  Impl(std::string address, const ClientOptions& options, internal::DaemonChannel channel)
      : address_(std::move(address)),
        check_trust_(internal::NeedsTrustCheck(options)),
        connect_timeout_(options.connect_timeout),
        timeout_(options.rpc_timeout),
        stub_(v1::Admin::NewStub(channel.channel)),
        own_connection_(channel.peer_uid.has_value()) {}

  enum class Retry { kOnce, kNever };

  // Calls one unary method of the Admin service with the client's deadline.
  template <typename Request, typename Response, typename Method>
  absl::StatusOr<Response> Call(Method method, const Request& request, std::string_view what, Retry retry) {
    for (int attempt = 0;; ++attempt) {
      absl::StatusOr<std::shared_ptr<v1::Admin::Stub>> stub = Stub();
      if (!stub.ok()) return Failed(stub.status(), what);
      Response response;
      grpc::ClientContext context;
      internal::SetDeadline(context, timeout_);
      grpc::Status status = ((*stub).get()->*method)(&context, request, &response);
      if (status.ok()) return response;
      if (status.error_code() == grpc::StatusCode::UNAVAILABLE && own_connection_) {
        MarkLost(*stub);
        if (retry == Retry::kOnce && attempt == 0) continue;
      }
      return internal::RpcError(status, fmt::format("{} at {}", what, internal::SocketPathOf(address_)), timeout_);
    }
  }

 private:
  // The current stub; a new connection first when the last one was lost.
  absl::StatusOr<std::shared_ptr<v1::Admin::Stub>> Stub() {
    std::lock_guard lock(mu_);
    if (stub_ == nullptr) {
      absl::StatusOr<internal::DaemonChannel> channel =
          internal::ConnectChannel(address_, connect_timeout_, check_trust_);
      if (!channel.ok()) return channel.status();
      stub_ = v1::Admin::NewStub(channel->channel);
    }
    return stub_;
  }

  void MarkLost(const std::shared_ptr<v1::Admin::Stub>& stub) {
    std::lock_guard lock(mu_);
    if (stub_ == stub) stub_.reset();
  }

  // A reconnect's error keeps its code and payload (an untrusted daemon stays
  // one), prefixed by the call.
  static absl::Status Failed(const absl::Status& status, std::string_view what) {
    absl::Status prefixed(status.code(), fmt::format("{}: {}", what, std::string(status.message())));
    status.ForEachPayload(
        [&](absl::string_view url, const absl::Cord& payload) { prefixed.SetPayload(url, payload); });
    return prefixed;
  }

  const std::string address_;
  const bool check_trust_;
  const std::chrono::milliseconds connect_timeout_;
  const std::chrono::milliseconds timeout_;
  std::mutex mu_;
  std::shared_ptr<v1::Admin::Stub> stub_;  // null after a lost connection; guarded by mu_
  const bool own_connection_;              // a checked channel: reconnect here
};

absl::StatusOr<std::unique_ptr<AdminClient>> AdminClient::Connect(const ClientOptions& options) {
  const std::string address = internal::ResolveAddress(options);
  absl::StatusOr<internal::DaemonChannel> channel =
      internal::ConnectChannel(address, options.connect_timeout, internal::NeedsTrustCheck(options));
  if (!channel.ok()) return channel.status();
  return std::unique_ptr<AdminClient>(new AdminClient(std::make_unique<Impl>(address, options, *std::move(channel))));
}

AdminClient::AdminClient(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
AdminClient::~AdminClient() = default;

absl::StatusOr<v1::HealthResponse> AdminClient::Health() {
  return impl_->Call<v1::HealthRequest, v1::HealthResponse>(&v1::Admin::Stub::Health, {}, "Health", Impl::Retry::kOnce);
}

absl::StatusOr<v1::GetStatsResponse> AdminClient::GetStats() {
  return impl_->Call<v1::GetStatsRequest, v1::GetStatsResponse>(&v1::Admin::Stub::GetStats, {}, "GetStats",
                                                                Impl::Retry::kOnce);
}

absl::StatusOr<v1::ListSessionsResponse> AdminClient::ListSessions() {
  return impl_->Call<v1::ListSessionsRequest, v1::ListSessionsResponse>(&v1::Admin::Stub::ListSessions, {},
                                                                        "ListSessions", Impl::Retry::kOnce);
}

absl::StatusOr<v1::ListJobsResponse> AdminClient::ListJobs(bool all_users) {
  v1::ListJobsRequest request;
  request.set_all_users(all_users);
  return impl_->Call<v1::ListJobsRequest, v1::ListJobsResponse>(&v1::Admin::Stub::ListJobs, request, "ListJobs",
                                                                Impl::Retry::kOnce);
}

absl::StatusOr<v1::DeleteJobResponse> AdminClient::DeleteJob(const std::string& name) {
  v1::DeleteJobRequest request;
  request.set_name(name);
  return impl_->Call<v1::DeleteJobRequest, v1::DeleteJobResponse>(
      &v1::Admin::Stub::DeleteJob, request, fmt::format("DeleteJob of job '{}'", name), Impl::Retry::kNever);
}

absl::StatusOr<v1::CopyJobResponse> AdminClient::CopyJob(const std::string& src, const std::string& dst) {
  v1::CopyJobRequest request;
  request.set_src(src);
  request.set_dst(dst);
  return impl_->Call<v1::CopyJobRequest, v1::CopyJobResponse>(
      &v1::Admin::Stub::CopyJob, request, fmt::format("CopyJob of job '{}' into '{}'", src, dst),
      Impl::Retry::kNever);
}

}  // namespace fuyou
