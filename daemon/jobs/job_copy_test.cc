#include "jobs/job_copy.h"

#include <gtest/gtest.h>
#include <unistd.h>

#include <cstring>
#include <vector>

#include "jobs/job_registry.h"
#include "stats/daemon_stats.h"
#include "storage/aligned_buffer.h"
#include "test_support/temp_dir.h"

namespace fuyou {
namespace {
namespace fs = std::filesystem;

class JobCopyTest : public ::testing::Test {
 protected:
  void SetUp() override {
    roots_ = {root_ / "a", root_ / "b"};
    for (const fs::path& root : roots_) fs::create_directories(root);
    stats_ = std::make_unique<DaemonStats>(roots_);
    auto io = storage::IoEngine::Create({});
    ASSERT_TRUE(io.ok()) << io.status();
    io_ = std::move(*io);
    auto registry = JobRegistry::Create(roots_, *io_, *stats_, JobRegistryOptions{.max_jobs_per_user = 3});
    ASSERT_TRUE(registry.ok()) << registry.status();
    registry_ = std::move(*registry);
  }
  void TearDown() override {
    registry_.reset();
    io_.reset();
  }

  // Job `name` of uid 1000: chunk 7 (1000 elements, one segment at 3 updates,
  // one at 5) whose committed extent holds bytes `fill`, committed at step 5.
  // With `stores_weights`, the chunk keeps its working weights (bf16) too, and
  // its extent a weights checksum of 5678.
  void MakeJob(const std::string& name, std::byte fill, bool stores_weights = false) {
    auto job = registry_->Acquire(name, kUid);
    ASSERT_TRUE(job.ok()) << job.status();
    v1::JobManifest next = (*job)->manifest();
    ASSERT_TRUE((*job)->AddChunk(next, 7, 1000, stores_weights ? DType::kBFloat16 : DType::kFloat32,
                                 DType::kFloat32, stores_weights).ok());
    v1::ChunkRecord& record = *next.mutable_chunks(0);
    record.add_segment_elements(400);
    record.add_segment_elements(600);
    record.set_update_count(5);
    record.add_segment_update_counts(3);
    record.add_segment_update_counts(5);
    record.set_layout_fingerprint(0xfeed);
    const v1::StateExtent& extent = CommittedExtent(record);
    auto buffer = storage::AlignedBuffer::Allocate(extent.length());
    ASSERT_TRUE(buffer.ok());
    std::memset(buffer->data(), static_cast<int>(fill), extent.length());
    ASSERT_TRUE((*job)->states().Write(extent.offset(), buffer->span().first(extent.length())).ok());
    record.mutable_extents(0)->set_checksum(1234);
    if (stores_weights) record.mutable_extents(0)->set_weights_checksum(5678);
    next.set_committed_step(5);
    ASSERT_TRUE((*job)->Commit(next).ok());
    registry_->Release(**job);
  }

  static constexpr uid_t kUid = 1000;
  const TempDir temp_dir_{"fuyou-job-copy-test"};
  const fs::path root_ = temp_dir_.path();
  std::vector<fs::path> roots_;
  std::unique_ptr<DaemonStats> stats_;
  std::unique_ptr<storage::IoEngine> io_;
  std::unique_ptr<JobRegistry> registry_;
};

TEST_F(JobCopyTest, ACopyHasTheCommittedStatesCountsAndStep) {
  MakeJob("src", std::byte{0x5a});
  auto copied = registry_->Copy("src", "dst", kUid);
  ASSERT_TRUE(copied.ok()) << copied.status();
  auto dst = Job::Open(roots_, "dst", kUid, /*create=*/false, *io_, *stats_);
  ASSERT_TRUE(dst.ok()) << dst.status();
  const v1::JobManifest& manifest = (*dst)->manifest();
  EXPECT_EQ(manifest.name(), "dst");
  EXPECT_EQ(manifest.committed_step(), 5);
  ASSERT_EQ(manifest.chunks_size(), 1);
  const v1::ChunkRecord& record = manifest.chunks(0);
  EXPECT_EQ(record.chunk_id(), 7u);
  EXPECT_EQ(record.update_count(), 5);
  EXPECT_EQ(std::vector<int64_t>(record.segment_update_counts().begin(), record.segment_update_counts().end()),
            (std::vector<int64_t>{3, 5}));
  EXPECT_EQ(record.segment_elements_size(), 2);
  EXPECT_EQ(record.layout_fingerprint(), 0xfeedu);
  const v1::StateExtent& extent = CommittedExtent(record);
  EXPECT_EQ(extent.checksum(), 1234u);
  EXPECT_EQ(*copied, extent.length());
  auto buffer = storage::AlignedBuffer::Allocate(extent.length());
  ASSERT_TRUE(buffer.ok());
  ASSERT_TRUE((*dst)->states().Read(extent.offset(), buffer->span().first(extent.length())).ok());
  for (uint64_t i = 0; i < extent.length(); ++i) ASSERT_EQ(buffer->data()[i], std::byte{0x5a}) << i;
}

// Issue 12: a chunk's working weights travel with its extent, and the copy
// stores them as the source did.
TEST_F(JobCopyTest, ACopyKeepsAChunksWorkingWeights) {
  MakeJob("src", std::byte{0x3c}, /*stores_weights=*/true);
  auto copied = registry_->Copy("src", "dst", kUid);
  ASSERT_TRUE(copied.ok()) << copied.status();
  auto dst = Job::Open(roots_, "dst", kUid, /*create=*/false, *io_, *stats_);
  ASSERT_TRUE(dst.ok()) << dst.status();
  const v1::ChunkRecord& record = (*dst)->manifest().chunks(0);
  EXPECT_TRUE(record.stores_weights());
  EXPECT_EQ(record.param_dtype(), v1::DTYPE_BFLOAT16);
  const v1::StateExtent& extent = CommittedExtent(record);
  EXPECT_EQ(extent.length(), 12288u + 4096u);
  EXPECT_EQ(extent.checksum(), 1234u);
  EXPECT_EQ(extent.weights_checksum(), 5678u);
  EXPECT_EQ(*copied, extent.length());
  auto buffer = storage::AlignedBuffer::Allocate(extent.length());
  ASSERT_TRUE(buffer.ok());
  ASSERT_TRUE((*dst)->states().Read(extent.offset(), buffer->span().first(extent.length())).ok());
  for (uint64_t i = 0; i < extent.length(); ++i) ASSERT_EQ(buffer->data()[i], std::byte{0x3c}) << i;
}

TEST_F(JobCopyTest, RefusalsChangeNothing) {
  MakeJob("src", std::byte{1});
  MakeJob("other", std::byte{2});
  // dst exists.
  auto exists = registry_->Copy("src", "other", kUid);
  EXPECT_EQ(exists.status().code(), absl::StatusCode::kAlreadyExists) << exists.status();
  // src missing, or only another user's.
  EXPECT_EQ(registry_->Copy("none", "x", kUid).status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(registry_->Copy("src", "x", kUid + 1).status().code(), absl::StatusCode::kNotFound);
  // src open in a session.
  auto held = registry_->Acquire("src", kUid);
  ASSERT_TRUE(held.ok());
  auto open = registry_->Copy("src", "x", kUid);
  EXPECT_EQ(open.status().code(), absl::StatusCode::kFailedPrecondition) << open.status();
  EXPECT_NE(open.status().message().find("open in a session"), std::string::npos) << open.status();
  registry_->Release(**held);
  // Onto itself, or a bad name.
  EXPECT_EQ(registry_->Copy("src", "src", kUid).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(registry_->Copy("src", "../x", kUid).status().code(), absl::StatusCode::kInvalidArgument);
  // The per-user job limit (3) counts the copy.
  ASSERT_TRUE(registry_->Copy("src", "third", kUid).ok());
  auto limit = registry_->Copy("src", "fourth", kUid);
  EXPECT_EQ(limit.status().code(), absl::StatusCode::kResourceExhausted) << limit.status();
  auto listed = registry_->List(kUid);
  ASSERT_TRUE(listed.ok());
  EXPECT_EQ(listed->size(), 3u);
  EXPECT_TRUE(registry_->List(kUid + 1)->empty());
}

}  // namespace
}  // namespace fuyou
