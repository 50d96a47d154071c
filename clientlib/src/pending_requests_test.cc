#include "pending_requests.h"

#include <gtest/gtest.h>

#include <set>
#include <string>

namespace fuyou::internal {
namespace {

bool Contains(const absl::Status& status, const std::string& text) {
  return std::string(status.message()).find(text) != std::string::npos;
}

v1::DaemonMessage ParamsReadyFor(uint64_t id, uint32_t chunk_id, uint32_t slot) {
  v1::DaemonMessage answer;
  answer.set_request_id(id);
  answer.mutable_params_ready()->set_chunk_id(chunk_id);
  answer.mutable_params_ready()->set_slot(slot);
  return answer;
}

v1::DaemonMessage ErrorFor(uint64_t id, absl::StatusCode code, const std::string& message) {
  v1::DaemonMessage answer;
  answer.set_request_id(id);
  answer.mutable_error()->set_code(static_cast<int>(code));
  answer.mutable_error()->set_message(message);
  return answer;
}

TEST(PendingRequestsTest, IdsAreUniqueNonZeroAndNeverReused) {
  PendingRequests table;
  std::set<uint64_t> ids;
  for (int i = 0; i < 100; ++i) {
    const uint64_t id = table.Add({.kind = RequestKind::kGradReady, .chunk_id = static_cast<uint32_t>(i)});
    EXPECT_NE(id, 0u);
    EXPECT_TRUE(ids.insert(id).second) << id;
    if (i % 2 == 0) {
      ASSERT_TRUE(table.Take(id).has_value());  // a freed id is not handed out again
    }
  }
  EXPECT_EQ(table.size(), 50u);
}

TEST(PendingRequestsTest, AnAnswerCompletesTheRequestItsIdNames) {
  PendingRequests table;
  const uint64_t first = table.Add({.kind = RequestKind::kGradReady, .chunk_id = 1, .slot = 0, .step = 5});
  const uint64_t second = table.Add({.kind = RequestKind::kGradReady, .chunk_id = 2, .slot = 1, .step = 5});
  absl::StatusOr<PendingRequests::Delivery> delivered = table.Deliver(ParamsReadyFor(second, 2, 1));
  ASSERT_TRUE(delivered.ok()) << delivered.status();
  EXPECT_EQ(delivered->id, second);
  EXPECT_EQ(delivered->kind, RequestKind::kGradReady);
  ASSERT_NE(delivered->request, nullptr);
  EXPECT_EQ(delivered->request->chunk_id, 2u);
  EXPECT_FALSE(table.Find(first)->answered);
  EXPECT_TRUE(table.Find(second)->answered);
  std::optional<PendingRequest> taken = table.Take(second);
  ASSERT_TRUE(taken.has_value());
  EXPECT_TRUE(taken->status.ok());
  EXPECT_EQ(taken->answer.params_ready().slot(), 1u);
  EXPECT_EQ(table.Find(second), nullptr);
}

// An Error names its request by id alone: one without chunk or step goes to the
// fetch it answers, not to the GradReady of the same chunk, and the reverse.
TEST(PendingRequestsTest, AnErrorIsRoutedToItsRequestByIdAlone) {
  PendingRequests table;
  const uint64_t update = table.Add({.kind = RequestKind::kGradReady, .chunk_id = 7, .slot = 0, .step = 1});
  const uint64_t fetch = table.Add({.kind = RequestKind::kFetchWeights, .chunk_id = 7, .slot = 1});
  const uint64_t end = table.Add({.kind = RequestKind::kEndStep, .step = 1});
  ASSERT_TRUE(table.Deliver(ErrorFor(fetch, absl::StatusCode::kDataLoss, "weights fail their checksum")).ok());
  EXPECT_FALSE(table.Find(update)->answered);
  EXPECT_FALSE(table.Find(end)->answered);
  EXPECT_EQ(table.Find(fetch)->status, absl::DataLossError("weights fail their checksum"));
  ASSERT_TRUE(table.Deliver(ErrorFor(update, absl::StatusCode::kFailedPrecondition, "refused")).ok());
  EXPECT_EQ(table.Find(update)->status, absl::FailedPreconditionError("refused"));
  EXPECT_FALSE(table.Find(end)->answered);
  // A code outside google.rpc.Code is UNKNOWN, not trusted as a code.
  ASSERT_TRUE(table.Deliver(ErrorFor(end, static_cast<absl::StatusCode>(99), "odd")).ok());
  EXPECT_EQ(table.Find(end)->status.code(), absl::StatusCode::kUnknown);
}

TEST(PendingRequestsTest, AnAnswerForAnUnknownIdIsAnErrorAndChangesNothing) {
  PendingRequests table;
  const uint64_t id = table.Add({.kind = RequestKind::kGradReady, .chunk_id = 1});
  for (uint64_t unknown : {id + 1, uint64_t{1} << 63, ~uint64_t{0}}) {
    absl::StatusOr<PendingRequests::Delivery> delivered = table.Deliver(ParamsReadyFor(unknown, 1, 0));
    EXPECT_EQ(delivered.status().code(), absl::StatusCode::kInternal);
    EXPECT_TRUE(Contains(delivered.status(), "ParamsReady for request " + std::to_string(unknown)))
        << delivered.status();
    EXPECT_TRUE(Contains(delivered.status(), "has not sent")) << delivered.status();
  }
  EXPECT_FALSE(table.Find(id)->answered);
  // A second answer to an answered request is refused the same way.
  ASSERT_TRUE(table.Deliver(ParamsReadyFor(id, 1, 0)).ok());
  absl::StatusOr<PendingRequests::Delivery> again = table.Deliver(ErrorFor(id, absl::StatusCode::kInternal, "x"));
  EXPECT_EQ(again.status().code(), absl::StatusCode::kInternal);
  EXPECT_TRUE(Contains(again.status(), "already has an answer")) << again.status();
  EXPECT_TRUE(table.Find(id)->status.ok());
  // Once taken, its id is unknown.
  ASSERT_TRUE(table.Take(id).has_value());
  EXPECT_FALSE(table.Deliver(ParamsReadyFor(id, 1, 0)).ok());
}

TEST(PendingRequestsTest, AnAnswerWithoutAnIdNamesAnOlderDaemon) {
  PendingRequests table;
  table.Add({.kind = RequestKind::kAttach});
  v1::DaemonMessage attached;
  attached.mutable_attached()->set_session_id("s");
  absl::StatusOr<PendingRequests::Delivery> delivered = table.Deliver(attached);
  EXPECT_EQ(delivered.status().code(), absl::StatusCode::kInternal);
  EXPECT_TRUE(Contains(delivered.status(), "Attached without a request id")) << delivered.status();
  EXPECT_TRUE(Contains(delivered.status(), "upgrade fuyoud")) << delivered.status();
}

TEST(PendingRequestsTest, AnAnswerOfAnotherKindIsAnError) {
  PendingRequests table;
  const uint64_t id = table.Add({.kind = RequestKind::kFetchWeights, .chunk_id = 3});
  absl::StatusOr<PendingRequests::Delivery> delivered = table.Deliver(ParamsReadyFor(id, 3, 0));
  EXPECT_EQ(delivered.status().code(), absl::StatusCode::kInternal);
  EXPECT_TRUE(Contains(delivered.status(), "(a FetchWeights) with ParamsReady")) << delivered.status();
  EXPECT_FALSE(table.Find(id)->answered);
  v1::DaemonMessage empty;
  empty.set_request_id(id);
  EXPECT_TRUE(Contains(table.Deliver(empty).status(), "no kind set"));
}

TEST(PendingRequestsTest, AnAbandonedRequestDropsItsLateAnswer) {
  PendingRequests table;
  const uint64_t id = table.Add({.kind = RequestKind::kEndStep, .step = 4});
  table.Abandon(id);
  EXPECT_EQ(table.Find(id), nullptr);
  EXPECT_EQ(table.Count(OfKind(RequestKind::kEndStep)), 0u);
  EXPECT_EQ(table.size(), 1u);  // kept until its answer comes
  v1::DaemonMessage committed;
  committed.set_request_id(id);
  committed.mutable_step_committed()->set_step(4);
  absl::StatusOr<PendingRequests::Delivery> delivered = table.Deliver(committed);
  ASSERT_TRUE(delivered.ok()) << delivered.status();
  EXPECT_EQ(delivered->request, nullptr);
  EXPECT_EQ(table.size(), 0u);
  EXPECT_FALSE(table.Deliver(committed).ok());  // a second answer is unknown
}

TEST(PendingRequestsTest, TheStreamsEndFailsEveryPendingRequestWithItsStatus) {
  PendingRequests table;
  const uint64_t answered = table.Add({.kind = RequestKind::kGradReady, .chunk_id = 1});
  const uint64_t update = table.Add({.kind = RequestKind::kGradReady, .chunk_id = 2});
  const uint64_t fetch = table.Add({.kind = RequestKind::kFetchWeights, .chunk_id = 2});
  const uint64_t read = table.Add({.kind = RequestKind::kReadState, .chunk_id = 3});
  const uint64_t abandoned = table.Add({.kind = RequestKind::kEndStep, .step = 1});
  ASSERT_TRUE(table.Deliver(ParamsReadyFor(answered, 1, 0)).ok());
  table.Abandon(abandoned);
  const absl::Status lost = absl::UnavailableError("connection to fuyoud lost: socket closed");
  table.FailAll(lost);
  for (uint64_t id : {update, fetch, read}) {
    ASSERT_NE(table.Find(id), nullptr) << id;
    EXPECT_TRUE(table.Find(id)->answered) << id;
    EXPECT_EQ(table.Find(id)->status, lost) << id;
  }
  EXPECT_TRUE(table.Find(answered)->status.ok());  // its answer came first and stays
  EXPECT_EQ(table.size(), 4u);                      // the abandoned one is gone
}

TEST(PendingRequestsTest, OldestAndSelectSkipAbandonedRequests) {
  PendingRequests table;
  const uint64_t a = table.Add({.kind = RequestKind::kFetchWeights, .chunk_id = 5, .slot = 0});
  const uint64_t b = table.Add({.kind = RequestKind::kFetchWeights, .chunk_id = 5, .slot = 1});
  table.Add({.kind = RequestKind::kFetchWeights, .chunk_id = 6, .slot = 2});
  EXPECT_EQ(table.FindOldest(OfChunk(RequestKind::kFetchWeights, 5)), a);
  EXPECT_EQ(table.Count(OfKind(RequestKind::kFetchWeights)), 3u);
  EXPECT_EQ(table.Count(OfKind(RequestKind::kGradReady)), 0u);
  table.Abandon(a);
  EXPECT_EQ(table.FindOldest(OfChunk(RequestKind::kFetchWeights, 5)), b);
  EXPECT_EQ(table.Select(OfChunk(RequestKind::kFetchWeights, 5)).size(), 1u);
  EXPECT_FALSE(table.FindOldest(OfChunk(RequestKind::kFetchWeights, 7)).has_value());
}

}  // namespace
}  // namespace fuyou::internal
