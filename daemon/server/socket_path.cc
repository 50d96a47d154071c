#include "server/socket_path.h"

#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include "common/log.h"
#include "common/status_util.h"
#include "fmt/format.h"

namespace fuyou {
namespace fs = std::filesystem;

absl::Status PrepareSocketPath(const fs::path& path) {
  sockaddr_un address{};
  if (path.string().size() >= sizeof(address.sun_path)) {
    return absl::InvalidArgumentError(
        fmt::format("socket path {} is longer than the {} bytes a Unix socket path may have", path.string(),
                    sizeof(address.sun_path) - 1));
  }
  std::error_code ec;
  fs::create_directories(path.parent_path(), ec);
  if (ec) {
    return absl::FailedPreconditionError(
        fmt::format("cannot create the socket directory {}: {}", path.parent_path().string(), ec.message()));
  }
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
  const mode_t old_umask = ::umask(0177);
  const int bound = ::bind(fd, reinterpret_cast<sockaddr*>(&address), sizeof(address));
  const int bind_errno = errno;
  ::umask(old_umask);
  if (bound != 0) {
    ::close(fd);
    return ErrnoStatus(bind_errno, fmt::format("cannot bind {}", path.string()));
  }
  if (::chmod(path.c_str(), mode) != 0 || ::listen(fd, 128) != 0) {
    int err = errno;
    ::close(fd);
    return ErrnoStatus(err, fmt::format("cannot set up {}", path.string()));
  }
  return fd;
}

}  // namespace fuyou
