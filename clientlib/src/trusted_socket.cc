#include "trusted_socket.h"

#include <pwd.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <thread>

#include "absl/strings/cord.h"
#include "fmt/format.h"
#include "fuyou/socket_links.h"

namespace fuyou::internal {
namespace {

// How often ConnectTrusted tries again while the socket is missing or refuses.
constexpr std::chrono::milliseconds kRetryPeriod{100};

std::string UidName(uid_t uid) {
  if (const passwd* entry = ::getpwuid(uid); entry != nullptr) return fmt::format("uid {} ({})", uid, entry->pw_name);
  return fmt::format("uid {}", uid);
}

std::string DirectoryOf(const std::string& path) {
  const std::filesystem::path dir = std::filesystem::path(path).parent_path();
  return dir.empty() ? std::string(".") : dir.string();
}

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

bool FillAddress(const std::string& path, sockaddr_un& address) {
  address = {};
  address.sun_family = AF_UNIX;
  if (path.empty() || path.size() >= sizeof(address.sun_path)) return false;
  std::memcpy(address.sun_path, path.data(), path.size());
  return true;
}

// The peer's uid, or errno's.
absl::StatusOr<uid_t> PeerUid(int fd, const std::string& path) {
  ucred peer{};
  socklen_t length = sizeof peer;
  if (::getsockopt(fd, SOL_SOCKET, SO_PEERCRED, &peer, &length) != 0) {
    return absl::UnavailableError(
        fmt::format("cannot tell who serves the fuyoud socket {}: SO_PEERCRED: {}", path, std::strerror(errno)));
  }
  return peer.uid;
}

absl::Status UntrustedPeer(const std::string& path, uid_t uid) {
  return UntrustedDaemonError(fmt::format(
      "refusing the fuyoud at {}: it runs as {}, not as you ({}), root or the fuyou user, so it could keep your "
      "optimizer states and weights; nothing was sent. Stop the daemon or remove {} (ask its owner or an "
      "administrator), start your own fuyoud, or name the address explicitly (FUYOU_SOCKET, address=, "
      "ClientOptions::address) if you trust it",
      path, UidName(uid), UidName(::geteuid()), DirectoryOf(path)));
}

}  // namespace

ConnectedSocket::~ConnectedSocket() {
  if (fd_ >= 0) ::close(fd_);
}

ConnectedSocket& ConnectedSocket::operator=(ConnectedSocket&& other) noexcept {
  if (this != &other) {
    if (fd_ >= 0) ::close(fd_);
    peer_uid_ = other.peer_uid_;
    fd_ = other.Release();
  }
  return *this;
}

int ConnectedSocket::Release() {
  const int fd = fd_;
  fd_ = -1;
  return fd;
}

bool TrustedUid(uid_t uid) {
  if (uid == ::geteuid() || uid == 0) return true;
  const passwd* fuyou = ::getpwnam("fuyou");
  return fuyou != nullptr && fuyou->pw_uid == uid;
}

absl::Status UntrustedDaemonError(std::string message) {
  absl::Status status = absl::FailedPreconditionError(message);
  status.SetPayload(kUntrustedDaemonPayload, absl::Cord("1"));
  return status;
}

absl::Status CheckSocketPath(const std::string& path) {
  const std::string dir = DirectoryOf(path);
  const std::string me = UidName(::geteuid());
  if (const std::optional<PathLink> link = FindUntrustedLink(path, TrustedUid); link.has_value()) {
    return UntrustedDaemonError(fmt::format(
        "refusing the fuyoud socket {}: it is reached through the symbolic link {}, which belongs to {}, not to you "
        "({}), root or the fuyou user, so that user may point it at a daemon of their own to receive your "
        "optimizer states; nothing was sent. Ask an administrator to remove {}, or set XDG_RUNTIME_DIR or "
        "FUYOU_SOCKET to a directory of your own",
        path, link->link.string(), UidName(link->owner), me, link->link.string()));
  }
  struct stat info {};
  if (::stat(dir.c_str(), &info) != 0) return absl::OkStatus();
  if (!TrustedUid(info.st_uid)) {
    return UntrustedDaemonError(fmt::format(
        "refusing the fuyoud socket {}: its directory {} belongs to {}, not to you ({}), root or the fuyou user, "
        "so another user may run the daemon behind it to receive your optimizer states; nothing was sent. Ask an "
        "administrator to remove {}, or set XDG_RUNTIME_DIR or FUYOU_SOCKET to a directory of your own",
        path, dir, UidName(info.st_uid), me, dir));
  }
  if ((info.st_mode & 0022) != 0 && (info.st_mode & S_ISVTX) == 0) {
    return UntrustedDaemonError(fmt::format(
        "refusing the fuyoud socket {}: its directory {} (owner {}, mode {:04o}) can be written by other users, who "
        "could replace the socket; nothing was sent. Run `chmod go-w {}` if it is yours, or set FUYOU_SOCKET",
        path, dir, UidName(info.st_uid), info.st_mode & 07777, dir));
  }
  return absl::OkStatus();
}

absl::Status ConnectError(const std::string& path, int error) {
  if (error == EACCES || error == EPERM) return PermissionDenied(path);
  if (error == ENAMETOOLONG || error == EINVAL) {
    return absl::InvalidArgumentError(fmt::format("'{}' is not a usable socket path", path));
  }
  if (error == ENOENT || error == ECONNREFUSED || error == ENOTDIR) {
    return absl::UnavailableError(fmt::format(
        "fuyoud is not reachable at {}: is the daemon running? ({}; start it with `fuyoud` or set FUYOU_SOCKET)",
        path, error == ECONNREFUSED ? "nothing listens on the socket" : "the socket does not exist"));
  }
  return absl::UnavailableError(fmt::format("fuyoud is not reachable at {}: connect: {}", path, std::strerror(error)));
}

absl::StatusOr<ConnectedSocket> ConnectTrusted(const std::string& path, std::chrono::milliseconds timeout) {
  sockaddr_un address{};
  if (!FillAddress(path, address)) return ConnectError(path, ENAMETOOLONG);
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  for (;;) {
    if (absl::Status checked = CheckSocketPath(path); !checked.ok()) return checked;
    const int fd = ::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (fd < 0) return absl::ResourceExhaustedError(fmt::format("socket(AF_UNIX): {}", std::strerror(errno)));
    ConnectedSocket socket(fd, 0);
    // Bounds a connect that waits for room in a full backlog.
    const auto left = std::max<int64_t>(
        std::chrono::duration_cast<std::chrono::milliseconds>(deadline - std::chrono::steady_clock::now()).count(), 1);
    const timeval limit{static_cast<time_t>(left / 1000), static_cast<suseconds_t>(left % 1000 * 1000)};
    ::setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &limit, sizeof limit);
    if (::connect(fd, reinterpret_cast<const sockaddr*>(&address), sizeof(address)) == 0) {
      // The check that counts: who accepted this connection, the one returned.
      absl::StatusOr<uid_t> peer = PeerUid(fd, path);
      if (!peer.ok()) return peer.status();
      if (!TrustedUid(*peer)) return UntrustedPeer(path, *peer);
      const timeval none{0, 0};
      ::setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &none, sizeof none);
      return ConnectedSocket(socket.Release(), *peer);
    }
    const int error = errno;
    const bool may_come = error == ENOENT || error == ECONNREFUSED || error == ENOTDIR || error == EAGAIN ||
                          error == EINTR || error == EINPROGRESS;
    const auto now = std::chrono::steady_clock::now();
    if (!may_come || now >= deadline) return ConnectError(path, error == EINPROGRESS ? EAGAIN : error);
    std::this_thread::sleep_for(std::min<std::chrono::steady_clock::duration>(kRetryPeriod, deadline - now));
  }
}

absl::Status CheckPeerIs(int fd, uid_t expected_uid, const std::string& path) {
  absl::StatusOr<uid_t> peer = PeerUid(fd, path);
  if (!peer.ok()) return peer.status();
  if (*peer == expected_uid) return absl::OkStatus();
  return UntrustedDaemonError(fmt::format(
      "refusing the socket {}: it is served by {}, not by the daemon of this session ({}); nothing was sent. Its "
      "directory may have been changed by another user: ask an administrator to check {}",
      path, UidName(*peer), UidName(expected_uid), DirectoryOf(path)));
}

}  // namespace fuyou::internal
