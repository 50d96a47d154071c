#include "fuyou/client_segment.h"

#include <fcntl.h>
#include <poll.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <cerrno>
#include <algorithm>
#include <cstring>
#include <vector>

#include "fmt/format.h"
#include "fuyou/segment_handover.h"
#include "trusted_socket.h"

namespace fuyou {
namespace {

absl::Status SystemError(int err, std::string_view what) {
  const std::string message = fmt::format("{}: {}", what, std::strerror(err));
  switch (err) {
    case ENOMEM:
    case ENOSPC:
    case EMFILE:
    case ENFILE: return absl::ResourceExhaustedError(message);
    case EACCES:
    case EPERM: return absl::PermissionDeniedError(message);
    default: return absl::InternalError(message);
  }
}

// The longest reply line read; longer ones are cut (the daemon's are short).
constexpr size_t kMaxReplyBytes = 4096;

}  // namespace

absl::StatusOr<std::unique_ptr<ClientSegment>> ClientSegment::Create(uint64_t bytes) {
  if (bytes == 0 || bytes > static_cast<uint64_t>(INT64_MAX)) {
    return absl::InvalidArgumentError(fmt::format("a segment of {} bytes cannot be created", bytes));
  }
  const int fd = ::memfd_create(kSegmentMemfdName, MFD_CLOEXEC | MFD_ALLOW_SEALING);
  if (fd < 0) return SystemError(errno, "memfd_create for the session's segment");
  auto fail = [fd](absl::Status status) {
    ::close(fd);
    return status;
  };
  if (::ftruncate(fd, static_cast<off_t>(bytes)) != 0) {
    return fail(SystemError(errno, fmt::format("cannot size the segment memfd to {} bytes", bytes)));
  }
  // Reserve every page now: without it, a full memory (or memory cgroup) would
  // show up as a SIGBUS in the middle of a step instead of an error here.
  if (int err = ::posix_fallocate(fd, 0, static_cast<off_t>(bytes)); err != 0) {
    return fail(SystemError(err == ENOSPC ? ENOMEM : err,
                            fmt::format("cannot reserve {} bytes of memory for the session's segment", bytes)));
  }
  if (::fcntl(fd, F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL) != 0) {
    return fail(SystemError(errno, "cannot seal the segment memfd"));
  }
  void* base = ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  if (base == MAP_FAILED) return fail(SystemError(errno, fmt::format("cannot map a segment of {} bytes", bytes)));
  return std::unique_ptr<ClientSegment>(new ClientSegment(fd, static_cast<std::byte*>(base), bytes));
}

ClientSegment::~ClientSegment() {
  ::munmap(base_, size_);
  CloseFd();
}

void ClientSegment::CloseFd() {
  if (fd_ >= 0) ::close(fd_);
  fd_ = -1;
}

absl::Status ClientSegment::HandOver(const std::filesystem::path& socket, std::string_view session_id,
                                     std::chrono::milliseconds timeout, std::optional<uid_t> daemon_uid) const {
  if (fd_ < 0) return absl::FailedPreconditionError("the segment's fd is already closed");
  return SendSegmentHandover(socket, std::string(session_id) + "\n", fd_, timeout, daemon_uid);
}

long SendWithFds(int connected_socket, std::string_view payload, std::span<const int> fds, int flags) {
  iovec data{const_cast<char*>(payload.data()), payload.size()};
  msghdr message{};
  message.msg_iov = &data;
  message.msg_iovlen = 1;
  std::vector<std::byte> control(fds.empty() ? 0 : CMSG_SPACE(fds.size_bytes()));
  if (!fds.empty()) {
    message.msg_control = control.data();
    message.msg_controllen = control.size();
    cmsghdr* header = CMSG_FIRSTHDR(&message);
    header->cmsg_level = SOL_SOCKET;
    header->cmsg_type = SCM_RIGHTS;
    header->cmsg_len = CMSG_LEN(fds.size_bytes());
    std::memcpy(CMSG_DATA(header), fds.data(), fds.size_bytes());
  }
  return ::sendmsg(connected_socket, &message, flags);
}

absl::Status SendSegmentHandover(const std::filesystem::path& socket, std::string_view payload, int fd,
                                 std::chrono::milliseconds timeout, std::optional<uid_t> daemon_uid) {
  sockaddr_un address{};
  if (socket.string().size() >= sizeof(address.sun_path)) {
    return absl::InvalidArgumentError(fmt::format("segment socket path {} is too long", socket.string()));
  }
  const int connection = ::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (connection < 0) return SystemError(errno, "socket(AF_UNIX)");
  struct Closer {
    int fd;
    ~Closer() { ::close(fd); }
  } closer{connection};
  // Bounds the connect (a full backlog) and the send.
  const timeval limit{static_cast<time_t>(timeout.count() / 1000),
                      static_cast<suseconds_t>(timeout.count() % 1000 * 1000)};
  ::setsockopt(connection, SOL_SOCKET, SO_SNDTIMEO, &limit, sizeof limit);
  address.sun_family = AF_UNIX;
  std::strncpy(address.sun_path, socket.c_str(), sizeof(address.sun_path) - 1);
  if (::connect(connection, reinterpret_cast<sockaddr*>(&address), sizeof address) != 0) {
    const int err = errno;
    const std::string what = fmt::format("cannot connect to fuyoud's segment socket {}: {}", socket.string(),
                                         std::strerror(err));
    return err == EACCES ? absl::PermissionDeniedError(what) : absl::UnavailableError(what);
  }
  if (daemon_uid.has_value()) {
    if (absl::Status same = internal::CheckPeerIs(connection, *daemon_uid, socket.string()); !same.ok()) return same;
  }

  const std::span<const int> fds = fd >= 0 ? std::span<const int>(&fd, 1) : std::span<const int>();
  if (SendWithFds(connection, payload, fds, MSG_NOSIGNAL) != static_cast<long>(payload.size())) {
    return absl::UnavailableError(
        fmt::format("cannot send the segment to fuyoud's segment socket {}: {}", socket.string(),
                    std::strerror(errno)));
  }

  // The reply: one line, then the daemon closes the connection.
  std::string reply;
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  while (reply.find('\n') == std::string::npos && reply.size() < kMaxReplyBytes) {
    const auto left =
        std::chrono::duration_cast<std::chrono::milliseconds>(deadline - std::chrono::steady_clock::now());
    pollfd readable{connection, POLLIN, 0};
    const int ready = ::poll(&readable, 1, static_cast<int>(std::max<int64_t>(left.count(), 0)));
    if (ready < 0 && errno == EINTR) continue;
    if (ready == 0) {
      return absl::DeadlineExceededError(fmt::format("fuyoud did not answer the segment handover on {} within {} ms",
                                                     socket.string(), timeout.count()));
    }
    char buffer[512];
    const ssize_t got = ::recv(connection, buffer, sizeof buffer, 0);
    if (got < 0 && errno == EINTR) continue;
    if (got <= 0) break;
    reply.append(buffer, static_cast<size_t>(got));
  }
  if (reply.empty()) {
    return absl::UnavailableError(
        fmt::format("fuyoud's segment socket {} closed the connection without a reply", socket.string()));
  }
  return ParseHandoverReply(reply.substr(0, reply.find('\n')));
}

}  // namespace fuyou
