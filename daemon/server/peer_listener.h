// PeerListener: the daemon's Unix socket, accepted by fuyoud itself so that each
// connection's peer credentials (SO_PEERCRED: pid, uid, gid) are known.
//
// gRPC's insecure Unix transport does not expose who connected. So the daemon
// binds and listens, accepts each connection, records its credentials, and hands
// the connected fd to gRPC (grpc::AddInsecureChannelFromFd). Calls on that
// connection report the peer "fd:N", which PeerOf maps back to the credentials.
#pragma once

#include <sys/socket.h>
#include <sys/types.h>

#include <atomic>
#include <chrono>
#include <filesystem>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>

#include "absl/status/statusor.h"
#include "server/connection_table.h"

namespace grpc {
class Server;
namespace experimental {
class ServerInterceptorFactoryInterface;
}
}

namespace fuyou {

class PeerListener {
 public:
  // Binds `path` (which PrepareSocketPath has cleared) with permissions `mode`
  // and listens (ListenOnSocketPath). Each connection is admitted against
  // `limits` (ConnectionTable) before gRPC sees it; a refused one is closed at
  // once, and the refusals are logged at most once per 10 s with a count.
  // A connection that carries no call for `idle_timeout` (0: never) is shut
  // down (ConnectionTable::CloseIdle), checked every quarter of it, at most
  // every second.
  static absl::StatusOr<std::unique_ptr<PeerListener>> Listen(const std::filesystem::path& path, mode_t mode,
                                                              ConnectionLimits limits = {},
                                                              std::chrono::milliseconds idle_timeout = {});
  // Stops accepting and closes the listening socket (not the socket file).
  ~PeerListener();

  // Starts the accept thread, which hands connections to `server` (not owned;
  // must outlive this object or Stop must be called first).
  void Serve(grpc::Server* server);
  void Stop();

  // Credentials of the connection a call came in on (ServerContext::peer()).
  std::optional<PeerCredentials> PeerOf(const std::string& peer) const;
  // The live connections and their limits.
  const ConnectionTable& connections() const { return connections_; }
  // A gRPC interceptor factory that tells the table when calls start and end
  // on each connection (for the idle timeout); give it to the ServerBuilder.
  std::unique_ptr<grpc::experimental::ServerInterceptorFactoryInterface> CallCounter();

 private:
  PeerListener(int listen_fd, int wake_fd, ConnectionLimits limits, std::chrono::milliseconds idle_timeout);
  void AcceptLoop(grpc::Server* server);

  int listen_fd_;
  int wake_fd_;  // eventfd that wakes the accept loop to stop
  std::thread thread_;
  ConnectionTable connections_;
  const std::chrono::milliseconds idle_timeout_;
};

// The credentials (SO_PEERCRED) of the process at the other end of a connected
// Unix socket; nullopt when the kernel cannot say (errno is left set).
std::optional<PeerCredentials> ReadPeerCredentials(int connected_socket);

// Who a call comes from (ServerContext::peer()); the daemon's own uid for a call
// that did not come through the listener (in-process), uid 65534 (nobody) for an
// "fd:N" peer the listener never admitted.
PeerCredentials Caller(const PeerListener* listener, const std::string& peer);
// True when `uid` may see every user's sessions and jobs: root or the daemon's uid.
bool IsAdministrator(uid_t uid);

}  // namespace fuyou
