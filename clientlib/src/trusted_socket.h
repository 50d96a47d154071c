// Connecting to a daemon's Unix socket so that the daemon that was checked is the
// daemon that is used. Private to clientlib (channel.h builds gRPC channels on it).
//
// Issue 32: the client used to check the socket with one connection (SO_PEERCRED)
// and let gRPC connect to the path again; another user who could change what the
// path names between the two (a link in a sticky directory, flipped between a
// root-owned listener and their own fuyoud) got some of the victim's sessions.
// Here the check and the connection are one act: ConnectTrusted connects once,
// reads SO_PEERCRED of that very connection, and returns it; channel.h hands
// the same fd to gRPC, which never looks the path up again. A new connection
// (a reconnect) is a new ConnectTrusted with the same checks.
#pragma once

#include <sys/types.h>

#include <chrono>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace fuyou::internal {

// One connected Unix socket, closed on destruction unless released.
class ConnectedSocket {
 public:
  ConnectedSocket() = default;
  ConnectedSocket(int fd, uid_t peer_uid) : fd_(fd), peer_uid_(peer_uid) {}
  ~ConnectedSocket();
  ConnectedSocket(ConnectedSocket&& other) noexcept : fd_(other.Release()), peer_uid_(other.peer_uid_) {}
  ConnectedSocket& operator=(ConnectedSocket&& other) noexcept;
  ConnectedSocket(const ConnectedSocket&) = delete;
  ConnectedSocket& operator=(const ConnectedSocket&) = delete;

  int fd() const { return fd_; }
  // The uid of the process that listens at the other end (SO_PEERCRED).
  uid_t peer_uid() const { return peer_uid_; }
  // Gives up ownership (to gRPC, which closes it); -1 afterwards.
  int Release();

 private:
  int fd_ = -1;
  uid_t peer_uid_ = 0;
};

// Whose daemon a client trusts at a default address: its own euid, root, and
// the package's `fuyou` system user.
bool TrustedUid(uid_t uid);

// The message of a refusal carries this payload (type URL); fuyou::IsUntrustedDaemon
// (client.h) tests for it, and the Python binding raises fuyou.UntrustedDaemon.
inline constexpr char kUntrustedDaemonPayload[] = "type.fuyou.dev/UntrustedDaemon";

// FAILED_PRECONDITION with `message`, marked as a refusal of an untrusted daemon.
absl::Status UntrustedDaemonError(std::string message);

// OK when the path to the socket may be trusted with this user's states, before
// anything connects: the socket's directory belongs to this user, root or the
// fuyou user, and nobody else may write it (unless sticky, as /tmp); and no
// symbolic link on the way to the socket (its directory's components or the
// socket itself) belongs to anyone else. An untrusted-daemon error otherwise,
// naming the path, the owner and what to do. OK when the directory does not
// exist (nothing to connect to; ConnectTrusted waits for it and reports it).
// A check of names that may change later: ConnectTrusted's check of the
// connection itself is the one that counts.
absl::Status CheckSocketPath(const std::string& path);

// Why a connect(2) to the Unix socket `path` failed with `error`:
// PERMISSION_DENIED (naming the socket's owner and mode, and what to ask for),
// UNAVAILABLE (nothing listens, no socket: how to start fuyoud), or
// INVALID_ARGUMENT for a path a Unix socket cannot have.
absl::Status ConnectError(const std::string& path, int error);

// Connects to the Unix socket `path` and checks the process that accepted: the
// path first (CheckSocketPath), then one connection, retried every 100 ms until
// `timeout` while the socket does not exist or refuses (a daemon starting), and
// the peer of that connection (SO_PEERCRED) must run as a TrustedUid. Returns
// the connection, on which nothing was sent. Errors: an untrusted-daemon error
// naming the path and the daemon's uid (the connection is closed unused), or
// ConnectError's.
absl::StatusOr<ConnectedSocket> ConnectTrusted(const std::string& path, std::chrono::milliseconds timeout);

// OK when the peer of the connected Unix socket `fd` runs as `expected_uid`
// (SO_PEERCRED): a second socket of the same daemon (the segment socket) must be
// served by the daemon whose connection was checked. An untrusted-daemon error
// naming `path` otherwise.
absl::Status CheckPeerIs(int fd, uid_t expected_uid, const std::string& path);

}  // namespace fuyou::internal
