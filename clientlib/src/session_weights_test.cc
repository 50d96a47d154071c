// Session: streaming weights (FetchWeights, WaitWeights) beside updates.
#include <gtest/gtest.h>

#include "session_test_fixture.h"

namespace fuyou::session_test {
namespace {

TEST_F(SessionTest, FetchWeightsCopiesTheStoredWeightsIntoTheSlot) {
  absl::StatusOr<std::unique_ptr<Session>> session = Open(/*slots=*/3);
  ASSERT_TRUE(session.ok()) << session.status();
  Session& s = **session;
  std::vector<float> weights(100);
  for (size_t i = 0; i < weights.size(); ++i) weights[i] = static_cast<float>(i) * 0.5f;
  const std::vector<float> initial = weights;
  ASSERT_TRUE(s.RegisterChunk(StoredWeightsChunk(4, 100), Bytes(weights)).ok());
  EXPECT_TRUE(fake_.LastSpec().store_weights());  // store_weights reaches the daemon
  std::vector<float> other(10);
  ASSERT_TRUE(s.RegisterChunk(Float32Chunk(5, 10), Bytes(other)).ok());
  EXPECT_FALSE(fake_.LastSpec().store_weights());

  // Two fetches of one chunk in flight at once, in two slots: answered in order.
  absl::StatusOr<uint32_t> a = s.AcquireSlot(milliseconds(1000));
  absl::StatusOr<uint32_t> b = s.AcquireSlot(milliseconds(1000));
  ASSERT_TRUE(a.ok() && b.ok());
  ASSERT_TRUE(s.SendFetchWeights(4, *a).ok());
  ASSERT_TRUE(s.SendFetchWeights(4, *b).ok());
  absl::StatusOr<uint32_t> first = s.WaitWeights(4, milliseconds(5000));
  ASSERT_TRUE(first.ok()) << first.status();
  EXPECT_EQ(*first, *a);
  EXPECT_EQ(SlotFloats(s, *first, 100), initial);
  s.ReleaseSlot(*first);
  absl::StatusOr<uint32_t> second = s.WaitWeights(4, milliseconds(5000));
  ASSERT_TRUE(second.ok()) << second.status();
  EXPECT_EQ(*second, *b);
  EXPECT_EQ(SlotFloats(s, *second, 100), initial);
  s.ReleaseSlot(*second);
  EXPECT_EQ(fake_.fetches_seen.load(), 2);
  EXPECT_EQ(s.WaitWeights(4, milliseconds(10)).status().code(), absl::StatusCode::kFailedPrecondition);

  // A fetch the daemon never answers: its slot stays in flight (not sent
  // again, not released), states are not read meanwhile, and the wait times
  // out without losing it.
  std::vector<float> silent(8);
  ASSERT_TRUE(s.RegisterChunk(StoredWeightsChunk(kSilentChunk, 8), Bytes(silent)).ok());
  absl::StatusOr<uint32_t> c = s.AcquireSlot(milliseconds(1000));
  ASSERT_TRUE(c.ok());
  ASSERT_TRUE(s.SendFetchWeights(kSilentChunk, *c).ok());
  absl::Status again = s.SendFetchWeights(4, *c);
  EXPECT_EQ(again.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_TRUE(Contains(again, "already in flight")) << again;
  std::vector<float> out(100);
  absl::StatusOr<int64_t> read = s.ReadState(4, StateKind::kMaster, 0, out);
  EXPECT_EQ(read.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_TRUE(Contains(read.status(), "weights fetches of 1 chunks are in flight")) << read.status();
  for (int i = 0; i < 2; ++i) {
    absl::StatusOr<uint32_t> waited = s.WaitWeights(kSilentChunk, milliseconds(100));
    EXPECT_EQ(waited.status().code(), absl::StatusCode::kDeadlineExceeded);
    EXPECT_TRUE(Contains(waited.status(), "no WeightsFetched for chunk 777")) << waited.status();
  }
  EXPECT_EQ(fake_.fetches_seen.load(), 3);  // the refused one was not sent
  s.ReleaseSlot(*c);                         // ignored: the daemon owns it
  // The two other slots are free again; the third stays in flight.
  EXPECT_TRUE(s.AcquireSlot(milliseconds(100)).ok());
  EXPECT_TRUE(s.AcquireSlot(milliseconds(100)).ok());
  EXPECT_EQ(s.AcquireSlot(milliseconds(10)).status().code(), absl::StatusCode::kDeadlineExceeded);
}

// A fetch beside the chunk's own GradReady: each answer goes to its waiter, and
// so does each refusal (a refused fetch names no step, a refused GradReady does).
TEST_F(SessionTest, FetchesAndUpdatesOfOneChunkInFlightGetTheirOwnAnswers) {
  absl::StatusOr<std::unique_ptr<Session>> session = Open(/*slots=*/4);
  ASSERT_TRUE(session.ok()) << session.status();
  Session& s = **session;
  std::vector<float> weights(50, 3.0f), refused(50, 1.0f);
  ASSERT_TRUE(s.RegisterChunk(StoredWeightsChunk(2, 50), Bytes(weights)).ok());
  ASSERT_TRUE(s.RegisterChunk(StoredWeightsChunk(kRefusedChunk, 50), Bytes(refused)).ok());

  absl::StatusOr<uint32_t> grad_slot = s.AcquireSlot(milliseconds(1000));
  absl::StatusOr<uint32_t> fetch_slot = s.AcquireSlot(milliseconds(1000));
  ASSERT_TRUE(grad_slot.ok() && fetch_slot.ok());
  auto* grad = reinterpret_cast<float*>(s.GradRegion(*grad_slot).data());
  for (int i = 0; i < 50; ++i) grad[i] = 1.0f;
  ASSERT_TRUE(s.SendGradReady(2, *grad_slot, 1, AdamWHyper{}).ok());
  ASSERT_TRUE(s.SendFetchWeights(2, *fetch_slot).ok());
  absl::StatusOr<uint32_t> fetched = s.WaitWeights(2, milliseconds(5000));
  ASSERT_TRUE(fetched.ok()) << fetched.status();
  EXPECT_EQ(*fetched, *fetch_slot);
  EXPECT_EQ(SlotFloats(s, *fetched, 50), std::vector<float>(50, 3.0f));  // the stored weights
  absl::StatusOr<uint32_t> ready = s.WaitParams(2, milliseconds(5000));
  ASSERT_TRUE(ready.ok()) << ready.status();
  EXPECT_EQ(*ready, *grad_slot);
  EXPECT_EQ(SlotFloats(s, *ready, 50), std::vector<float>(50, 3.0f));  // the fake's update: 2 * 1 + step 1
  s.ReleaseSlot(*fetched);
  s.ReleaseSlot(*ready);

  // Both refused, the fetch first in the stream: the GradReady's error (with a
  // step) does not end the fetch's wait, nor the fetch's the GradReady's.
  grad_slot = s.AcquireSlot(milliseconds(1000));
  fetch_slot = s.AcquireSlot(milliseconds(1000));
  ASSERT_TRUE(grad_slot.ok() && fetch_slot.ok());
  ASSERT_TRUE(s.SendFetchWeights(kRefusedChunk, *fetch_slot).ok());
  ASSERT_TRUE(s.SendGradReady(kRefusedChunk, *grad_slot, 1, AdamWHyper{}).ok());
  absl::StatusOr<uint32_t> refused_params = s.WaitParams(kRefusedChunk, milliseconds(5000));
  EXPECT_EQ(refused_params.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_TRUE(Contains(refused_params.status(), "chunk 999 in slot")) << refused_params.status();
  absl::StatusOr<uint32_t> refused_fetch = s.WaitWeights(kRefusedChunk, milliseconds(5000));
  EXPECT_EQ(refused_fetch.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(refused_fetch.status().message(),
            fmt::format("fetch of chunk 999 into slot {} refused by the fake daemon", *fetch_slot));
  // Both slots were freed by the refusals, the session is still usable.
  for (int i = 0; i < 4; ++i) EXPECT_TRUE(s.AcquireSlot(milliseconds(100)).ok()) << i;
  EXPECT_TRUE(s.EndStep(1).ok());
}

TEST_F(SessionTest, BadFetchesAreRefusedLocally) {
  absl::StatusOr<std::unique_ptr<Session>> session = Open(/*slots=*/2);
  ASSERT_TRUE(session.ok()) << session.status();
  Session& s = **session;
  std::vector<float> weights(10);
  ASSERT_TRUE(s.RegisterChunk(StoredWeightsChunk(1, 10), Bytes(weights)).ok());
  ASSERT_TRUE(s.RegisterChunk(Float32Chunk(2, 10), Bytes(weights)).ok());
  absl::StatusOr<uint32_t> slot = s.AcquireSlot(milliseconds(1000));
  ASSERT_TRUE(slot.ok());

  absl::Status unknown = s.SendFetchWeights(3, *slot);
  EXPECT_EQ(unknown.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(Contains(unknown, "chunk 3 is not registered")) << unknown;
  absl::Status without = s.SendFetchWeights(2, *slot);
  EXPECT_EQ(without.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_TRUE(Contains(without, "chunk 2 of job 'test-job'")) << without;
  EXPECT_TRUE(Contains(without, "without store_weights")) << without;
  absl::Status no_such_slot = s.SendFetchWeights(1, 2);
  EXPECT_EQ(no_such_slot.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(Contains(no_such_slot, "slot 2 does not exist")) << no_such_slot;
  const uint32_t free_slot = 1 - *slot;
  absl::Status not_held = s.SendFetchWeights(1, free_slot);
  EXPECT_EQ(not_held.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_TRUE(Contains(not_held, "is free")) << not_held;
  EXPECT_EQ(fake_.fetches_seen.load(), 0);  // nothing was sent
  absl::StatusOr<uint32_t> nothing = s.WaitWeights(1, milliseconds(10));
  EXPECT_EQ(nothing.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_TRUE(Contains(nothing.status(), "no weights fetch in flight")) << nothing.status();
}

}  // namespace
}  // namespace fuyou::session_test
