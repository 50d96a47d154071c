// Request ids (issue 21) against a real fuyoud over raw gRPC (raw_session.h):
// every reply on the stream, the answer or an Error, carries the request_id of
// the message it answers, exactly as sent. The daemon never checks ids: 0 (a
// client older than ids), the largest uint64 and an id used twice are echoed
// alike and change nothing else. Then a clientlib session, whose Attach and
// every later call need their ids echoed, trains a step.
#include <gtest/gtest.h>

#include <cstdint>
#include <limits>
#include <string>
#include <vector>

#include "daemon_process.h"
#include "fuyou/client.h"
#include "raw_session.h"
#include "test_values.h"

namespace fuyou::testing {
namespace {

constexpr uint64_t kMaxId = std::numeric_limits<uint64_t>::max();

v1::AdamWHyper Hyper() {
  v1::AdamWHyper hyper;
  hyper.set_lr(1e-3f);
  hyper.set_beta1(0.9f);
  hyper.set_beta2(0.999f);
  hyper.set_eps(1e-8f);
  return hyper;
}

class RequestIdTest : public ::testing::Test {
 protected:
  void SetUp() override {
    daemon_ = std::make_unique<DaemonProcess>(dir_.path(), std::vector<std::string>{"--dram-budget", "64MiB"});
    absl::Status started = daemon_->Start();
    ASSERT_TRUE(started.ok()) << Text(started);
  }

  TempDir dir_;
  std::unique_ptr<DaemonProcess> daemon_;
};

v1::ClientMessage WithId(v1::ClientMessage message, uint64_t id) {
  message.set_request_id(id);
  return message;
}

TEST_F(RequestIdTest, EveryReplyCarriesTheIdOfTheMessageItAnswers) {
  auto session = RawSession::Open(daemon_->client_options(), "ids-job", 2, 4096);
  ASSERT_TRUE(session.ok()) << Text(session.status());
  RawSession& s = **session;
  v1::RegisterChunksResponse registered;
  v1::ChunkSpec spec = ChunkSpecOf(1, 16, 0);
  spec.set_store_weights(true);
  ASSERT_TRUE(s.Register({spec}, &registered).ok());

  // An update: ParamsReady with the GradReady's id.
  v1::ClientMessage grad;
  *grad.mutable_grad_ready() = GradReadyOf(1, 1, 0, Hyper());
  v1::DaemonMessage reply = s.Exchange(WithId(grad, 41));
  ASSERT_TRUE(reply.has_params_ready()) << reply.ShortDebugString();
  EXPECT_EQ(reply.request_id(), 41u);

  // Refusals: the Error names its request by id, whatever fields it has set.
  v1::ClientMessage unknown_chunk;
  *unknown_chunk.mutable_grad_ready() = GradReadyOf(1, 9, 1, Hyper());
  reply = s.Exchange(WithId(unknown_chunk, 42));
  ASSERT_TRUE(reply.has_error()) << reply.ShortDebugString();
  EXPECT_EQ(reply.request_id(), 42u);
  v1::ClientMessage fetch;
  fetch.mutable_fetch_weights()->set_chunk_id(1);
  fetch.mutable_fetch_weights()->set_slot(7);  // out of range
  reply = s.Exchange(WithId(fetch, kMaxId));
  ASSERT_TRUE(reply.has_error()) << reply.ShortDebugString();
  EXPECT_EQ(reply.error().code(), static_cast<int>(absl::StatusCode::kInvalidArgument));
  EXPECT_EQ(reply.request_id(), kMaxId);
  v1::ClientMessage again_attach;
  again_attach.mutable_attach()->set_session_id(s.opened().session_id());
  reply = s.Exchange(WithId(again_attach, 43));
  ASSERT_TRUE(reply.has_error()) << reply.ShortDebugString();
  EXPECT_EQ(reply.request_id(), 43u);
  reply = s.Exchange(WithId(v1::ClientMessage{}, 44));  // no kind set
  ASSERT_TRUE(reply.has_error()) << reply.ShortDebugString();
  EXPECT_EQ(reply.request_id(), 44u);

  // A good fetch, an id used twice (not checked), and EndStep without an id.
  fetch.mutable_fetch_weights()->set_slot(1);
  for (int i = 0; i < 2; ++i) {
    reply = s.Exchange(WithId(fetch, 45));
    ASSERT_TRUE(reply.has_weights_fetched()) << reply.ShortDebugString();
    EXPECT_EQ(reply.request_id(), 45u);
  }
  v1::ClientMessage end;
  end.mutable_end_step()->set_step(1);
  reply = s.Exchange(end);
  ASSERT_TRUE(reply.has_step_committed()) << reply.ShortDebugString();
  EXPECT_EQ(reply.step_committed().step(), 1);
  EXPECT_EQ(reply.request_id(), 0u);

  // Export: ReadState with its id; AbortStep of the next step with another.
  v1::ClientMessage read;
  read.mutable_read_state()->set_chunk_id(1);
  read.mutable_read_state()->set_which(v1::STATE_MASTER);
  read.mutable_read_state()->set_slot(0);
  read.mutable_read_state()->set_num_elements(16);
  reply = s.Exchange(WithId(read, 46));
  ASSERT_TRUE(reply.has_state_read()) << reply.ShortDebugString();
  EXPECT_EQ(reply.request_id(), 46u);
  v1::ClientMessage abort;
  abort.mutable_abort_step()->set_step(2);
  reply = s.Exchange(WithId(abort, 47));
  ASSERT_TRUE(reply.has_step_aborted()) << reply.ShortDebugString();
  EXPECT_EQ(reply.request_id(), 47u);
  EXPECT_TRUE(s.Close().ok());
}

TEST_F(RequestIdTest, AClientlibSessionTrainsAgainstTheDaemon) {
  auto session = Session::Open({.job = "clientlib-ids", .num_slots = 2, .slot_bytes = 4096},
                               daemon_->client_options());
  ASSERT_TRUE(session.ok()) << Text(session.status());  // Attach needs its id echoed
  std::vector<float> weights(64, 0.5f), grads(64, 1.0f);
  ASSERT_TRUE((*session)->RegisterChunk({.chunk_id = 1, .num_elements = 64, .store_weights = true},
                                        std::as_writable_bytes(std::span(weights)))
                  .ok());
  AdamWHyper hyper;
  hyper.weight_decay = 0;
  ASSERT_TRUE((*session)->PushGradients(1, 1, hyper, std::as_bytes(std::span(grads))).ok());
  absl::StatusOr<uint32_t> slot = (*session)->AcquireSlot(std::chrono::milliseconds(5000));
  ASSERT_TRUE(slot.ok()) << Text(slot.status());
  ASSERT_TRUE((*session)->SendFetchWeights(1, *slot).ok());
  absl::StatusOr<uint32_t> fetched = (*session)->WaitWeights(1, std::chrono::milliseconds(20000));
  ASSERT_TRUE(fetched.ok()) << Text(fetched.status());
  (*session)->ReleaseSlot(*fetched);
  ASSERT_TRUE((*session)->PullParams(1, std::as_writable_bytes(std::span(weights))).ok());
  // A refusal reaches its own call: a step that is not the next one.
  absl::StatusOr<StepResult> wrong = (*session)->EndStep(5);
  EXPECT_EQ(wrong.status().code(), absl::StatusCode::kFailedPrecondition) << Text(wrong.status());
  absl::StatusOr<StepResult> committed = (*session)->EndStep(1);
  ASSERT_TRUE(committed.ok()) << Text(committed.status());
  EXPECT_EQ(committed->step, 1);
  std::vector<float> master(64);
  absl::StatusOr<int64_t> read = (*session)->ReadState(1, StateKind::kMaster, 0, master);
  ASSERT_TRUE(read.ok()) << Text(read.status());
  EXPECT_EQ(*read, 1);
  EXPECT_NEAR(master[0], 0.5f - hyper.lr, 1e-6);  // Adam's first step: lr against the gradient's sign
  EXPECT_TRUE((*session)->Close().ok());
}

}  // namespace
}  // namespace fuyou::testing
