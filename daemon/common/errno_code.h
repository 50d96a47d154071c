// ErrnoCode: the one errno -> status code table of fuyoud. Every place that
// turns an errno into a Status (ErrnoStatus in common/status_util.h, the I/O
// engine's ErrnoToIoStatus, storage/dir_fd) uses it, so one errno reads the same
// everywhere:
//
//   ENOSPC EDQUOT EMFILE ENFILE ENOMEM   RESOURCE_EXHAUSTED  space, quota, fds, memory
//   EIO                                  DATA_LOSS           the device failed; data may be gone
//   ENOENT                               NOT_FOUND
//   EACCES EPERM                         PERMISSION_DENIED
//   EEXIST ENOTEMPTY                     ALREADY_EXISTS
//   EINVAL                               INVALID_ARGUMENT
//   EROFS EOPNOTSUPP ELOOP ENOTDIR EISDIR FAILED_PRECONDITION the path is not what it must be
//                                                            (read-only, a symlink, not a directory)
//   ECANCELED                            CANCELLED
//   anything else                        INTERNAL
// Header-only and free of gRPC so that storage/ can use it.
#pragma once

#include <cerrno>

#include "absl/status/status.h"

namespace fuyou {

inline absl::StatusCode ErrnoCode(int err) {
  switch (err) {
    case ENOSPC:
    case EDQUOT:
    case EMFILE:
    case ENFILE:
    case ENOMEM: return absl::StatusCode::kResourceExhausted;
    case EIO: return absl::StatusCode::kDataLoss;
    case ENOENT: return absl::StatusCode::kNotFound;
    case EACCES:
    case EPERM: return absl::StatusCode::kPermissionDenied;
    case EEXIST:
    case ENOTEMPTY: return absl::StatusCode::kAlreadyExists;
    case EINVAL: return absl::StatusCode::kInvalidArgument;
    case EROFS:
    case EOPNOTSUPP:
    case ELOOP:
    case ENOTDIR:
    case EISDIR: return absl::StatusCode::kFailedPrecondition;
    case ECANCELED: return absl::StatusCode::kCancelled;
    default: return absl::StatusCode::kInternal;
  }
}

}  // namespace fuyou
