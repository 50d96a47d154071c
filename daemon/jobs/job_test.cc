#include "jobs/job.h"

#include <gtest/gtest.h>
#include <unistd.h>

#include <fstream>

#include "jobs/job_registry.h"
#include "stats/daemon_stats.h"

namespace fuyou {
namespace {
namespace fs = std::filesystem;

class JobTest : public ::testing::Test {
 protected:
  void SetUp() override {
    char pattern[] = "/tmp/fuyou-job-test-XXXXXX";
    ASSERT_NE(::mkdtemp(pattern), nullptr);
    root_ = pattern;
    roots_ = {root_ / "a", root_ / "b"};
    stats_ = std::make_unique<DaemonStats>(roots_);
    auto io = storage::IoEngine::Create({});
    ASSERT_TRUE(io.ok()) << io.status();
    io_ = std::move(*io);
  }
  void TearDown() override {
    io_.reset();
    fs::remove_all(root_);
  }

  fs::path root_;
  std::vector<fs::path> roots_;
  std::unique_ptr<DaemonStats> stats_;
  std::unique_ptr<storage::IoEngine> io_;
};

TEST_F(JobTest, ChunksAreStripedAndSurviveReopen) {
  {
    auto job = Job::Open(roots_, "gpt", ::getuid(), true, *io_, *stats_);
    ASSERT_TRUE(job.ok()) << job.status();
    v1::JobManifest next = (*job)->manifest();
    ASSERT_TRUE((*job)->AddChunk(next, 10, 1000, DType::kFloat32, DType::kBFloat16).ok());
    ASSERT_TRUE((*job)->AddChunk(next, 11, 5, DType::kFloat16, DType::kFloat16).ok());
    next.set_committed_step(7);
    ASSERT_TRUE((*job)->Commit(next).ok());
    // Each chunk has two extents, one after the other in the job's state space,
    // which is striped over both storage paths: each holds its share.
    EXPECT_EQ((*job)->manifest().chunks(0).extents(1).offset(), ChunkStateBytes(1000));
    EXPECT_EQ((*job)->manifest().chunks(1).extents(0).offset(), 2 * ChunkStateBytes(1000));
    const uint64_t total = 2 * ChunkStateBytes(1000) + 2 * ChunkStateBytes(5);
    EXPECT_EQ((*job)->manifest().state_bytes(), total);
    EXPECT_EQ((*job)->manifest().path_bytes(0) + (*job)->manifest().path_bytes(1), total);
  }
  auto reopened = Job::Open(roots_, "gpt", ::getuid(), false, *io_, *stats_);
  ASSERT_TRUE(reopened.ok()) << reopened.status();
  EXPECT_EQ((*reopened)->manifest().committed_step(), 7);
  EXPECT_EQ((*reopened)->FindChunk(11), 1);
  EXPECT_EQ((*reopened)->FindChunk(12), -1);
}

TEST_F(JobTest, CorruptManifestIsDataLossNotGarbage) {
  {
    auto job = Job::Open(roots_, "gpt", ::getuid(), true, *io_, *stats_);
    ASSERT_TRUE(job.ok());
  }
  fs::path manifest = roots_[0] / "jobs" / "gpt" / "manifest.pb";
  std::fstream file(manifest, std::ios::in | std::ios::out | std::ios::binary);
  file.seekp(10);
  file.put('\x7f');
  file.close();
  auto reopened = Job::Open(roots_, "gpt", ::getuid(), false, *io_, *stats_);
  EXPECT_EQ(reopened.status().code(), absl::StatusCode::kDataLoss);
  EXPECT_NE(reopened.status().message().find("gpt"), std::string::npos);
}

TEST_F(JobTest, BadNamesAreRefused) {
  for (const char* name : {"", ".hidden", "a/b", "x y", "../etc"}) {
    EXPECT_EQ(Job::Open(roots_, name, ::getuid(), true, *io_, *stats_).status().code(),
              absl::StatusCode::kInvalidArgument)
        << name;
  }
}

TEST_F(JobTest, RegistryAllowsOneSessionPerJobAndDeletesFiles) {
  auto registry = JobRegistry::Create(roots_, *io_, *stats_);
  ASSERT_TRUE(registry.ok());
  auto job = (*registry)->Acquire("gpt", ::getuid());
  ASSERT_TRUE(job.ok());
  EXPECT_EQ((*registry)->Acquire("gpt", ::getuid()).status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ((*registry)->Delete("gpt", ::getuid()).status().code(), absl::StatusCode::kFailedPrecondition);
  v1::JobManifest next = (*job)->manifest();
  ASSERT_TRUE((*job)->AddChunk(next, 0, 100000, DType::kFloat32, DType::kFloat32).ok());
  ASSERT_TRUE((*job)->Commit(next).ok());
  job->reset();
  (*registry)->Release("gpt");
  auto jobs = (*registry)->List();
  ASSERT_TRUE(jobs.ok());
  ASSERT_EQ(jobs->size(), 1u);
  EXPECT_EQ((*jobs)[0].parameters(), 100000u);
  auto freed = (*registry)->Delete("gpt", ::getuid());
  ASSERT_TRUE(freed.ok()) << freed.status();
  EXPECT_GE(*freed, 2 * ChunkStateBytes(100000));
  EXPECT_FALSE(fs::exists(roots_[0] / "jobs" / "gpt"));
  EXPECT_FALSE(fs::exists(roots_[1] / "jobs" / "gpt"));
  EXPECT_EQ((*registry)->Delete("gpt", ::getuid()).status().code(), absl::StatusCode::kNotFound);
}

}  // namespace
}  // namespace fuyou
