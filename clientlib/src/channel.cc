#include "channel.h"

#include <fcntl.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <filesystem>

#include "fmt/format.h"
#include "fuyou/defaults.h"
#include "fuyou/daemon_trust.h"
#include "grpcpp/create_channel.h"
#include "grpcpp/create_channel_posix.h"
#include "grpcpp/security/credentials.h"
#include "grpcpp/support/channel_arguments.h"
#include "trusted_socket.h"

namespace fuyou {

std::string DefaultAddress() { return "unix:" + DefaultSocketPath().string(); }

bool IsUntrustedDaemon(const absl::Status& status) {
  return status.code() == absl::StatusCode::kFailedPrecondition &&
         status.GetPayload(internal::kUntrustedDaemonPayload).has_value();
}

absl::Status CheckTrustedDaemon(const std::string& path, std::chrono::milliseconds timeout) {
  return internal::ConnectTrusted(path, timeout).status();
}

namespace internal {
namespace {

// The channel arguments of every channel to fuyoud.
grpc::ChannelArguments ChannelArgs() {
  grpc::ChannelArguments args;
  // A daemon that starts while we wait is found within about a second, not after
  // gRPC's default exponential backoff.
  args.SetInt(GRPC_ARG_INITIAL_RECONNECT_BACKOFF_MS, 200);
  args.SetInt(GRPC_ARG_MIN_RECONNECT_BACKOFF_MS, 200);
  args.SetInt(GRPC_ARG_MAX_RECONNECT_BACKOFF_MS, 1000);
  // Large counters and stats fit easily; keep the default message limits otherwise.
  return args;
}

// errno of a plain connect(2) to the Unix socket `path` (0 when it connects),
// made after gRPC gave up to learn why: gRPC reports every failure alike. The
// probe sends nothing.
int ConnectErrno(const std::string& path) {
  sockaddr_un address{};
  address.sun_family = AF_UNIX;
  if (path.empty() || path.size() >= sizeof(address.sun_path)) return ENAMETOOLONG;
  std::memcpy(address.sun_path, path.data(), path.size());
  const int fd = ::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return 0;
  const int connected = ::connect(fd, reinterpret_cast<const sockaddr*>(&address), sizeof(address));
  const int error = errno;
  ::close(fd);
  return connected == 0 ? 0 : error;
}

// The socket paths a default address may name: the system socket and this
// user's per-user socket (fuyou/defaults.h), whichever DefaultSocketPath picks.
bool IsDefaultSocketPath(const std::string& path) {
  const std::filesystem::path normal = std::filesystem::path(path).lexically_normal();
  return normal == std::filesystem::path(kSystemSocketPath).lexically_normal() ||
         normal == (UserRuntimeDir() / "fuyoud.sock").lexically_normal();
}

// A channel on the connection ConnectTrusted made and checked: gRPC gets the fd
// itself and never resolves the path.
absl::StatusOr<DaemonChannel> ConnectChecked(const std::string& path, std::chrono::milliseconds connect_timeout) {
  absl::StatusOr<ConnectedSocket> socket = ConnectTrusted(path, connect_timeout);
  if (!socket.ok()) return socket.status();
  grpc::ChannelArguments args = ChannelArgs();
  args.SetString(GRPC_ARG_DEFAULT_AUTHORITY, "localhost");
  const uid_t peer = socket->peer_uid();
  std::shared_ptr<grpc::Channel> channel =
      grpc::CreateCustomInsecureChannelFromFd("unix:" + path, socket->Release(), args);
  if (channel == nullptr) {
    return absl::InternalError(fmt::format("cannot create a gRPC channel on the connection to {}", path));
  }
  return DaemonChannel{.channel = std::move(channel), .peer_uid = peer};
}

}  // namespace

bool NeedsTrustCheck(const ClientOptions& options) {
  const char* env = std::getenv("FUYOU_SOCKET");
  const bool env_set = env != nullptr && *env != '\0';
  if (options.address.empty()) return !env_set;
  if (!options.address.starts_with("unix:")) return false;
  const std::string path = SocketPathOf(options.address);
  if (env_set && std::filesystem::path(path).lexically_normal() == std::filesystem::path(env).lexically_normal()) {
    return false;
  }
  return IsDefaultSocketPath(path);
}

std::string ResolveAddress(const ClientOptions& options) {
  return options.address.empty() ? DefaultAddress() : options.address;
}

std::string SocketPathOf(std::string_view address) {
  if (address.starts_with("unix://")) address.remove_prefix(7);
  else if (address.starts_with("unix:")) address.remove_prefix(5);
  return std::string(address);
}

absl::StatusOr<DaemonChannel> ConnectChannel(const std::string& address, std::chrono::milliseconds connect_timeout,
                                             bool check_trust) {
  const bool unix_socket = address.starts_with("unix:");
  if (check_trust && unix_socket) return ConnectChecked(SocketPathOf(address), connect_timeout);
  // connect(2) on a Unix socket needs write permission on it and search
  // permission on its directories: a refusal is known at once, without waiting
  // for gRPC's connect timeout. A socket that does not exist yet is waited for.
  if (unix_socket) {
    const std::string path = SocketPathOf(address);
    if (::faccessat(AT_FDCWD, path.c_str(), W_OK, AT_EACCESS) != 0 && (errno == EACCES || errno == EPERM)) {
      return ConnectError(path, errno);
    }
  }
  std::shared_ptr<grpc::Channel> channel =
      grpc::CreateCustomChannel(address, grpc::InsecureChannelCredentials(), ChannelArgs());
  if (channel == nullptr) {
    return absl::InvalidArgumentError(fmt::format("cannot create a gRPC channel to '{}'", address));
  }
  if (!channel->WaitForConnected(std::chrono::system_clock::now() + connect_timeout)) {
    if (unix_socket) {
      const std::string path = SocketPathOf(address);
      if (const int error = ConnectErrno(path); error != 0) return ConnectError(path, error);
    }
    return absl::UnavailableError(fmt::format(
        "fuyoud is not reachable at {}: is the daemon running? (start it with `fuyoud` or set "
        "FUYOU_SOCKET)",
        SocketPathOf(address)));
  }
  return DaemonChannel{.channel = std::move(channel), .peer_uid = std::nullopt};
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
