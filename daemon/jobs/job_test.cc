#include "jobs/job.h"

#include <gtest/gtest.h>
#include <unistd.h>

#include <fstream>
#include <functional>
#include <vector>

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
    EXPECT_EQ((*job)->manifest().chunks(0).extents(1).offset(), *ChunkStateBytes(1000));
    EXPECT_EQ((*job)->manifest().chunks(1).extents(0).offset(), 2 * *ChunkStateBytes(1000));
    const uint64_t total = 2 * *ChunkStateBytes(1000) + 2 * *ChunkStateBytes(5);
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

// Issue 8, item 2: 12 * n and its rounding are checked; the element count is
// capped before it is multiplied.
TEST(ChunkSizeTest, SizesAreCheckedNotWrapped) {
  EXPECT_EQ(ChunkPayloadBytes(1), 12u);
  EXPECT_EQ(ChunkStateBytes(1), 4096u);
  EXPECT_EQ(ChunkStateBytes(342), 8192u);  // 4104 bytes of payload
  EXPECT_EQ(ChunkStateBytes(kMaxChunkElements), kMaxChunkElements * 12);
  EXPECT_FALSE(ChunkStateBytes(kMaxChunkElements + 1));
  EXPECT_FALSE(ChunkStateBytes((uint64_t{1} << 62) + 1));  // 12 * n wraps to 12 unchecked
  EXPECT_FALSE(ChunkPayloadBytes(UINT64_MAX));
}

TEST_F(JobTest, AddChunkRefusesSizesThatWrapAndReservesNothing) {
  auto job = Job::Open(roots_, "gpt", ::getuid(), true, *io_, *stats_);
  ASSERT_TRUE(job.ok()) << job.status();
  v1::JobManifest next = (*job)->manifest();
  const std::string before = next.SerializeAsString();
  for (uint64_t n : {(uint64_t{1} << 62) + 1, UINT64_MAX, kMaxChunkElements + 1}) {
    absl::Status added = (*job)->AddChunk(next, 1, n, DType::kFloat32, DType::kFloat32);
    EXPECT_EQ(added.code(), absl::StatusCode::kInvalidArgument) << n << ": " << added;
    EXPECT_EQ(next.SerializeAsString(), before) << n;
  }
}

// A manifest with two well-formed chunks (ids 1 and 2, 1000 and 10 elements).
v1::JobManifest GoodManifest() {
  v1::JobManifest manifest;
  manifest.set_name("gpt");
  uint64_t offset = 0;
  uint32_t id = 1;
  for (uint64_t n : {1000, 10}) {
    v1::ChunkRecord* record = manifest.add_chunks();
    record->set_chunk_id(id++);
    record->set_num_elements(n);
    record->set_param_dtype(v1::DTYPE_FLOAT32);
    record->set_grad_dtype(v1::DTYPE_FLOAT32);
    for (int version = 0; version < 2; ++version) {
      v1::StateExtent* extent = record->add_extents();
      extent->set_offset(offset);
      extent->set_length(*ChunkStateBytes(n));
      offset += *ChunkStateBytes(n);
    }
  }
  manifest.set_state_bytes(offset);
  return manifest;
}

TEST(ValidateManifestTest, ImpossibleChunkRecordsAreDataLoss) {
  ASSERT_TRUE(ValidateManifest(GoodManifest()).ok()) << ValidateManifest(GoodManifest());
  struct Case {
    const char* what;
    std::function<void(v1::JobManifest&)> damage;
  };
  const std::vector<Case> cases = {
      {"2^62+1 elements", [](v1::JobManifest& m) { m.mutable_chunks(1)->set_num_elements((uint64_t{1} << 62) + 1); }},
      {"no elements", [](v1::JobManifest& m) { m.mutable_chunks(1)->set_num_elements(0); }},
      {"12 * n > extent length", [](v1::JobManifest& m) { m.mutable_chunks(1)->set_num_elements(342); }},
      {"one extent", [](v1::JobManifest& m) { m.mutable_chunks(1)->mutable_extents()->RemoveLast(); }},
      {"three extents", [](v1::JobManifest& m) { *m.mutable_chunks(1)->add_extents() = m.chunks(1).extents(0); }},
      {"beyond state_bytes", [](v1::JobManifest& m) { m.set_state_bytes(m.state_bytes() - 4096); }},
      {"offset + length wraps",
       [](v1::JobManifest& m) { m.mutable_chunks(1)->mutable_extents(1)->set_offset(UINT64_MAX - 4095); }},
      {"overlap", [](v1::JobManifest& m) { m.mutable_chunks(1)->mutable_extents(0)->set_offset(4096); }},
      {"unaligned", [](v1::JobManifest& m) { m.mutable_chunks(1)->mutable_extents(0)->set_offset(8193 + 4096); }},
      {"duplicate id", [](v1::JobManifest& m) { m.mutable_chunks(1)->set_chunk_id(1); }},
      {"update count", [](v1::JobManifest& m) { m.mutable_chunks(1)->set_update_count(kMaxUpdateCount + 1); }},
      {"negative update count", [](v1::JobManifest& m) { m.mutable_chunks(1)->set_update_count(-1); }},
      {"committed version", [](v1::JobManifest& m) { m.mutable_chunks(1)->set_committed_version(2); }},
      {"dtype", [](v1::JobManifest& m) { m.mutable_chunks(1)->set_grad_dtype(static_cast<v1::DType>(9)); }},
  };
  {
    v1::JobManifest manifest = GoodManifest();
    manifest.add_path_bytes(UINT64_MAX);
    manifest.add_path_bytes(1);
    EXPECT_EQ(ValidateManifest(manifest).code(), absl::StatusCode::kDataLoss);
  }
  for (const Case& c : cases) {
    v1::JobManifest manifest = GoodManifest();
    c.damage(manifest);
    absl::Status status = ValidateManifest(manifest);
    EXPECT_EQ(status.code(), absl::StatusCode::kDataLoss) << c.what << ": " << status;
    EXPECT_NE(status.message().find("job 'gpt'"), std::string::npos) << c.what << ": " << status;
    EXPECT_NE(status.message().find("chunk "), std::string::npos) << c.what << ": " << status;
  }
}

// A manifest with a valid checksum but an impossible chunk (as the overflow of
// issue 8 left on disk) is refused at Open, not used.
TEST_F(JobTest, OpenRefusesAManifestWithImpossibleChunks) {
  {
    auto job = Job::Open(roots_, "gpt", ::getuid(), true, *io_, *stats_);
    ASSERT_TRUE(job.ok()) << job.status();
    v1::JobManifest next = (*job)->manifest();
    ASSERT_TRUE((*job)->AddChunk(next, 7, 1000, DType::kFloat32, DType::kFloat32).ok());
    next.mutable_chunks(0)->set_num_elements((uint64_t{1} << 62) + 1);  // what the bug wrote
    ASSERT_TRUE((*job)->Commit(next).ok());
  }
  auto reopened = Job::Open(roots_, "gpt", ::getuid(), false, *io_, *stats_);
  EXPECT_EQ(reopened.status().code(), absl::StatusCode::kDataLoss) << reopened.status();
  EXPECT_NE(reopened.status().message().find("job 'gpt'"), std::string::npos) << reopened.status();
  EXPECT_NE(reopened.status().message().find("chunk 7"), std::string::npos) << reopened.status();
}

TEST_F(JobTest, BadNamesAreRefused) {
  for (const char* name : {"", ".hidden", "a/b", "x y", "../etc"}) {
    EXPECT_EQ(Job::Open(roots_, name, ::getuid(), true, *io_, *stats_).status().code(),
              absl::StatusCode::kInvalidArgument)
        << name;
  }
  // A long or hostile name comes back bounded and escaped, not whole.
  const std::string problem = JobNameProblem(std::string(10000, 'x') + "\x1b[2J");
  EXPECT_LT(problem.size(), 200u) << problem;
  EXPECT_NE(problem.find("(10004 bytes)"), std::string::npos) << problem;
  EXPECT_NE(JobNameProblem("bad\x1bname").find("'bad\\x1bname'"), std::string::npos) << JobNameProblem("bad\x1bname");
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
  EXPECT_GE(*freed, 2 * *ChunkStateBytes(100000));
  EXPECT_FALSE(fs::exists(roots_[0] / "jobs" / "gpt"));
  EXPECT_FALSE(fs::exists(roots_[1] / "jobs" / "gpt"));
  EXPECT_EQ((*registry)->Delete("gpt", ::getuid()).status().code(), absl::StatusCode::kNotFound);
}

}  // namespace
}  // namespace fuyou
