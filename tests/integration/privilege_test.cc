// Least privilege: a real fuyoud running as an unprivileged uid (65534) with no
// capability serves root and another user (65533), because clients create their
// segments themselves and hand the memfds over the segment socket. And the
// handover refuses what would let a client hurt the daemon or reach another
// user's session. Needs root (to start processes as other uids); skipped if not.
#include <fcntl.h>
#include <gtest/gtest.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstring>
#include <fstream>
#include <sstream>
#include <string>
#include <thread>

#include "adamw_reference.h"
#include "daemon_process.h"
#include "fmt/format.h"
#include "fuyou/admin_client.h"
#include "fuyou/client.h"
#include "fuyou/client_segment.h"
#include "fuyou/segment_handover.h"
#include "fuyou/segment_layout.h"
#include "fuyou/v1/offload.grpc.pb.h"
#include "grpcpp/grpcpp.h"
#include "test_values.h"

namespace fuyou::testing {
namespace {
namespace fs = std::filesystem;
using std::chrono::milliseconds;

constexpr uid_t kDaemonUid = 65534;  // nobody
constexpr uid_t kOtherUid = 65533;
constexpr milliseconds kTimeout{20000};

// The value of `field` ("CapEff", "Uid", ...) in /proc/<pid>/status.
std::string ProcStatus(pid_t pid, const std::string& field) {
  std::ifstream status(fmt::format("/proc/{}/status", pid));
  std::string line;
  while (std::getline(status, line)) {
    if (line.rfind(field + ":", 0) == 0) {
      std::string value = line.substr(field.size() + 1);
      value.erase(0, value.find_first_not_of(" \t"));
      return value;
    }
  }
  return "";
}

// Runs privilege_client as `uid` with `args`; its exit status and its output.
int RunClientAs(uid_t uid, const std::vector<std::string>& args, const fs::path& dir, std::string* output) {
  const fs::path out = dir / fmt::format("client-{}.out", uid);
  std::vector<std::string> shell_args = {"-c", "exec \"$0\" \"$@\" >" + out.string() + " 2>&1",
                                         PRIVILEGE_CLIENT_PATH};
  shell_args.insert(shell_args.end(), args.begin(), args.end());
  // The output file is created by the shell, as `uid`: the directory must let it.
  const pid_t pid = SpawnAs(uid, "/bin/sh", shell_args);
  if (pid < 0) return -1;
  int status = 0;
  ::waitpid(pid, &status, 0);
  std::ifstream in(out);
  *output = std::string((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
}

class PrivilegeTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (::geteuid() != 0) GTEST_SKIP() << "skipped: needs root to start processes as other users";
    // The daemon's uid creates its sockets and data directory here; other users
    // reach the socket (mode 0666) through it.
    ASSERT_EQ(::chown(dir_.path().c_str(), kDaemonUid, kDaemonUid), 0);
    ASSERT_EQ(::chmod(dir_.path().c_str(), 0755), 0);
    ASSERT_EQ(::mkdir((dir_.path() / "out").c_str(), 0777), 0);
    ASSERT_EQ(::chmod((dir_.path() / "out").c_str(), 01777), 0);
    daemon_ = std::make_unique<DaemonProcess>(dir_.path(),
                                              std::vector<std::string>{"--dram-budget", "64MiB", "--socket-mode", "0666",
                                                                       "--drain-seconds", "0"});
    daemon_->set_run_as(kDaemonUid);
    absl::Status started = daemon_->Start();
    ASSERT_TRUE(started.ok()) << Text(started);
    stub_ = v1::Offload::NewStub(grpc::CreateChannel(daemon_->client_options().address, grpc::InsecureChannelCredentials()));
  }

  v1::OpenSessionResponse OpenRaw(const std::string& job) {
    grpc::ClientContext context;
    v1::OpenSessionRequest request;
    request.set_job(job);
    request.set_num_slots(2);
    request.set_slot_bytes(4096);
    v1::OpenSessionResponse response;
    grpc::Status status = stub_->OpenSession(&context, request, &response);
    EXPECT_TRUE(status.ok()) << status.error_message();
    return response;
  }
  grpc::Status RegisterRaw(const std::string& session_id, uint64_t elements) {
    grpc::ClientContext context;
    v1::RegisterChunksRequest request;
    request.set_session_id(session_id);
    v1::ChunkSpec* spec = request.add_chunks();
    spec->set_chunk_id(0);
    spec->set_num_elements(elements);
    spec->set_param_dtype(v1::DTYPE_FLOAT32);
    spec->set_grad_dtype(v1::DTYPE_FLOAT32);
    v1::RegisterChunksResponse response;
    return stub_->RegisterChunks(&context, request, &response);
  }
  bool Healthy() {
    auto admin = AdminClient::Connect(daemon_->client_options());
    return admin.ok() && (*admin)->Health().ok();
  }
  fs::path out_dir() const { return dir_.path() / "out"; }

  TempDir dir_;
  std::unique_ptr<DaemonProcess> daemon_;
  std::unique_ptr<v1::Offload::Stub> stub_;
};

void ExpectStatus(const absl::Status& status, absl::StatusCode code, const std::string& words) {
  EXPECT_EQ(status.code(), code) << Text(status);
  EXPECT_NE(Text(status).find(words), std::string::npos) << "message '" << Text(status) << "' lacks '" << words << "'";
}

TEST_F(PrivilegeTest, TheDaemonRunsAsItsUserWithNoCapability) {
  const pid_t pid = daemon_->pid();
  EXPECT_EQ(ProcStatus(pid, "Uid"), "65534\t65534\t65534\t65534");
  EXPECT_EQ(ProcStatus(pid, "Gid"), "65534\t65534\t65534\t65534");
  EXPECT_EQ(ProcStatus(pid, "CapEff"), "0000000000000000");
  EXPECT_EQ(ProcStatus(pid, "CapPrm"), "0000000000000000");
  EXPECT_EQ(ProcStatus(pid, "CapAmb"), "0000000000000000");
  struct stat info {};
  ASSERT_EQ(::stat(daemon_->socket_path().c_str(), &info), 0);
  EXPECT_EQ(info.st_uid, kDaemonUid);
  const fs::path segment_socket = daemon_->socket_path().string() + std::string(kSegmentSocketSuffix);
  ASSERT_EQ(::stat(segment_socket.c_str(), &info), 0);
  EXPECT_TRUE(S_ISSOCK(info.st_mode));
  EXPECT_EQ(info.st_mode & 0777, 0666u) << "the segment socket has the main socket's mode";
}

TEST_F(PrivilegeTest, RootAndAnotherUserTrainSideBySide) {
  // Another user trains in its own process...
  std::string other_output;
  const fs::path other_out = out_dir() / "other.out";
  std::vector<std::string> shell_args = {"-c", "exec \"$0\" \"$@\" >" + other_out.string() + " 2>&1",
                                         PRIVILEGE_CLIENT_PATH, "train", daemon_->socket_path().string(), "theirs",
                                         "5"};
  const pid_t other = SpawnAs(kOtherUid, "/bin/sh", shell_args);
  ASSERT_GT(other, 0);

  // ...while root trains here, through clientlib, checked against the reference.
  auto session = Session::Open({.job = "ours", .num_slots = 2, .slot_bytes = 4 * 2048}, daemon_->client_options());
  ASSERT_TRUE(session.ok()) << Text(session.status());
  std::vector<float> weights = Values(7, 2048);
  ReferenceChunk reference(weights);
  auto registered = (*session)->RegisterChunk({.chunk_id = 0, .num_elements = 2048},
                                              std::as_writable_bytes(std::span(weights)));
  ASSERT_TRUE(registered.ok()) << Text(registered.status());
  AdamWHyper hyper;
  hyper.lr = 1e-3f;
  for (int64_t step = 1; step <= 5; ++step) {
    const std::vector<float> grads = Values(step, 2048, 0.1f);
    ASSERT_TRUE((*session)->PushGradients(0, step, hyper, std::as_bytes(std::span(grads))).ok());
    reference.Step(grads, hyper);
    ASSERT_TRUE((*session)->PullParams(0, std::as_writable_bytes(std::span(weights))).ok());
    for (size_t i = 0; i < weights.size(); ++i) {
      ASSERT_NEAR(weights[i], reference.master[i], 1e-6 * std::max(std::abs(reference.master[i]), 1e-3f))
          << "step " << step << " element " << i;
    }
    ASSERT_TRUE((*session)->EndStep(step).ok());
  }
  EXPECT_TRUE((*session)->Close().ok());

  int status = 0;
  ASSERT_EQ(::waitpid(other, &status, 0), other);
  std::ifstream in(other_out);
  other_output = std::string((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << "uid 65533's client: " << other_output;
  EXPECT_NE(other_output.find("trained 5 steps"), std::string::npos) << other_output;
  // The other user's job belongs to it.
  auto admin = AdminClient::Connect(daemon_->client_options());
  ASSERT_TRUE(admin.ok());
  auto jobs = (*admin)->ListJobs(/*all_users=*/true);  // root is an administrator
  ASSERT_TRUE(jobs.ok()) << Text(jobs.status());
  bool found = false;
  for (const auto& job : jobs->jobs()) {
    if (job.name() == "theirs") {
      found = true;
      EXPECT_EQ(job.owner_uid(), kOtherUid);
    }
  }
  EXPECT_TRUE(found);
}

TEST_F(PrivilegeTest, NothingButTheHandoverGivesASessionItsSegment) {
  v1::OpenSessionResponse opened = OpenRaw("early");
  EXPECT_TRUE(opened.segment_name().empty());
  EXPECT_EQ(opened.segment_socket(), daemon_->socket_path().string() + ".seg");
  grpc::Status registered = RegisterRaw(opened.session_id(), 100);
  EXPECT_EQ(registered.error_code(), grpc::StatusCode::FAILED_PRECONDITION);
  EXPECT_NE(registered.error_message().find("send the segment first"), std::string::npos) << registered.error_message();
  {
    grpc::ClientContext context;
    auto stream = stub_->Stream(&context);
    v1::ClientMessage attach;
    attach.mutable_attach()->set_session_id(opened.session_id());
    stream->Write(attach);
    stream->WritesDone();
    v1::DaemonMessage reply;
    EXPECT_FALSE(stream->Read(&reply));
    grpc::Status finished = stream->Finish();
    EXPECT_EQ(finished.error_code(), grpc::StatusCode::FAILED_PRECONDITION);
    EXPECT_NE(finished.error_message().find("send the segment first"), std::string::npos) << finished.error_message();
  }
  // Refused requests changed nothing: the handover, then registration, work.
  auto segment = HandOverNewSegment(opened);
  ASSERT_TRUE(segment.ok()) << Text(segment.status());
  EXPECT_TRUE(RegisterRaw(opened.session_id(), 100).ok());
}

TEST_F(PrivilegeTest, AnUnsealedMemfdIsRefused) {
  v1::OpenSessionResponse opened = OpenRaw("unsealed");
  const int fd = ::memfd_create("fuyou-segment", MFD_CLOEXEC | MFD_ALLOW_SEALING);
  ASSERT_GE(fd, 0);
  ASSERT_EQ(::ftruncate(fd, static_cast<off_t>(opened.segment_bytes())), 0);
  ExpectStatus(SendSegmentHandover(opened.segment_socket(), opened.session_id() + "\n", fd, kTimeout),
               absl::StatusCode::kFailedPrecondition, "the segment must be a memfd sealed with F_SEAL_SHRINK|F_SEAL_GROW");
  // Had the daemon taken it, this would make its next access a SIGBUS.
  ASSERT_EQ(::ftruncate(fd, 0), 0);
  ::close(fd);
  EXPECT_EQ(RegisterRaw(opened.session_id(), 100).error_code(), grpc::StatusCode::FAILED_PRECONDITION);
  EXPECT_TRUE(Healthy());
}

TEST_F(PrivilegeTest, AMemfdOfTheWrongSizeIsRefused) {
  v1::OpenSessionResponse opened = OpenRaw("size");
  auto small = ClientSegment::Create(opened.segment_bytes() - 4096);
  ASSERT_TRUE(small.ok());
  ExpectStatus((*small)->HandOver(opened.segment_socket(), opened.session_id(), kTimeout),
               absl::StatusCode::kInvalidArgument,
               fmt::format("the segment is {} bytes but the session's segment_bytes is {}", opened.segment_bytes() - 4096,
                           opened.segment_bytes()));
}

TEST_F(PrivilegeTest, AHandoverWithoutAnFdIsRefused) {
  v1::OpenSessionResponse opened = OpenRaw("nofd");
  ExpectStatus(SendSegmentHandover(opened.segment_socket(), opened.session_id() + "\n", -1, kTimeout),
               absl::StatusCode::kInvalidArgument, "carried no fd");
  EXPECT_TRUE(HandOverNewSegment(opened).ok());
}

TEST_F(PrivilegeTest, AnotherUsersSessionIsAnsweredLikeAnUnknownOne) {
  v1::OpenSessionResponse opened = OpenRaw("roots");
  std::string theirs, unknown;
  ASSERT_EQ(RunClientAs(kOtherUid,
                        {"handover", opened.segment_socket(), opened.session_id(),
                         std::to_string(opened.segment_bytes())},
                        out_dir(), &theirs),
            0)
      << theirs;
  EXPECT_EQ(theirs, fmt::format("NOT_FOUND no open session has id '{}'\n", opened.session_id()));
  ASSERT_EQ(RunClientAs(kOtherUid,
                        {"handover", opened.segment_socket(), "s-0000000000000000",
                         std::to_string(opened.segment_bytes())},
                        out_dir(), &unknown),
            0)
      << unknown;
  EXPECT_EQ(unknown, "NOT_FOUND no open session has id 's-0000000000000000'\n");
  // The owner's handover still works: the other user's attempt changed nothing.
  EXPECT_TRUE(HandOverNewSegment(opened).ok());
}

TEST_F(PrivilegeTest, AfterTheHandoverTheClientCannotShrinkItsSegment) {
  v1::OpenSessionResponse opened = OpenRaw("sealed");
  auto segment = HandOverNewSegment(opened);
  ASSERT_TRUE(segment.ok()) << Text(segment.status());
  // The /dev/shm design's crash: the client truncates the segment under the
  // daemon. The seals forbid it.
  EXPECT_EQ(::ftruncate((*segment)->fd(), 0), -1);
  EXPECT_EQ(errno, EPERM);
  EXPECT_EQ(::fcntl((*segment)->fd(), F_ADD_SEALS, F_SEAL_WRITE), -1);
  // The daemon reads the slots (initial weights of a new chunk) and serves on.
  const SegmentLayout layout{opened.num_slots(), opened.slot_bytes()};
  std::vector<float> weights = Values(3, 1000);
  std::memcpy((*segment)->bytes().data() + layout.ParamOffset(0), weights.data(), weights.size() * sizeof(float));
  grpc::ClientContext context;
  v1::RegisterChunksRequest request;
  request.set_session_id(opened.session_id());
  v1::ChunkSpec* spec = request.add_chunks();
  spec->set_chunk_id(0);
  spec->set_num_elements(1000);
  spec->set_param_dtype(v1::DTYPE_FLOAT32);
  spec->set_grad_dtype(v1::DTYPE_FLOAT32);
  spec->set_slot(0);
  v1::RegisterChunksResponse response;
  ASSERT_TRUE(stub_->RegisterChunks(&context, request, &response).ok());
  EXPECT_TRUE(Healthy());
  EXPECT_EQ(daemon_->WaitForExit(milliseconds(0)), -1) << "the daemon must still run";
}

TEST_F(PrivilegeTest, ASecondHandoverForTheSameSessionIsRefused) {
  v1::OpenSessionResponse opened = OpenRaw("twice");
  auto first = HandOverNewSegment(opened);
  ASSERT_TRUE(first.ok()) << Text(first.status());
  auto second = HandOverNewSegment(opened);
  ExpectStatus(second.status(), absl::StatusCode::kFailedPrecondition, "already has its segment");
  // The first segment is still the session's: its header is intact.
  SegmentHeader header;
  std::memcpy(&header, (*first)->bytes().data(), sizeof header);
  EXPECT_EQ(header.magic, kSegmentMagic);
}

// A client that opens a session and never hands over its segment (it died, or
// it is hostile) holds the job only until the reaper's 30 s grace has passed.
// (Waits about 35 s: the reaper runs every 5 s.)
TEST_F(PrivilegeTest, ASessionThatNeverGetsItsSegmentIsClosedByTheReaper) {
  v1::OpenSessionResponse opened = OpenRaw("abandoned");
  auto admin = AdminClient::Connect(daemon_->client_options());
  ASSERT_TRUE(admin.ok());
  bool gone = false;
  for (int i = 0; i < 240 && !gone; ++i) {  // up to 2 minutes on a slow machine
    auto sessions = (*admin)->ListSessions();
    ASSERT_TRUE(sessions.ok());
    gone = sessions->sessions_size() == 0;
    if (!gone) std::this_thread::sleep_for(milliseconds(500));
  }
  ASSERT_TRUE(gone) << "the session without a segment is still open after 2 minutes";
  // The job is free again, and the late segment finds no session.
  EXPECT_FALSE(HandOverNewSegment(opened).ok());
  v1::OpenSessionResponse again = OpenRaw("abandoned");
  EXPECT_TRUE(HandOverNewSegment(again).ok());
}

}  // namespace
}  // namespace fuyou::testing
