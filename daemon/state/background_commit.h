// BackgroundCommit: the durable half of one step's commit, on a thread of its
// own, while the session goes on with the next step.
//
// A step is applied first (StepTransaction::Commit with `background`: its new
// manifest is the acknowledged one, the cache holds its states as committed)
// and EndStep answers; then this makes it durable: it waits for the data syncs
// the step's write-backs started (StateFile::SyncAsync, one per chunk as its
// write-back completed), then Job::WriteManifest (the final fdatasync of the
// state files, cheap with nothing left dirty, manifest.tmp, rename, directory
// fsync). Finish, on the session's thread, waits for it and adopts the
// manifest into the Job (Job::Adopt) when it was renamed into place.
//
// Until Finish returned, the job's durable manifest (Job::manifest(), what a
// crash resumes at) is the previous step, whose committed extents are the
// applied step's shadows: nothing may write a shadow extent, or commit another
// manifest, before Finish (the store calls it first in BeginUpdate, CommitStep,
// MakeDurable and everything that writes).
//
// Crash points: background_commit_started (on the commit's thread, before it
// waits for the syncs: nothing of the step's manifest is written yet), then
// Job::WriteManifest's (before_state_sync ... dir_synced), and
// before_commit_wait (Finish, on the session's thread, before it waits: a
// request of the next step that needs the step durable; the commit may be
// running or over). Each is passed once per background commit.
//
// Not thread-safe: Start, Finish and pending() are called on the session's
// thread (the store's calls are serialised); done() may be asked from it too.
#pragma once

#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "common/future.h"
#include "fuyou/v1/manifest.pb.h"
#include "jobs/job.h"
#include "storage/io_engine.h"

namespace fuyou {

class BackgroundCommit {
 public:
  BackgroundCommit() = default;
  // Waits for a commit still running; its manifest is not adopted (the job is
  // closing without Finish: a restart reads what the commit left on disk).
  ~BackgroundCommit();
  BackgroundCommit(const BackgroundCommit&) = delete;
  BackgroundCommit& operator=(const BackgroundCommit&) = delete;

  // Starts making `manifest` durable for `job` once `syncs` completed (a failed
  // sync fails the commit before anything is written). Precondition: !pending().
  // `job` outlives the commit (Finish or the destructor).
  void Start(Job& job, int64_t step, v1::JobManifest manifest, std::vector<storage::IoFuture> syncs);
  // True from Start until Finish.
  bool pending() const { return thread_.joinable(); }
  // The step being made durable; meaningful while pending().
  int64_t step() const { return step_; }
  // True when pending and its work is over (Finish would not wait).
  bool done() const { return pending() && result_.ready(); }
  // True when done() with an error (Finish would return it at once).
  bool failed() const { return done() && !result_.result().ok(); }
  // The commit's result, set on its thread when its work is over, before
  // Finish adopts its manifest: what Finish returns. Meaningful while
  // pending(); the Future stays valid after Finish. A continuation (Then) runs
  // on the commit's thread, or at once when the commit is over: it must not
  // wait, nor take a lock that is held while Finish waits (WaitDurable's answer).
  Future<void> result() const { return result_; }
  // OK when nothing is pending. Otherwise waits for the commit and returns its
  // result: OK (adopted), ABORTED (renamed, the directory not synced: adopted,
  // not known durable) or the error before the rename (not adopted: the job's
  // durable manifest is the previous step, unchanged). Not pending afterwards.
  absl::Status Finish();

 private:
  Job* job_ = nullptr;
  int64_t step_ = 0;
  v1::JobManifest manifest_;  // the commit's thread's until it ends
  Future<void> result_;
  std::thread thread_;
};

}  // namespace fuyou
