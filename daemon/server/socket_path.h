// The daemon's Unix socket paths (the gRPC socket and the segment socket beside
// it): refuse a path a live daemon serves, remove a stale socket left by a
// crash, create the parent directory, bind and listen.
#pragma once

#include <sys/types.h>

#include <filesystem>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace fuyou {

// FAILED_PRECONDITION when something accepts connections at `path` (another
// fuyoud) or `path` is not a socket; removes a socket nobody listens on.
absl::Status PrepareSocketPath(const std::filesystem::path& path);

// Binds `path` (which PrepareSocketPath has cleared) with permissions `mode` and
// listens; returns the listening fd (non-blocking, close-on-exec). The socket is
// created under umask 0177 and then chmod-ed, so it is never more open than
// `mode`.
absl::StatusOr<int> ListenOnSocketPath(const std::filesystem::path& path, mode_t mode);

}  // namespace fuyou
