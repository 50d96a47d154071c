#include "session/session_quota.h"

#include <gtest/gtest.h>

#include <string>
#include <vector>

namespace fuyou {
namespace {

constexpr uint64_t kMiB = uint64_t{1} << 20;

SessionLimits SmallLimits() {
  SessionLimits limits;
  limits.max_sessions = 4;
  limits.max_sessions_per_user = 2;
  limits.max_segment_bytes_per_user = 10 * kMiB;
  limits.max_client_info_bytes = 100;
  return limits;
}

void ExpectRefusal(const absl::StatusOr<SessionQuota::Hold>& hold, const std::vector<std::string>& words) {
  ASSERT_FALSE(hold.ok());
  EXPECT_EQ(hold.status().code(), absl::StatusCode::kResourceExhausted);
  for (const std::string& word : words) {
    EXPECT_NE(hold.status().message().find(word), std::string::npos) << word << " in: " << hold.status().message();
  }
}

TEST(SessionQuotaTest, BoundsTheSessionsOfOneUser) {
  SessionQuota quota(SmallLimits());
  auto first = quota.Take(1000, kMiB);
  auto second = quota.Take(1000, kMiB);
  ASSERT_TRUE(first.ok() && second.ok());
  ExpectRefusal(quota.Take(1000, kMiB), {"max_sessions_per_user = 2", "uid 1000 already has 2", "--max-sessions-per-user"});
  EXPECT_TRUE(quota.Take(1001, kMiB).ok()) << "another user is not bound by the first one's sessions";
  first->Reset();
  EXPECT_TRUE(quota.Take(1000, kMiB).ok()) << "a closed session gives its place back";
}

TEST(SessionQuotaTest, BoundsTheSegmentBytesOfOneUser) {
  SessionQuota quota(SmallLimits());
  auto big = quota.Take(1000, 6 * kMiB);
  ASSERT_TRUE(big.ok());
  ExpectRefusal(quota.Take(1000, 5 * kMiB),
                {"max_segment_bytes_per_user = 10485760", "6291456 bytes are in use", "--max-segment-bytes-per-user"});
  auto exact = quota.Take(1000, 4 * kMiB);
  EXPECT_TRUE(exact.ok()) << "exactly at the limit is allowed";
  EXPECT_EQ(quota.UsageOf(1000).segment_bytes, 10 * kMiB);
  ExpectRefusal(quota.Take(1001, UINT64_MAX), {"max_segment_bytes_per_user"});
}

TEST(SessionQuotaTest, BoundsTheSessionsOfAllUsers) {
  SessionQuota quota(SmallLimits());
  std::vector<SessionQuota::Hold> holds;
  for (uid_t uid : {1000, 1000, 1001, 1001}) {
    auto hold = quota.Take(uid, kMiB);
    ASSERT_TRUE(hold.ok());
    holds.push_back(std::move(*hold));
  }
  ExpectRefusal(quota.Take(1002, kMiB), {"max_sessions = 4", "already has 4 live sessions", "--max-sessions"});
  EXPECT_EQ(quota.total_sessions(), 4u);
  holds.clear();
  EXPECT_EQ(quota.total_sessions(), 0u);
  EXPECT_EQ(quota.UsageOf(1000).sessions, 0u);
  EXPECT_EQ(quota.UsageOf(1000).segment_bytes, 0u);
}

TEST(SessionQuotaTest, ARefusalTakesNothing) {
  SessionQuota quota(SmallLimits());
  auto hold = quota.Take(1000, 9 * kMiB);
  ASSERT_TRUE(hold.ok());
  EXPECT_FALSE(quota.Take(1000, 2 * kMiB).ok());
  EXPECT_EQ(quota.UsageOf(1000).sessions, 1u);
  EXPECT_EQ(quota.UsageOf(1000).segment_bytes, 9 * kMiB);
  EXPECT_EQ(quota.total_sessions(), 1u);
}

TEST(SessionQuotaTest, MovedHoldsGiveTheirPlaceBackOnce) {
  SessionQuota quota(SmallLimits());
  {
    auto hold = quota.Take(1000, kMiB);
    ASSERT_TRUE(hold.ok());
    SessionQuota::Hold moved = std::move(*hold);
    SessionQuota::Hold assigned;
    assigned = std::move(moved);
    EXPECT_EQ(quota.total_sessions(), 1u);
  }
  EXPECT_EQ(quota.total_sessions(), 0u);
}

TEST(SessionQuotaTest, ClientInfoIsBounded) {
  SessionQuota quota(SmallLimits());
  EXPECT_TRUE(quota.CheckClientInfo(100).ok());
  absl::Status refused = quota.CheckClientInfo(101);
  EXPECT_EQ(refused.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_NE(refused.message().find("max_client_info_bytes = 100"), std::string::npos) << refused.message();
  EXPECT_NE(refused.message().find("101 bytes"), std::string::npos) << refused.message();
}

TEST(SessionQuotaTest, JournalBytesAreBoundedPerUser) {
  SessionLimits limits = SmallLimits();
  limits.max_journal_bytes_per_user = 1000;
  SessionQuota quota(limits);
  EXPECT_TRUE(quota.TakeJournal(7, 600).ok());
  absl::Status refused = quota.TakeJournal(7, 401);
  EXPECT_EQ(refused.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_NE(refused.message().find("max_journal_bytes_per_user = 1000"), std::string::npos) << refused.message();
  EXPECT_NE(refused.message().find("600 bytes are journaled"), std::string::npos) << refused.message();
  EXPECT_TRUE(quota.TakeJournal(8, 1000).ok());  // another user has a budget of its own
  EXPECT_TRUE(quota.TakeJournal(7, 400).ok());
  EXPECT_EQ(quota.JournalBytesOf(7), 1000u);
  quota.GiveJournal(7, 1000);
  EXPECT_EQ(quota.JournalBytesOf(7), 0u);
  EXPECT_TRUE(quota.TakeJournal(7, 1000).ok());
}

TEST(SessionQuotaTest, ActivationScratchIsBoundedPerUserApartFromJournals) {
  SessionLimits limits = SmallLimits();
  limits.max_activation_bytes_per_user = 8192;
  limits.max_journal_bytes_per_user = 1000;
  SessionQuota quota(limits);
  EXPECT_TRUE(quota.TakeActivations(7, 4096).ok());
  absl::Status refused = quota.TakeActivations(7, 8192);
  EXPECT_EQ(refused.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_NE(refused.message().find("max_activation_bytes_per_user = 8192"), std::string::npos) << refused.message();
  EXPECT_NE(refused.message().find("4096 bytes are spilled"), std::string::npos) << refused.message();
  EXPECT_EQ(quota.TakeActivations(7, UINT64_MAX).code(), absl::StatusCode::kResourceExhausted);  // no overflow
  EXPECT_TRUE(quota.TakeJournal(7, 1000).ok());  // journals are counted apart
  EXPECT_TRUE(quota.TakeActivations(8, 8192).ok());  // another user has a budget of its own
  EXPECT_TRUE(quota.TakeActivations(7, 4096).ok());
  EXPECT_EQ(quota.ActivationBytesOf(7), 8192u);
  quota.GiveActivations(7, 8192);
  EXPECT_EQ(quota.ActivationBytesOf(7), 0u);
}

}  // namespace
}  // namespace fuyou
