// Session: registration, GradReady and ParamsReady, EndStep and AbortStep,
// local refusals, slots, and many threads at once.
#include <gtest/gtest.h>

#include "session_test_fixture.h"

namespace fuyou::session_test {
namespace {

TEST_F(SessionTest, ChunkErrorComesBackFromPullParamsAndFreesTheSlot) {
  absl::StatusOr<std::unique_ptr<Session>> session = Open(/*slots=*/1);
  ASSERT_TRUE(session.ok()) << session.status();
  Session& s = **session;
  std::vector<float> weights(100, 1.0f), grads(100, 1.0f);
  ASSERT_TRUE(s.RegisterChunk(Float32Chunk(kRefusedChunk, 100), Bytes(weights)).ok());
  ASSERT_TRUE(s.RegisterChunk(Float32Chunk(1, 100), Bytes(weights)).ok());

  ASSERT_TRUE(s.PushGradients(kRefusedChunk, 1, AdamWHyper{}, ConstBytes(grads)).ok());
  absl::Status pulled = s.PullParams(kRefusedChunk, Bytes(weights));
  EXPECT_EQ(pulled.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(pulled.message(), "chunk 999 in slot 0 refused by the fake daemon");
  EXPECT_EQ(weights, std::vector<float>(100, 1.0f));  // untouched

  // The only slot was freed: another chunk goes through, and the session is usable.
  ASSERT_TRUE(s.PushGradients(1, 1, AdamWHyper{}, ConstBytes(grads)).ok());
  ASSERT_TRUE(s.PullParams(1, Bytes(weights)).ok());
  EXPECT_EQ(weights, std::vector<float>(100, 3.0f));
  EXPECT_TRUE(s.EndStep(1).ok());
}

TEST_F(SessionTest, DaemonValidatesWhatSendGradReadySends) {
  absl::StatusOr<std::unique_ptr<Session>> session = Open();
  ASSERT_TRUE(session.ok()) << session.status();
  Session& s = **session;
  absl::StatusOr<uint32_t> slot = s.AcquireSlot(milliseconds(1000));
  ASSERT_TRUE(slot.ok()) << slot.status();
  ASSERT_TRUE(s.SendGradReady(/*chunk_id=*/42, *slot, 1, AdamWHyper{}).ok());
  absl::StatusOr<uint32_t> ready = s.WaitParams(42, milliseconds(5000));
  EXPECT_EQ(ready.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(Contains(ready.status(), "chunk 42 is not registered")) << ready.status();
}

TEST_F(SessionTest, ZeroCopyApi) {
  absl::StatusOr<std::unique_ptr<Session>> session = Open();
  ASSERT_TRUE(session.ok()) << session.status();
  Session& s = **session;
  std::vector<float> weights(16, 0.0f);
  ASSERT_TRUE(s.RegisterChunk(Float32Chunk(3, 16), Bytes(weights)).ok());
  absl::StatusOr<uint32_t> slot = s.AcquireSlot(milliseconds(1000));
  ASSERT_TRUE(slot.ok()) << slot.status();
  ASSERT_EQ(s.GradRegion(*slot).size(), s.slot_bytes());
  EXPECT_TRUE(s.GradRegion(s.num_slots()).empty());
  auto* grad = reinterpret_cast<float*>(s.GradRegion(*slot).data());
  for (int i = 0; i < 16; ++i) grad[i] = static_cast<float>(i);
  ASSERT_TRUE(s.SendGradReady(3, *slot, 1, AdamWHyper{}).ok());
  // Sending the chunk again before taking its parameters is refused.
  EXPECT_EQ(s.SendGradReady(3, *slot, 1, AdamWHyper{}).code(), absl::StatusCode::kFailedPrecondition);
  absl::StatusOr<uint32_t> ready = s.WaitParams(3, milliseconds(5000));
  ASSERT_TRUE(ready.ok()) << ready.status();
  EXPECT_EQ(*ready, *slot);
  const auto* param = reinterpret_cast<const float*>(s.ParamRegion(*ready).data());
  for (int i = 0; i < 16; ++i) EXPECT_EQ(param[i], static_cast<float>(i) * 2 + 1);
  s.ReleaseSlot(*ready);
  EXPECT_EQ(s.WaitParams(3, milliseconds(10)).status().code(), absl::StatusCode::kFailedPrecondition);
}

TEST_F(SessionTest, BadArgumentsAreRefusedLocally) {
  absl::StatusOr<std::unique_ptr<Session>> session = Open(2, 4096);
  ASSERT_TRUE(session.ok()) << session.status();
  Session& s = **session;
  std::vector<float> weights(1024), grads(1024);

  absl::Status unknown = s.PushGradients(3, 1, AdamWHyper{}, ConstBytes(grads));
  EXPECT_EQ(unknown.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(Contains(unknown, "chunk 3 is not registered")) << unknown;

  absl::Status too_big = s.RegisterChunk(Float32Chunk(1, 1025), Bytes(weights)).status();
  EXPECT_EQ(too_big.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(Contains(too_big, "slot_bytes")) << too_big;

  ChunkSpec no_dtype = Float32Chunk(1, 1024);
  no_dtype.grad_dtype = DType::kUnspecified;
  EXPECT_EQ(s.RegisterChunk(no_dtype, Bytes(weights)).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(s.RegisterChunk(Float32Chunk(1, 0), {}).status().code(), absl::StatusCode::kInvalidArgument);
  absl::Status wrong_size = s.RegisterChunk(Float32Chunk(1, 512), Bytes(weights)).status();
  EXPECT_EQ(wrong_size.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(Contains(wrong_size, "weights are 4096 bytes, expected 2048")) << wrong_size;

  ASSERT_TRUE(s.RegisterChunk(Float32Chunk(1, 1024), Bytes(weights)).ok());
  std::vector<float> short_grads(10);
  EXPECT_EQ(s.PushGradients(1, 1, AdamWHyper{}, ConstBytes(short_grads)).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(s.PullParams(1, Bytes(short_grads)).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(s.SendGradReady(1, /*slot=*/0, 1, AdamWHyper{}).code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(s.SendGradReady(1, /*slot=*/9, 1, AdamWHyper{}).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(fake_.grad_ready_seen, 0);
}

TEST_F(SessionTest, SegmentsSpeculationRedoAndAbortReasonReachTheDaemon) {
  absl::StatusOr<std::unique_ptr<Session>> session = Open();
  ASSERT_TRUE(session.ok()) << session.status();
  Session& s = **session;
  std::vector<float> weights(16, 0.0f);
  ChunkSpec spec = Float32Chunk(3, 16);
  spec.segment_elements = {10, 6};
  ASSERT_TRUE(s.RegisterChunk(spec, Bytes(weights)).ok());
  const v1::ChunkSpec received = fake_.LastSpec();
  EXPECT_EQ(std::vector<uint64_t>(received.segment_elements().begin(), received.segment_elements().end()),
            (std::vector<uint64_t>{10, 6}));

  absl::StatusOr<uint32_t> slot = s.AcquireSlot(milliseconds(1000));
  ASSERT_TRUE(slot.ok()) << slot.status();
  ASSERT_TRUE(s.SendGradReady(3, *slot, 1, AdamWHyper{},
                              {.segments_without_grad = {1}, .speculative = true})
                  .ok());
  ASSERT_TRUE(s.WaitParams(3, milliseconds(5000)).ok());
  v1::GradReady sent = fake_.LastGradReady();
  EXPECT_EQ(sent.segments_without_grad_size(), 1);
  EXPECT_EQ(sent.segments_without_grad(0), 1u);
  EXPECT_TRUE(sent.speculative());
  EXPECT_EQ(sent.redo(), v1::REDO_REASON_UNSPECIFIED);

  // The redo of the same chunk in the same step, after its parameters were taken.
  ASSERT_TRUE(s.SendGradReady(3, *slot, 1, AdamWHyper{}, {.redo = RedoReason::kClipped}).ok());
  ASSERT_TRUE(s.WaitParams(3, milliseconds(5000)).ok());
  sent = fake_.LastGradReady();
  EXPECT_EQ(sent.segments_without_grad_size(), 0);
  EXPECT_FALSE(sent.speculative());
  EXPECT_EQ(sent.redo(), v1::REDO_REASON_CLIPPED);

  // Segment indices out of order, repeated or past the chunk's segments: nothing sent.
  const int seen = fake_.grad_ready_seen;
  for (const std::vector<uint32_t>& bad : {std::vector<uint32_t>{1, 0}, std::vector<uint32_t>{0, 0},
                                           std::vector<uint32_t>{2}}) {
    absl::Status refused = s.SendGradReady(3, *slot, 1, AdamWHyper{}, {.segments_without_grad = bad});
    EXPECT_EQ(refused.code(), absl::StatusCode::kInvalidArgument) << refused;
    EXPECT_TRUE(Contains(refused, "segments without gradients")) << refused;
  }
  EXPECT_EQ(fake_.grad_ready_seen, seen);
  s.ReleaseSlot(*slot);

  ASSERT_TRUE(s.AbortStep(1, AbortReason::kSkippedStep).ok());
  EXPECT_EQ(fake_.LastAbortStep().step(), 1);
  EXPECT_EQ(fake_.LastAbortStep().reason(), v1::ABORT_REASON_SKIPPED_STEP);
  ASSERT_TRUE(s.AbortStep(1).ok());
  EXPECT_EQ(fake_.LastAbortStep().reason(), v1::ABORT_REASON_UNSPECIFIED);
}

TEST_F(SessionTest, JournalUseAndGradOpsReachTheDaemonAndItsStatsAreKept) {
  absl::StatusOr<std::unique_ptr<Session>> session = Open();
  ASSERT_TRUE(session.ok()) << session.status();
  Session& s = **session;
  std::vector<float> weights(16, 0.0f);
  ASSERT_TRUE(s.RegisterChunk(Float32Chunk(4, 16), Bytes(weights)).ok());
  absl::StatusOr<uint32_t> slot = s.AcquireSlot(milliseconds(1000));
  ASSERT_TRUE(slot.ok()) << slot.status();
  EXPECT_FALSE(s.GetJournalStats(4).has_value());
  ASSERT_TRUE(s.SendGradReady(4, *slot, 1, AdamWHyper{}, {.journal = JournalUse::kKeep}).ok());
  ASSERT_TRUE(s.WaitParams(4, milliseconds(5000)).ok());
  EXPECT_EQ(fake_.LastGradReady().journal(), v1::JOURNAL_USE_KEEP);
  EXPECT_EQ(fake_.LastGradReady().grad_ops_size(), 0);
  std::optional<JournalStats> stats = s.GetJournalStats(4);
  ASSERT_TRUE(stats.has_value());
  EXPECT_EQ(stats->sum_squares, (std::vector<double>{1.5}));
  EXPECT_EQ(stats->max_abs, (std::vector<float>{0.0f}));

  GradReadyOptions replay{.redo = RedoReason::kGradientsChanged, .journal = JournalUse::kReplay};
  replay.grad_ops = {{GradOp::Kind::kMul, 0.25f}, {GradOp::Kind::kDiv, 1024.0f}};
  ASSERT_TRUE(s.SendGradReady(4, *slot, 1, AdamWHyper{}, replay).ok());
  ASSERT_TRUE(s.WaitParams(4, milliseconds(5000)).ok());
  const v1::GradReady sent = fake_.LastGradReady();
  EXPECT_EQ(sent.journal(), v1::JOURNAL_USE_REPLAY);
  ASSERT_EQ(sent.grad_ops_size(), 2);
  EXPECT_EQ(sent.grad_ops(0).kind(), v1::GradOp::KIND_MUL);
  EXPECT_EQ(sent.grad_ops(0).operand(), 0.25f);
  EXPECT_EQ(sent.grad_ops(1).kind(), v1::GradOp::KIND_DIV);
  EXPECT_EQ(sent.grad_ops(1).operand(), 1024.0f);
  stats = s.GetJournalStats(4);
  ASSERT_TRUE(stats.has_value());
  EXPECT_EQ(stats->max_abs, (std::vector<float>{2.0f}));

  // An update without a journal: no stats for it.
  ASSERT_TRUE(s.SendGradReady(4, *slot, 1, AdamWHyper{}, {.redo = RedoReason::kClipped}).ok());
  ASSERT_TRUE(s.WaitParams(4, milliseconds(5000)).ok());
  EXPECT_FALSE(s.GetJournalStats(4).has_value());
  s.ReleaseSlot(*slot);
}

TEST_F(SessionTest, SegmentsThatDoNotAddUpAreRefusedLocally) {
  absl::StatusOr<std::unique_ptr<Session>> session = Open();
  ASSERT_TRUE(session.ok()) << session.status();
  Session& s = **session;
  std::vector<float> weights(16, 0.0f);
  for (const std::vector<uint64_t>& bad :
       {std::vector<uint64_t>{10, 5}, std::vector<uint64_t>{10, 7}, std::vector<uint64_t>{16, 0},
        std::vector<uint64_t>(4097, 1)}) {
    ChunkSpec spec = Float32Chunk(3, 16);
    spec.segment_elements = bad;
    absl::Status refused = s.RegisterChunk(spec, Bytes(weights)).status();
    EXPECT_EQ(refused.code(), absl::StatusCode::kInvalidArgument) << refused;
  }
}

TEST_F(SessionTest, ResumedChunkReturnsItsSegmentUpdateCounts) {
  fake_.AddExistingChunk(5, std::vector<float>(16, 1.0f), 7, {7, 4});
  absl::StatusOr<std::unique_ptr<Session>> session = Open();
  ASSERT_TRUE(session.ok()) << session.status();
  std::vector<float> weights(16, 0.0f);
  ChunkSpec spec = Float32Chunk(5, 16);
  spec.segment_elements = {8, 8};
  absl::StatusOr<RegisterResult> registered = (*session)->RegisterChunk(spec, Bytes(weights));
  ASSERT_TRUE(registered.ok()) << registered.status();
  EXPECT_TRUE(registered->resumed);
  EXPECT_EQ(registered->update_count, 7);
  EXPECT_EQ(registered->segment_update_counts, (std::vector<int64_t>{7, 4}));
}

TEST_F(SessionTest, SlotsRunOutAndComeBack) {
  absl::StatusOr<std::unique_ptr<Session>> session = Open(/*slots=*/1);
  ASSERT_TRUE(session.ok()) << session.status();
  Session& s = **session;
  absl::StatusOr<uint32_t> slot = s.AcquireSlot(milliseconds(100));
  ASSERT_TRUE(slot.ok());
  const auto start = Clock::now();
  absl::StatusOr<uint32_t> none = s.AcquireSlot(milliseconds(200));
  EXPECT_GE(Clock::now() - start, milliseconds(150));
  EXPECT_EQ(none.status().code(), absl::StatusCode::kDeadlineExceeded);
  EXPECT_TRUE(Contains(none.status(), "no free slot within 200 ms")) << none.status();
  s.ReleaseSlot(*slot);
  EXPECT_TRUE(s.AcquireSlot(milliseconds(100)).ok());
}

TEST_F(SessionTest, StepErrorComesBackFromEndStep) {
  absl::StatusOr<std::unique_ptr<Session>> session = Open();
  ASSERT_TRUE(session.ok()) << session.status();
  absl::StatusOr<StepResult> result = (*session)->EndStep(kRefusedStep);
  EXPECT_EQ(result.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(result.status().message(), "step 113 is not the next step (fake)");
  EXPECT_EQ((*session)->committed_step(), 0);
  EXPECT_TRUE((*session)->EndStep(1).ok());  // still usable
}

// WaitDurable: the daemon's durable step, its refusal unchanged (the session
// stays usable), and an answer saying less than asked is INTERNAL.
TEST_F(SessionTest, WaitDurableReturnsTheDurableStepOrTheDaemonsRefusal) {
  absl::StatusOr<std::unique_ptr<Session>> session = Open();
  ASSERT_TRUE(session.ok()) << session.status();
  Session& s = **session;
  ASSERT_TRUE(s.EndStep(1).ok());
  ASSERT_TRUE(s.EndStep(2).ok());
  absl::StatusOr<int64_t> durable = s.WaitDurable(1);
  ASSERT_TRUE(durable.ok()) << durable.status();
  EXPECT_EQ(*durable, 2);
  absl::StatusOr<int64_t> later = s.WaitDurable(3);
  EXPECT_EQ(later.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(later.status().message(), "WaitDurable for step 3: not committed (fake)");
  EXPECT_EQ(s.WaitDurable(2).value_or(-1), 2);  // still usable
  ASSERT_TRUE(s.EndStep(kLyingDurableStep).ok());
  absl::StatusOr<int64_t> lie = s.WaitDurable(kLyingDurableStep);
  EXPECT_EQ(lie.status().code(), absl::StatusCode::kInternal);
  EXPECT_TRUE(Contains(lie.status(), "WaitDurable of step 116")) << lie.status();
}

TEST_F(SessionTest, WaitWithoutAnswerTimesOut) {
  absl::StatusOr<std::unique_ptr<Session>> session = Open();
  ASSERT_TRUE(session.ok()) << session.status();
  std::vector<float> weights(8), grads(8);
  ASSERT_TRUE((*session)->RegisterChunk(Float32Chunk(kSilentChunk, 8), Bytes(weights)).ok());
  ASSERT_TRUE((*session)->PushGradients(kSilentChunk, 1, AdamWHyper{}, ConstBytes(grads)).ok());
  absl::StatusOr<uint32_t> ready = (*session)->WaitParams(kSilentChunk, milliseconds(200));
  EXPECT_EQ(ready.status().code(), absl::StatusCode::kDeadlineExceeded);
  EXPECT_TRUE(Contains(ready.status(), "chunk 777")) << ready.status();
}

TEST_F(SessionTest, ManyThreadsPushAndPull) {
  constexpr int kThreads = 4, kChunksPerThread = 4, kSteps = 20;
  absl::StatusOr<std::unique_ptr<Session>> session = Open(/*slots=*/3, 1024 * sizeof(float));
  ASSERT_TRUE(session.ok()) << session.status();
  Session& s = **session;
  for (uint32_t c = 0; c < kThreads * kChunksPerThread; ++c) {
    std::vector<float> weights(1024, 0.0f);
    ASSERT_TRUE(s.RegisterChunk(Float32Chunk(c, 1024), Bytes(weights)).ok());
  }
  for (int64_t step = 1; step <= kSteps; ++step) {
    std::vector<std::thread> threads;
    std::atomic<int> failures{0};
    for (int t = 0; t < kThreads; ++t) {
      threads.emplace_back([&, t] {
        for (int k = 0; k < kChunksPerThread; ++k) {
          const uint32_t chunk = t * kChunksPerThread + k;
          std::vector<float> grads(1024, static_cast<float>(chunk)), weights(1024);
          if (!s.PushGradients(chunk, step, AdamWHyper{}, ConstBytes(grads)).ok()) ++failures;
          if (!s.PullParams(chunk, Bytes(weights)).ok()) ++failures;
          if (weights[1023] != static_cast<float>(chunk) * 2 + static_cast<float>(step)) ++failures;
        }
      });
    }
    for (std::thread& thread : threads) thread.join();
    ASSERT_EQ(failures, 0) << "step " << step;
    absl::StatusOr<StepResult> committed = s.EndStep(step);
    ASSERT_TRUE(committed.ok()) << committed.status();
    EXPECT_EQ(committed->chunks_updated, static_cast<uint32_t>(kThreads * kChunksPerThread));
  }
  EXPECT_EQ(s.committed_step(), kSteps);
}

}  // namespace
}  // namespace fuyou::session_test
