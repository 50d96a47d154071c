// Crash points: named places in fuyoud where a test can make the daemon die, to
// prove that a crash at that instant leaves every job at its last commit (in the
// spirit of RocksDB's test_util/sync_point.h).
//
//   FUYOU_CRASH_POINT("manifest_renamed");
//
// Test-only. When fuyoud starts with FUYOU_CRASH_AT="<name>:<N>" in its
// environment, the N-th time (1-based, counted over the whole process and all
// threads) the point <name> is passed, the daemon logs one line to stderr and
// kills itself with SIGKILL: no destructor, flush or fsync runs, as in a real
// crash (a power loss additionally loses what was not fsynced; that is not
// simulated). When the variable is unset, a point costs one load of a static bool.
//
// The points, in the order a job meets them:
//   registration (ChunkStore::Register, in daemon/state/chunk_registration.cc)
//     registration_reserved        extents of every new chunk reserved, nothing written
//     registration_states_written  initial states of the new chunks written, not committed
//     registration_committed       the manifest naming them committed, before the reply
//   a step (daemon/session/session.cc; writeback_* in daemon/state/step_transaction.cc)
//     grad_received                GradReady accepted, before the states are acquired
//     after_kernel                 new weights in the slot, before ParamsReady is sent
//     writeback_submitted          write-back to the shadow extent queued
//     writeback_completed          a write-back finished (its Future's continuation, on an I/O thread unless done first)
//   a redo (GradReady.redo: the chunk's update of the step done again)
//     redo_received                redo accepted, the step's update of the chunk not yet dropped
//     redo_after_kernel            the chunk updated again from its committed states, before ParamsReady
//     redo_writeback_submitted     the redone states' write-back to the shadow extent queued
//     end_step_received            EndStep accepted, before waiting for the write-backs
//   a durable commit with acknowledged (not yet durable) steps (commit_every_steps > 1)
//     durable_commit_pending_written  pending chunks' states written to their shadow extents, manifest not committed
//     abort_step_received          AbortStep accepted, before the rollback
//     session_close                a session is closing, before the rollback of its step
//   every commit of a manifest (Job::Commit in daemon/jobs/job.cc: job creation,
//   registration, and the end of each step)
//     before_state_sync            before the state files are fdatasync'ed
//     after_state_sync             state files synced, no manifest.tmp yet
//     manifest_tmp_written         manifest.tmp written and fsync'ed, not renamed
//     manifest_renamed             manifest.tmp renamed over manifest.pb, dir not synced
//     dir_synced                   directory fsync'ed: the commit is complete
//   the reply (daemon/server/offload_service.cc)
//     step_committed_reply_sent    StepCommitted written to the client's stream
//   the durable commit of a step after EndStep answered (daemon/state/background_commit.cc;
//   its manifest points above run on the commit's thread, while the next step goes on)
//     background_commit_started    the step applied (EndStep may be answered), its syncs and manifest not begun
//     before_commit_wait           a request of the next step that needs the step durable (its first
//                                  GradReady, an EndStep, a registration, an import, the close) is
//                                  about to wait for the commit, which may still be running
// A crash at or before manifest_tmp_written leaves the previous commit; from
// manifest_renamed on, the new one. A step's EndStep answers before its commit
// is durable (StepCommitted.durable_step says the step before); the next
// step's write-backs wait for that commit (before_commit_wait), so the extents
// the durable manifest names are never written.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>

#include "absl/status/statusor.h"

namespace fuyou::crash_point {

// Where to crash: the `hit`-th pass of the point `name`.
struct CrashSpec {
  std::string name;
  uint64_t hit = 0;
};

// Parses "<name>:<N>", N >= 1; INVALID_ARGUMENT saying what is wrong otherwise.
absl::StatusOr<CrashSpec> ParseCrashSpec(std::string_view text);

// Reads FUYOU_CRASH_AT and arms the matching point. Call once, at start-up, before
// any thread runs a point. OK and nothing armed when the variable is unset or
// empty; INVALID_ARGUMENT when it cannot be parsed.
absl::Status ArmFromEnvironment();

// Arms `spec` directly (for unit tests); an empty name disarms. Same threading
// rule as ArmFromEnvironment.
void Arm(const CrashSpec& spec);

// Counts a pass of `name`; returns the count when `name` is the armed point
// (the pass that reaches the armed hit does not return), 0 otherwise. Use the
// macro, which skips the call when nothing is armed.
uint64_t Pass(const char* name);

namespace internal {
// True when a point is armed. Written only before threads start.
extern bool armed;
// Called at the armed hit: logs and raises SIGKILL. Replaceable in unit tests.
extern void (*on_crash)(const char* name, uint64_t hit);
}  // namespace internal

}  // namespace fuyou::crash_point

#define FUYOU_CRASH_POINT(name)                                                       \
  do {                                                                                \
    if (::fuyou::crash_point::internal::armed) ::fuyou::crash_point::Pass(name);      \
  } while (0)
