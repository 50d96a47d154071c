// Spilled activations (issue 23, activation offload's SSD tier) over the raw
// protocol against a real fuyoud: SpillActivation then RecallActivation give
// back the same bytes, from <data>/activations; hostile fields are refused
// with a clear error and the session keeps serving; EndStep, AbortStep and
// DropActivations drop them; the per-user limit; a closed session leaves no
// file; the GetStats counters.
#include <gtest/gtest.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <string>
#include <vector>

#include "daemon_process.h"
#include "fmt/format.h"
#include "fuyou/admin_client.h"
#include "raw_session.h"
#include "test_values.h"

namespace fuyou::testing {
namespace {
namespace fs = std::filesystem;

constexpr uint32_t kSlots = 2;
constexpr uint64_t kSlotBytes = 64 * 1024;

v1::ClientMessage Spill(uint64_t key, uint32_t slot, uint64_t bytes) {
  v1::ClientMessage message;
  message.mutable_spill_activation()->set_key(key);
  message.mutable_spill_activation()->set_slot(slot);
  message.mutable_spill_activation()->set_bytes(bytes);
  return message;
}

v1::ClientMessage Recall(uint64_t key, uint32_t slot) {
  v1::ClientMessage message;
  message.mutable_recall_activation()->set_key(key);
  message.mutable_recall_activation()->set_slot(slot);
  return message;
}

v1::ClientMessage Drop() {
  v1::ClientMessage message;
  message.mutable_drop_activations();
  return message;
}

std::string Describe(const v1::DaemonMessage& reply) { return reply.ShortDebugString(); }

void Fill(RawSession& session, uint32_t slot, uint8_t seed) {
  std::span<std::byte> region = session.GradRegion(slot);
  for (size_t i = 0; i < region.size(); ++i) region[i] = static_cast<std::byte>(seed + i * 7);
}

bool Holds(RawSession& session, uint32_t slot, uint8_t seed, size_t bytes) {
  std::span<std::byte> region = session.GradRegion(slot);
  for (size_t i = 0; i < bytes; ++i) {
    if (region[i] != static_cast<std::byte>(seed + i * 7)) return false;
  }
  return true;
}

class ActivationTest : public ::testing::Test {
 protected:
  void StartDaemon(std::vector<std::string> extra = {}, std::vector<std::string> env = {}) {
    extra.insert(extra.end(), {"--dram-budget", "64MiB", "--threads", "2"});
    daemon_ = std::make_unique<DaemonProcess>(dir_.path(), extra, env);
    absl::Status started = daemon_->Start();
    ASSERT_TRUE(started.ok()) << Text(started);
  }

  std::unique_ptr<RawSession> Open(const std::string& job) {
    auto session = RawSession::Open(daemon_->client_options(), job, kSlots, kSlotBytes);
    EXPECT_TRUE(session.ok()) << Text(session.status());
    return session.ok() ? std::move(*session) : nullptr;
  }

  // The activation scratch files under the data dir, and their sizes.
  std::vector<std::pair<fs::path, uintmax_t>> ScratchFiles() {
    std::vector<std::pair<fs::path, uintmax_t>> out;
    for (const auto& entry : fs::recursive_directory_iterator(daemon_->data_dir())) {
      if (entry.is_regular_file() && entry.path().parent_path().filename() == "activations") {
        out.emplace_back(entry.path(), entry.file_size());
      }
    }
    return out;
  }

  v1::GetStatsResponse Stats() {
    auto admin = AdminClient::Connect(daemon_->client_options());
    EXPECT_TRUE(admin.ok());
    auto stats = (*admin)->GetStats();
    EXPECT_TRUE(stats.ok()) << Text(stats.status());
    return stats.ok() ? *stats : v1::GetStatsResponse{};
  }

  TempDir dir_;
  std::unique_ptr<DaemonProcess> daemon_;
};

TEST_F(ActivationTest, SpillThenRecallGivesBackTheSameBytes) {
  StartDaemon();
  auto session = Open("act");
  ASSERT_NE(session, nullptr);
  Fill(*session, 0, 1);
  v1::DaemonMessage reply = session->Exchange(Spill(10, 0, 5000));
  ASSERT_TRUE(reply.has_activation_spilled()) << Describe(reply);
  EXPECT_EQ(reply.activation_spilled().bytes(), 5000u);
  EXPECT_EQ(reply.activation_spilled().session_scratch_bytes(), 8192u);  // whole blocks
  Fill(*session, 0, 2);
  reply = session->Exchange(Spill(11, 0, kSlotBytes));
  ASSERT_TRUE(reply.has_activation_spilled()) << Describe(reply);
  auto files = ScratchFiles();
  ASSERT_EQ(files.size(), 1u);
  EXPECT_GE(files[0].second, 8192u + kSlotBytes);

  std::fill(session->GradRegion(1).begin(), session->GradRegion(1).end(), std::byte{0});
  reply = session->Exchange(Recall(10, 1));
  ASSERT_TRUE(reply.has_activation_recalled()) << Describe(reply);
  EXPECT_EQ(reply.activation_recalled().bytes(), 5000u);
  EXPECT_TRUE(Holds(*session, 1, 1, 5000));
  reply = session->Exchange(Recall(11, 0));
  ASSERT_TRUE(reply.has_activation_recalled()) << Describe(reply);
  EXPECT_TRUE(Holds(*session, 0, 2, kSlotBytes));

  v1::GetStatsResponse stats = Stats();
  EXPECT_EQ(stats.activation_spilled_bytes_total(), 5000u + kSlotBytes);
  EXPECT_EQ(stats.activation_recalled_bytes_total(), 5000u + kSlotBytes);
  ASSERT_TRUE(session->Close().ok());
  EXPECT_TRUE(ScratchFiles().empty()) << "a closed session leaves no scratch file";
}

v1::ClientMessage WithId(v1::ClientMessage message, uint64_t id) {
  message.set_request_id(id);
  return message;
}

TEST_F(ActivationTest, ASpillInFlightHoldsUpNoOtherMessageOfTheSession) {
  // Every write to the activation scratch completes only once `gate` exists:
  // while it does not, a spill is in flight however long the machine takes.
  const fs::path gate = dir_.path() / "release-the-spill";
  StartDaemon({}, {fmt::format("FUYOU_TEST_FAULTS=write:HOLD:until={}:dir=activations", gate.string())});
  auto session = Open("inflight");
  ASSERT_NE(session, nullptr);
  v1::RegisterChunksResponse registered;
  ASSERT_TRUE(session->Register({ChunkSpecOf(1, 16, 1)}, &registered).ok());
  Fill(*session, 0, 5);
  ASSERT_TRUE(session->Send(WithId(Spill(1, 0, kSlotBytes), 1)));
  // A gradient chunk and cheap requests sent after it are answered while it is
  // in flight: the spill's write does not run on the session's handler.
  v1::ClientMessage grad;
  v1::AdamWHyper hyper;
  hyper.set_lr(1e-3f);
  hyper.set_beta1(0.9f);
  hyper.set_beta2(0.999f);
  hyper.set_eps(1e-8f);
  *grad.mutable_grad_ready() = GradReadyOf(1, 1, 1, hyper);
  std::fill(session->GradRegion(1).begin(), session->GradRegion(1).begin() + 64, std::byte{0});
  ASSERT_TRUE(session->Send(WithId(grad, 2)));
  std::map<uint64_t, v1::DaemonMessage> replies;
  std::vector<uint64_t> order;
  auto read = [&] {
    v1::DaemonMessage reply = session->Read();
    order.push_back(reply.request_id());
    replies[reply.request_id()] = reply;
  };
  read();
  ASSERT_TRUE(session->Send(WithId(Recall(99, 1), 3)));
  read();
  // The spill is answered once its write completes (every reply is read
  // whatever the order, so that a failure ends the stream cleanly).
  { std::ofstream(gate.string()) << "go"; }
  read();
  EXPECT_EQ(order, (std::vector<uint64_t>{2, 3, 1}))
      << "the gradient chunk (2) or the cheap request (3) waited for the spill (1)";
  EXPECT_TRUE(replies[2].has_params_ready()) << Describe(replies[2]);
  EXPECT_EQ(replies[3].error().code(), 5) << Describe(replies[3]);
  // The spill's bytes are those of the slot when it was sent (the slot is
  // reused for the recall below).
  ASSERT_TRUE(replies[1].has_activation_spilled()) << Describe(replies[1]);
  EXPECT_EQ(replies[1].activation_spilled().bytes(), kSlotBytes);
  v1::DaemonMessage reply;
  std::fill(session->GradRegion(0).begin(), session->GradRegion(0).end(), std::byte{0});
  reply = session->Exchange(WithId(Recall(1, 0), 4));
  ASSERT_TRUE(reply.has_activation_recalled()) << Describe(reply);
  EXPECT_EQ(reply.request_id(), 4u);
  EXPECT_TRUE(Holds(*session, 0, 5, kSlotBytes));
  ASSERT_TRUE(session->EndStep(1).has_step_committed());
  ASSERT_TRUE(session->Close().ok());
  EXPECT_TRUE(ScratchFiles().empty());
}

TEST_F(ActivationTest, AClientWithoutRequestIdsGetsItsAnswersInOrder) {
  // Request id 0 (a client older than ids) cannot match answers that come out
  // of order: its spill is answered before the message after it.
  const fs::path gate = dir_.path() / "release";
  StartDaemon({}, {fmt::format("FUYOU_TEST_FAULTS=write:HOLD:until={}:dir=activations", gate.string())});
  auto session = Open("no-ids");
  ASSERT_NE(session, nullptr);
  ASSERT_TRUE(session->Send(Spill(1, 0, 4096)));
  ASSERT_TRUE(session->Send(Recall(99, 1)));
  { std::ofstream(gate.string()) << "go"; }  // only now can the spill complete
  const v1::DaemonMessage first = session->Read();
  const v1::DaemonMessage second = session->Read();
  EXPECT_TRUE(first.has_activation_spilled()) << Describe(first);
  EXPECT_EQ(second.error().code(), 5) << Describe(second);
  ASSERT_TRUE(session->Close().ok());
}

TEST_F(ActivationTest, TheStepsEndAnswersTheSpillsInFlightFirstAndLeavesNothing) {
  // Spills in flight when the step ends are answered before it, and their
  // scratch is gone after it. (A session's end waits for them the same way:
  // activation_spill_test's DropWaitsForTheTransfersInFlight.)
  const fs::path gate = dir_.path() / "release";
  StartDaemon({}, {fmt::format("FUYOU_TEST_FAULTS=write:HOLD:until={}:dir=activations", gate.string())});
  auto session = Open("ending");
  ASSERT_NE(session, nullptr);
  ASSERT_TRUE(session->Send(WithId(Spill(1, 0, 4096), 1)));
  ASSERT_TRUE(session->Send(WithId(Spill(2, 1, 4096), 2)));
  v1::ClientMessage end;
  end.mutable_end_step()->set_step(1);
  ASSERT_TRUE(session->Send(WithId(end, 3)));
  { std::ofstream(gate.string()) << "go"; }  // EndStep waits for the writes, which wait for this
  std::vector<uint64_t> order;
  for (int i = 0; i < 3; ++i) {
    v1::DaemonMessage reply = session->Read();
    order.push_back(reply.request_id());
    if (reply.request_id() == 3) {
      EXPECT_TRUE(reply.has_step_committed()) << Describe(reply);
    } else {
      EXPECT_TRUE(reply.has_activation_spilled()) << Describe(reply);
    }
  }
  EXPECT_EQ(order.back(), 3u) << "EndStep was answered before a spill it dropped";
  for (const auto& [path, size] : ScratchFiles()) EXPECT_EQ(size, 0u) << path;
  EXPECT_EQ(session->Exchange(Recall(1, 0)).error().code(), 5);
  ASSERT_TRUE(session->Close().ok());
  EXPECT_TRUE(ScratchFiles().empty());
}

TEST_F(ActivationTest, HostileFieldsAreRefusedClearlyAndTheSessionGoesOn) {
  StartDaemon();
  auto session = Open("hostile");
  ASSERT_NE(session, nullptr);
  struct Case {
    v1::ClientMessage message;
    int code;
    std::string says;
  };
  const std::vector<Case> cases = {
      {Spill(1, kSlots, 100), 3, "slot 2 does not exist"},
      {Spill(1, 0, 0), 3, "not in 1.."},
      {Spill(1, 0, kSlotBytes + 1), 3, "not in 1.."},
      {Spill(1, 0, UINT64_MAX), 3, "not in 1.."},
      {Recall(1, UINT32_MAX), 3, "does not exist"},
      {Recall(99, 0), 5, "activation 99 is not spilled"},
  };
  for (const Case& c : cases) {
    v1::DaemonMessage reply = session->Exchange(c.message);
    ASSERT_TRUE(reply.has_error()) << c.message.ShortDebugString() << " -> " << Describe(reply);
    EXPECT_EQ(reply.error().code(), c.code) << Describe(reply);
    EXPECT_NE(reply.error().message().find(c.says), std::string::npos) << Describe(reply);
  }
  ASSERT_TRUE(session->Exchange(Spill(1, 0, 100)).has_activation_spilled());
  v1::DaemonMessage again = session->Exchange(Spill(1, 0, 100));
  ASSERT_TRUE(again.has_error());
  EXPECT_EQ(again.error().code(), 3);
  EXPECT_NE(again.error().message().find("already spilled"), std::string::npos) << Describe(again);
  // Another session (any user's) cannot name this one's keys.
  auto other = Open("other");
  ASSERT_NE(other, nullptr);
  v1::DaemonMessage theirs = other->Exchange(Recall(1, 0));
  ASSERT_TRUE(theirs.has_error()) << Describe(theirs);
  EXPECT_EQ(theirs.error().code(), 5);
  EXPECT_TRUE(session->Exchange(Recall(1, 0)).has_activation_recalled());
}

TEST_F(ActivationTest, TheStepsEndAndDropForgetThem) {
  StartDaemon();
  auto session = Open("ends");
  ASSERT_NE(session, nullptr);
  ASSERT_TRUE(session->Exchange(Spill(1, 0, 4096)).has_activation_spilled());
  ASSERT_TRUE(session->EndStep(1).has_step_committed());
  EXPECT_EQ(session->Exchange(Recall(1, 0)).error().code(), 5);
  ASSERT_TRUE(session->Exchange(Spill(2, 0, 4096)).has_activation_spilled());
  ASSERT_TRUE(session->AbortStep(2, v1::ABORT_REASON_UNSPECIFIED).has_step_aborted());
  EXPECT_EQ(session->Exchange(Recall(2, 0)).error().code(), 5);
  ASSERT_TRUE(session->Exchange(Spill(3, 0, 4096)).has_activation_spilled());
  ASSERT_TRUE(session->Exchange(Spill(4, 0, 4096)).has_activation_spilled());
  ASSERT_TRUE(session->Exchange(Recall(3, 0)).has_activation_recalled());
  v1::DaemonMessage dropped = session->Exchange(Drop());
  ASSERT_TRUE(dropped.has_activations_dropped()) << Describe(dropped);
  EXPECT_EQ(dropped.activations_dropped().activations(), 1u);
  EXPECT_EQ(dropped.activations_dropped().scratch_bytes(), 8192u);
  EXPECT_EQ(session->Exchange(Recall(4, 0)).error().code(), 5);
  for (const auto& [path, size] : ScratchFiles()) EXPECT_EQ(size, 0u) << path;
}

TEST_F(ActivationTest, ThePerUserLimitRefusesASpillAndTakesNothing) {
  StartDaemon({"--max-activation-bytes-per-user", "12KiB"});
  auto a = Open("limit-a");
  auto b = Open("limit-b");
  ASSERT_NE(a, nullptr);
  ASSERT_NE(b, nullptr);
  ASSERT_TRUE(a->Exchange(Spill(1, 0, 8192)).has_activation_spilled());
  v1::DaemonMessage refused = b->Exchange(Spill(1, 0, 4097));  // the same user's other session
  ASSERT_TRUE(refused.has_error()) << Describe(refused);
  EXPECT_EQ(refused.error().code(), 8);  // RESOURCE_EXHAUSTED
  EXPECT_NE(refused.error().message().find("max_activation_bytes_per_user = 12288"), std::string::npos)
      << Describe(refused);
  ASSERT_TRUE(b->Exchange(Spill(2, 0, 4096)).has_activation_spilled());  // the refusal took nothing
  ASSERT_TRUE(a->Close().ok());  // gives its 8 KiB back
  ASSERT_TRUE(b->Exchange(Spill(3, 0, 8192)).has_activation_spilled());
}

TEST_F(ActivationTest, TheStorageBudgetRefusesASpillClearlyAndTheSessionGoesOn) {
  StartDaemon({"--max-storage-per-user", "12KiB"});
  auto session = Open("storage");
  ASSERT_NE(session, nullptr);
  Fill(*session, 0, 1);
  ASSERT_TRUE(session->Exchange(Spill(1, 0, 8192)).has_activation_spilled());
  v1::DaemonMessage refused = session->Exchange(Spill(2, 0, 4097));  // two more blocks: over
  ASSERT_TRUE(refused.has_error()) << Describe(refused);
  EXPECT_EQ(refused.error().code(), 8);  // RESOURCE_EXHAUSTED
  for (const char* word : {"SpillActivation (session", "activation 2: the activation scratch of uid",
                           "max_storage_bytes_per_user (12288 bytes", "8192 of them scratch",
                           "--max-storage-per-user", "the session goes on"}) {
    EXPECT_NE(refused.error().message().find(word), std::string::npos) << word << " in " << Describe(refused);
  }
  // The session goes on: a spill that fits, its bytes back, and the drop gives it all back.
  Fill(*session, 1, 2);
  ASSERT_TRUE(session->Exchange(Spill(3, 1, 4096)).has_activation_spilled());
  ASSERT_TRUE(session->Exchange(Recall(1, 1)).has_activation_recalled());
  EXPECT_TRUE(Holds(*session, 1, 1, 8192));
  ASSERT_TRUE(session->Exchange(Drop()).has_activations_dropped());
  ASSERT_TRUE(session->Exchange(Spill(4, 0, 12288)).has_activation_spilled());
  ASSERT_TRUE(session->Close().ok());
}

TEST_F(ActivationTest, AnotherUserReachesNoneOfASessionsActivations) {
  if (::geteuid() != 0) GTEST_SKIP() << "skipped: needs root to act as a second user";
  constexpr uid_t kOther = 65533;
  // The other user reaches the socket (and writes its output) under the test's directory.
  ::chmod(dir_.path().c_str(), 01777);
  StartDaemon({"--socket-mode", "0666", "--drain-seconds", "0"});
  auto mine = Open("shared-name");
  ASSERT_NE(mine, nullptr);
  Fill(*mine, 0, 3);
  ASSERT_TRUE(mine->Exchange(Spill(1, 0, 8192)).has_activation_spilled());
  const auto files = ScratchFiles();
  ASSERT_EQ(files.size(), 1u);

  std::string output;
  ASSERT_EQ(RunAs(kOther, ACTIVATION_PEER_CLIENT_PATH,
                  {daemon_->socket_path().string(), mine->opened().session_id(), "shared-name", "1",
                   files[0].first.string()},
                  dir_.path() / "peer.out", &output),
            0)
      << output;
  const std::string unknown = fmt::format("no open session has id '{}'", mine->opened().session_id());
  // Their session id is answered like an unknown one, on a stream and to CloseSession.
  EXPECT_NE(output.find("attach code=5 replies=0 message=" + unknown), std::string::npos) << output;
  EXPECT_NE(output.find("close code=5 message=" + unknown), std::string::npos) << output;
  // A session of their own (on a job of the same name) has none of them.
  EXPECT_NE(output.find("own-recall code=5\n"), std::string::npos) << output;
  EXPECT_NE(output.find("own-drop activations=0 scratch_bytes=0\n"), std::string::npos) << output;
  EXPECT_NE(output.find("read opened=0\n"), std::string::npos) << output;  // the scratch is the daemon's

  // Nothing of mine was recalled, dropped or closed.
  std::fill(mine->GradRegion(1).begin(), mine->GradRegion(1).end(), std::byte{0});
  v1::DaemonMessage recalled = mine->Exchange(Recall(1, 1));
  ASSERT_TRUE(recalled.has_activation_recalled()) << Describe(recalled);
  EXPECT_TRUE(Holds(*mine, 1, 3, 8192));
  ASSERT_TRUE(mine->Close().ok());
}

}  // namespace
}  // namespace fuyou::testing
