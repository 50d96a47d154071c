// The daemon's Unix socket paths (the gRPC socket and the segment socket beside
// it): refuse a path a live daemon serves, remove a stale socket left by a
// crash, create or check the parent directory, bind and listen.
#pragma once

#include <sys/types.h>

#include <filesystem>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace fuyou {

// The mode of a socket directory the daemon creates: 0700, plus search
// permission (x, never read or write) for the classes `socket_mode` lets connect,
// so that they reach the socket without being able to list or change the directory.
mode_t SocketDirectoryMode(mode_t socket_mode);

// A directory the daemon may put its socket in: owned by the daemon's euid or by
// root, and writable by group or others only with the sticky bit (as /tmp), so
// that nobody else can replace or rename the socket in it. FAILED_PRECONDITION
// otherwise, naming the directory, its owner and mode, and what to do (another
// user may have created /tmp/fuyou-<uid> before the daemon: the squat of issue 20).
// FAILED_PRECONDITION as well when a symbolic link on the way to `dir` belongs
// to anyone else (a /tmp/fuyou-<uid> link into a root-owned sticky directory,
// which its owner could repoint later: issue 32), naming the link and its owner.
absl::Status CheckSocketDirectory(const std::filesystem::path& dir);

// Creates the parent directory of `path` when it is missing (mode
// SocketDirectoryMode(socket_mode), whatever the umask; missing ancestors 0755)
// and checks it (CheckSocketDirectory). Then FAILED_PRECONDITION when something
// accepts connections at `path` (another fuyoud) or `path` is not a socket;
// removes a socket nobody listens on.
absl::Status PrepareSocketPath(const std::filesystem::path& path, mode_t socket_mode = 0600);

// Binds `path` (which PrepareSocketPath has cleared) with permissions `mode` and
// listens; returns the listening fd (non-blocking, close-on-exec). The mode is
// given to the socket inode before bind (fchmod) and bind runs under the umask
// ~mode, so the file is created with `mode` at once: no chmod by path, which
// would follow a link planted at `path`.
absl::StatusOr<int> ListenOnSocketPath(const std::filesystem::path& path, mode_t mode);

}  // namespace fuyou
