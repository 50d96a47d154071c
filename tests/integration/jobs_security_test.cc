// Jobs belong to their owner (issue 8, items 3, 4, 5, 9, 10) against a real
// fuyoud run as root: a namespace of jobs per uid, files created without
// following links, deletes that unlink only a job's own files, a job limit per
// user, storage hygiene on refused registrations and on EMFILE, the layout
// migration, and the storage-path lock after the data directory is removed.
#include <fcntl.h>
#include <fmt/format.h>
#include <gtest/gtest.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <csignal>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <set>
#include <string>
#include <vector>

#include "daemon_process.h"
#include "test_values.h"
#include "fuyou/admin_client.h"
#include "fuyou/client.h"
#include "fuyou/v1/offload.grpc.pb.h"
#include "grpcpp/grpcpp.h"

namespace fuyou::testing {
namespace {
namespace fs = std::filesystem;

constexpr uid_t kNobody = 65534;

std::string ReadText(const fs::path& path) {
  std::ifstream in(path);
  return std::string(std::istreambuf_iterator<char>(in), {});
}

class JobsSecurityTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (::geteuid() != 0) GTEST_SKIP() << "skipped: needs root to act as a second user";
    ::chmod(dir_.path().c_str(), 0755);
  }
  void StartDaemon(std::vector<std::string> args = {}, std::vector<std::string> env = {}) {
    args.insert(args.begin(), {"--dram-budget", "64MiB", "--socket-mode", "0666"});
    daemon_ = std::make_unique<DaemonProcess>(dir_.path(), std::move(args), std::move(env));
    absl::Status started = daemon_->Start();
    ASSERT_TRUE(started.ok()) << Text(started);
  }
  AdminClient& Admin() {
    if (!admin_) {
      auto admin = AdminClient::Connect(daemon_->client_options());
      EXPECT_TRUE(admin.ok());
      admin_ = std::move(*admin);
    }
    return *admin_;
  }
  fs::path JobDir(uid_t uid, const std::string& name) const {
    return daemon_->data_dir() / "users" / std::to_string(uid) / "jobs" / name;
  }
  // job_owner_client as `uid`: "resumed=<0|1> weight=<w>", or its error output.
  std::string RunClient(uid_t uid, const std::string& job, float weight) {
    std::string text;
    int rc = RunAs(uid, JOB_OWNER_CLIENT_PATH, {daemon_->socket_path().string(), job, fmt::format("{}", weight)},
                   dir_.path() / "client.out", &text);
    if (rc != 0) return fmt::format("exit {}: {}", rc, text);
    return text;
  }
  std::string Fuyouctl(uid_t uid, const std::vector<std::string>& args, int* rc) {
    std::vector<std::string> all = {"--socket", daemon_->socket_path().string()};
    all.insert(all.end(), args.begin(), args.end());
    std::string text;
    *rc = RunAs(uid, FUYOUCTL_PATH, all, dir_.path() / "fuyouctl.out", &text);
    return text;
  }
  std::unique_ptr<Session> Open(const std::string& job) {
    auto session = Session::Open({.job = job, .num_slots = 2, .slot_bytes = 4096 * 4}, daemon_->client_options());
    EXPECT_TRUE(session.ok()) << Text(session.status());
    return session.ok() ? std::move(*session) : nullptr;
  }

  TempDir dir_;
  std::unique_ptr<DaemonProcess> daemon_;
  std::unique_ptr<AdminClient> admin_;
};

// Item 3: an unprivileged user who creates "llama-prod" first does not hand root
// its weights, and root's job does not replace the user's.
TEST_F(JobsSecurityTest, RootNeverResumesAnotherUsersJobOfTheSameName) {
  StartDaemon();
  EXPECT_EQ(RunClient(kNobody, "llama-prod", 7.0f), "resumed=0 weight=7\n");
  auto session = Open("llama-prod");
  ASSERT_NE(session, nullptr);
  std::vector<float> weights(1024, 1.0f);
  auto registered = session->RegisterChunk({.chunk_id = 0, .num_elements = 1024},
                                           std::as_writable_bytes(std::span(weights)));
  ASSERT_TRUE(registered.ok()) << Text(registered.status());
  EXPECT_FALSE(registered->resumed) << "root resumed the job another user created";
  EXPECT_EQ(weights[0], 1.0f);
  ASSERT_TRUE(session->Close().ok());
  // The user resumes their own job, with their own weights.
  const std::string again = RunClient(kNobody, "llama-prod", 0.0f);
  float weight = 0;
  ASSERT_EQ(std::sscanf(again.c_str(), "resumed=1 weight=%f", &weight), 1) << again;
  EXPECT_NEAR(weight, 7.0f, 0.05f);
  // Each sees its own in the listing; an administrator may ask for all.
  auto mine = Admin().ListJobs();
  ASSERT_TRUE(mine.ok());
  ASSERT_EQ(mine->jobs_size(), 1);
  EXPECT_EQ(mine->jobs(0).owner_uid(), 0u);
  auto all = Admin().ListJobs(/*all_users=*/true);
  ASSERT_TRUE(all.ok());
  EXPECT_EQ(all->jobs_size(), 2);
  int rc = 0;
  std::string text = Fuyouctl(kNobody, {"jobs", "--all-users"}, &rc);
  EXPECT_NE(rc, 0);
  EXPECT_NE(text.find("for root and the daemon's user"), std::string::npos) << text;
  text = Fuyouctl(kNobody, {"jobs", "--json"}, &rc);
  ASSERT_EQ(rc, 0) << text;
  EXPECT_NE(text.find("llama-prod"), std::string::npos) << text;
}

// Item 4: a symlink planted in a job directory is never written through.
TEST_F(JobsSecurityTest, PlantedSymlinksAreRefusedAndTouchNothing) {
  StartDaemon();
  const fs::path victim = dir_.path() / "victim";
  std::ofstream(victim) << "precious";
  auto session = Open("mine");
  ASSERT_NE(session, nullptr);
  std::vector<float> weights(1024, 1.0f);
  ASSERT_TRUE(session->RegisterChunk({.chunk_id = 0, .num_elements = 1024}, std::as_writable_bytes(std::span(weights))).ok());
  // The next commit writes manifest.tmp: planted, it is replaced, not followed.
  fs::create_symlink(victim, JobDir(0, "mine") / "manifest.tmp");
  std::vector<float> grads(1024, 0.5f);
  ASSERT_TRUE(session->PushGradients(0, 1, AdamWHyper{}, std::as_bytes(std::span(grads))).ok());
  ASSERT_TRUE(session->PullParams(0, std::as_writable_bytes(std::span(weights))).ok());
  ASSERT_TRUE(session->EndStep(1).ok());
  ASSERT_TRUE(session->Close().ok());
  EXPECT_EQ(ReadText(victim), "precious");
  // states.bin of a job being created: refused with a clear error.
  fs::create_directories(JobDir(0, "evil"));
  fs::create_symlink(victim, JobDir(0, "evil") / "states.bin");
  auto evil = Session::Open({.job = "evil", .num_slots = 2, .slot_bytes = 4096}, daemon_->client_options());
  EXPECT_EQ(evil.status().code(), absl::StatusCode::kFailedPrecondition) << Text(evil.status());
  EXPECT_NE(Text(evil.status()).find("symbolic link"), std::string::npos) << Text(evil.status());
  EXPECT_EQ(ReadText(victim), "precious");
  struct stat st {};
  ASSERT_EQ(::stat(JobDir(0, "mine").c_str(), &st), 0);
  EXPECT_EQ(st.st_mode & 0777, 0700u);
}

// Items 5 and 9: a job whose manifest is damaged is its owner's to see and
// delete; another user (root included) cannot name it.
TEST_F(JobsSecurityTest, ADamagedManifestIsDeletedOnlyByItsOwner) {
  StartDaemon();
  ASSERT_EQ(RunClient(kNobody, "theirs", 3.0f), "resumed=0 weight=3\n");
  std::ofstream(JobDir(kNobody, "theirs") / "manifest.pb", std::ios::trunc) << "garbage";
  auto refused = Admin().DeleteJob("theirs");
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kNotFound) << Text(refused.status());
  EXPECT_EQ(Text(refused.status()).find("65534"), std::string::npos) << Text(refused.status());
  EXPECT_TRUE(fs::exists(JobDir(kNobody, "theirs") / "states.bin"));
  int rc = 0;
  std::string text = Fuyouctl(kNobody, {"jobs"}, &rc);
  ASSERT_EQ(rc, 0) << text;
  EXPECT_NE(text.find("DAMAGED"), std::string::npos) << text;
  text = Fuyouctl(kNobody, {"delete-job", "theirs"}, &rc);
  EXPECT_EQ(rc, 0) << text;
  EXPECT_FALSE(fs::exists(JobDir(kNobody, "theirs")));
}

// Item 10: a registration refused for space leaves the job as committed (no
// space kept from the failed fallocate), and a job that never got a chunk is
// gone when its session ends.
TEST_F(JobsSecurityTest, ARegistrationRefusedForSpaceLeavesTheJobAsItWas) {
  StartDaemon({}, {"FUYOU_TEST_FAULTS=reserve:ENOSPC:after=1:job=full;reserve:ENOSPC:job=none"});
  auto session = Open("full");
  ASSERT_NE(session, nullptr);
  std::vector<float> weights(4096, 1.0f);
  std::vector<float> small(1024, 1.0f);
  ASSERT_TRUE(session->RegisterChunk({.chunk_id = 0, .num_elements = 1024}, std::as_writable_bytes(std::span(small))).ok());
  const uint64_t committed = fs::file_size(JobDir(0, "full") / "states.bin");
  auto refused = session->RegisterChunk({.chunk_id = 1, .num_elements = 4096}, std::as_writable_bytes(std::span(weights)));
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kResourceExhausted) << Text(refused.status());
  EXPECT_EQ(fs::file_size(JobDir(0, "full") / "states.bin"), committed) << "the refused reservation kept its space";
  ASSERT_TRUE(session->Close().ok());
  auto none = Open("none");
  ASSERT_NE(none, nullptr);
  EXPECT_EQ(none->RegisterChunk({.chunk_id = 0, .num_elements = 1024}, std::as_writable_bytes(std::span(small))).status().code(),
            absl::StatusCode::kResourceExhausted);
  ASSERT_TRUE(none->Close().ok());
  EXPECT_FALSE(fs::exists(JobDir(0, "none"))) << "a half-registered job was left behind";
  auto jobs = Admin().ListJobs();
  ASSERT_TRUE(jobs.ok());
  ASSERT_EQ(jobs->jobs_size(), 1);
  EXPECT_EQ(jobs->jobs(0).name(), "full");
}

// Item 10: an OpenSession that runs out of file descriptors anywhere on the way
// leaves no state file without a manifest: every job on disk is listed.
TEST_F(JobsSecurityTest, OpenSessionsOutOfFileDescriptorsLeaveNoInvisibleJob) {
  StartDaemon();
  auto channel = grpc::CreateChannel(daemon_->client_options().address, grpc::InsecureChannelCredentials());
  auto raw = v1::Offload::NewStub(channel);
  ASSERT_TRUE(channel->WaitForConnected(std::chrono::system_clock::now() + std::chrono::seconds(20)));
  ASSERT_TRUE(Admin().Health().ok());
  rlimit old {};
  ASSERT_EQ(::prlimit(daemon_->pid(), RLIMIT_NOFILE, nullptr, &old), 0);
  // The daemon's descriptor numbers in use; a limit L leaves it the free numbers
  // below L. Try every count of free descriptors from 0 to 13.
  std::set<int> used;
  for (const auto& entry : fs::directory_iterator(fmt::format("/proc/{}/fd", daemon_->pid()))) {
    used.insert(std::stoi(entry.path().filename().string()));
  }
  auto limit_leaving = [&](int free) {
    int limit = 0;
    for (int left = 0; left < free || used.count(limit) != 0; ++limit) {
      if (used.count(limit) == 0) ++left;
    }
    return limit;
  };
  int exhausted = 0;
  std::string outcomes;
  for (int extra = 0; extra < 14; ++extra) {
    rlimit low = old;
    low.rlim_cur = static_cast<rlim_t>(limit_leaving(extra));
    ASSERT_EQ(::prlimit(daemon_->pid(), RLIMIT_NOFILE, &low, nullptr), 0);
    grpc::ClientContext context;
    context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(30));
    v1::OpenSessionRequest request;
    request.set_job(fmt::format("emfile-{}", extra));
    request.set_num_slots(1);
    request.set_slot_bytes(4096);
    v1::OpenSessionResponse opened;
    grpc::Status status = raw->OpenSession(&context, request, &opened);
    ASSERT_EQ(::prlimit(daemon_->pid(), RLIMIT_NOFILE, &old, nullptr), 0);
    if (status.ok()) {
      grpc::ClientContext close_context;
      v1::CloseSessionRequest close;
      close.set_session_id(opened.session_id());
      v1::CloseSessionResponse closed;
      EXPECT_TRUE(raw->CloseSession(&close_context, close, &closed).ok());
    } else {
      if (status.error_code() == grpc::StatusCode::RESOURCE_EXHAUSTED) ++exhausted;
    }
    outcomes += fmt::format("{} free: {} {}\n", extra, static_cast<int>(status.error_code()), status.error_message());
  }
  EXPECT_GT(exhausted, 2) << outcomes;
  // Nothing on disk that the API does not show: the empty jobs of the sessions
  // were removed when they closed, and failed creations removed what they made.
  const fs::path jobs_dir = daemon_->data_dir() / "users" / "0" / "jobs";
  if (fs::exists(jobs_dir)) {
    for (const auto& entry : fs::directory_iterator(jobs_dir)) {
      ADD_FAILURE() << entry.path() << " is left on disk";
    }
  }
  auto jobs = Admin().ListJobs();
  ASSERT_TRUE(jobs.ok());
  EXPECT_EQ(jobs->jobs_size(), 0);
}

// The per-user job limit.
TEST_F(JobsSecurityTest, OneJobOverTheLimitIsRefusedNamingTheSetting) {
  StartDaemon({"--max-jobs-per-user", "2"});
  EXPECT_EQ(RunClient(kNobody, "a", 1.0f), "resumed=0 weight=1\n");
  EXPECT_EQ(RunClient(kNobody, "b", 1.0f), "resumed=0 weight=1\n");
  const std::string third = RunClient(kNobody, "c", 1.0f);
  EXPECT_NE(third.find("max_jobs_per_user (2)"), std::string::npos) << third;
  EXPECT_NE(third.find("--max-jobs-per-user"), std::string::npos) << third;
  // Another user has a count of their own.
  auto session = Open("c");
  ASSERT_NE(session, nullptr);
  ASSERT_TRUE(session->Close().ok());
}

// Migration: a data directory of the layout before namespaces
// (<root>/jobs/<name>/) is moved at start; the job resumes for its owner.
TEST_F(JobsSecurityTest, AJobOfTheOldLayoutResumesForItsOwner) {
  StartDaemon();
  ASSERT_EQ(RunClient(kNobody, "old", 5.0f), "resumed=0 weight=5\n");
  ASSERT_EQ(daemon_->Stop(), 0);
  admin_.reset();
  const fs::path data = daemon_->data_dir();
  fs::create_directories(data / "jobs");
  fs::rename(data / "users" / "65534" / "jobs" / "old", data / "jobs" / "old");
  fs::remove_all(data / "users");
  ::chmod((data / "jobs" / "old").c_str(), 0755);  // as round 1 made them
  StartDaemon();
  EXPECT_FALSE(fs::exists(data / "jobs"));
  struct stat st {};
  ASSERT_EQ(::stat(JobDir(kNobody, "old").c_str(), &st), 0);
  EXPECT_EQ(st.st_mode & 0777, 0700u);
  const std::string resumed = RunClient(kNobody, "old", 0.0f);
  float weight = 0;
  ASSERT_EQ(std::sscanf(resumed.c_str(), "resumed=1 weight=%f", &weight), 1) << resumed;
  EXPECT_NEAR(weight, 5.0f, 0.05f);
}

// Item 10: after the data directory is removed and re-created under a running
// daemon, a second daemon on the same path is still refused.
TEST_F(JobsSecurityTest, TheStoragePathLockSurvivesTheDataDirectoryBeingRemoved) {
  StartDaemon();
  const fs::path data = daemon_->data_dir();
  fs::remove_all(data);
  fs::create_directories(data);
  // The daemon re-creates and re-locks its lock file within a reaper period
  // (5 s); wait for it without a timed assertion.
  for (int i = 0; i < 600 && !fs::exists(data / "fuyoud.lock"); ++i) ::usleep(100'000);
  ASSERT_TRUE(fs::exists(data / "fuyoud.lock"));
  const fs::path other = dir_.path() / "other";
  fs::create_directories(other);
  pid_t second = Spawn(FUYOUD_PATH, {"--socket", (other / "fuyoud.sock").string(), "--data-dir", data.string(),
                                     "--dram-budget", "64MiB"});
  ASSERT_GT(second, 0);
  // A refused daemon exits at once; one that got the lock would serve forever.
  int status = 0;
  pid_t reaped = 0;
  for (int i = 0; i < 600 && reaped == 0; ++i) {
    reaped = ::waitpid(second, &status, WNOHANG);
    if (reaped == 0) ::usleep(100'000);
  }
  if (reaped == 0) {
    ::kill(second, SIGKILL);
    ::waitpid(second, &status, 0);
    FAIL() << "a second daemon ran on the locked storage path";
  }
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) != 0) << "a second daemon ran on a locked path";
  // And the first daemon still serves jobs on the re-created directory.
  auto session = Open("after");
  ASSERT_NE(session, nullptr);
  std::vector<float> weights(1024, 1.0f);
  EXPECT_TRUE(session->RegisterChunk({.chunk_id = 0, .num_elements = 1024}, std::as_writable_bytes(std::span(weights))).ok());
  EXPECT_TRUE(session->Close().ok());
}

}  // namespace
}  // namespace fuyou::testing
