// The segment handover: how a session's shared-memory segment gets from the job
// to fuyoud. The contract both sides follow (clientlib's ClientSegment and the
// daemon's SegmentListener), like segment_layout.h for the bytes inside it.
//
// The client creates the segment's memory itself and passes the file descriptor:
//   1. OpenSession answers session_id, segment_bytes and segment_socket (the
//      daemon socket's path + kSegmentSocketSuffix).
//   2. The client creates a memfd (MFD_CLOEXEC | MFD_ALLOW_SEALING), sizes it to
//      segment_bytes, reserves its pages (posix_fallocate: a full memory is an
//      error here, not a SIGBUS later), seals it with at least
//      kRequiredSegmentSeals (F_SEAL_SHRINK | F_SEAL_GROW; F_SEAL_SEAL too) and
//      maps it MAP_SHARED read-write.
//   3. It connects (SOCK_STREAM) to segment_socket and sends ONE sendmsg:
//      payload "<session_id>\n" (at most kMaxHandoverMessageBytes in all) with
//      exactly one fd in an SCM_RIGHTS control message.
//   4. The daemon answers one line, "OK\n" or "ERR <CODE_NAME> <message>\n"
//      (CODE_NAME as absl::StatusCodeToString: FAILED_PRECONDITION, NOT_FOUND...),
//      and closes the connection. On OK it has mapped the memfd and written the
//      SegmentHeader; the client checks that header in its own mapping (proof
//      that both map the same memory), then attaches the Stream.
//
// Why this way and not a /dev/shm name the daemon creates and chowns:
//   - fuyoud needs no capability at all. Giving a segment to the client's uid
//     took CAP_CHOWN (as ambient capability a daemon bug could chown any file),
//     and removing a chowned name from the sticky /dev/shm took CAP_FOWNER.
//   - Nothing lives in /dev/shm: no name to guess, nothing left behind by a
//     crash; the memory is charged to the client that asked for it.
//   - Seals close a crash: the owner of a /dev/shm object can ftruncate it to 0
//     while the daemon has it mapped, and the daemon's next access is a SIGBUS.
//     A memfd sealed against shrinking cannot be truncated by anyone, so the
//     daemon refuses one that is not sealed.
#pragma once

#include <cstddef>
#include <string>
#include <string_view>

#include "absl/status/status.h"

namespace fuyou {

// The segment socket is the daemon socket's path with this suffix.
inline constexpr std::string_view kSegmentSocketSuffix = ".seg";
// The handover payload, "<session_id>\n", is at most this long.
inline constexpr size_t kMaxHandoverMessageBytes = 128;
// Seals the daemon requires on a segment (fcntl F_GET_SEALS); values of
// F_SEAL_SHRINK | F_SEAL_GROW, spelled out so that this header needs no <fcntl.h>.
inline constexpr unsigned kRequiredSegmentSeals = 0x0002 | 0x0004;
// The name a client gives its memfd ("/memfd:fuyou-segment" in /proc/PID/maps).
inline constexpr const char* kSegmentMemfdName = "fuyou-segment";
// How long the daemon waits for a connection's handover message, in seconds.
inline constexpr int kHandoverTimeoutSeconds = 5;

// The daemon's reply line for `status`: "OK\n" or "ERR <CODE_NAME> <message>\n"
// (a newline inside the message becomes a space, so the reply is one line).
inline std::string FormatHandoverReply(const absl::Status& status) {
  if (status.ok()) return "OK\n";
  std::string message(status.message());
  for (char& c : message) {
    if (c == '\n' || c == '\r') c = ' ';
  }
  return "ERR " + absl::StatusCodeToString(status.code()) + " " + message + "\n";
}

// The status a reply line stands for (the line with or without its '\n'). A line
// that is neither form is UNAVAILABLE ("not a fuyoud segment socket").
inline absl::Status ParseHandoverReply(std::string_view line) {
  if (!line.empty() && line.back() == '\n') line.remove_suffix(1);
  if (line == "OK") return absl::OkStatus();
  if (line.substr(0, 4) == "ERR ") {
    std::string_view rest = line.substr(4);
    const size_t space = rest.find(' ');
    const std::string_view name = rest.substr(0, space);
    const std::string_view message = space == std::string_view::npos ? "" : rest.substr(space + 1);
    for (int code = 1; code <= static_cast<int>(absl::StatusCode::kUnauthenticated); ++code) {
      if (absl::StatusCodeToString(static_cast<absl::StatusCode>(code)) == name) {
        return absl::Status(static_cast<absl::StatusCode>(code), std::string(message));
      }
    }
    return absl::UnknownError(std::string(message));
  }
  return absl::UnavailableError(
      "the segment socket answered something that is not a fuyoud reply (\"OK\" or \"ERR CODE message\")");
}

}  // namespace fuyou
