#include "server/peer_listener.h"

#include <poll.h>
#include <sys/eventfd.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <algorithm>
#include <charconv>
#include <cerrno>
#include <chrono>
#include <cstring>

#include "common/log.h"
#include "common/log_throttle.h"
#include "common/status_util.h"
#include "fmt/format.h"
#include "grpcpp/server.h"
#include "grpcpp/server_posix.h"
#include "grpcpp/support/server_interceptor.h"
#include "grpcpp/server_context.h"
#include "server/socket_path.h"

namespace fuyou {

absl::StatusOr<std::unique_ptr<PeerListener>> PeerListener::Listen(const std::filesystem::path& path, mode_t mode,
                                                                   ConnectionLimits limits,
                                                                   std::chrono::milliseconds idle_timeout) {
  absl::StatusOr<int> listening = ListenOnSocketPath(path, mode);
  if (!listening.ok()) return listening.status();
  const int fd = *listening;
  int wake = ::eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
  if (wake < 0) {
    int err = errno;
    ::close(fd);
    return ErrnoStatus(err, "eventfd");
  }
  return std::unique_ptr<PeerListener>(new PeerListener(fd, wake, limits, idle_timeout));
}

PeerListener::PeerListener(int listen_fd, int wake_fd, ConnectionLimits limits, std::chrono::milliseconds idle_timeout)
    : listen_fd_(listen_fd), wake_fd_(wake_fd), connections_(limits), idle_timeout_(idle_timeout) {}

namespace {

constexpr uid_t kNobodyUid = 65534;

// The fd of a call's connection, from its peer "fd:N"; -1 for anything else.
int FdOfPeer(const std::string& peer) {
  if (peer.rfind("fd:", 0) != 0) return -1;
  int fd = -1;
  auto [end, error] = std::from_chars(peer.data() + 3, peer.data() + peer.size(), fd);
  if (error != std::errc() || end != peer.data() + peer.size()) return -1;
  return fd;
}

// Lives as long as its call: counts it on its connection. The call's peer is
// not known yet when the interceptor is created; it is at its first hook
// (the received initial metadata), before the handler runs.
class CallCounterInterceptor : public grpc::experimental::Interceptor {
 public:
  CallCounterInterceptor(ConnectionTable& table, grpc::experimental::ServerRpcInfo* info)
      : table_(table), info_(info) {}
  ~CallCounterInterceptor() override {
    if (fd_ >= 0) table_.CallEnded(fd_);
  }
  void Intercept(grpc::experimental::InterceptorBatchMethods* methods) override {
    if (!counted_) {
      counted_ = true;
      fd_ = FdOfPeer(info_->server_context()->peer());
      if (fd_ >= 0) table_.CallStarted(fd_);
    }
    methods->Proceed();
  }

 private:
  ConnectionTable& table_;
  grpc::experimental::ServerRpcInfo* const info_;
  bool counted_ = false;
  int fd_ = -1;
};

class CallCounterFactory : public grpc::experimental::ServerInterceptorFactoryInterface {
 public:
  explicit CallCounterFactory(ConnectionTable& table) : table_(table) {}
  grpc::experimental::Interceptor* CreateServerInterceptor(grpc::experimental::ServerRpcInfo* info) override {
    return new CallCounterInterceptor(table_, info);
  }

 private:
  ConnectionTable& table_;
};

}  // namespace

std::unique_ptr<grpc::experimental::ServerInterceptorFactoryInterface> PeerListener::CallCounter() {
  // `connections_` outlives the server: DaemonServer stops the server first.
  return std::make_unique<CallCounterFactory>(connections_);
}

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
  // Whatever a peer can repeat is logged at most once per period.
  LogThrottle accept_failures(std::chrono::seconds(10));
  LogThrottle refusals(std::chrono::seconds(10));
  pollfd fds[2] = {{listen_fd_, POLLIN, 0}, {wake_fd_, POLLIN, 0}};
  const int idle_check_ms =
      idle_timeout_.count() > 0 ? static_cast<int>(std::clamp<int64_t>(idle_timeout_.count() / 4, 10, 1000)) : -1;
  auto next_idle_check = std::chrono::steady_clock::now();
  // After a failed accept (EMFILE, ENFILE, ENOBUFS...) the loop sleeps this long,
  // doubling from 50 ms up to 1 s, before it tries again: the connection stays
  // in the backlog and the socket stays readable, so retrying at once would
  // spin a core (issue 20: 10 million log lines in 40 s).
  std::chrono::milliseconds backoff(0);
  for (;;) {
    const int ready = ::poll(fds, 2, idle_check_ms);
    if (ready < 0) {
      if (errno == EINTR) continue;
      log::Error("accept loop: poll failed: {}", std::strerror(errno));
      return;
    }
    if (fds[1].revents != 0) return;
    if (idle_check_ms > 0 && std::chrono::steady_clock::now() >= next_idle_check) {
      next_idle_check = std::chrono::steady_clock::now() + std::chrono::milliseconds(idle_check_ms);
      if (const size_t closed = connections_.CloseIdle(idle_timeout_); closed > 0) {
        log::Debug("closed {} connection(s) that carried no call for {} ms", closed, idle_timeout_.count());
      }
    }
    if (ready == 0 || fds[0].revents == 0) continue;
    // gRPC drives the connection with non-blocking I/O.
    int connection = ::accept4(listen_fd_, nullptr, nullptr, SOCK_CLOEXEC | SOCK_NONBLOCK);
    if (connection < 0) {
      const int err = errno;
      if (err == EAGAIN || err == EINTR || err == ECONNABORTED) {
        backoff = std::chrono::milliseconds(0);
        continue;
      }
      backoff = std::clamp(backoff * 2, std::chrono::milliseconds(50), std::chrono::milliseconds(1000));
      if (auto held_back = accept_failures.Allow()) {
        log::Warn("accept on the daemon socket failed: {}; retrying in {} ms ({} more failures not logged)",
                  std::strerror(err), backoff.count(), *held_back);
      }
      // Sleep through the backoff unless asked to stop.
      pollfd wake{wake_fd_, POLLIN, 0};
      if (::poll(&wake, 1, static_cast<int>(backoff.count())) > 0) return;
      continue;
    }
    backoff = std::chrono::milliseconds(0);
    const std::optional<PeerCredentials> credentials = ReadPeerCredentials(connection);
    if (!credentials) {
      if (auto held_back = refusals.Allow()) {
        log::Warn("cannot read the peer credentials of a connection ({}); refusing it ({} more refusals not logged)",
                  std::strerror(errno), *held_back);
      }
      ::close(connection);
      continue;
    }
    if (absl::Status admitted = connections_.Admit(connection, *credentials); !admitted.ok()) {
      if (auto held_back = refusals.Allow()) {
        log::Warn("{} ({} more refused connections not logged)", admitted.message(), *held_back);
      }
      ::close(connection);
      continue;
    }
    // gRPC owns the fd from here and closes it with the connection; the table
    // notices (ConnectionTable::Sweep), and a reused fd number replaces the
    // entry before any call on it can arrive.
    grpc::AddInsecureChannelFromFd(server, connection);
  }
}

std::optional<PeerCredentials> PeerListener::PeerOf(const std::string& peer) const {
  const int fd = FdOfPeer(peer);
  if (fd < 0) return std::nullopt;
  return connections_.PeerOf(fd);
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
    // A connection the listener never admitted: nobody, never the daemon's own uid.
    if (FdOfPeer(peer) >= 0) return PeerCredentials{0, kNobodyUid, kNobodyUid};
  }
  return PeerCredentials{0, ::geteuid(), ::getegid()};
}

bool IsAdministrator(uid_t uid) { return uid == 0 || uid == ::geteuid(); }

}  // namespace fuyou
