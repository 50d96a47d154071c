// Limits against a real fuyoud: sessions and segment bytes per user, sessions
// in all, client_info (bounded and sanitised), idle sessions, the open-file
// limit, what GetStats shows an ordinary user, and fuyouctl's message for a
// socket it may not use. A second user is limits_client or fuyouctl run as
// nobody (fork, setuid, exec), so these tests need root.
#include <fcntl.h>
#include <fmt/format.h>
#include <gtest/gtest.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <fstream>
#include <map>
#include <sstream>
#include <thread>

#include "daemon_process.h"
#include "fuyou/admin_client.h"
#include "fuyou/client.h"
#include "fuyou/v1/offload.grpc.pb.h"
#include "grpcpp/grpcpp.h"
#include "test_values.h"

namespace fuyou::testing {
namespace {
namespace fs = std::filesystem;
using std::chrono::milliseconds;

constexpr uid_t kNobody = 65534;

class LimitsTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (::geteuid() != 0) GTEST_SKIP() << "skipped: needs root to act as a second user";
    // nobody must reach the socket (and write its output files) under the test's directory.
    ::chmod(dir_.path().c_str(), 01777);  // sticky: fuyoud refuses a socket directory others can write otherwise
  }

  void StartDaemon(std::vector<std::string> args = {}) {
    // No drain at the end: the test's unattached sessions would hold it 10 s.
    args.insert(args.end(), {"--dram-budget", "64MiB", "--socket-mode", "0666", "--drain-seconds", "0"});
    daemon_ = std::make_unique<DaemonProcess>(dir_.path(), std::move(args));
    absl::Status started = daemon_->Start();
    ASSERT_TRUE(started.ok()) << Text(started);
    channel_ = grpc::CreateChannel("unix:" + daemon_->socket_path().string(), grpc::InsecureChannelCredentials());
    stub_ = v1::Offload::NewStub(channel_);
  }

  // A raw OpenSession as root (the session stays unattached).
  grpc::Status Open(const std::string& job, uint64_t slot_bytes, const std::string& client_info = "",
                    std::string* session_id = nullptr, uint32_t slots = 1) {
    v1::OpenSessionRequest request;
    request.set_job(job);
    request.set_num_slots(slots);
    request.set_slot_bytes(slot_bytes);
    request.set_client_info(client_info);
    v1::OpenSessionResponse response;
    grpc::ClientContext context;
    context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(20));
    grpc::Status status = stub_->OpenSession(&context, request, &response);
    if (session_id != nullptr) *session_id = response.session_id();
    return status;
  }

  grpc::Status Close(const std::string& session_id) {
    v1::CloseSessionRequest request;
    request.set_session_id(session_id);
    v1::CloseSessionResponse response;
    grpc::ClientContext context;
    context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(20));
    return stub_->CloseSession(&context, request, &response);
  }

  // Opens a session as nobody through limits_client; returns its exit status.
  int OpenAsNobody(const std::string& job, uint64_t slot_bytes, std::string* output) {
    return RunAs(kNobody, LIMITS_CLIENT_PATH, {daemon_->socket_path().string(), "open", job, std::to_string(slot_bytes)},
                 dir_.path() / "client.out", output);
  }

  v1::ListSessionsResponse Sessions() {
    auto admin = AdminClient::Connect(daemon_->client_options());
    EXPECT_TRUE(admin.ok());
    auto sessions = (*admin)->ListSessions();
    EXPECT_TRUE(sessions.ok()) << Text(sessions.status());
    return sessions.ok() ? *sessions : v1::ListSessionsResponse{};
  }

  v1::GetStatsResponse Stats() {
    auto admin = AdminClient::Connect(daemon_->client_options());
    EXPECT_TRUE(admin.ok());
    auto stats = (*admin)->GetStats();
    EXPECT_TRUE(stats.ok()) << Text(stats.status());
    return stats.ok() ? *stats : v1::GetStatsResponse{};
  }

  static void ExpectLimit(const grpc::Status& status, const std::vector<std::string>& words) {
    EXPECT_EQ(status.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED) << status.error_message();
    for (const std::string& word : words) {
      EXPECT_NE(status.error_message().find(word), std::string::npos) << word << " in: " << status.error_message();
    }
  }

  TempDir dir_;
  std::unique_ptr<DaemonProcess> daemon_;
  std::shared_ptr<grpc::Channel> channel_;
  std::unique_ptr<v1::Offload::Stub> stub_;
};

TEST_F(LimitsTest, OneUserHasAtMostEightSessionsAndAnotherUserIsNotStarved) {
  StartDaemon();  // the default limits
  std::vector<std::string> ids(8);
  for (int i = 0; i < 8; ++i) {
    grpc::Status opened = Open(fmt::format("job-{}", i), 4096, "", &ids[i]);
    ASSERT_TRUE(opened.ok()) << i << ": " << opened.error_message();
  }
  // Unattached sessions used to pile up until the file descriptors ran out and
  // every OpenSession of every user failed.
  ExpectLimit(Open("job-8", 4096), {"max_sessions_per_user = 8", "already has 8 live sessions", "--max-sessions-per-user"});
  std::string output;
  EXPECT_EQ(OpenAsNobody("nobodys-job", 4096, &output), 0) << "another user must still get a session: " << output;
  ASSERT_TRUE(Close(ids[0]).ok());
  EXPECT_TRUE(Open("job-8", 4096).ok()) << "a closed session gives its place back";
}

TEST_F(LimitsTest, SegmentBytesOfOneUserAreBounded) {
  StartDaemon({"--max-segment-bytes-per-user", "16MiB"});
  ASSERT_TRUE(Open("big", 6 << 20).ok());  // 4 KiB + 2 x 6 MiB
  ExpectLimit(Open("more", 2 << 20),
              {"max_segment_bytes_per_user = 16777216", "12587008 bytes are in use", "--max-segment-bytes-per-user"});
  EXPECT_TRUE(Open("small", 1 << 20).ok()) << "what still fits is allowed";
  std::string output;
  EXPECT_EQ(OpenAsNobody("nobodys-job", 6 << 20, &output), 0) << "the bound is per user: " << output;
}

TEST_F(LimitsTest, SessionsOfAllUsersTogetherAreBounded) {
  StartDaemon({"--max-sessions", "3"});
  ASSERT_TRUE(Open("a", 4096).ok());
  ASSERT_TRUE(Open("b", 4096).ok());
  std::string output;
  ASSERT_EQ(OpenAsNobody("c", 4096, &output), 0) << output;
  ExpectLimit(Open("d", 4096), {"max_sessions = 3", "already has 3 live sessions", "--max-sessions"});
  EXPECT_EQ(OpenAsNobody("e", 4096, &output), 1);
  EXPECT_NE(output.find("max_sessions = 3"), std::string::npos) << output;
}

TEST_F(LimitsTest, ClientInfoIsBoundedAndStoredPrintable) {
  StartDaemon();
  ExpectLimit(Open("long", 4096, std::string(1025, 'x')), {"max_client_info_bytes = 1024", "1025 bytes"});
  // A message over gRPC's limit is refused before the daemon reads it; it used to
  // take 4 MB of RSS per session, most of which stayed after the session ended.
  const grpc::Status huge = Open("huge", 4096, std::string(5 << 20, 'x'));
  EXPECT_EQ(huge.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED) << huge.error_message();
  ASSERT_TRUE(Open("exact", 4096, std::string(1024, 'x')).ok());

  // (Invalid UTF-8 never arrives: proto3 refuses it in a string field.)
  const std::string hostile = "\x1b]0;owned\x07\x1b[2J\x1b[31mred\r\nFAKE LINE\x7f\xc2\x9b\xc3\xa9";
  ASSERT_TRUE(Open("hostile", 4096, hostile).ok());
  std::string stored;
  const v1::ListSessionsResponse sessions = Sessions();
  for (const v1::SessionInfo& session : sessions.sessions()) {
    if (session.job() == "hostile") stored = session.client_info();
  }
  EXPECT_EQ(stored, "?]0;owned??[2J?[31mred??FAKE LINE???\xc3\xa9");

  // fuyouctl prints none of it raw, as root (who sees every session) and as the owner.
  std::string output;
  ASSERT_EQ(RunAs(0, FUYOUCTL_PATH, {"--socket", daemon_->socket_path().string(), "sessions"}, dir_.path() / "ctl.out",
                  &output),
            0)
      << output;
  EXPECT_NE(output.find("hostile"), std::string::npos) << output;
  EXPECT_EQ(output.find('\x1b'), std::string::npos) << output;
  EXPECT_EQ(output.find('\r'), std::string::npos) << output;
  EXPECT_EQ(output.find('\x07'), std::string::npos) << output;
  EXPECT_EQ(output.find('\x7f'), std::string::npos) << output;
}

TEST_F(LimitsTest, AnIdleAttachedSessionIsClosedAndItsStepRolledBack) {
  StartDaemon({"--idle-session-timeout", "2"});
  const std::vector<float> initial(4096, 0.5f);
  std::vector<float> weights = initial;
  std::vector<float> grads(4096, 0.25f);
  auto bytes = [](std::vector<float>& v) { return std::as_writable_bytes(std::span(v)); };
  auto session = Session::Open({.job = "idle", .num_slots = 2, .slot_bytes = 4 * 4096}, daemon_->client_options());
  ASSERT_TRUE(session.ok()) << Text(session.status());
  ASSERT_TRUE((*session)->RegisterChunk({.chunk_id = 0, .num_elements = 4096}, bytes(weights)).ok());
  // Step 1 updated on the daemon but never committed; then the client goes quiet.
  ASSERT_TRUE((*session)->PushGradients(0, 1, {}, std::as_bytes(std::span(grads))).ok());
  ASSERT_TRUE((*session)->PullParams(0, bytes(weights)).ok());
  EXPECT_NE(weights[0], initial[0]);

  bool closed = false;
  for (int i = 0; i < 1200 && !closed; ++i) {  // waits for the reaper, not for a time
    closed = Sessions().sessions_size() == 0;
    if (!closed) std::this_thread::sleep_for(milliseconds(50));
  }
  ASSERT_TRUE(closed) << "the idle session is still listed after 60 s";
  EXPECT_FALSE((*session)->EndStep(1).ok()) << "the closed session cannot commit its step";
  session->reset();

  // The job resumes at its last commit: step 0, the initial weights.
  auto reopened = Session::Open({.job = "idle", .num_slots = 2, .slot_bytes = 4 * 4096}, daemon_->client_options());
  ASSERT_TRUE(reopened.ok()) << Text(reopened.status()) << " (the idle session must have released its job)";
  EXPECT_EQ((*reopened)->committed_step(), 0);
  auto resumed = (*reopened)->RegisterChunk({.chunk_id = 0, .num_elements = 4096}, bytes(weights));
  ASSERT_TRUE(resumed.ok()) << Text(resumed.status());
  EXPECT_TRUE(resumed->resumed);
  EXPECT_EQ(resumed->update_count, 0);
  EXPECT_EQ(weights, initial);
  EXPECT_TRUE((*reopened)->Close().ok());
}

TEST_F(LimitsTest, TheOpenFileLimitIsRaisedToTheHardLimit) {
  rlimit original{};
  ASSERT_EQ(::getrlimit(RLIMIT_NOFILE, &original), 0);
  if (original.rlim_max <= 512) GTEST_SKIP() << "the hard limit is too low to tell";
  rlimit low = original;
  low.rlim_cur = 512;  // what fuyoud inherits; systemd's default soft limit is 1024
  ASSERT_EQ(::setrlimit(RLIMIT_NOFILE, &low), 0);
  StartDaemon();
  ASSERT_EQ(::setrlimit(RLIMIT_NOFILE, &original), 0);
  std::ifstream limits(fmt::format("/proc/{}/limits", daemon_->pid()));
  std::string line, found;
  while (std::getline(limits, line)) {
    if (line.starts_with("Max open files")) found = line;
  }
  std::istringstream fields(found.substr(std::string("Max open files").size()));
  uint64_t soft = 0, hard = 0;
  fields >> soft >> hard;
  EXPECT_EQ(soft, hard) << found;
  EXPECT_EQ(hard, original.rlim_max) << found;
}

TEST_F(LimitsTest, GetStatsShowsAnOrdinaryUserOnlyTheirOwnActivity) {
  StartDaemon();
  // Root trains 2 chunks for 3 steps...
  {
    auto session = Session::Open({.job = "roots-job", .num_slots = 2, .slot_bytes = 4 * 4096}, daemon_->client_options());
    ASSERT_TRUE(session.ok()) << Text(session.status());
    std::vector<float> weights(4096, 0.5f), grads(4096, 0.25f);
    auto bytes = [](std::vector<float>& v) { return std::as_writable_bytes(std::span(v)); };
    for (uint32_t chunk = 0; chunk < 2; ++chunk) {
      ASSERT_TRUE((*session)->RegisterChunk({.chunk_id = chunk, .num_elements = 4096}, bytes(weights)).ok());
    }
    for (int64_t step = 1; step <= 3; ++step) {
      for (uint32_t chunk = 0; chunk < 2; ++chunk) {
        ASSERT_TRUE((*session)->PushGradients(chunk, step, {}, std::as_bytes(std::span(grads))).ok());
        ASSERT_TRUE((*session)->PullParams(chunk, bytes(weights)).ok());
      }
      ASSERT_TRUE((*session)->EndStep(step).ok());
    }
    ASSERT_TRUE((*session)->Close().ok());
  }
  // ...then nobody trains 1 chunk for 2 steps and reads GetStats with its session open.
  std::string output;
  ASSERT_EQ(RunAs(kNobody, LIMITS_CLIENT_PATH, {daemon_->socket_path().string(), "train", "nobodys-job", "2"},
                  dir_.path() / "train.out", &output),
            0)
      << output;
  auto mine = KeyValues(output);
  EXPECT_EQ(mine["scope"], std::to_string(v1::STATS_SCOPE_USER)) << output;
  EXPECT_EQ(mine["uid"], std::to_string(kNobody));
  EXPECT_EQ(mine["storage"], "0") << "storage paths are for administrators";
  EXPECT_EQ(mine["dram_budget_bytes"], "0") << "the DRAM tier is for administrators";
  EXPECT_EQ(mine["chunk_updates"], "2") << "root's 6 updates must not show";
  EXPECT_EQ(mine["params_updated"], "8192");
  EXPECT_EQ(mine["steps_committed"], "2");
  EXPECT_EQ(mine["live_sessions"], "1");
  // Registration wrote the initial states, each step its new ones: 3 extents.
  EXPECT_EQ(mine["bytes_written"], std::to_string(3 * 12 * 4096)) << output;

  const v1::GetStatsResponse all = Stats();  // root: the whole daemon
  EXPECT_EQ(all.scope(), v1::STATS_SCOPE_DAEMON);
  EXPECT_EQ(all.chunk_updates(), 8u);
  EXPECT_EQ(all.steps_committed(), 5u);
  EXPECT_EQ(all.storage_size(), 1);
  EXPECT_GT(all.dram_budget_bytes(), 0u);
  EXPECT_EQ(all.bytes_written(), all.storage(0).bytes_written());
  EXPECT_GE(all.bytes_written(), std::stoull(mine["bytes_written"]) + 8 * 12 * 4096);
}

TEST_F(LimitsTest, FuyouctlSaysPermissionDeniedOnASocketItMayNotUse) {
  StartDaemon();
  const std::string socket = daemon_->socket_path().string();
  const fs::path out = dir_.path() / "ctl.out";
  std::string output;
  ASSERT_EQ(::chmod(socket.c_str(), 0600), 0);  // root's alone
  EXPECT_EQ(RunAs(kNobody, FUYOUCTL_PATH, {"--socket", socket, "status"}, out, &output), 1);
  EXPECT_NE(output.find("permission denied on the socket " + socket), std::string::npos) << output;
  EXPECT_EQ(output.find("is the daemon running"), std::string::npos) << output;
  EXPECT_EQ(RunAs(0, FUYOUCTL_PATH, {"--socket", socket, "status"}, out, &output), 0) << output;

  // A directory nobody cannot search: the same answer.
  ASSERT_EQ(::chmod(socket.c_str(), 0666), 0);
  const fs::path closed = dir_.path() / "closed";
  fs::create_directory(closed);
  ::chmod(closed.c_str(), 0700);
  const fs::path link = closed / "fuyoud.sock";
  fs::create_symlink(socket, link);
  EXPECT_EQ(RunAs(kNobody, FUYOUCTL_PATH, {"--socket", link.string(), "status"}, out, &output), 1);
  EXPECT_NE(output.find("permission denied on the socket"), std::string::npos) << output;

  // And a socket that does not exist is still "is the daemon running?".
  EXPECT_EQ(RunAs(kNobody, FUYOUCTL_PATH, {"--socket", (dir_.path() / "none.sock").string(), "--timeout", "1", "status"},
                  out, &output),
            1);
  EXPECT_NE(output.find("is the daemon running?"), std::string::npos) << output;
}

}  // namespace
}  // namespace fuyou::testing
