#include "state/background_commit.h"

#include <memory>
#include <utility>

#include "common/crash_point.h"
#include "common/status_util.h"
#include "common/trace.h"
#include "fmt/format.h"

namespace fuyou {

BackgroundCommit::~BackgroundCommit() {
  if (thread_.joinable()) thread_.join();
}

void BackgroundCommit::Start(Job& job, int64_t step, v1::JobManifest manifest, std::vector<storage::IoFuture> syncs) {
  job_ = &job;
  step_ = step;
  manifest_ = std::move(manifest);
  Promise<void> promise;
  result_ = promise.future();
  thread_ = std::thread([this, promise = std::move(promise), syncs = std::move(syncs)]() mutable {
    FUYOU_CRASH_POINT("background_commit_started");
    const int64_t started = trace::NowUs();
    absl::Status status = WaitAll(syncs);
    if (!status.ok()) {
      status = absl::Status(status.code(), fmt::format("job '{}': the data sync of step {} failed: {}", job_->name(),
                                                       step_, status.message()));
    } else {
      status = job_->WriteManifest(manifest_);
    }
    trace::Record("commit", 0, started, trace::NowUs());
    promise.Set(std::move(status));
  });
}

absl::Status BackgroundCommit::Finish() {
  if (!pending()) return absl::OkStatus();
  FUYOU_CRASH_POINT("before_commit_wait");
  thread_.join();
  absl::Status status = result_.result();
  if (status.ok() || absl::IsAborted(status)) job_->Adopt(std::move(manifest_));
  manifest_.Clear();
  result_ = Future<void>();
  return status;
}

}  // namespace fuyou
