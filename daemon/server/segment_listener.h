// SegmentListener: the daemon's segment socket (<gRPC socket path>.seg), where
// each client hands over the memfd of its session's segment (the protocol:
// proto/include/fuyou/segment_handover.h).
//
// The transport only: per connection it reads the peer's credentials
// (SO_PEERCRED), one message "<session_id>\n" of at most
// kMaxHandoverMessageBytes with one fd (SCM_RIGHTS, received close-on-exec; any
// further fds are closed unused), passes them to the Handler, writes the reply
// line and closes the connection. What a handover means (which session, whose,
// which fd is acceptable) is the Handler's.
//
// One thread serves every connection with poll(): no client can hold it, since
// reads and the reply never block and a connection that has not sent its
// message within Options::timeout is answered DEADLINE_EXCEEDED and closed. A
// uid with Options::max_pending_per_uid connections waiting, or a daemon with
// Options::max_pending, answers a new connection RESOURCE_EXHAUSTED at once, so
// one user's idle connections cannot keep another's out.
#pragma once

#include <sys/types.h>

#include <chrono>
#include <filesystem>
#include <functional>
#include <memory>
#include <string>
#include <thread>

#include "absl/status/statusor.h"
#include "server/peer_listener.h"

namespace fuyou {

class SegmentListener {
 public:
  // Decides a complete handover: the session id (without its '\n') and the fd
  // received (owned by the listener, closed after the call). The returned status
  // is the reply. Runs on the listener's thread: it must not block for long.
  using Handler = std::function<absl::Status(const PeerCredentials& peer, const std::string& session_id, int fd)>;

  struct Options {
    std::chrono::milliseconds timeout{5000};
    size_t max_pending = 256;
    size_t max_pending_per_uid = 16;
  };

  // Binds `path` (which PrepareSocketPath has cleared) with permissions `mode`.
  static absl::StatusOr<std::unique_ptr<SegmentListener>> Listen(const std::filesystem::path& path, mode_t mode,
                                                                 Handler handler, Options options);
  static absl::StatusOr<std::unique_ptr<SegmentListener>> Listen(const std::filesystem::path& path, mode_t mode,
                                                                 Handler handler) {
    return Listen(path, mode, std::move(handler), Options{});
  }
  // Stops, closes the connections still waiting and the listening socket (not
  // the socket file).
  ~SegmentListener();
  SegmentListener(const SegmentListener&) = delete;
  SegmentListener& operator=(const SegmentListener&) = delete;

  // Starts the thread that serves connections.
  void Serve();
  // Stops serving; connections still waiting are closed without a reply.
  void Stop();

 private:
  struct Connection;
  SegmentListener(int listen_fd, int wake_fd, Handler handler, Options options);
  void Loop();

  const int listen_fd_;
  const int wake_fd_;  // eventfd that wakes the loop to stop
  const Handler handler_;
  const Options options_;
  std::thread thread_;
};

}  // namespace fuyou
