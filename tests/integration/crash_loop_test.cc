// Crash loop: the crash driver's job (crash_driver.h) against a real fuyoud that
// kills itself at a crash point (FUYOU_CRASH_AT, see daemon/common/crash_point.h),
// or inside a client that kills itself mid-step. After each crash the job must
// resume at its last durable commit and, trained to the end, give weights
// bit-identical to an uninterrupted run. A step's EndStep answers before its
// commit is durable (the commit runs while the next step goes on), so the job
// resumes at the last step the client was answered or the one before it, never
// before the durable step it was told (StepCommitted.durable_step); where the
// crash point fixes which (a manifest point's pass, a point after the next
// step's first update waited for the commit) it must be exactly that. With a
// durability interval (--commit-every-steps N > 1) it must resume at a durable
// step within N of the last acknowledged one, with the states of exactly that
// step.
#include <fmt/format.h>
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/wait.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <random>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "crash_driver.h"
#include "daemon_process.h"

namespace fuyou::testing {
namespace {
using std::chrono::milliseconds;

const std::vector<std::string> kDaemonArgs = {"--dram-budget", "64MiB", "--threads", "2"};

// Points after which the commit in flight is on disk (see crash_point.h).
bool IsAfterCommit(const std::string& point) {
  static const std::set<std::string> after = {"manifest_renamed", "dir_synced", "step_committed_reply_sent",
                                              "registration_committed"};
  return after.count(point.substr(0, point.find(':'))) != 0;
}

// The uninterrupted run, once per test process.
const WeightHistory& Reference() {
  static const WeightHistory history = [] {
    TempDir dir;
    DaemonProcess daemon(dir.path(), kDaemonArgs);
    WeightHistory recorded;
    absl::Status started = daemon.Start();
    EXPECT_TRUE(started.ok()) << started.message();
    DriverProgress progress;
    absl::Status run = DriveJob(daemon.client_options(), "reference", nullptr, progress, &recorded);
    EXPECT_TRUE(run.ok()) << progress.failed_call;
    return recorded;
  }();
  return history;
}

// The steps a job may resume at after a crash at `point` (every step durable),
// given what the client saw before it. Commits #1-#5 create the job and
// register its chunks, synchronously; #(5+s) is step s's, in the background.
struct ResumeRange {
  int64_t lo = 0;
  int64_t hi = 0;
};
ResumeRange ExpectedResume(const std::string& point, const DriverProgress& before) {
  const std::string name = point.substr(0, point.find(':'));
  const int64_t pass = std::stoll(point.substr(point.find(':') + 1));
  static const std::set<std::string> manifest_points = {"before_state_sync", "after_state_sync",
                                                        "manifest_tmp_written", "manifest_renamed", "dir_synced"};
  if (manifest_points.count(name) != 0 && pass > 5) {
    const int64_t step = pass - 5;
    const int64_t at = IsAfterCommit(point) ? step : step - 1;
    return {at, at};
  }
  if (name == "background_commit_started") return {pass - 1, pass - 1};  // step `pass`, nothing written
  if (name == "before_commit_wait") return {pass - 1, pass};             // step `pass`'s commit, maybe done
  const int64_t last = before.acked_step + (before.commit_in_flight && IsAfterCommit(point) ? 1 : 0);
  // Passed only after the step's first update waited for the commit before it.
  static const std::set<std::string> after_wait = {"writeback_submitted", "writeback_completed", "after_kernel",
                                                   "end_step_received", "abort_step_received"};
  if (after_wait.count(name) != 0) return {last, last};
  return {std::min(last, before.durable_step), last};
}

// Runs the driver until the daemon answers a session open (the daemon may still
// be closing the session of a client that just died).
absl::Status DriveWhenOpen(const ClientOptions& options, const std::string& job, DriverProgress& progress) {
  absl::Status status;
  for (int attempt = 0; attempt < 200; ++attempt) {
    status = DriveJob(options, job, &Reference(), progress);
    if (!(progress.opened_at < 0 && absl::IsFailedPrecondition(status))) return status;
    std::this_thread::sleep_for(milliseconds(50));
  }
  return status;
}

bool SameAsReference(const DriverProgress& progress) {
  return progress.weights == Reference()[kDriverSteps];
}

TEST(CrashLoopTest, TheDaemonKilledAtAnyCrashPointResumesAtItsLastCommit) {
  ASSERT_EQ(Reference().size(), static_cast<size_t>(kDriverSteps + 1));
  // Commits: #1 creates the job, #2-#5 register chunks 0-3, #(5+s) ends step s.
  // grad_received/after_kernel/writeback_*: 4 a step, 6 in step 3 (2 aborted).
  const std::vector<std::string> points = {
      "before_state_sync:1",          // job creation
      "manifest_renamed:1",           // job creation, manifest in place
      "registration_reserved:1",      // chunk 0
      "registration_states_written:2",
      "after_state_sync:3",           // registration of chunk 1
      "registration_committed:3",     // chunk 2
      "manifest_tmp_written:4",       // chunk 2
      "dir_synced:5",                 // chunk 3, registration done
      "grad_received:1",              // step 1
      "writeback_submitted:1",
      "writeback_completed:3",
      "background_commit_started:1",  // step 1's commit, EndStep(1) answered or about to be
      "before_state_sync:7",          // step 2's commit
      "before_commit_wait:2",         // step 3's first update, step 2's commit maybe still running
      "abort_step_received:1",        // step 3
      "writeback_submitted:11",       // step 3, first real update after the abort
      "after_state_sync:8",           // step 3's commit
      "writeback_completed:16",       // step 4, last write-back
      "step_committed_reply_sent:4",
      "end_step_received:5",
      "manifest_tmp_written:10",      // step 5
      "before_commit_wait:5",         // step 6's first update waits for step 5's commit
      "manifest_renamed:11",          // step 6
      "background_commit_started:7",  // step 7's commit, while step 8 begins
      "grad_received:29",             // step 7
      "dir_synced:12",                // step 7
      "grad_received:31",             // step 8, first chunk
      "after_kernel:34",              // step 8, last chunk
      "manifest_renamed:13",          // step 8
      "step_committed_reply_sent:8",
      "session_close:1",
  };
  struct Row {
    std::string point, died_in;
    int64_t acked = 0, found = 0;
    bool commit_in_flight = false;
    int resumed = 0;
  };
  std::vector<Row> rows;
  const auto start = std::chrono::steady_clock::now();
  for (const std::string& point : points) {
    SCOPED_TRACE(point);
    TempDir dir;
    DaemonProcess daemon(dir.path(), kDaemonArgs, {"FUYOU_CRASH_AT=" + point});
    absl::Status started = daemon.Start();
    ASSERT_TRUE(started.ok()) << started.message();
    DriverProgress before;
    absl::Status run = DriveJob(daemon.client_options(), "crash-job", &Reference(), before);
    const int exit = daemon.WaitForExit(milliseconds(10000));
    ASSERT_TRUE(exit != -1 && WIFSIGNALED(exit) && WTERMSIG(exit) == SIGKILL)
        << "fuyoud did not die at " << point << " (the driver " << (run.ok() ? "finished" : before.failed_call) << ")";
    if (!run.ok()) {
      EXPECT_TRUE(absl::IsUnavailable(run)) << before.failed_call;
    }
    EXPECT_EQ(before.mismatches, std::vector<std::string>{});

    daemon.set_env({});
    started = daemon.Start();
    ASSERT_TRUE(started.ok()) << started.message();
    DriverProgress after;
    absl::Status rerun = DriveJob(daemon.client_options(), "crash-job", &Reference(), after);
    ASSERT_TRUE(rerun.ok()) << after.failed_call;
    // Legal: the last commit the client saw, the one in flight when the crash
    // came after its manifest was renamed into place, or the one before the
    // last answered step when that step's durable commit had not renamed yet.
    const bool after_commit = IsAfterCommit(point);
    const ResumeRange expected_step = ExpectedResume(point, before);
    const int expected_resumed =
        before.opened_at < 0 ? 0 : before.chunks_registered + (before.registration_in_flight && after_commit ? 1 : 0);
    EXPECT_GE(after.opened_at, expected_step.lo);
    EXPECT_LE(after.opened_at, expected_step.hi);
    EXPECT_GE(after.opened_at, before.durable_step) << "a step reported durable was lost";
    EXPECT_LE(after.opened_at, before.acked_step + (before.commit_in_flight ? 1 : 0));
    EXPECT_EQ(after.chunks_resumed, expected_resumed);
    EXPECT_EQ(after.mismatches, std::vector<std::string>{});
    EXPECT_TRUE(SameAsReference(after)) << "final weights differ from the uninterrupted run";
    rows.push_back({point, run.ok() ? "(finished)" : before.failed_call.substr(0, before.failed_call.find(':')),
                    before.acked_step, after.opened_at, before.commit_in_flight, after.chunks_resumed});
    EXPECT_EQ(daemon.Stop(), 0);
  }
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  std::printf("\n[crash table] daemon killed (SIGKILL) at FUYOU_CRASH_AT, restarted, job resumed and finished\n");
  std::printf("%-30s %-26s %5s %6s %9s %8s  %s\n", "crash point", "client call that failed", "acked", "in-fl.",
              "resumed@", "chunks", "committed step found");
  for (const Row& row : rows) {
    std::printf("%-30s %-26s %5lld %6s %9lld %8d  %s\n", row.point.c_str(), row.died_in.c_str(),
                static_cast<long long>(row.acked), row.commit_in_flight ? "EndStep" : "-",
                static_cast<long long>(row.found), row.resumed,
                row.found == row.acked  ? "last acked commit"
                : row.found > row.acked ? "the step in flight (crash after its rename)"
                                        : "the step before (the acked step's commit was in flight)");
  }
  std::printf("[figures] %zu crash points, all final weights bit-identical to the uninterrupted run; %.1f s\n",
              rows.size(), seconds);
}

// --commit-every-steps 3: steps 3 and 6 are durable, 1, 2, 4, 5, 7 and 8 only
// acknowledged; closing the session makes step 8 durable. The daemon is killed
// at crash points and pass counts drawn at random (seed printed; set
// FUYOU_CRASH_SEED to replay one), restarted with the same interval, and the job
// resumed: it must open at a step no older than the last durable step it was
// told (StepCommitted.durable_step) and at most N = 3 before the last
// acknowledged one (N-1 acknowledged only, and a durable step whose commit was
// still in flight), with weights and update counts bit-exact to that step of the
// uninterrupted run (the driver checks both), and end bit-identical to it.
TEST(CrashLoopTest, WithCommitEveryThreeStepsACrashLosesOnlyStepsNotReportedDurable) {
  ASSERT_EQ(Reference().size(), static_cast<size_t>(kDriverSteps + 1));
  constexpr int64_t kInterval = 3;
  std::vector<std::string> args = kDaemonArgs;
  args.insert(args.end(), {"--commit-every-steps", std::to_string(kInterval)});
  // Passes of each point in one run of the driver with this interval: commits
  // are #1 job creation, #2-#5 registrations, #6 step 3, #7 step 6, #8 the close
  // (step 8); 4 updates a step, 6 in step 3 (2 aborted).
  struct Range {
    std::string name;
    int most;
  };
  const std::vector<Range> ranges = {
      {"grad_received", 34},    {"after_kernel", 34},     {"end_step_received", 8},
      {"step_committed_reply_sent", 8}, {"before_state_sync", 8}, {"after_state_sync", 8},
      {"manifest_renamed", 8},  {"dir_synced", 8},        {"durable_commit_pending_written", 3},
      {"writeback_completed", 10},  // only durable steps write back: steps 3 (4, +2 aborted) and 6 (4)
      {"background_commit_started", 2}, {"before_commit_wait", 2},  // steps 3 and 6 (the close commits itself)
  };
  const char* seed_env = std::getenv("FUYOU_CRASH_SEED");
  const uint32_t seed = seed_env != nullptr ? static_cast<uint32_t>(std::strtoul(seed_env, nullptr, 10))
                                            : static_cast<uint32_t>(std::random_device{}());
  std::printf("\n[interval crash table] --commit-every-steps %lld, FUYOU_CRASH_SEED=%u\n",
              static_cast<long long>(kInterval), seed);
  std::mt19937 rng(seed);
  // Always: a kill while a durable commit writes the pending states, and one
  // between durable steps; then random ones.
  std::vector<std::string> points = {"durable_commit_pending_written:1", "grad_received:23", "manifest_renamed:8",
                                     "background_commit_started:2"};
  for (int i = 0; i < 9; ++i) {
    const Range& range = ranges[std::uniform_int_distribution<size_t>(0, ranges.size() - 1)(rng)];
    points.push_back(fmt::format("{}:{}", range.name, std::uniform_int_distribution<int>(1, range.most)(rng)));
  }
  int lost_steps = 0;
  std::printf("%-36s %5s %8s %6s %9s\n", "crash point", "acked", "durable", "in-fl.", "resumed@");
  for (const std::string& point : points) {
    SCOPED_TRACE(point);
    TempDir dir;
    DaemonProcess daemon(dir.path(), args, {"FUYOU_CRASH_AT=" + point});
    absl::Status started = daemon.Start();
    ASSERT_TRUE(started.ok()) << started.message();
    DriverProgress before;
    absl::Status run = DriveJob(daemon.client_options(), "interval-job", &Reference(), before);
    const int exit = daemon.WaitForExit(milliseconds(10000));
    ASSERT_TRUE(exit != -1 && WIFSIGNALED(exit) && WTERMSIG(exit) == SIGKILL)
        << "fuyoud did not die at " << point << " (the driver " << (run.ok() ? "finished" : before.failed_call) << ")";
    EXPECT_EQ(before.mismatches, std::vector<std::string>{});
    if (before.opened_at == 0) {
      // What the daemon said would survive: the last multiple of the interval
      // before the answered step (that step's own commit was still in flight
      // when it was answered; the next answer reports it).
      EXPECT_EQ(before.durable_step, std::max<int64_t>(0, before.acked_step - 1) / kInterval * kInterval);
    }

    daemon.set_env({});
    started = daemon.Start();
    ASSERT_TRUE(started.ok()) << started.message();
    DriverProgress after;
    absl::Status rerun = DriveJob(daemon.client_options(), "interval-job", &Reference(), after);
    ASSERT_TRUE(rerun.ok()) << after.failed_call;
    if (before.opened_at >= 0) {
      EXPECT_GE(after.opened_at, before.durable_step) << "a step reported durable was lost";
      EXPECT_GE(after.opened_at, before.acked_step - kInterval);
      EXPECT_LE(after.opened_at, before.acked_step + (before.commit_in_flight ? 1 : 0));
    }
    EXPECT_EQ(after.mismatches, std::vector<std::string>{});
    EXPECT_TRUE(SameAsReference(after)) << "final weights differ from the uninterrupted run";
    if (after.opened_at < before.acked_step) ++lost_steps;
    std::printf("%-36s %5lld %8lld %6s %9lld\n", point.c_str(), static_cast<long long>(before.acked_step),
                static_cast<long long>(before.durable_step), before.commit_in_flight ? "EndStep" : "-",
                static_cast<long long>(after.opened_at));
    EXPECT_EQ(daemon.Stop(), 0);
  }
  // The fixed point grad_received:23 (step 5) resumes at step 3: the interval
  // was in effect, not every step made durable.
  EXPECT_GE(lost_steps, 1);
  std::printf("[figures] %zu crash points, %d resumed before the last acknowledged step, all within %lld steps\n",
              points.size(), lost_steps, static_cast<long long>(kInterval));
}

// A client that dies between durable steps loses nothing: closing its session
// (the daemon sees the stream end) makes the acknowledged steps durable.
TEST(CrashLoopTest, WithCommitEveryThreeStepsAClientKilledResumesAtItsLastAcknowledgedStep) {
  ASSERT_EQ(Reference().size(), static_cast<size_t>(kDriverSteps + 1));
  TempDir dir;
  std::vector<std::string> args = kDaemonArgs;
  args.insert(args.end(), {"--commit-every-steps", "3"});
  DaemonProcess daemon(dir.path(), args);
  absl::Status started = daemon.Start();
  ASSERT_TRUE(started.ok()) << started.message();
  const std::vector<std::pair<int64_t, int64_t>> points = {{4, 4}, {5, 4}, {2, 2}};  // committed step -> expected
  for (const auto& [step, expected] : points) {
    const std::string job = fmt::format("interval-client-{}", step);
    SCOPED_TRACE(job);
    pid_t client = Spawn(CRASH_LOOP_CLIENT_PATH, {daemon.socket_path().string(), job, step == 5 ? "pulled" : "committed",
                                                 std::to_string(step), step == 5 ? "4" : "0"});
    ASSERT_GT(client, 0);
    int status = 0;
    ASSERT_EQ(::waitpid(client, &status, 0), client);
    ASSERT_TRUE(WIFSIGNALED(status) && WTERMSIG(status) == SIGKILL) << "exit status " << status;
    DriverProgress after;
    absl::Status rerun = DriveWhenOpen(daemon.client_options(), job, after);
    ASSERT_TRUE(rerun.ok()) << after.failed_call;
    EXPECT_EQ(after.opened_at, expected);
    EXPECT_EQ(after.mismatches, std::vector<std::string>{});
    EXPECT_TRUE(SameAsReference(after));
  }
}

// SIGTERM (systemctl stop) between durable steps loses nothing: the drain
// closes the session, which makes the acknowledged step durable.
TEST(CrashLoopTest, WithCommitEveryTenStepsADrainedDaemonKeepsTheLastAcknowledgedStep) {
  ASSERT_EQ(Reference().size(), static_cast<size_t>(kDriverSteps + 1));
  TempDir dir;
  std::vector<std::string> args = kDaemonArgs;
  args.insert(args.end(), {"--commit-every-steps", "10", "--drain-seconds", "0.2"});
  DaemonProcess daemon(dir.path(), args);
  absl::Status started = daemon.Start();
  ASSERT_TRUE(started.ok()) << started.message();
  DriverProgress before;
  int exit = -1;
  absl::Status run = DriveJob(daemon.client_options(), "drained-job", &Reference(), before, nullptr,
                              [&](const std::string& what, int64_t step, int /*k*/) {
                                if (what != "committed" || step != 4) return;
                                ::kill(daemon.pid(), SIGTERM);  // the session is idle between steps
                                exit = daemon.WaitForExit(milliseconds(30000));
                              });
  EXPECT_FALSE(run.ok()) << "the driver finished against a stopped daemon";
  ASSERT_TRUE(exit != -1 && WIFEXITED(exit) && WEXITSTATUS(exit) == 0) << "exit status " << exit;
  EXPECT_EQ(before.acked_step, 4);
  EXPECT_EQ(before.durable_step, 0);  // not durable when acknowledged: made so by the drain
  started = daemon.Start();
  ASSERT_TRUE(started.ok()) << started.message();
  DriverProgress after;
  absl::Status rerun = DriveJob(daemon.client_options(), "drained-job", &Reference(), after);
  ASSERT_TRUE(rerun.ok()) << after.failed_call;
  EXPECT_EQ(after.opened_at, 4);
  EXPECT_EQ(after.mismatches, std::vector<std::string>{});
  EXPECT_TRUE(SameAsReference(after));
  EXPECT_EQ(daemon.Stop(), 0);
}

TEST(CrashLoopTest, AClientKilledMidStepResumesAtItsLastCommit) {
  ASSERT_EQ(Reference().size(), static_cast<size_t>(kDriverSteps + 1));
  TempDir dir;
  DaemonProcess daemon(dir.path(), kDaemonArgs);
  absl::Status started = daemon.Start();
  ASSERT_TRUE(started.ok()) << started.message();
  struct Point {
    std::string what;
    int64_t step;
    int k;
    int64_t expected;  // committed step after the kill
  };
  const std::vector<Point> points = {
      {"pushed", 1, 1, 0},     // one gradient of step 1 handed over
      {"pushed", 3, 4, 2},     // after the aborted attempt, all of step 3 handed over
      {"pulled", 5, 4, 4},     // every weight of step 5 back, EndStep never sent
      {"committed", 6, 0, 6},  // right after step 6 committed
  };
  std::printf("\n[client crash table] client killed (SIGKILL) at a point, job resumed by a new client\n");
  for (const Point& point : points) {
    const std::string job = fmt::format("client-{}-{}-{}", point.what, point.step, point.k);
    SCOPED_TRACE(job);
    pid_t client = Spawn(CRASH_LOOP_CLIENT_PATH, {daemon.socket_path().string(), job, point.what,
                                                 std::to_string(point.step), std::to_string(point.k)});
    ASSERT_GT(client, 0);
    int status = 0;
    ASSERT_EQ(::waitpid(client, &status, 0), client);
    ASSERT_TRUE(WIFSIGNALED(status) && WTERMSIG(status) == SIGKILL) << "exit status " << status;
    DriverProgress after;
    absl::Status rerun = DriveWhenOpen(daemon.client_options(), job, after);
    ASSERT_TRUE(rerun.ok()) << after.failed_call;
    EXPECT_EQ(after.opened_at, point.expected);
    EXPECT_EQ(after.chunks_resumed, 4);
    EXPECT_EQ(after.mismatches, std::vector<std::string>{});
    EXPECT_TRUE(SameAsReference(after));
    std::printf("  killed after %-9s step %lld k=%d -> resumed at committed step %lld\n", point.what.c_str(),
                static_cast<long long>(point.step), point.k, static_cast<long long>(after.opened_at));
  }
}

}  // namespace
}  // namespace fuyou::testing
