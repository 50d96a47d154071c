#include "server/socket_path.h"

#include <fcntl.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <optional>

#include "common/log.h"
#include "common/status_util.h"
#include "fmt/format.h"
#include "fuyou/socket_links.h"

namespace fuyou {
namespace fs = std::filesystem;

mode_t SocketDirectoryMode(mode_t socket_mode) {
  mode_t mode = 0700;
  if (socket_mode & 0060) mode |= 0010;
  if (socket_mode & 0006) mode |= 0001;
  return mode;
}

absl::Status CheckSocketDirectory(const fs::path& dir) {
  const uid_t self = ::geteuid();
  // Issue 32: /tmp/fuyou-<uid> made another user's link into a root-owned
  // sticky directory passes every check below, and its owner can repoint it.
  if (const std::optional<PathLink> link =
          FindUntrustedLink(dir, [self](uid_t owner) { return owner == self || owner == 0; });
      link.has_value()) {
    return absl::FailedPreconditionError(fmt::format(
        "refusing the socket directory {}: it is reached through the symbolic link {}, which belongs to uid {}, not "
        "to this daemon's uid {} or root, so that user could point it (and clients with it) elsewhere at any time. "
        "Remove the link (as root, or ask its owner) and start fuyoud again, or choose another --socket",
        dir.string(), link->link.string(), link->owner, self));
  }
  struct stat info {};
  if (::stat(dir.c_str(), &info) != 0) {
    return ErrnoStatus(errno, fmt::format("cannot inspect the socket directory {}", dir.string()));
  }
  if (!S_ISDIR(info.st_mode)) {
    return absl::FailedPreconditionError(fmt::format("the socket directory {} is not a directory", dir.string()));
  }
  if (info.st_uid != self && info.st_uid != 0) {
    return absl::FailedPreconditionError(fmt::format(
        "refusing the socket directory {}: it belongs to uid {}, not to this daemon's uid {} or root, so that user "
        "could replace the socket; someone else may have created it first. Remove it (as root, or ask its owner) "
        "and start fuyoud again, or choose another --socket",
        dir.string(), info.st_uid, self));
  }
  if ((info.st_mode & 0022) != 0 && (info.st_mode & S_ISVTX) == 0) {
    return absl::FailedPreconditionError(fmt::format(
        "refusing the socket directory {}: its mode {:04o} lets {} write it, so they could replace the socket. "
        "Run `chmod go-w {}` (or `chmod +t` for a shared directory), or choose another --socket",
        dir.string(), info.st_mode & 07777, (info.st_mode & 0002) ? "every user" : "its group", dir.string()));
  }
  return absl::OkStatus();
}

absl::Status PrepareSocketPath(const fs::path& path, mode_t socket_mode) {
  sockaddr_un address{};
  if (path.string().size() >= sizeof(address.sun_path)) {
    return absl::InvalidArgumentError(
        fmt::format("socket path {} is longer than the {} bytes a Unix socket path may have", path.string(),
                    sizeof(address.sun_path) - 1));
  }
  const fs::path dir = path.parent_path().empty() ? fs::path(".") : path.parent_path();
  std::error_code ec;
  if (!fs::exists(dir, ec)) {
    if (dir.has_parent_path()) fs::create_directories(dir.parent_path(), ec);
    // Made 0700, then given its search bits through an fd opened without
    // following links. EEXIST (another creator won a race) is checked below
    // like any directory found.
    if (::mkdir(dir.c_str(), 0700) == 0) {
      if (const int dir_fd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC); dir_fd >= 0) {
        (void)::fchmod(dir_fd, SocketDirectoryMode(socket_mode));
        ::close(dir_fd);
      }
    } else if (errno != EEXIST) {
      return ErrnoStatus(errno, fmt::format("cannot create the socket directory {}", dir.string()));
    }
  }
  FUYOU_RETURN_IF_ERROR(CheckSocketDirectory(dir));
  struct stat info {};
  if (::lstat(path.c_str(), &info) != 0) {
    if (errno == ENOENT) return absl::OkStatus();
    return ErrnoStatus(errno, fmt::format("cannot inspect {}", path.string()));
  }
  if (!S_ISSOCK(info.st_mode)) {
    return absl::FailedPreconditionError(
        fmt::format("{} exists and is not a socket; refusing to replace it", path.string()));
  }
  int fd = ::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return ErrnoStatus(errno, "socket(AF_UNIX)");
  address.sun_family = AF_UNIX;
  std::strncpy(address.sun_path, path.c_str(), sizeof(address.sun_path) - 1);
  const int rc = ::connect(fd, reinterpret_cast<sockaddr*>(&address), sizeof(address));
  const int err = errno;
  ::close(fd);
  if (rc == 0) {
    return absl::FailedPreconditionError(fmt::format(
        "another fuyoud is already serving {}; stop it first or choose another --socket", path.string()));
  }
  if (err != ECONNREFUSED) {
    return ErrnoStatus(err, fmt::format("cannot tell whether a daemon serves {}", path.string()));
  }
  log::Info("removing stale socket {} (nothing listens on it)", path.string());
  if (::unlink(path.c_str()) != 0 && errno != ENOENT) {
    return ErrnoStatus(errno, fmt::format("cannot remove stale socket {}", path.string()));
  }
  return absl::OkStatus();
}

absl::StatusOr<int> ListenOnSocketPath(const fs::path& path, mode_t mode) {
  int fd = ::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
  if (fd < 0) return ErrnoStatus(errno, "socket(AF_UNIX)");
  sockaddr_un address{};
  address.sun_family = AF_UNIX;
  std::strncpy(address.sun_path, path.c_str(), sizeof(address.sun_path) - 1);
  // bind creates the file with the socket inode's mode less the umask.
  (void)::fchmod(fd, mode & 0777);
  const mode_t old_umask = ::umask(~mode & 0777);
  const int bound = ::bind(fd, reinterpret_cast<sockaddr*>(&address), sizeof(address));
  const int bind_errno = errno;
  ::umask(old_umask);
  if (bound != 0) {
    ::close(fd);
    return ErrnoStatus(bind_errno, fmt::format("cannot bind {}", path.string()));
  }
  if (::listen(fd, 128) != 0) {
    int err = errno;
    ::close(fd);
    return ErrnoStatus(err, fmt::format("cannot set up {}", path.string()));
  }
  return fd;
}

}  // namespace fuyou
