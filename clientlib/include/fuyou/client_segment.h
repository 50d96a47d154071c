// ClientSegment: the job's side of a session's shared-memory segment, a sealed
// memfd that the client creates, maps and hands to fuyoud over the segment
// socket (the protocol and why it is built this way: fuyou/segment_handover.h).
//
// Session::Open does all of this; the type is public for tools and tests that
// speak the protocol themselves.
#pragma once

#include <sys/types.h>

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>

#include "absl/status/statusor.h"

namespace fuyou {

class ClientSegment {
 public:
  // A memfd of `bytes` (> 0), its pages reserved (RESOURCE_EXHAUSTED when memory
  // cannot hold them), sealed with F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL,
  // and mapped MAP_SHARED read-write.
  static absl::StatusOr<std::unique_ptr<ClientSegment>> Create(uint64_t bytes);
  // Unmaps the segment and closes the fd if it is still open.
  ~ClientSegment();
  ClientSegment(const ClientSegment&) = delete;
  ClientSegment& operator=(const ClientSegment&) = delete;

  std::span<std::byte> bytes() const { return {base_, size_}; }
  // The memfd; -1 after CloseFd.
  int fd() const { return fd_; }

  // Sends the memfd for `session_id` to the daemon's segment socket and returns
  // the status of its reply (see SendSegmentHandover, and its `daemon_uid`).
  absl::Status HandOver(const std::filesystem::path& socket, std::string_view session_id,
                        std::chrono::milliseconds timeout, std::optional<uid_t> daemon_uid = std::nullopt) const;
  // Closes the fd; the mapping stays. Once handed over, the fd is not needed.
  void CloseFd();

 private:
  ClientSegment(int fd, std::byte* base, size_t size) : fd_(fd), base_(base), size_(size) {}
  int fd_;
  std::byte* base_;
  size_t size_;
};

// One sendmsg of `payload` on a connected Unix socket with `fds` (none, one or
// several) in an SCM_RIGHTS control message; sendmsg's result (bytes sent, or -1
// with errno set). `flags` go to sendmsg.
long SendWithFds(int connected_socket, std::string_view payload, std::span<const int> fds, int flags);

// One handover, at the level of the wire: connects to `socket`, sends `payload`
// in one sendmsg with `fd` in an SCM_RIGHTS message (no control message when fd
// is -1), reads the reply line and returns its status (ParseHandoverReply).
// UNAVAILABLE when the socket cannot be reached or closes without a reply;
// DEADLINE_EXCEEDED when no reply comes within `timeout`. `daemon_uid` set (the
// uid of the daemon whose gRPC connection the session checked): the process that
// accepts on `socket` (SO_PEERCRED) must run as it, or nothing is sent and the
// result is FAILED_PRECONDITION (IsUntrustedDaemon): a segment holds the job's
// weights and gradients.
absl::Status SendSegmentHandover(const std::filesystem::path& socket, std::string_view payload, int fd,
                                 std::chrono::milliseconds timeout, std::optional<uid_t> daemon_uid = std::nullopt);

}  // namespace fuyou
