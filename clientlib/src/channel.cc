#include "channel.h"

#include <fcntl.h>
#include <pwd.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <filesystem>

#include "fmt/format.h"
#include "fuyou/defaults.h"
#include "grpcpp/create_channel.h"
#include "grpcpp/security/credentials.h"
#include "grpcpp/support/channel_arguments.h"

namespace fuyou {

std::string DefaultAddress() { return "unix:" + DefaultSocketPath().string(); }

namespace internal {
namespace {

// This user may not connect to the Unix socket at `path`.
absl::Status PermissionDenied(const std::string& path) {
  struct stat info {};
  const std::string owner =
      ::stat(path.c_str(), &info) == 0
          ? fmt::format("the socket is mode {:04o}, owner uid {}, group gid {}", info.st_mode & 07777, info.st_uid,
                        info.st_gid)
          : "its directory cannot be searched";
  return absl::PermissionDeniedError(fmt::format(
      "permission denied on the socket {}: uid {} may not connect to fuyoud ({}); ask the administrator to add "
      "you to the socket's group (usually 'fuyou') and log in again, or use a daemon of your own (FUYOU_SOCKET)",
      path, ::geteuid(), owner));
}

// Why the Unix socket at `path` did not take a connection, from a plain
// connect(2) made after gRPC gave up: gRPC reports every failure alike.
absl::Status UnixSocketError(const std::string& path) {
  sockaddr_un address{};
  address.sun_family = AF_UNIX;
  if (path.empty() || path.size() >= sizeof(address.sun_path)) {
    return absl::InvalidArgumentError(fmt::format("'{}' is not a usable socket path", path));
  }
  std::memcpy(address.sun_path, path.data(), path.size());
  const int fd = ::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return absl::OkStatus();
  const int connected = ::connect(fd, reinterpret_cast<const sockaddr*>(&address), sizeof(address));
  const int error = errno;
  ::close(fd);
  if (connected == 0) return absl::OkStatus();
  if (error == EACCES || error == EPERM) return PermissionDenied(path);
  if (error == ENOENT || error == ECONNREFUSED || error == ENOTDIR) {
    return absl::UnavailableError(fmt::format(
        "fuyoud is not reachable at {}: is the daemon running? ({}; start it with `fuyoud` or set FUYOU_SOCKET)",
        path, error == ECONNREFUSED ? "nothing listens on the socket" : "the socket does not exist"));
  }
  return absl::UnavailableError(
      fmt::format("fuyoud is not reachable at {}: connect: {}", path, std::strerror(error)));
}

std::string UidName(uid_t uid) {
  if (const passwd* entry = ::getpwuid(uid); entry != nullptr) return fmt::format("uid {} ({})", uid, entry->pw_name);
  return fmt::format("uid {}", uid);
}

bool TrustedUid(uid_t uid) {
  if (uid == ::geteuid() || uid == 0) return true;
  const passwd* fuyou = ::getpwnam("fuyou");
  return fuyou != nullptr && fuyou->pw_uid == uid;
}

}  // namespace

absl::Status CheckTrustedSocket(const std::string& path) {
  const std::filesystem::path dir = std::filesystem::path(path).parent_path();
  const std::string dir_name = dir.empty() ? std::string(".") : dir.string();
  struct stat info {};
  if (::stat(dir_name.c_str(), &info) != 0) return absl::OkStatus();
  const std::string me = UidName(::geteuid());
  if (!TrustedUid(info.st_uid)) {
    return absl::FailedPreconditionError(fmt::format(
        "refusing the fuyoud socket {}: its directory {} belongs to {}, not to you ({}), root or the fuyou user, "
        "so another user may run the daemon behind it to receive your optimizer states; nothing was sent. Ask an "
        "administrator to remove {}, or set XDG_RUNTIME_DIR or FUYOU_SOCKET to a directory of your own",
        path, dir_name, UidName(info.st_uid), me, dir_name));
  }
  if ((info.st_mode & 0022) != 0 && (info.st_mode & S_ISVTX) == 0) {
    return absl::FailedPreconditionError(fmt::format(
        "refusing the fuyoud socket {}: its directory {} (owner {}, mode {:04o}) can be written by other users, who "
        "could replace the socket; nothing was sent. Run `chmod go-w {}` if it is yours, or set FUYOU_SOCKET",
        path, dir_name, UidName(info.st_uid), info.st_mode & 07777, dir_name));
  }
  sockaddr_un address{};
  address.sun_family = AF_UNIX;
  if (path.empty() || path.size() >= sizeof(address.sun_path)) return absl::OkStatus();
  std::memcpy(address.sun_path, path.data(), path.size());
  const int fd = ::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return absl::OkStatus();
  ucred peer{};
  socklen_t length = sizeof peer;
  const bool known = ::connect(fd, reinterpret_cast<const sockaddr*>(&address), sizeof(address)) == 0 &&
                     ::getsockopt(fd, SOL_SOCKET, SO_PEERCRED, &peer, &length) == 0;
  ::close(fd);
  if (!known) return absl::OkStatus();
  if (!TrustedUid(peer.uid)) {
    return absl::FailedPreconditionError(fmt::format(
        "refusing the fuyoud at {}: it runs as {}, not as you ({}), root or the fuyou user, so it could keep your "
        "optimizer states and weights; nothing was sent. Stop the daemon or remove {} (ask its owner or an "
        "administrator), start your own fuyoud, or name the address explicitly (FUYOU_SOCKET, "
        "ClientOptions::address) if you trust it",
        path, UidName(peer.uid), me, dir_name));
  }
  return absl::OkStatus();
}

bool UsesDefaultAddress(const ClientOptions& options) {
  const char* env = std::getenv("FUYOU_SOCKET");
  return options.address.empty() && (env == nullptr || *env == '\0');
}

std::string ResolveAddress(const ClientOptions& options) {
  return options.address.empty() ? DefaultAddress() : options.address;
}

std::string SocketPathOf(std::string_view address) {
  if (address.starts_with("unix://")) address.remove_prefix(7);
  else if (address.starts_with("unix:")) address.remove_prefix(5);
  return std::string(address);
}

absl::StatusOr<std::shared_ptr<grpc::Channel>> ConnectChannel(const std::string& address,
                                                             std::chrono::milliseconds connect_timeout,
                                                             bool check_trust) {
  // connect(2) on a Unix socket needs write permission on it and search
  // permission on its directories: a refusal is known at once, without waiting
  // for gRPC's connect timeout. A socket that does not exist yet is waited for.
  if (address.starts_with("unix:")) {
    const std::string path = SocketPathOf(address);
    if (::faccessat(AT_FDCWD, path.c_str(), W_OK, AT_EACCESS) != 0 && (errno == EACCES || errno == EPERM)) {
      return PermissionDenied(path);
    }
  }
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
    if (address.starts_with("unix:")) {
      if (absl::Status why = UnixSocketError(SocketPathOf(address)); !why.ok()) return why;
    }
    return absl::UnavailableError(fmt::format(
        "fuyoud is not reachable at {}: is the daemon running? (start it with `fuyoud` or set "
        "FUYOU_SOCKET)",
        SocketPathOf(address)));
  }
  // Connected, nothing sent yet but HTTP/2's preface: no call goes out unless
  // the daemon is one this user trusts.
  if (check_trust && address.starts_with("unix:")) {
    if (absl::Status trusted = CheckTrustedSocket(SocketPathOf(address)); !trusted.ok()) return trusted;
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
