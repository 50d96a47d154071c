// Connecting to fuyoud and turning gRPC results into absl::Status. Private to
// clientlib: shared by Session, AdminClient and fuyouctl.
#pragma once

#include <sys/types.h>

#include <chrono>
#include <memory>
#include <optional>
#include <string>
#include <string_view>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "fuyou/client.h"
#include "grpcpp/channel.h"
#include "grpcpp/client_context.h"
#include "grpcpp/support/status.h"

namespace fuyou::internal {

// options.address, or DefaultAddress() when it is empty.
std::string ResolveAddress(const ClientOptions& options);

// The socket path of a "unix:" target ("unix:/run/x.sock" -> "/run/x.sock"); any
// other target is returned unchanged. Used in messages a user reads.
std::string SocketPathOf(std::string_view address);

// A channel to fuyoud, and what the connection under it was checked to be.
struct DaemonChannel {
  std::shared_ptr<grpc::Channel> channel;
  // Set when the connection was checked (ConnectTrusted): the uid the daemon
  // runs as. The channel then lives on that one connection and never reconnects
  // by itself: a client that outlives it (an idle GOAWAY, a restarted daemon)
  // calls ConnectChannel again, which checks the new connection the same way.
  std::optional<uid_t> peer_uid;
};

// Creates a channel to `address`. With `check_trust` (NeedsTrustCheck) and a
// "unix:" address: one connection made by ConnectTrusted (trusted_socket.h),
// whose peer is checked before the channel is built on that very fd, so no
// call can reach a daemon other than the one checked; an untrusted-daemon
// error (FAILED_PRECONDITION, IsUntrustedDaemon) otherwise, with nothing sent.
// Without it: a gRPC channel to the address, which reconnects by itself.
// Either way waits up to `connect_timeout` for the daemon; when it does not
// connect in time: PERMISSION_DENIED, naming the socket and its owner, when
// this user may not connect to the Unix socket; else UNAVAILABLE, naming the
// socket and how to start the daemon.
absl::StatusOr<DaemonChannel> ConnectChannel(const std::string& address, std::chrono::milliseconds connect_timeout,
                                             bool check_trust = false);

// True when a connection made with `options` must be checked (ConnectChannel's
// `check_trust`): the address is a default socket (left empty, or naming the
// system socket or this user's per-user socket, as the Python client passes the
// default it resolved) and FUYOU_SOCKET does not name it. A socket the user
// named elsewhere (FUYOU_SOCKET, an explicit address) is trusted as given.
bool NeedsTrustCheck(const ClientOptions& options);

// The same code (by number) and message.
absl::Status FromGrpcStatus(const grpc::Status& status);

// FromGrpcStatus with the message prefixed by `what` ("RegisterChunks for job 'x'").
// A transport failure (UNAVAILABLE, DEADLINE_EXCEEDED) says which call went
// unanswered and for how long.
absl::Status RpcError(const grpc::Status& status, std::string_view what,
                      std::chrono::milliseconds timeout);

// Sets the deadline of a unary call.
void SetDeadline(grpc::ClientContext& context, std::chrono::milliseconds timeout);

}  // namespace fuyou::internal
