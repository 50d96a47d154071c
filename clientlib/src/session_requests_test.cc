// Session: request ids. Every stream request carries its own id, every answer
// is routed by the id it carries (an Error too, naming no chunk or step), and
// an answer the protocol does not allow (an id never sent, no id, an answer of
// another kind) makes the session unusable with a clear INTERNAL error.
#include <gtest/gtest.h>

#include <set>

#include "session_test_fixture.h"

namespace fuyou::session_test {
namespace {

TEST_F(SessionTest, EveryRequestCarriesItsOwnId) {
  absl::StatusOr<std::unique_ptr<Session>> session = Open(/*slots=*/2);
  ASSERT_TRUE(session.ok()) << session.status();
  Session& s = **session;
  std::vector<float> weights(10, 1.0f), grads(10, 1.0f);
  ASSERT_TRUE(s.RegisterChunk(StoredWeightsChunk(1, 10), Bytes(weights)).ok());
  ASSERT_TRUE(s.PushGradients(1, 1, AdamWHyper{}, ConstBytes(grads)).ok());
  absl::StatusOr<uint32_t> slot = s.AcquireSlot(milliseconds(1000));
  ASSERT_TRUE(slot.ok());
  ASSERT_TRUE(s.SendFetchWeights(1, *slot).ok());
  ASSERT_TRUE(s.WaitWeights(1, milliseconds(5000)).ok());
  s.ReleaseSlot(*slot);
  ASSERT_TRUE(s.PullParams(1, Bytes(weights)).ok());
  ASSERT_TRUE(s.EndStep(1).ok());
  ASSERT_TRUE(s.AbortStep(2).ok());
  std::vector<float> out(10);
  ASSERT_TRUE(s.ReadState(1, StateKind::kMaster, 0, out).ok());

  const std::vector<uint64_t> ids = fake_.RequestIds();
  ASSERT_EQ(ids.size(), 6u);  // Attach, GradReady, FetchWeights, EndStep, AbortStep, ReadState
  const std::set<uint64_t> distinct(ids.begin(), ids.end());
  EXPECT_EQ(distinct.size(), ids.size());
  EXPECT_EQ(distinct.count(0), 0u);  // 0 is "no id"
}

// Errors that name neither chunk nor step: before request ids a refused fetch
// was told from a refused GradReady only by those fields.
TEST_F(SessionTest, ErrorsThatNameNoChunkOrStepReachTheirRequests) {
  fake_.bare_errors = true;
  absl::StatusOr<std::unique_ptr<Session>> session = Open(/*slots=*/2);
  ASSERT_TRUE(session.ok()) << session.status();
  Session& s = **session;
  std::vector<float> weights(10, 1.0f);
  ASSERT_TRUE(s.RegisterChunk(StoredWeightsChunk(kRefusedChunk, 10), Bytes(weights)).ok());
  absl::StatusOr<uint32_t> grad_slot = s.AcquireSlot(milliseconds(1000));
  absl::StatusOr<uint32_t> fetch_slot = s.AcquireSlot(milliseconds(1000));
  ASSERT_TRUE(grad_slot.ok() && fetch_slot.ok());
  ASSERT_TRUE(s.SendGradReady(kRefusedChunk, *grad_slot, 1, AdamWHyper{}).ok());
  ASSERT_TRUE(s.SendFetchWeights(kRefusedChunk, *fetch_slot).ok());
  absl::StatusOr<uint32_t> fetched = s.WaitWeights(kRefusedChunk, milliseconds(5000));
  EXPECT_EQ(fetched.status().message(),
            fmt::format("fetch of chunk 999 into slot {} refused by the fake daemon", *fetch_slot));
  absl::StatusOr<uint32_t> ready = s.WaitParams(kRefusedChunk, milliseconds(5000));
  EXPECT_EQ(ready.status().message(), fmt::format("chunk 999 in slot {} refused by the fake daemon", *grad_slot));

  absl::StatusOr<StepResult> ended = s.EndStep(kRefusedStep);
  EXPECT_EQ(ended.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(ended.status().message(), "step 113 is not the next step (fake)");
  std::vector<float> out(10);
  absl::StatusOr<int64_t> read = s.ReadState(kRefusedChunk, StateKind::kMaster, 0, out);
  EXPECT_EQ(read.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(read.status().message(), "ReadState of chunk 999 refused by the fake");
  // Nothing was left over for a later call, and both slots came back.
  for (int i = 0; i < 2; ++i) EXPECT_TRUE(s.AcquireSlot(milliseconds(100)).ok()) << i;
  EXPECT_TRUE(s.EndStep(1).ok());
}

TEST_F(SessionTest, ReadStateGetsItsAnswerByIdAndTheValues) {
  fake_.AddExistingChunk(5, {1.5f, 2.5f, 3.5f, 4.5f}, 9);
  absl::StatusOr<std::unique_ptr<Session>> session = Open();
  ASSERT_TRUE(session.ok()) << session.status();
  std::vector<float> weights(4);
  ASSERT_TRUE((*session)->RegisterChunk(Float32Chunk(5, 4), Bytes(weights)).ok());
  std::vector<float> out(3);
  absl::StatusOr<int64_t> read = (*session)->ReadState(5, StateKind::kMaster, 1, out);
  ASSERT_TRUE(read.ok()) << read.status();
  EXPECT_EQ(*read, 9);
  EXPECT_EQ(out, (std::vector<float>{2.5f, 3.5f, 4.5f}));
}

TEST_F(SessionTest, AnAnswerForAnIdNeverSentMakesTheSessionUnusable) {
  absl::StatusOr<std::unique_ptr<Session>> session = Open();
  ASSERT_TRUE(session.ok()) << session.status();
  Session& s = **session;
  std::vector<float> weights(10), grads(10);
  ASSERT_TRUE(s.RegisterChunk(Float32Chunk(1, 10), Bytes(weights)).ok());
  fake_.answer_id_offset = 1000;
  ASSERT_TRUE(s.PushGradients(1, 1, AdamWHyper{}, ConstBytes(grads)).ok());
  absl::Status pulled = s.PullParams(1, Bytes(weights));
  EXPECT_EQ(pulled.code(), absl::StatusCode::kInternal) << pulled;
  EXPECT_TRUE(Contains(pulled, "protocol error on the stream of job 'test-job'")) << pulled;
  EXPECT_TRUE(Contains(pulled, "ParamsReady for request 1002, which this client has not sent")) << pulled;
  EXPECT_EQ(weights, std::vector<float>(10, 0.0f));  // nothing was taken from the slot
  // Every later call gets the same error, without a wait.
  EXPECT_EQ(s.EndStep(1).status(), pulled);
  EXPECT_EQ(s.AcquireSlot(milliseconds(5000)).status(), pulled);
  EXPECT_EQ(s.PushGradients(1, 1, AdamWHyper{}, ConstBytes(grads)), pulled);
  EXPECT_TRUE(s.Close().ok());  // the daemon is still told to close the session
  EXPECT_EQ(fake_.close_calls, 1);
}

TEST_F(SessionTest, AnAnswerOfAnotherKindMakesTheSessionUnusable) {
  absl::StatusOr<std::unique_ptr<Session>> session = Open();
  ASSERT_TRUE(session.ok()) << session.status();
  Session& s = **session;
  std::vector<float> weights(10), grads(10);
  ASSERT_TRUE(s.RegisterChunk(Float32Chunk(kWrongKindChunk, 10), Bytes(weights)).ok());
  ASSERT_TRUE(s.PushGradients(kWrongKindChunk, 1, AdamWHyper{}, ConstBytes(grads)).ok());
  absl::Status pulled = s.PullParams(kWrongKindChunk, Bytes(weights));
  EXPECT_EQ(pulled.code(), absl::StatusCode::kInternal) << pulled;
  EXPECT_TRUE(Contains(pulled, "(a GradReady) with StepCommitted")) << pulled;
  EXPECT_EQ(s.committed_step(), 0);  // the stray StepCommitted moved nothing
  EXPECT_EQ(s.EndStep(1).status(), pulled);
}

TEST_F(SessionTest, ADaemonThatEchoesNoIdsIsRefusedAtAttach) {
  fake_.echo_request_ids = false;
  absl::StatusOr<std::unique_ptr<Session>> session = Open();
  EXPECT_EQ(session.status().code(), absl::StatusCode::kInternal);
  EXPECT_TRUE(Contains(session.status(), "Attached without a request id")) << session.status();
  EXPECT_TRUE(Contains(session.status(), "upgrade fuyoud")) << session.status();
  EXPECT_EQ(fake_.close_calls, 1);  // the daemon is told to free the session
}

// A call that gave up on its answer: the answer, when it comes, is dropped,
// not taken for an answer to an unknown id.
TEST_F(SessionTest, ALateAnswerToAnAbandonedRequestIsDropped) {
  ClientOptions client = Client();
  client.rpc_timeout = milliseconds(2000);
  absl::StatusOr<std::unique_ptr<Session>> session =
      Session::Open({.job = "test-job", .num_slots = 2, .slot_bytes = 4000}, client);
  ASSERT_TRUE(session.ok()) << session.status();
  Session& s = **session;
  absl::StatusOr<StepResult> late = s.EndStep(kLateStep);  // the fake holds its answer
  EXPECT_EQ(late.status().code(), absl::StatusCode::kDeadlineExceeded);
  EXPECT_TRUE(Contains(late.status(), "no answer to EndStep of step 114")) << late.status();
  fake_.ReleaseLateStep();
  // The stream answers in order: the late StepCommitted arrives before this one's.
  absl::StatusOr<StepResult> next = s.EndStep(kLateStep + 1);
  ASSERT_TRUE(next.ok()) << next.status();
  EXPECT_EQ(next->step, kLateStep + 1);
  EXPECT_EQ(s.committed_step(), kLateStep + 1);
  EXPECT_TRUE(s.AbortStep(kLateStep + 2).ok());
}

}  // namespace
}  // namespace fuyou::session_test
