#include "jobs/job_edit.h"

#include <gtest/gtest.h>
#include <unistd.h>

#include <filesystem>

#include "stats/daemon_stats.h"
#include "test_support/temp_dir.h"

namespace fuyou {
namespace {
namespace fs = std::filesystem;

class JobEditTest : public ::testing::Test {
 protected:
  void SetUp() override {
    stats_ = std::make_unique<DaemonStats>(std::vector<fs::path>{root_});
    auto io = storage::IoEngine::Create({});
    ASSERT_TRUE(io.ok()) << io.status();
    io_ = std::move(*io);
    auto job = Job::Open({root_}, "job", 1000, /*create=*/true, *io_, *stats_);
    ASSERT_TRUE(job.ok()) << job.status();
    job_ = std::move(*job);
  }
  void TearDown() override {
    job_.reset();
    io_.reset();
  }
  const TempDir temp_dir_{"fuyou-job-edit-test"};
  const fs::path root_ = temp_dir_.path();
  std::unique_ptr<DaemonStats> stats_;
  std::unique_ptr<storage::IoEngine> io_;
  std::unique_ptr<Job> job_;
};

TEST_F(JobEditTest, ShadowWrittenFlipsTheCommittedExtentAtCommit) {
  {
    JobEdit edit(*job_);
    ASSERT_TRUE(edit.AddChunk(3, 100, DType::kFloat32, DType::kBFloat16, 77).ok());
    edit.InitialStatesWritten(3, {111});
    ASSERT_TRUE(edit.Commit().ok());
  }
  const v1::ChunkRecord* record = job_->FindRecord(3);
  ASSERT_NE(record, nullptr);
  EXPECT_EQ(record->committed_version(), 0u);
  EXPECT_EQ(CommittedExtent(*record).checksum(), 111u);
  EXPECT_EQ(record->layout_fingerprint(), 77u);
  EXPECT_EQ(ShadowVersion(*record), 1u);
  EXPECT_FALSE(record->stores_weights());

  JobEdit step(*job_);
  step.ShadowWritten(3, {222});
  step.SetUpdateCount(3, 1);
  step.SetCommittedStep(1);
  EXPECT_EQ(job_->FindRecord(3)->committed_version(), 0u);  // nothing changes before Commit
  ASSERT_TRUE(step.Commit().ok());
  record = job_->FindRecord(3);
  EXPECT_EQ(record->committed_version(), 1u);
  EXPECT_EQ(CommittedExtent(*record).checksum(), 222u);
  EXPECT_EQ(ShadowExtent(*record).checksum(), 111u);  // the old committed extent is the next shadow
  EXPECT_EQ(record->update_count(), 1);
  EXPECT_EQ(job_->manifest().committed_step(), 1);
}

// Issue 12: a chunk that stores its working weights records it, and both
// checksums of each extent it writes.
TEST_F(JobEditTest, AChunkWithWeightsRecordsBothChecksums) {
  {
    JobEdit edit(*job_);
    ASSERT_TRUE(edit.AddChunk(4, 100, DType::kBFloat16, DType::kBFloat16, 0, /*stores_weights=*/true).ok());
    edit.InitialStatesWritten(4, {.states = 111, .weights = 112});
    ASSERT_TRUE(edit.Commit().ok());
  }
  const v1::ChunkRecord* record = job_->FindRecord(4);
  ASSERT_NE(record, nullptr);
  EXPECT_TRUE(record->stores_weights());
  EXPECT_EQ(CommittedExtent(*record).length(), 4096u + 4096u);
  EXPECT_EQ(CommittedExtent(*record).weights_checksum(), 112u);
  JobEdit step(*job_);
  step.ShadowWritten(4, {.states = 221, .weights = 222});
  ASSERT_TRUE(step.Commit().ok());
  record = job_->FindRecord(4);
  EXPECT_EQ(CommittedExtent(*record).checksum(), 221u);
  EXPECT_EQ(CommittedExtent(*record).weights_checksum(), 222u);
  EXPECT_EQ(ShadowExtent(*record).weights_checksum(), 112u);
}

TEST_F(JobEditTest, AnUncommittedEditGivesItsReservationsBack) {
  {
    JobEdit edit(*job_);
    ASSERT_TRUE(edit.AddChunk(0, 100000, DType::kFloat32, DType::kFloat32, 0).ok());
    EXPECT_TRUE(edit.changed());
    EXPECT_GT(job_->states().size(), 0u);
  }
  EXPECT_EQ(job_->states().size(), 0u);
  EXPECT_EQ(job_->FindRecord(0), nullptr);
}

TEST_F(JobEditTest, OnlyRealChangesCount) {
  {
    JobEdit edit(*job_);
    ASSERT_TRUE(edit.AddChunk(0, 100, DType::kFloat32, DType::kFloat32, 0).ok());
    ASSERT_TRUE(edit.Commit().ok());
  }
  JobEdit edit(*job_);
  edit.SetDTypes(0, DType::kFloat32, DType::kFloat32);
  EXPECT_FALSE(edit.changed());
  edit.AdoptLayoutFingerprint(0, 0);  // nothing to adopt
  EXPECT_FALSE(edit.changed());
  edit.AdoptLayoutFingerprint(0, 9);
  EXPECT_TRUE(edit.changed());
  edit.AdoptLayoutFingerprint(0, 10);  // a stored fingerprint is kept
  EXPECT_EQ(edit.Find(0)->layout_fingerprint(), 9u);
}

TEST_F(JobEditTest, SegmentCountsAreStoredOnlyWhenTheyDiffer) {
  {
    JobEdit edit(*job_);
    ASSERT_TRUE(edit.AddChunk(0, 100, DType::kFloat32, DType::kFloat32, 0).ok());
    ASSERT_TRUE(edit.Commit().ok());
  }
  JobEdit edit(*job_);
  const std::vector<int64_t> differ = {4, 3, 4};
  edit.SetSegmentUpdateCounts(0, differ);
  EXPECT_EQ(edit.Find(0)->update_count(), 4);
  EXPECT_EQ(edit.Find(0)->segment_update_counts_size(), 3);
  const std::vector<int64_t> same = {5, 5};
  edit.SetSegmentUpdateCounts(0, same);
  EXPECT_EQ(edit.Find(0)->update_count(), 5);
  EXPECT_EQ(edit.Find(0)->segment_update_counts_size(), 0);
}

TEST(ChunkLayoutTest, StatesLieOneAfterAnother) {
  std::vector<std::byte> bytes(*ChunkPayloadBytes(10));
  ChunkStates states(bytes.data(), 10);
  EXPECT_EQ(reinterpret_cast<std::byte*>(states.master()), bytes.data());
  EXPECT_EQ(reinterpret_cast<std::byte*>(states.exp_avg()), bytes.data() + 40);
  EXPECT_EQ(reinterpret_cast<std::byte*>(states.exp_avg_sq()), bytes.data() + 80);
  EXPECT_EQ(*ChunkPayloadBytes(10), kChunkStateCount * kStateElementBytes * 10);
}

}  // namespace
}  // namespace fuyou
