#include "channel.h"

#include "fmt/format.h"
#include "fuyou/defaults.h"
#include "grpcpp/create_channel.h"
#include "grpcpp/security/credentials.h"
#include "grpcpp/support/channel_arguments.h"

namespace fuyou {

std::string DefaultAddress() { return "unix:" + DefaultSocketPath().string(); }

namespace internal {

std::string ResolveAddress(const ClientOptions& options) {
  return options.address.empty() ? DefaultAddress() : options.address;
}

std::string SocketPathOf(std::string_view address) {
  if (address.starts_with("unix://")) address.remove_prefix(7);
  else if (address.starts_with("unix:")) address.remove_prefix(5);
  return std::string(address);
}

absl::StatusOr<std::shared_ptr<grpc::Channel>> ConnectChannel(const std::string& address,
                                                             std::chrono::milliseconds connect_timeout) {
  grpc::ChannelArguments args;
  // A daemon that starts while we wait is found within about a second, not after
  // gRPC's default exponential backoff.
  args.SetInt(GRPC_ARG_INITIAL_RECONNECT_BACKOFF_MS, 200);
  args.SetInt(GRPC_ARG_MIN_RECONNECT_BACKOFF_MS, 200);
  args.SetInt(GRPC_ARG_MAX_RECONNECT_BACKOFF_MS, 1000);
  // Large counters and stats fit easily; keep the default message limits otherwise.
  std::shared_ptr<grpc::Channel> channel =
      grpc::CreateCustomChannel(address, grpc::InsecureChannelCredentials(), args);
  if (channel == nullptr) {
    return absl::InvalidArgumentError(fmt::format("cannot create a gRPC channel to '{}'", address));
  }
  if (!channel->WaitForConnected(std::chrono::system_clock::now() + connect_timeout)) {
    return absl::UnavailableError(fmt::format(
        "fuyoud is not reachable at {}: is the daemon running? (start it with `fuyoud` or set "
        "FUYOU_SOCKET)",
        SocketPathOf(address)));
  }
  return channel;
}

absl::Status FromGrpcStatus(const grpc::Status& status) {
  if (status.ok()) return absl::OkStatus();
  return absl::Status(static_cast<absl::StatusCode>(status.error_code()), status.error_message());
}

absl::Status RpcError(const grpc::Status& status, std::string_view what,
                      std::chrono::milliseconds timeout) {
  if (status.ok()) return absl::OkStatus();
  const auto code = static_cast<absl::StatusCode>(status.error_code());
  if (code == absl::StatusCode::kDeadlineExceeded) {
    return absl::DeadlineExceededError(
        fmt::format("{}: fuyoud did not answer within {} ms", what, timeout.count()));
  }
  if (code == absl::StatusCode::kUnavailable) {
    return absl::UnavailableError(
        fmt::format("{}: fuyoud is unavailable: {}", what, status.error_message()));
  }
  return absl::Status(code, fmt::format("{}: {}", what, status.error_message()));
}

void SetDeadline(grpc::ClientContext& context, std::chrono::milliseconds timeout) {
  context.set_deadline(std::chrono::system_clock::now() + timeout);
}

}  // namespace internal
}  // namespace fuyou
