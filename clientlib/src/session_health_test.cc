// SessionHealth: which status refuses a new call, in which order, and how
// often: a fatal error sticks, a refusal nobody waited for is reported once.
#include "session_health.h"

#include <gtest/gtest.h>

namespace fuyou::internal {
namespace {

const absl::Status kClosed = absl::FailedPreconditionError("session of job 'j' is closed");
constexpr const char* kWho = "job 'j' (session s)";

TEST(SessionHealthTest, AFreshSessionIsUsable) {
  SessionHealth health;
  EXPECT_TRUE(health.CheckUsable(kClosed).ok());
  EXPECT_TRUE(health.trusts_stream());
  EXPECT_FALSE(health.stream_ended());
  EXPECT_TRUE(health.lost().ok());
}

TEST(SessionHealthTest, ARefusalNobodyWaitedForIsReportedOnce) {
  SessionHealth health;
  health.OnDaemonError(absl::FailedPreconditionError("refused"), /*waited=*/false);
  EXPECT_EQ(health.CheckUsable(kClosed), absl::FailedPreconditionError("refused"));
  EXPECT_TRUE(health.CheckUsable(kClosed).ok());
  // One a waiter took is not reported again.
  health.OnDaemonError(absl::InvalidArgumentError("taken"), /*waited=*/true);
  EXPECT_TRUE(health.CheckUsable(kClosed).ok());
}

TEST(SessionHealthTest, AbortedAndInternalMakeTheSessionUnusable) {
  for (const absl::Status& fatal : {absl::AbortedError("job gone"), absl::InternalError("bad")}) {
    SessionHealth health;
    health.OnDaemonError(fatal, /*waited=*/true);
    EXPECT_EQ(health.CheckUsable(kClosed), fatal);
    EXPECT_EQ(health.CheckUsable(kClosed), fatal) << "every later call";
    health.OnDaemonError(absl::InternalError("second"), /*waited=*/true);
    EXPECT_EQ(health.CheckUsable(kClosed), fatal) << "the first fatal error stays";
  }
}

TEST(SessionHealthTest, ABrokenProtocolIsFatalAndEndsTrust) {
  SessionHealth health;
  const absl::Status broken = health.BreakProtocol(kWho, absl::InternalError("answer 9 was never sent"));
  EXPECT_EQ(broken.code(), absl::StatusCode::kInternal);
  EXPECT_EQ(broken.message(),
            "protocol error on the stream of job 'j' (session s): answer 9 was never sent; the session is "
            "unusable, close it");
  EXPECT_FALSE(health.trusts_stream());
  EXPECT_EQ(health.CheckUsable(kClosed), broken);
}

TEST(SessionHealthTest, TheStreamsEndLosesTheConnectionUnlessClosing) {
  SessionHealth health;
  const absl::Status end = health.OnStreamEnd(grpc::Status(grpc::StatusCode::UNAVAILABLE, "socket closed"), kWho,
                                              kClosed);
  EXPECT_TRUE(health.stream_ended());
  EXPECT_EQ(end, absl::UnavailableError("connection to fuyoud lost: socket closed (job 'j' (session s))"));
  EXPECT_EQ(health.lost(), end);
  EXPECT_EQ(health.CheckUsable(kClosed), end);

  SessionHealth ended_by_daemon;
  EXPECT_EQ(ended_by_daemon.OnStreamEnd(grpc::Status::OK, kWho, kClosed).message(),
            "connection to fuyoud lost: the daemon ended the session's stream (job 'j' (session s))");
  SessionHealth no_message;
  EXPECT_EQ(no_message.OnStreamEnd(grpc::Status(grpc::StatusCode::CANCELLED, ""), kWho, kClosed).message(),
            "connection to fuyoud lost: gRPC status 1 (job 'j' (session s))");

  SessionHealth closing;
  closing.BeginClose();
  EXPECT_EQ(closing.OnStreamEnd(grpc::Status::OK, kWho, kClosed), kClosed);
  EXPECT_TRUE(closing.lost().ok()) << "a close is not a lost connection";
  EXPECT_EQ(closing.CheckUsable(kClosed), kClosed);
}

TEST(SessionHealthTest, ClosedComesFirst) {
  SessionHealth health;
  health.OnDaemonError(absl::AbortedError("job gone"), /*waited=*/false);
  health.BeginClose();
  EXPECT_EQ(health.CheckUsable(kClosed), kClosed);
}

}  // namespace
}  // namespace fuyou::internal
