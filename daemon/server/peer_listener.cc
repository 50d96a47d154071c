#include "server/peer_listener.h"

#include <poll.h>
#include <sys/eventfd.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include "common/log.h"
#include "common/status_util.h"
#include "fmt/format.h"
#include "grpcpp/server.h"
#include "grpcpp/server_posix.h"
#include "server/socket_path.h"

namespace fuyou {

absl::StatusOr<std::unique_ptr<PeerListener>> PeerListener::Listen(const std::filesystem::path& path, mode_t mode) {
  absl::StatusOr<int> listening = ListenOnSocketPath(path, mode);
  if (!listening.ok()) return listening.status();
  const int fd = *listening;
  int wake = ::eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
  if (wake < 0) {
    int err = errno;
    ::close(fd);
    return ErrnoStatus(err, "eventfd");
  }
  return std::unique_ptr<PeerListener>(new PeerListener(fd, wake));
}

PeerListener::PeerListener(int listen_fd, int wake_fd) : listen_fd_(listen_fd), wake_fd_(wake_fd) {}

PeerListener::~PeerListener() {
  Stop();
  ::close(listen_fd_);
  ::close(wake_fd_);
}

void PeerListener::Serve(grpc::Server* server) {
  thread_ = std::thread([this, server] { AcceptLoop(server); });
}

void PeerListener::Stop() {
  if (!thread_.joinable()) return;
  uint64_t one = 1;
  (void)::write(wake_fd_, &one, sizeof one);
  thread_.join();
}

void PeerListener::AcceptLoop(grpc::Server* server) {
  pollfd fds[2] = {{listen_fd_, POLLIN, 0}, {wake_fd_, POLLIN, 0}};
  for (;;) {
    if (::poll(fds, 2, -1) < 0) {
      if (errno == EINTR) continue;
      log::Error("accept loop: poll failed: {}", std::strerror(errno));
      return;
    }
    if (fds[1].revents != 0) return;
    // gRPC drives the connection with non-blocking I/O.
    int connection = ::accept4(listen_fd_, nullptr, nullptr, SOCK_CLOEXEC | SOCK_NONBLOCK);
    if (connection < 0) {
      if (errno != EAGAIN && errno != EINTR && errno != ECONNABORTED) {
        log::Warn("accept on the daemon socket failed: {}", std::strerror(errno));
      }
      continue;
    }
    const std::optional<PeerCredentials> credentials = ReadPeerCredentials(connection);
    if (!credentials) {
      log::Warn("cannot read the peer credentials of a connection ({}); refusing it", std::strerror(errno));
      ::close(connection);
      continue;
    }
    {
      std::lock_guard lock(mutex_);
      peers_[connection] = *credentials;
    }
    // gRPC owns the fd from here and closes it with the connection; a reused fd
    // number overwrites the entry above before any call on it can arrive.
    grpc::AddInsecureChannelFromFd(server, connection);
  }
}

std::optional<PeerCredentials> PeerListener::PeerOf(const std::string& peer) const {
  if (peer.rfind("fd:", 0) != 0) return std::nullopt;
  int fd = 0;
  try {
    fd = std::stoi(peer.substr(3));
  } catch (...) {
    return std::nullopt;
  }
  std::lock_guard lock(mutex_);
  auto it = peers_.find(fd);
  if (it == peers_.end()) return std::nullopt;
  return it->second;
}

std::optional<PeerCredentials> ReadPeerCredentials(int connected_socket) {
  ucred credentials{};
  socklen_t length = sizeof credentials;
  if (::getsockopt(connected_socket, SOL_SOCKET, SO_PEERCRED, &credentials, &length) != 0) return std::nullopt;
  return PeerCredentials{credentials.pid, credentials.uid, credentials.gid};
}

PeerCredentials Caller(const PeerListener* listener, const std::string& peer) {
  if (listener != nullptr) {
    if (auto credentials = listener->PeerOf(peer)) return *credentials;
  }
  return PeerCredentials{0, ::geteuid(), ::getegid()};
}

bool IsAdministrator(uid_t uid) { return uid == 0 || uid == ::geteuid(); }

}  // namespace fuyou
