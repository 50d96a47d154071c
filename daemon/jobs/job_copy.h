// CopyJobStates: a server-side fork of a job (admin CopyJob, `fuyouctl
// copy-job`): the committed states of one job become a new job's, without
// passing through any client.
#pragma once

#include <cstdint>

#include "absl/status/statusor.h"
#include "jobs/job.h"

namespace fuyou {

// Gives `dst` (a job Job::Open just created: no chunks) every chunk of `src`'s
// committed manifest, each with fresh extents reserved in dst (Job::AddChunk:
// RESOURCE_EXHAUSTED when a storage path is full, before anything is written),
// the chunk's committed states copied byte for byte (checksum kept), its dtypes,
// update counts, segments and layout fingerprint kept, and src's committed step;
// then commits dst once. Returns the bytes of states copied.
// Precondition: no session uses src or dst (the caller holds the registry).
// On an error dst's committed manifest is still the empty one it was created
// with (the caller removes dst); src is never written.
absl::StatusOr<uint64_t> CopyJobStates(Job& src, Job& dst);

}  // namespace fuyou
