// Connecting to fuyoud and turning gRPC results into absl::Status. Private to
// clientlib: shared by Session, AdminClient and fuyouctl.
#pragma once

#include <chrono>
#include <memory>
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

// Creates a channel to `address` and waits up to `connect_timeout` for it to
// connect. When it does not connect in time: PERMISSION_DENIED, naming the socket
// and its owner, when this user may not connect to the Unix socket; else
// UNAVAILABLE, naming the socket and how to start the daemon.
//
// `check_trust` (set when the address is the default one, DefaultAddress, with
// no FUYOU_SOCKET): before the channel is returned, and so before any call,
// CheckTrustedSocket must accept the socket; FAILED_PRECONDITION otherwise.
absl::StatusOr<std::shared_ptr<grpc::Channel>> ConnectChannel(const std::string& address,
                                                             std::chrono::milliseconds connect_timeout,
                                                             bool check_trust = false);

// OK when the Unix socket `path` may be trusted with this user's states: its
// directory belongs to this user, root or the package's `fuyou` user and no one
// else may write it (unless sticky, as /tmp), and the process accepting on it
// (SO_PEERCRED of a probe connection, which sends nothing) runs as one of those
// uids. FAILED_PRECONDITION otherwise, naming the path, the owner and what to do
// (issue 20: another user can create /tmp/fuyou-<uid> first and run a fuyoud
// there). OK as well when nothing accepts at `path` (the caller reports that).
absl::Status CheckTrustedSocket(const std::string& path);

// True when `options` leave the address to DefaultAddress() and FUYOU_SOCKET is unset.
bool UsesDefaultAddress(const ClientOptions& options);

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
