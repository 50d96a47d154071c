// Preparing the daemon's Unix socket path: refuse a path a live daemon serves,
// remove a stale socket left by a crash, create the parent directory.
#pragma once

#include <sys/types.h>

#include <filesystem>

#include "absl/status/status.h"

namespace fuyou {

// FAILED_PRECONDITION when something accepts connections at `path` (another
// fuyoud) or `path` is not a socket; removes a socket nobody listens on.
absl::Status PrepareSocketPath(const std::filesystem::path& path);

}  // namespace fuyou
