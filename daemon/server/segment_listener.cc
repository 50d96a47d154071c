#include "server/segment_listener.h"

#include <poll.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <list>
#include <map>
#include <vector>

#include "common/log.h"
#include "common/log_throttle.h"
#include "common/status_util.h"
#include "fmt/format.h"
#include "fuyou/segment_handover.h"
#include "server/socket_path.h"

namespace fuyou {

using Clock = std::chrono::steady_clock;

// One accepted connection waiting for its message.
struct SegmentListener::Connection {
  int socket = -1;
  PeerCredentials peer;
  Clock::time_point deadline;
  std::string data;    // bytes received so far, at most kMaxHandoverMessageBytes
  int passed_fd = -1;  // the first fd received

  ~Connection() {
    if (passed_fd >= 0) ::close(passed_fd);
    if (socket >= 0) ::close(socket);
  }
  // Sends the reply line (the peer's socket buffer is empty: it never blocks).
  void Reply(const absl::Status& status) const {
    const std::string line = FormatHandoverReply(status);
    (void)::send(socket, line.data(), line.size(), MSG_NOSIGNAL | MSG_DONTWAIT);
  }
};

namespace {

// Room for a few fds: the first is used, the rest are closed. Fds beyond what
// fits are discarded (closed) by the kernel, which sets MSG_CTRUNC.
constexpr size_t kMaxFdsPerRead = 8;

}  // namespace

absl::StatusOr<std::unique_ptr<SegmentListener>> SegmentListener::Listen(const std::filesystem::path& path,
                                                                         mode_t mode, Handler handler,
                                                                         Options options) {
  absl::StatusOr<int> listening = ListenOnSocketPath(path, mode);
  if (!listening.ok()) return listening.status();
  const int wake = ::eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
  if (wake < 0) {
    const int err = errno;
    ::close(*listening);
    return ErrnoStatus(err, "eventfd");
  }
  return std::unique_ptr<SegmentListener>(new SegmentListener(*listening, wake, std::move(handler), options));
}

SegmentListener::SegmentListener(int listen_fd, int wake_fd, Handler handler, Options options)
    : listen_fd_(listen_fd), wake_fd_(wake_fd), handler_(std::move(handler)), options_(options) {}

SegmentListener::~SegmentListener() {
  Stop();
  ::close(listen_fd_);
  ::close(wake_fd_);
}

void SegmentListener::Serve() {
  thread_ = std::thread([this] { Loop(); });
}

void SegmentListener::Stop() {
  if (!thread_.joinable()) return;
  uint64_t one = 1;
  (void)::write(wake_fd_, &one, sizeof one);
  thread_.join();
}

void SegmentListener::Loop() {
  LogThrottle accept_failures(std::chrono::seconds(10));  // a peer can repeat them at will
  std::list<Connection> waiting;
  std::map<uid_t, size_t> waiting_per_uid;
  auto finish = [&](std::list<Connection>::iterator it, const absl::Status& reply) {
    it->Reply(reply);
    if (--waiting_per_uid[it->peer.uid] == 0) waiting_per_uid.erase(it->peer.uid);
    return waiting.erase(it);  // closes the connection and any fd it passed
  };

  std::vector<pollfd> fds;
  for (;;) {
    fds.assign({{listen_fd_, POLLIN, 0}, {wake_fd_, POLLIN, 0}});
    Clock::time_point next_deadline = Clock::time_point::max();
    for (const Connection& connection : waiting) {
      fds.push_back({connection.socket, POLLIN, 0});
      next_deadline = std::min(next_deadline, connection.deadline);
    }
    int timeout_ms = -1;
    if (!waiting.empty()) {
      const auto left = std::chrono::ceil<std::chrono::milliseconds>(next_deadline - Clock::now());
      timeout_ms = static_cast<int>(std::max<int64_t>(left.count(), 0));
    }
    if (::poll(fds.data(), fds.size(), timeout_ms) < 0) {
      if (errno == EINTR) continue;
      log::Error("segment socket: poll failed: {}; segment handovers stop", std::strerror(errno));
      return;
    }
    if (fds[1].revents != 0) return;  // Stop(): `waiting` closes what is left

    // Messages first (their fds are in `fds` in the order of `waiting`).
    size_t index = 2;
    for (auto it = waiting.begin(); it != waiting.end(); ++index) {
      Connection& connection = *it;
      if (fds[index].revents == 0) {
        ++it;
        continue;
      }
      char buffer[kMaxHandoverMessageBytes];
      alignas(cmsghdr) char control[CMSG_SPACE(sizeof(int) * kMaxFdsPerRead)];
      iovec data{buffer, kMaxHandoverMessageBytes - connection.data.size()};
      msghdr message{};
      message.msg_iov = &data;
      message.msg_iovlen = 1;
      message.msg_control = control;
      message.msg_controllen = sizeof control;
      const ssize_t got = ::recvmsg(connection.socket, &message, MSG_DONTWAIT | MSG_CMSG_CLOEXEC);
      if (got < 0 && (errno == EAGAIN || errno == EINTR)) {
        ++it;
        continue;
      }
      if (got >= 0 && message.msg_controllen > 0) {
        for (cmsghdr* header = CMSG_FIRSTHDR(&message); header != nullptr; header = CMSG_NXTHDR(&message, header)) {
          if (header->cmsg_level != SOL_SOCKET || header->cmsg_type != SCM_RIGHTS) continue;
          const size_t count = (header->cmsg_len - CMSG_LEN(0)) / sizeof(int);
          for (size_t i = 0; i < count; ++i) {
            int fd = -1;
            std::memcpy(&fd, CMSG_DATA(header) + i * sizeof(int), sizeof fd);
            if (connection.passed_fd < 0) {
              connection.passed_fd = fd;
            } else {
              ::close(fd);  // one segment per handover; extra fds are not kept
            }
          }
        }
      }
      if (got > 0) connection.data.append(buffer, static_cast<size_t>(got));
      const size_t newline = connection.data.find('\n');
      if (newline == std::string::npos) {
        if (got > 0 && connection.data.size() < kMaxHandoverMessageBytes) {
          ++it;  // the rest of the message is still coming
          continue;
        }
        it = finish(it, absl::InvalidArgumentError(fmt::format(
                            "the handover message must be \"<session_id>\\n\" in at most {} bytes, with the "
                            "memfd in SCM_RIGHTS",
                            kMaxHandoverMessageBytes)));
        continue;
      }
      if (connection.passed_fd < 0) {
        it = finish(it, absl::InvalidArgumentError(
                            "the handover carried no fd: send the segment's memfd in an SCM_RIGHTS control message "
                            "of the same sendmsg"));
        continue;
      }
      const std::string session_id = connection.data.substr(0, newline);
      absl::Status reply = handler_(connection.peer, session_id, connection.passed_fd);
      it = finish(it, reply);
    }

    // Connections whose time is up.
    const Clock::time_point now = Clock::now();
    for (auto it = waiting.begin(); it != waiting.end();) {
      if (it->deadline > now) {
        ++it;
        continue;
      }
      it = finish(it, absl::DeadlineExceededError(fmt::format(
                          "no complete handover message within {} ms; send \"<session_id>\\n\" and the memfd in one "
                          "sendmsg",
                          options_.timeout.count())));
    }

    // New connections.
    if (fds[0].revents == 0) continue;
    for (;;) {
      const int socket = ::accept4(listen_fd_, nullptr, nullptr, SOCK_CLOEXEC | SOCK_NONBLOCK);
      if (socket < 0) {
        if (errno == EMFILE || errno == ENFILE) {
          // The connection stays in the backlog and the socket stays readable:
          // pause instead of spinning until a descriptor is free.
          const int err = errno;
          if (auto held_back = accept_failures.Allow()) {
            log::Warn("segment socket: cannot accept a handover: {} ({} more not logged)", std::strerror(err),
                      *held_back);
          }
          std::this_thread::sleep_for(std::chrono::milliseconds(100));
        } else if (errno != EAGAIN && errno != EINTR && errno != ECONNABORTED) {
          const int err = errno;
          if (auto held_back = accept_failures.Allow()) {
            log::Warn("accept on the segment socket failed: {} ({} more not logged)", std::strerror(err), *held_back);
          }
        }
        break;
      }
      const std::optional<PeerCredentials> credentials = ReadPeerCredentials(socket);
      if (!credentials) {
        log::Warn("cannot read the peer credentials of a segment handover ({}); refusing it", std::strerror(errno));
        ::close(socket);
        continue;
      }
      waiting.emplace_back();
      Connection& connection = waiting.back();
      connection.socket = socket;
      connection.peer = *credentials;
      connection.deadline = Clock::now() + options_.timeout;
      const size_t of_uid = ++waiting_per_uid[credentials->uid];
      if (of_uid > options_.max_pending_per_uid || waiting.size() > options_.max_pending) {
        finish(std::prev(waiting.end()),
               absl::ResourceExhaustedError(fmt::format(
                   "too many segment handovers waiting ({} of uid {}, {} in all; the limits are {} and {}): send "
                   "each handover message as soon as the connection is open",
                   of_uid, credentials->uid, waiting.size(), options_.max_pending_per_uid, options_.max_pending)));
      }
    }
  }
}

}  // namespace fuyou
