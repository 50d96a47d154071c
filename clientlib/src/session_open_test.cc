// Session: opening (the segment, its handover and header), a whole step,
// closing, the destructor, and a daemon that goes away.
#include <gtest/gtest.h>

#include "session_test_fixture.h"

namespace fuyou::session_test {
namespace {

TEST(SessionOpenTest, NothingListeningIsUnavailableWithinTheConnectTimeout) {
  const TempDir dir("fuyou-session-test");
  const std::string path = dir.path().string() + "/fuyoud.sock";
  ClientOptions client;
  client.address = "unix:" + path;
  client.connect_timeout = milliseconds(1000);
  const auto start = Clock::now();
  absl::StatusOr<std::unique_ptr<Session>> session =
      Session::Open({.job = "j", .num_slots = 1, .slot_bytes = 4096}, client);
  EXPECT_LT(Clock::now() - start, std::chrono::seconds(10));
  EXPECT_EQ(session.status().code(), absl::StatusCode::kUnavailable);
  EXPECT_TRUE(Contains(session.status(), path)) << session.status();
  EXPECT_TRUE(Contains(session.status(), "is the daemon running?")) << session.status();
}

TEST(SessionOpenTest, BadOptionsAreRefusedLocally) {
  ClientOptions client;
  client.address = "unix:/nonexistent/fuyoud.sock";
  EXPECT_EQ(Session::Open({.job = "", .slot_bytes = 4096}, client).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(Session::Open({.job = "j", .num_slots = 65, .slot_bytes = 4096}, client).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(Session::Open({.job = "j", .slot_bytes = 0}, client).status().code(),
            absl::StatusCode::kInvalidArgument);
}

TEST(DefaultAddressTest, FollowsFuyouSocket) {
  ::setenv("FUYOU_SOCKET", "/tmp/x/fuyoud.sock", 1);
  EXPECT_EQ(DefaultAddress(), "unix:/tmp/x/fuyoud.sock");
  ::unsetenv("FUYOU_SOCKET");
}

TEST_F(SessionTest, RegisterPushPullEndStepClose) {
  absl::StatusOr<std::unique_ptr<Session>> session = Open(2, 4000);
  ASSERT_TRUE(session.ok()) << session.status();
  Session& s = **session;
  EXPECT_EQ(s.session_id(), "fake-1");
  EXPECT_EQ(s.num_slots(), 2u);
  EXPECT_EQ(s.slot_bytes(), 4096u);  // rounded up by the daemon
  EXPECT_EQ(s.committed_step(), 0);

  std::vector<float> weights(1000);
  for (size_t i = 0; i < weights.size(); ++i) weights[i] = static_cast<float>(i) * 0.5f;
  absl::StatusOr<RegisterResult> registered = s.RegisterChunk(Float32Chunk(1, 1000), Bytes(weights));
  ASSERT_TRUE(registered.ok()) << registered.status();
  EXPECT_FALSE(registered->resumed);
  EXPECT_EQ(fake_.StoredWeights(1), weights);  // initial weights went through the slot

  std::vector<float> grads(1000);
  for (size_t i = 0; i < grads.size(); ++i) grads[i] = static_cast<float>(i);
  ASSERT_TRUE(s.PushGradients(1, 1, AdamWHyper{}, ConstBytes(grads)).ok());
  ASSERT_TRUE(s.PullParams(1, Bytes(weights)).ok());
  for (size_t i = 0; i < weights.size(); ++i) ASSERT_EQ(weights[i], grads[i] * 2 + 1) << i;

  absl::StatusOr<StepResult> committed = s.EndStep(1);
  ASSERT_TRUE(committed.ok()) << committed.status();
  EXPECT_EQ(committed->step, 1);
  EXPECT_EQ(committed->chunks_updated, 1u);
  EXPECT_EQ(s.committed_step(), 1);
  EXPECT_TRUE(s.AbortStep(2).ok());

  EXPECT_TRUE(s.Close().ok());
  EXPECT_EQ(fake_.close_calls, 1);
  EXPECT_TRUE(s.Close().ok());  // idempotent
  EXPECT_EQ(fake_.close_calls, 1);
  absl::Status after = s.PushGradients(1, 2, AdamWHyper{}, ConstBytes(grads));
  EXPECT_EQ(after.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_TRUE(Contains(after, "closed")) << after;
}

TEST_F(SessionTest, TheSegmentIsASealedMemfdHandedOverOnTheSegmentSocket) {
  std::set<std::string> shm_before;
  for (const auto& entry : std::filesystem::directory_iterator("/dev/shm")) shm_before.insert(entry.path().string());
  absl::StatusOr<std::unique_ptr<Session>> session = Open();
  ASSERT_TRUE(session.ok()) << session.status();
  EXPECT_EQ(fake_.segments_received, 1);
  const int seals = fake_.last_segment_seals;
  EXPECT_EQ(seals & (F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL), F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL);
  // Nothing is named in /dev/shm, and the client keeps no fd of its segment.
  for (const auto& entry : std::filesystem::directory_iterator("/dev/shm")) {
    EXPECT_EQ(shm_before.count(entry.path().string()), 1u) << entry.path();
  }
  for (const auto& entry : std::filesystem::directory_iterator("/proc/self/fd")) {
    std::error_code ec;
    EXPECT_EQ(std::filesystem::read_symlink(entry.path(), ec).string().find("memfd:fuyou-segment"), std::string::npos);
  }
}

TEST_F(SessionTest, ASegmentTheDaemonRefusesFailsOpenWithItsStatus) {
  fake_.refuse_segment =
      absl::FailedPreconditionError("the segment must be a memfd sealed with F_SEAL_SHRINK|F_SEAL_GROW");
  absl::StatusOr<std::unique_ptr<Session>> session = Open();
  EXPECT_EQ(session.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_TRUE(Contains(session.status(), "handing the segment of job 'test-job' (session fake-1) to fuyoud failed"))
      << session.status();
  EXPECT_TRUE(Contains(session.status(), "F_SEAL_SHRINK|F_SEAL_GROW")) << session.status();
  EXPECT_EQ(fake_.close_calls, 1);  // the daemon is told to free the session
}

TEST_F(SessionTest, ADaemonThatNamesNoSegmentSocketIsRefused) {
  fake_.segment_socket = "";
  absl::StatusOr<std::unique_ptr<Session>> session = Open();
  EXPECT_EQ(session.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_TRUE(Contains(session.status(), "named no segment socket")) << session.status();
}

TEST_F(SessionTest, ExistingChunkIsResumedIntoTheWeights) {
  fake_.AddExistingChunk(5, std::vector<float>(10, 42.0f), 7);
  absl::StatusOr<std::unique_ptr<Session>> session = Open();
  ASSERT_TRUE(session.ok()) << session.status();
  std::vector<float> weights(10, 0.0f);
  absl::StatusOr<RegisterResult> registered = (*session)->RegisterChunk(Float32Chunk(5, 10), Bytes(weights));
  ASSERT_TRUE(registered.ok()) << registered.status();
  EXPECT_TRUE(registered->resumed);
  EXPECT_EQ(registered->update_count, 7);
  EXPECT_EQ(weights, std::vector<float>(10, 42.0f));
  EXPECT_EQ((*session)->RegisterChunk(Float32Chunk(5, 10), Bytes(weights)).status().code(),
            absl::StatusCode::kAlreadyExists);
}

TEST_F(SessionTest, WrongMagicIsDataLoss) {
  fake_.header_fault = FakeOffload::HeaderFault::kBadMagic;
  absl::StatusOr<std::unique_ptr<Session>> session = Open();
  EXPECT_EQ(session.status().code(), absl::StatusCode::kDataLoss);
  EXPECT_TRUE(Contains(session.status(), "magic")) << session.status();
  EXPECT_EQ(fake_.close_calls, 1);  // the daemon is told to free the session
}

TEST_F(SessionTest, HeaderThatDisagreesIsRefused) {
  fake_.header_fault = FakeOffload::HeaderFault::kWrongSlots;
  absl::StatusOr<std::unique_ptr<Session>> session = Open();
  EXPECT_EQ(session.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_TRUE(Contains(session.status(), "header of 3 slots")) << session.status();
  EXPECT_EQ(fake_.close_calls, 1);
}

TEST_F(SessionTest, DestructorClosesTheSession) {
  {
    absl::StatusOr<std::unique_ptr<Session>> session = Open();
    ASSERT_TRUE(session.ok()) << session.status();
  }
  EXPECT_EQ(fake_.close_calls, 1);
}

TEST_F(SessionTest, ServerShutdownMidWaitIsUnavailableNotAHang) {
  absl::StatusOr<std::unique_ptr<Session>> session = Open();
  ASSERT_TRUE(session.ok()) << session.status();
  Session& s = **session;
  std::vector<float> weights(8), grads(8);
  ASSERT_TRUE(s.RegisterChunk(Float32Chunk(kSilentChunk, 8), Bytes(weights)).ok());
  ASSERT_TRUE(s.PushGradients(kSilentChunk, 1, AdamWHyper{}, ConstBytes(grads)).ok());
  while (!fake_.silent_chunk_arrived) std::this_thread::sleep_for(milliseconds(5));

  std::thread killer([&] {
    std::this_thread::sleep_for(milliseconds(200));
    ShutdownServer();
  });
  const auto start = Clock::now();
  absl::Status pulled = s.PullParams(kSilentChunk, Bytes(weights));  // rpc_timeout is 10 s
  EXPECT_LT(Clock::now() - start, std::chrono::seconds(5));
  killer.join();
  EXPECT_EQ(pulled.code(), absl::StatusCode::kUnavailable) << pulled;
  EXPECT_TRUE(Contains(pulled, "connection to fuyoud lost")) << pulled;

  // Every later call fails the same way, quickly.
  EXPECT_EQ(s.EndStep(1).status().code(), absl::StatusCode::kUnavailable);
  EXPECT_EQ(s.AcquireSlot(milliseconds(5000)).status().code(), absl::StatusCode::kUnavailable);
  EXPECT_EQ(s.Close().code(), absl::StatusCode::kUnavailable);
  EXPECT_LT(Clock::now() - start, std::chrono::seconds(5));
}

}  // namespace
}  // namespace fuyou::session_test
