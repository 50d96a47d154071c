// Whether a daemon may be trusted with this user's states, in the terms of the
// public API (the checks themselves: clientlib/src/trusted_socket.h). A client
// that connects to a default address (ClientOptions::address empty, or naming
// the system or the per-user socket; no FUYOU_SOCKET) checks the connection it
// uses: Session::Open and AdminClient::Connect refuse an untrusted daemon with
// an error that IsUntrustedDaemon recognizes.
#pragma once

#include <chrono>
#include <string>

#include "absl/status/status.h"

namespace fuyou {

// True when `status` is a refusal of the daemon at a default address because it
// could not be trusted with this user's states (FAILED_PRECONDITION, nothing
// sent): its socket is reached through a directory or a link another user
// controls, or the process that accepted the connection runs as someone other
// than this user, root or the `fuyou` user. The connection checked is the one
// used (issue 32).
bool IsUntrustedDaemon(const absl::Status& status);

// Checks the daemon at the Unix socket `path` as a connection to a default
// address is checked (the path's directory and links, then the process that
// accepts the connection), waiting up to `timeout` for it, and closes the
// connection unused. OK; an untrusted-daemon error (IsUntrustedDaemon); or why
// nothing could be reached (UNAVAILABLE, PERMISSION_DENIED). A check of that
// moment: Session::Open and AdminClient::Connect check the connection they use.
absl::Status CheckTrustedDaemon(const std::string& path, std::chrono::milliseconds timeout);

}  // namespace fuyou
