// ConnectionTable: the gRPC connections PeerListener has handed to gRPC, by fd,
// with their peers' credentials, and the limits on them (issue 20: one user's
// 20,000 idle connections took every descriptor of the daemon). Thread-safe.
//
// gRPC owns an accepted fd and closes it when the connection ends, without
// telling anyone. A connection is therefore known to be gone when its fd no
// longer names the socket inode accepted (fstat: closed, or reused for another
// file); Sweep forgets those, and Admit sweeps before it counts. No descriptor
// is spent on the bookkeeping.
#pragma once

#include <sys/types.h>

#include <chrono>
#include <cstdint>
#include <map>
#include <mutex>
#include <optional>

#include "absl/status/status.h"

namespace fuyou {

// Who is at the other end of a Unix socket (SO_PEERCRED).
struct PeerCredentials {
  pid_t pid = 0;
  uid_t uid = 0;
  gid_t gid = 0;
};

struct ConnectionLimits {
  uint32_t max_connections = 1024;          // gRPC connections of all users together
  uint32_t max_connections_per_user = 64;   // gRPC connections of one uid
  // A connection is refused when its fd is at or above this number: fds are
  // handed out lowest first, so fd N means N descriptors are in use, and the
  // ones above stay free for commits, manifests and segment handovers of the
  // sessions already open. 0: no such bound.
  int max_connection_fd = 0;
};

class ConnectionTable {
 public:
  explicit ConnectionTable(ConnectionLimits limits) : limits_(limits) {}

  // Records the connection `fd` just accepted from `peer`, or refuses it:
  // RESOURCE_EXHAUSTED naming the limit, its value, the use and the setting
  // (the caller closes a refused fd). Connections that ended are forgotten first.
  absl::Status Admit(int fd, const PeerCredentials& peer);
  // The credentials of the connection last admitted on fd number `fd`, or
  // nullopt when none ever was. Kept after the connection is forgotten (until
  // the number is admitted again): a call gRPC read before a connection ended
  // or was shut down still runs as its own user, never as an unknown one.
  std::optional<PeerCredentials> PeerOf(int fd) const;
  // Forgets the connections whose fd is closed or names another file now;
  // returns how many are left.
  size_t Sweep();

  // A call started or ended on connection `fd` (a gRPC interceptor reports
  // them: PeerListener::CallCounter). Unknown fds are ignored.
  void CallStarted(int fd);
  void CallEnded(int fd);
  // Shuts down (shutdown(2): gRPC then sees the end and closes the fd) every
  // live connection that has carried no call for `timeout`, counting from its
  // accept or its last call's end, and forgets it; returns how many. This
  // covers what gRPC's own idle timer does not: a peer that never completes
  // the HTTP/2 handshake. The fd is checked to still be the socket accepted
  // just before it is shut down.
  size_t CloseIdle(std::chrono::steady_clock::duration timeout,
                   std::chrono::steady_clock::time_point now = std::chrono::steady_clock::now());

  size_t CountOf(uid_t uid) const;
  size_t total() const;
  const ConnectionLimits& limits() const { return limits_; }

 private:
  struct Entry {
    PeerCredentials peer;
    dev_t dev = 0;
    ino_t ino = 0;
    uint32_t calls = 0;                          // in flight
    std::chrono::steady_clock::time_point idle_since;  // when `calls` last became 0
  };
  static bool StillOpen(int fd, const Entry& entry);
  void EraseLocked(std::map<int, Entry>::iterator it);
  void SweepLocked();

  const ConnectionLimits limits_;
  mutable std::mutex mutex_;
  std::map<int, Entry> connections_;  // by fd
  std::map<uid_t, size_t> per_uid_;   // only uids with a connection
  std::map<int, PeerCredentials> last_peer_;  // by fd number, as last admitted
};

}  // namespace fuyou
