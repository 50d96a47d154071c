#include "storage/uring_ring.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cerrno>
#include <vector>

namespace fuyou::storage::internal {
namespace {

// Submits a no-op tagged `tag`.
void SubmitNop(UringRing& ring, uint64_t tag) {
  io_uring_sqe* sqe = ring.NextEntry();
  ASSERT_NE(sqe, nullptr);
  io_uring_prep_nop(sqe);
  io_uring_sqe_set_data64(sqe, tag);
  ring.Submit();
}

TEST(UringRingTest, CompletionsComeBackWithTheirUserData) {
  absl::StatusOr<std::unique_ptr<UringRing>> ring = UringRing::Create(4, "test");
  ASSERT_TRUE(ring.ok()) << ring.status();
  SubmitNop(**ring, 7);
  SubmitNop(**ring, 9);
  std::vector<uint64_t> seen;
  std::vector<UringRing::Completion> batch;
  while (seen.size() < 2) {
    (*ring)->WaitForCompletions(batch);
    EXPECT_FALSE(batch.empty());
    for (const UringRing::Completion& c : batch) {
      EXPECT_EQ(c.res, 0);
      seen.push_back(c.user_data);
    }
  }
  std::sort(seen.begin(), seen.end());
  EXPECT_EQ(seen, (std::vector<uint64_t>{7, 9}));
}

TEST(UringRingTest, AFullSubmissionQueueGivesNoEntry) {
  absl::StatusOr<std::unique_ptr<UringRing>> ring = UringRing::Create(2, "test");
  ASSERT_TRUE(ring.ok()) << ring.status();
  ASSERT_NE((*ring)->NextEntry(), nullptr);
  ASSERT_NE((*ring)->NextEntry(), nullptr);
  EXPECT_EQ((*ring)->NextEntry(), nullptr);
}

TEST(UringRingTest, ARingThatCannotBeSetUpIsAnErrorNamingIt) {
  // 0 entries: io_uring_setup refuses with EINVAL.
  absl::StatusOr<std::unique_ptr<UringRing>> ring = UringRing::Create(0, "nvme9");
  ASSERT_FALSE(ring.ok());
  EXPECT_NE(ring.status().message().find("io_uring_queue_init(0) for nvme9"), std::string::npos) << ring.status();
}

TEST(UringRingTest, ErrnoToIoStatusNamesWhatFailed) {
  const absl::Status status = ErrnoToIoStatus(ENOSPC, "write of /x");
  EXPECT_FALSE(status.ok());
  EXPECT_NE(status.message().find("write of /x failed"), std::string::npos) << status;
  EXPECT_NE(status.message().find("errno 28"), std::string::npos) << status;
}

}  // namespace
}  // namespace fuyou::storage::internal
