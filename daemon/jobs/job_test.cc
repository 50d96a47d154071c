#include "jobs/job.h"

#include <fcntl.h>
#include <gtest/gtest.h>
#include <sys/mount.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <unistd.h>

#include <fstream>
#include <functional>
#include <vector>

#include "jobs/job_registry.h"
#include "common/status_util.h"
#include "stats/daemon_stats.h"
#include "test_support/temp_dir.h"

namespace fuyou {
namespace {
namespace fs = std::filesystem;

class JobTest : public ::testing::Test {
 protected:
  void SetUp() override {
    roots_ = {root_ / "a", root_ / "b"};
    for (const fs::path& root : roots_) fs::create_directories(root);
    stats_ = std::make_unique<DaemonStats>(roots_);
    auto io = storage::IoEngine::Create({});
    ASSERT_TRUE(io.ok()) << io.status();
    io_ = std::move(*io);
  }
  void TearDown() override { io_.reset(); }

  fs::path JobDir(size_t root, uid_t uid, const std::string& name) const {
    return roots_[root] / "users" / std::to_string(uid) / "jobs" / name;
  }
  // A job of `uid` with one committed chunk (so releasing it keeps it).
  void MakeJob(JobRegistry& registry, const std::string& name, uid_t uid, uint64_t elements = 1000) {
    auto job = registry.Acquire(name, uid);
    ASSERT_TRUE(job.ok()) << job.status();
    v1::JobManifest next = (*job)->manifest();
    ASSERT_TRUE((*job)->AddChunk(next, 0, elements, DType::kFloat32, DType::kFloat32).ok());
    ASSERT_TRUE((*job)->Commit(next).ok());
    registry.Release(**job);
  }
  std::string ReadText(const fs::path& path) {
    std::ifstream in(path);
    return std::string(std::istreambuf_iterator<char>(in), {});
  }
  const TempDir temp_dir_{"fuyou-job-test"};
  const fs::path root_ = temp_dir_.path();
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

TEST_F(JobTest, RollBackToGoesBackOneCommitAndNoFurther) {
  uint32_t version_at_1 = 2;
  {
    auto job = Job::Open(roots_, "dp.rank0-of2", ::getuid(), true, *io_, *stats_);
    ASSERT_TRUE(job.ok()) << job.status();
    v1::JobManifest next = (*job)->manifest();
    ASSERT_TRUE((*job)->AddChunk(next, 0, 1000, DType::kFloat32, DType::kFloat32).ok());
    ASSERT_TRUE((*job)->Commit(next).ok());  // step 0: nothing kept before it
    for (int64_t step = 1; step <= 2; ++step) {  // each step flips the chunk to its shadow
      if (step == 2) version_at_1 = (*job)->manifest().chunks(0).committed_version();
      next = (*job)->manifest();
      next.set_committed_step(step);
      next.mutable_chunks(0)->set_committed_version(ShadowVersion(next.chunks(0)));
      next.mutable_chunks(0)->set_update_count(step);
      ASSERT_TRUE((*job)->Commit(next).ok());
    }
    EXPECT_TRUE(fs::exists(JobDir(0, ::getuid(), "dp.rank0-of2") / "manifest.prev.pb"));
    EXPECT_TRUE((*job)->RollBackTo(2).ok());  // its own step: nothing to do
    absl::Status later = (*job)->RollBackTo(3);
    EXPECT_EQ(later.code(), absl::StatusCode::kFailedPrecondition) << later;
    absl::Status two_back = (*job)->RollBackTo(0);
    EXPECT_EQ(two_back.code(), absl::StatusCode::kFailedPrecondition) << two_back;
    EXPECT_NE(two_back.message().find("is at step 2, its previous manifest at step 1"), std::string::npos)
        << two_back;
    ASSERT_TRUE((*job)->RollBackTo(1).ok());
    EXPECT_EQ((*job)->manifest().committed_step(), 1);
  }
  // on disk: step 1's manifest (its extent version and count); and only once
  auto reopened = Job::Open(roots_, "dp.rank0-of2", ::getuid(), false, *io_, *stats_);
  ASSERT_TRUE(reopened.ok()) << reopened.status();
  EXPECT_EQ((*reopened)->manifest().committed_step(), 1);
  EXPECT_EQ((*reopened)->manifest().chunks(0).update_count(), 1);
  EXPECT_EQ((*reopened)->manifest().chunks(0).committed_version(), version_at_1);
  EXPECT_EQ((*reopened)->RollBackTo(0).code(), absl::StatusCode::kFailedPrecondition);
  reopened->reset();
  // and the job, previous manifest included, is deleted whole
  uint64_t freed = 0;
  auto jobs = storage::DirFd::OpenRoot(roots_[0]);
  ASSERT_TRUE(jobs.ok());
  auto user_jobs = OpenUserJobsDir(*jobs, ::getuid(), false);
  ASSERT_TRUE(user_jobs.ok()) << user_jobs.status();
  ASSERT_TRUE(Job::RemoveFiles(*user_jobs, "dp.rank0-of2", &freed).ok());
  EXPECT_FALSE(fs::exists(JobDir(0, ::getuid(), "dp.rank0-of2")));
}

TEST_F(JobTest, CorruptManifestIsDataLossNotGarbage) {
  {
    auto job = Job::Open(roots_, "gpt", ::getuid(), true, *io_, *stats_);
    ASSERT_TRUE(job.ok());
  }
  fs::path manifest = JobDir(0, ::getuid(), "gpt") / "manifest.pb";
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

// Issue 12: a chunk that stores its working weights has them after
// master|m|v, from a block boundary, in a region of their own; a chunk without
// them keeps the bytes it always had.
TEST(ChunkLayoutTest, TheWeightsFollowTheStatesOnABlockBoundary) {
  const ChunkLayout plain(1000);
  EXPECT_FALSE(plain.stores_weights());
  EXPECT_EQ(plain.WeightsBytes(), 0u);
  EXPECT_EQ(plain.ExtentBytes(), 12288u);
  EXPECT_EQ(plain.ExtentBytes(), ChunkStateBytes(1000));
  const ChunkLayout bf16(1000, DType::kBFloat16);
  EXPECT_EQ(bf16.StatesBytes(), 12000u);
  EXPECT_EQ(bf16.WeightsOffset(), 12288u);
  EXPECT_EQ(bf16.WeightsBytes(), 2000u);
  EXPECT_EQ(bf16.WeightsRegionBytes(), 4096u);
  EXPECT_EQ(bf16.ExtentBytes(), 16384u);
  EXPECT_EQ(ChunkLayout(1024, DType::kFloat32).ExtentBytes(), 12288u + 4096u);  // both exact multiples
  // Checked: the largest chunk fits; one more element, or a dtype that is
  // none, gives no size instead of a wrapped one.
  EXPECT_EQ(ChunkLayout(kMaxChunkElements, DType::kFloat32).ExtentBytes(), kMaxChunkElements * 16);
  EXPECT_FALSE(ChunkLayout(kMaxChunkElements + 1, DType::kBFloat16).ExtentBytes());
  EXPECT_FALSE(ChunkLayout(UINT64_MAX, DType::kFloat32).WeightsBytes());
  EXPECT_FALSE(ChunkLayout((uint64_t{1} << 62) + 1, DType::kFloat32).ExtentBytes());
  EXPECT_FALSE(ChunkLayout(10, static_cast<DType>(9)).ExtentBytes());
}

// Issue 22: bf16 moments take 2 bytes each: master 4n, m 2n, v 2n; the states'
// checksum covers the 8n bytes as stored.
TEST(ChunkLayoutTest, Bf16MomentsTakeEightBytesAnElement) {
  const ChunkLayout fp32(1000);
  EXPECT_EQ(fp32.moments_dtype, DType::kFloat32);
  EXPECT_EQ(fp32.StateOffset(ChunkState::kExpAvg), 4000u);
  EXPECT_EQ(fp32.StateOffset(ChunkState::kExpAvgSq), 8000u);
  const ChunkLayout bf16(1000, std::nullopt, DType::kBFloat16);
  EXPECT_EQ(bf16.StatesBytes(), 8000u);
  EXPECT_EQ(bf16.StateOffset(ChunkState::kMaster), 0u);
  EXPECT_EQ(bf16.StateOffset(ChunkState::kExpAvg), 4000u);
  EXPECT_EQ(bf16.StateOffset(ChunkState::kExpAvgSq), 6000u);
  EXPECT_EQ(bf16.StateDType(ChunkState::kMaster), DType::kFloat32);
  EXPECT_EQ(bf16.StateDType(ChunkState::kExpAvgSq), DType::kBFloat16);
  EXPECT_EQ(bf16.ExtentBytes(), 8192u);
  EXPECT_EQ(ChunkLayout(1024, std::nullopt, DType::kBFloat16).ExtentBytes(), 8192u);  // exactly 8n
  const ChunkLayout bf16_weights(1000, DType::kBFloat16, DType::kBFloat16);
  EXPECT_EQ(bf16_weights.WeightsOffset(), 8192u);
  EXPECT_EQ(bf16_weights.ExtentBytes(), 8192u + 4096u);
  EXPECT_EQ(ChunkLayout(kMaxChunkElements, std::nullopt, DType::kBFloat16).StatesBytes(), kMaxChunkElements * 8);
  EXPECT_FALSE(ChunkLayout(kMaxChunkElements + 1, std::nullopt, DType::kBFloat16).ExtentBytes());
  EXPECT_FALSE(ChunkLayout(10, std::nullopt, DType::kFloat16).StatesBytes());  // not a moments dtype
  EXPECT_FALSE(ChunkLayout(10, std::nullopt, static_cast<DType>(9)).ExtentBytes());

  std::vector<std::byte> bytes(*bf16_weights.ExtentBytes(), std::byte{1});
  const ChunkStates states(bytes.data(), bf16_weights);
  EXPECT_EQ(states.exp_avg(), bytes.data() + 4000);
  EXPECT_EQ(states.exp_avg_sq(), bytes.data() + 6000);
  EXPECT_EQ(states.weights(), bytes.data() + 8192);
  const ChunkChecksums before = ComputeChunkChecksums(bytes.data(), bf16_weights);
  EXPECT_EQ(before.states, StatesChecksum(bytes.data(), bf16_weights));
  bytes[8000] = std::byte{9};  // padding after v: the states' checksum is unchanged
  EXPECT_EQ(ComputeChunkChecksums(bytes.data(), bf16_weights), before);
  bytes[7999] = std::byte{9};  // v's last byte
  EXPECT_NE(ComputeChunkChecksums(bytes.data(), bf16_weights).states, before.states);
}

// Issue 36: 8-bit moments take a code an element, padding to 4 bytes and an
// fp32 scale per block of 256: master 4n, then m and v each
// AlignUp(n, 4) + 4 * ceil(n / 256); the checksum covers them as stored.
TEST(ChunkLayoutTest, EightBitMomentsTakeACodeAnElementAndAScaleABlock) {
  const ChunkLayout q(1001, std::nullopt, DType::kBlock8);
  EXPECT_EQ(q.MomentBytes(), 1004u + 4 * 4u);
  EXPECT_EQ(q.MomentScalesOffset(), 1004u);
  EXPECT_EQ(q.StateOffset(ChunkState::kExpAvg), 4004u);
  EXPECT_EQ(q.StateOffset(ChunkState::kExpAvgSq), 4004u + 1020u);
  EXPECT_EQ(q.StatesBytes(), 4004u + 2 * 1020u);
  EXPECT_EQ(q.ExtentBytes(), 8192u);
  EXPECT_EQ(q.StateDType(ChunkState::kExpAvg), DType::kBlock8);
  EXPECT_EQ(ChunkLayout(1024, std::nullopt, DType::kBlock8).StatesBytes(), 4096u + 2 * (1024u + 16u));
  // About 6.03 bytes an element at scale, checked at the largest chunk.
  EXPECT_EQ(ChunkLayout(kMaxChunkElements, std::nullopt, DType::kBlock8).StatesBytes(),
            kMaxChunkElements * 6 + 2 * 4 * (kMaxChunkElements / 256));
  EXPECT_FALSE(ChunkLayout(kMaxChunkElements + 1, std::nullopt, DType::kBlock8).ExtentBytes());
  const ChunkLayout with_weights(1001, DType::kBFloat16, DType::kBlock8);
  EXPECT_EQ(with_weights.WeightsOffset(), 8192u);
  // The scales lie after each moment's codes; other moments have none.
  std::vector<std::byte> bytes(*q.ExtentBytes());
  const ChunkStates states(bytes.data(), q);
  EXPECT_EQ(reinterpret_cast<std::byte*>(states.moment_scales(ChunkState::kExpAvg)), bytes.data() + 4004 + 1004);
  EXPECT_EQ(reinterpret_cast<std::byte*>(states.moment_scales(ChunkState::kExpAvgSq)),
            bytes.data() + 4004 + 1020 + 1004);
  EXPECT_EQ(states.moment_scales(ChunkState::kMaster), nullptr);
  EXPECT_EQ(ChunkStates(bytes.data(), ChunkLayout(1001)).moment_scales(ChunkState::kExpAvg), nullptr);
}

TEST(ChunkLayoutTest, TheStatesAndTheWeightsAreChecksummedApart) {
  const ChunkLayout layout(1000, DType::kBFloat16);
  std::vector<std::byte> bytes(*layout.ExtentBytes(), std::byte{1});
  const ChunkStates states(bytes.data(), layout);
  EXPECT_EQ(states.weights(), bytes.data() + 12288);
  EXPECT_EQ(states.weights_bytes(), 2000u);
  EXPECT_EQ(ChunkStates(bytes.data(), 1000).weights(), nullptr);
  const ChunkChecksums before = ComputeChunkChecksums(bytes.data(), layout);
  EXPECT_EQ(before.states, ChunkPayloadChecksum(bytes.data(), 1000));
  EXPECT_EQ(before.weights, WeightsChecksum(bytes.data() + 12288, layout));
  EXPECT_EQ(ComputeChunkChecksums(bytes.data(), ChunkLayout(1000)).weights, 0u);
  bytes[12288 + 2000] = std::byte{9};  // padding after the weights: neither changes
  EXPECT_EQ(ComputeChunkChecksums(bytes.data(), layout), before);
  bytes[12288 + 1999] = std::byte{9};  // the last weight byte: only the weights' checksum
  ChunkChecksums after = ComputeChunkChecksums(bytes.data(), layout);
  EXPECT_EQ(after.states, before.states);
  EXPECT_NE(after.weights, before.weights);
  bytes[11999] = std::byte{9};  // the last byte of v: only the states' checksum
  const ChunkChecksums last = ComputeChunkChecksums(bytes.data(), layout);
  EXPECT_NE(last.states, after.states);
  EXPECT_EQ(last.weights, after.weights);
}

TEST_F(JobTest, AChunkThatStoresWeightsGetsExtentsWithTheirRegion) {
  auto job = Job::Open(roots_, "gpt", ::getuid(), true, *io_, *stats_);
  ASSERT_TRUE(job.ok()) << job.status();
  v1::JobManifest next = (*job)->manifest();
  ASSERT_TRUE((*job)->AddChunk(next, 1, 1000, DType::kFloat32, DType::kFloat32).ok());
  ASSERT_TRUE((*job)->AddChunk(next, 2, 1000, DType::kBFloat16, DType::kBFloat16, /*stores_weights=*/true).ok());
  const v1::ChunkRecord& plain = next.chunks(0);
  const v1::ChunkRecord& weights = next.chunks(1);
  EXPECT_FALSE(plain.stores_weights());
  EXPECT_EQ(plain.extents(0).length(), 12288u);  // as before issue 12
  EXPECT_TRUE(weights.stores_weights());
  EXPECT_EQ(RecordLayout(weights).weights_dtype, DType::kBFloat16);
  EXPECT_EQ(weights.extents(0).offset(), 2 * 12288u);
  EXPECT_EQ(weights.extents(0).length(), 16384u);
  EXPECT_EQ(weights.extents(1).offset(), 2 * 12288u + 16384u);
  EXPECT_EQ(next.state_bytes(), 2 * 12288u + 2 * 16384u);
  ASSERT_TRUE((*job)->Commit(next).ok());
  auto reopened = Job::Open(roots_, "gpt", ::getuid(), false, *io_, *stats_);
  ASSERT_TRUE(reopened.ok()) << reopened.status();
  EXPECT_TRUE((*reopened)->FindRecord(2)->stores_weights());
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
      {"fp16 moments", [](v1::JobManifest& m) { m.mutable_chunks(1)->set_moments_dtype(v1::DTYPE_FLOAT16); }},
      {"moments dtype", [](v1::JobManifest& m) { m.mutable_chunks(1)->set_moments_dtype(static_cast<v1::DType>(9)); }},
  };
  {
    v1::JobManifest manifest = GoodManifest();
    manifest.add_path_bytes(UINT64_MAX);
    manifest.add_path_bytes(1);
    EXPECT_EQ(ValidateManifest(manifest).code(), absl::StatusCode::kDataLoss);
  }
  // Issue 12: a chunk that stores weights needs its weights region in both
  // extents; one that does not carries no weights checksum.
  auto stores_weights = [](v1::JobManifest& m, v1::DType dtype) {
    m.mutable_chunks(0)->set_stores_weights(true);
    m.mutable_chunks(0)->set_param_dtype(dtype);
  };
  {
    v1::JobManifest manifest = GoodManifest();
    stores_weights(manifest, v1::DTYPE_BFLOAT16);
    for (int version = 0; version < 2; ++version) {  // 1000 elements: 12288 + 4096 bytes each
      manifest.mutable_chunks(0)->mutable_extents(version)->set_offset(version * 16384);
      manifest.mutable_chunks(0)->mutable_extents(version)->set_length(16384);
    }
    for (int version = 0; version < 2; ++version) {
      manifest.mutable_chunks(1)->mutable_extents(version)->set_offset(2 * 16384 + version * 4096);
    }
    manifest.set_state_bytes(2 * 16384 + 2 * 4096);
    EXPECT_TRUE(ValidateManifest(manifest).ok()) << ValidateManifest(manifest);
  }
  const std::vector<Case> weights_cases = {
      {"weights beyond the extent", [&](v1::JobManifest& m) { stores_weights(m, v1::DTYPE_BFLOAT16); }},
      {"weights of a bad dtype", [&](v1::JobManifest& m) { stores_weights(m, static_cast<v1::DType>(9)); }},
      {"weights checksum without weights",
       [](v1::JobManifest& m) { m.mutable_chunks(1)->mutable_extents(1)->set_weights_checksum(77); }},
  };
  for (const Case& c : weights_cases) {
    v1::JobManifest manifest = GoodManifest();
    c.damage(manifest);
    absl::Status status = ValidateManifest(manifest);
    EXPECT_EQ(status.code(), absl::StatusCode::kDataLoss) << c.what << ": " << status;
    EXPECT_NE(status.message().find("chunk "), std::string::npos) << c.what << ": " << status;
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
  (*registry)->Release(**job);
  job->reset();
  auto jobs = (*registry)->List(::getuid());
  ASSERT_TRUE(jobs.ok());
  ASSERT_EQ(jobs->size(), 1u);
  EXPECT_EQ((*jobs)[0].parameters(), 100000u);
  auto freed = (*registry)->Delete("gpt", ::getuid());
  ASSERT_TRUE(freed.ok()) << freed.status();
  EXPECT_GE(*freed, 2 * *ChunkStateBytes(100000));
  EXPECT_FALSE(fs::exists(JobDir(0, ::getuid(), "gpt")));
  EXPECT_FALSE(fs::exists(JobDir(1, ::getuid(), "gpt")));
  EXPECT_EQ((*registry)->Delete("gpt", ::getuid()).status().code(), absl::StatusCode::kNotFound);
}


// Issue 8 item 3: job names are per uid. A user who creates "llama-prod" first
// does not get root's later "llama-prod" (nor root theirs).
TEST_F(JobTest, JobsOfTwoUsersWithOneNameAreTwoJobs) {
  auto registry = JobRegistry::Create(roots_, *io_, *stats_);
  ASSERT_TRUE(registry.ok());
  MakeJob(**registry, "llama-prod", 65534, 5000);
  auto root_job = (*registry)->Acquire("llama-prod", 0);
  ASSERT_TRUE(root_job.ok()) << root_job.status();
  EXPECT_TRUE((*root_job)->created());
  EXPECT_EQ((*root_job)->manifest().chunks_size(), 0) << "root resumed another user's job";
  EXPECT_EQ((*root_job)->manifest().owner_uid(), 0u);
  EXPECT_NE((*root_job)->key(), Job::Key(65534, "llama-prod"));
  // One job of each name may be open per user at once.
  auto theirs = (*registry)->Acquire("llama-prod", 65534);
  ASSERT_TRUE(theirs.ok()) << theirs.status();
  EXPECT_EQ((*theirs)->manifest().chunks(0).num_elements(), 5000u);
  (*registry)->Release(**theirs);
  (*registry)->Release(**root_job);
  // root deleting "llama-prod" is about root's own (now removed: it was empty).
  auto deleted = (*registry)->Delete("llama-prod", 0);
  EXPECT_EQ(deleted.status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(deleted.status().message().find("65534"), std::string::npos) << deleted.status();
  EXPECT_TRUE(fs::exists(JobDir(0, 65534, "llama-prod") / "manifest.pb"));
  auto mine = (*registry)->List(0);
  ASSERT_TRUE(mine.ok());
  EXPECT_TRUE(mine->empty());
  auto all = (*registry)->List(std::nullopt);
  ASSERT_TRUE(all.ok());
  ASSERT_EQ(all->size(), 1u);
  EXPECT_EQ((*all)[0].owner_uid(), 65534u);
}

// Item 4: directories 0700, files 0600, whatever the umask.
TEST_F(JobTest, JobDirectoriesArePrivate) {
  const mode_t old = ::umask(0);
  auto job = Job::Open(roots_, "gpt", 1234, true, *io_, *stats_);
  ::umask(old);
  ASSERT_TRUE(job.ok()) << job.status();
  auto mode = [](const fs::path& path) {
    struct stat st {};
    EXPECT_EQ(::lstat(path.c_str(), &st), 0) << path;
    return st.st_mode & 07777;
  };
  for (size_t root = 0; root < 2; ++root) {
    EXPECT_EQ(mode(roots_[root] / "users" / "1234"), 0700u);
    EXPECT_EQ(mode(JobDir(root, 1234, "gpt")), 0700u);
    EXPECT_EQ(mode(JobDir(root, 1234, "gpt") / "states.bin"), 0600u);
  }
  EXPECT_EQ(mode(JobDir(0, 1234, "gpt") / "manifest.pb"), 0600u);
}

// Item 4: a symlink planted in place of states.bin, manifest.tmp, the job
// directory or users/<uid> fails the operation and writes nothing through it.
TEST_F(JobTest, PlantedSymlinksAreNeverFollowed) {
  const fs::path victim = root_ / "victim";
  std::ofstream(victim) << "precious";
  {
    auto job = Job::Open(roots_, "gpt", 1234, true, *io_, *stats_);
    ASSERT_TRUE(job.ok()) << job.status();
    // manifest.tmp: the commit replaces the link, never writes through it.
    fs::create_symlink(victim, JobDir(0, 1234, "gpt") / "manifest.tmp");
    v1::JobManifest next = (*job)->manifest();
    next.set_committed_step(3);
    EXPECT_TRUE((*job)->Commit(next).ok());
    EXPECT_EQ(ReadText(victim), "precious");
  }
  // states.bin of a job that is being created.
  fs::create_directories(JobDir(1, 1234, "evil"));
  fs::create_symlink(victim, JobDir(1, 1234, "evil") / "states.bin");
  auto evil = Job::Open(roots_, "evil", 1234, true, *io_, *stats_);
  EXPECT_EQ(evil.status().code(), absl::StatusCode::kFailedPrecondition) << evil.status();
  EXPECT_NE(evil.status().message().find("symbolic link"), std::string::npos) << evil.status();
  EXPECT_EQ(ReadText(victim), "precious");
  // states.bin of an existing job.
  fs::remove(JobDir(1, 1234, "gpt") / "states.bin");
  fs::create_symlink(victim, JobDir(1, 1234, "gpt") / "states.bin");
  EXPECT_EQ(Job::Open(roots_, "gpt", 1234, false, *io_, *stats_).status().code(),
            absl::StatusCode::kFailedPrecondition);
  // The job directory and the user directory.
  fs::create_directories(root_ / "elsewhere");
  fs::create_directory_symlink(root_ / "elsewhere", JobDir(0, 1234, "linked"));
  EXPECT_EQ(Job::Open(roots_, "linked", 1234, true, *io_, *stats_).status().code(),
            absl::StatusCode::kFailedPrecondition);
  fs::create_directories(roots_[0] / "users");
  fs::create_directory_symlink(root_ / "elsewhere", roots_[0] / "users" / "999");
  EXPECT_EQ(Job::Open(roots_, "gpt", 999, true, *io_, *stats_).status().code(),
            absl::StatusCode::kFailedPrecondition);
  EXPECT_TRUE(fs::is_empty(root_ / "elsewhere"));
  EXPECT_EQ(ReadText(victim), "precious");
}

// Item 5: delete removes only a job's own files, unlinking links, never
// following them; a job with a damaged manifest is listed and deletable by its
// owner only.
TEST_F(JobTest, DeleteUnlinksWithoutFollowingAndHandlesDamagedManifests) {
  auto registry = JobRegistry::Create(roots_, *io_, *stats_);
  ASSERT_TRUE(registry.ok());
  const fs::path victim = root_ / "victim";
  std::ofstream(victim) << "precious";
  MakeJob(**registry, "gpt", 1234);
  fs::remove(JobDir(1, 1234, "gpt") / "states.bin");
  fs::create_symlink(victim, JobDir(1, 1234, "gpt") / "states.bin");
  std::ofstream(JobDir(0, 1234, "gpt") / "manifest.pb", std::ios::trunc) << "garbage";
  auto listed = (*registry)->List(1234);
  ASSERT_TRUE(listed.ok());
  ASSERT_EQ(listed->size(), 1u);
  EXPECT_FALSE((*listed)[0].damaged().empty());
  EXPECT_EQ((*registry)->Delete("gpt", 4321).status().code(), absl::StatusCode::kNotFound);
  EXPECT_TRUE(fs::exists(JobDir(0, 1234, "gpt") / "manifest.pb"));
  auto freed = (*registry)->Delete("gpt", 1234);
  ASSERT_TRUE(freed.ok()) << freed.status();
  EXPECT_FALSE(fs::exists(JobDir(0, 1234, "gpt")));
  EXPECT_FALSE(fs::exists(JobDir(1, 1234, "gpt")));
  EXPECT_EQ(ReadText(victim), "precious");
  // Something fuyoud did not make stops the delete, and is kept.
  MakeJob(**registry, "gpt2", 1234);
  std::ofstream(JobDir(1, 1234, "gpt2") / "notes.txt") << "mine";
  EXPECT_EQ((*registry)->Delete("gpt2", 1234).status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_TRUE(fs::exists(JobDir(1, 1234, "gpt2") / "notes.txt"));
}

// Fails the reservations (fallocate) larger than `limit` bytes after the kernel
// made them, as a device that fills up half way through would.
class FailLargeReserves final : public storage::FaultInjector {
 public:
  explicit FailLargeReserves(uint64_t limit) : limit_(limit) {}
  int64_t Adjust(Op op, const fs::path&, uint64_t, uint64_t length, int64_t result) override {
    return op == Op::kReserve && length > limit_ ? -ENOSPC : result;
  }

 private:
  uint64_t limit_;
};

uint64_t AllocatedBytes(const fs::path& path) {
  struct stat st {};
  if (::stat(path.c_str(), &st) != 0) return 0;
  return static_cast<uint64_t>(st.st_blocks) * 512;
}

// Item 10: a reservation refused for space gives back what it allocated, and
// leaves the job exactly as committed.
TEST_F(JobTest, RefusedReservationGivesItsSpaceBack) {
  FailLargeReserves faults(8 << 20);
  storage::IoEngineOptions options;
  options.fault_injector = &faults;
  auto io = storage::IoEngine::Create(options);
  ASSERT_TRUE(io.ok());
  auto job = Job::Open(roots_, "gpt", 1234, true, **io, *stats_);
  ASSERT_TRUE(job.ok()) << job.status();
  v1::JobManifest next = (*job)->manifest();
  ASSERT_TRUE((*job)->AddChunk(next, 0, 300'000, DType::kFloat32, DType::kFloat32).ok());
  ASSERT_TRUE((*job)->Commit(next).ok());
  const uint64_t committed[2] = {fs::file_size(JobDir(0, 1234, "gpt") / "states.bin"),
                                 fs::file_size(JobDir(1, 1234, "gpt") / "states.bin")};
  const uint64_t allocated = AllocatedBytes(JobDir(0, 1234, "gpt") / "states.bin");
  next = (*job)->manifest();
  ASSERT_TRUE((*job)->AddChunk(next, 1, 100'000, DType::kFloat32, DType::kFloat32).ok());
  auto refused = (*job)->AddChunk(next, 2, 3'000'000, DType::kFloat32, DType::kFloat32);
  EXPECT_EQ(refused.code(), absl::StatusCode::kResourceExhausted) << refused;
  EXPECT_EQ(fs::file_size(JobDir(0, 1234, "gpt") / "states.bin"), committed[0]);
  EXPECT_EQ(fs::file_size(JobDir(1, 1234, "gpt") / "states.bin"), committed[1]);
  EXPECT_LE(AllocatedBytes(JobDir(0, 1234, "gpt") / "states.bin"), allocated);
}

// Item 10: creating a job is all or nothing. Whichever file descriptor the
// creation runs out at (EMFILE), nothing it made is left behind: no state file
// without a manifest, invisible to every API.
TEST_F(JobTest, CreationThatRunsOutOfFileDescriptorsLeavesNothing) {
  // The I/O ring of the filesystem exists before the limits below.
  ASSERT_TRUE(Job::Open(roots_, "warm", 1234, true, *io_, *stats_).ok());
  rlimit old {};
  ASSERT_EQ(::getrlimit(RLIMIT_NOFILE, &old), 0);
  // Fill every free descriptor number below the highest one in use, so that a
  // limit of highest + 1 + extra leaves exactly `extra` descriptors.
  int highest = 0;
  for (const auto& entry : fs::directory_iterator("/proc/self/fd")) {
    highest = std::max(highest, std::stoi(entry.path().filename().string()));
  }
  std::vector<int> fillers;
  for (int fd = ::open("/dev/null", O_RDONLY); fd >= 0; fd = ::open("/dev/null", O_RDONLY)) {
    fillers.push_back(fd);
    if (fd >= highest) break;
  }
  highest = std::max(highest, fillers.empty() ? 0 : fillers.back());
  int failures = 0;
  for (int extra = 0; extra < 16; ++extra) {
    const std::string name = "job" + std::to_string(extra);
    rlimit low = old;
    low.rlim_cur = static_cast<rlim_t>(highest + 1 + extra);
    ASSERT_EQ(::setrlimit(RLIMIT_NOFILE, &low), 0);
    auto job = Job::Open(roots_, name, 1234, true, *io_, *stats_);
    const absl::Status status = job.status();
    job = absl::UnknownError("closed");
    ASSERT_EQ(::setrlimit(RLIMIT_NOFILE, &old), 0);
    if (status.ok()) {
      EXPECT_TRUE(fs::exists(JobDir(0, 1234, name) / "manifest.pb"));
      continue;
    }
    ++failures;
    EXPECT_EQ(status.code(), absl::StatusCode::kResourceExhausted) << status;
    for (size_t root = 0; root < 2; ++root) {
      EXPECT_FALSE(fs::exists(JobDir(root, 1234, name))) << status << " left " << JobDir(root, 1234, name);
    }
  }
  for (int fd : fillers) ::close(fd);
  EXPECT_GT(failures, 2);
}

// Item 1 of the lead's plan: the per-user job limit.
TEST_F(JobTest, OneJobMoreThanTheLimitIsResourceExhausted) {
  auto registry = JobRegistry::Create(roots_, *io_, *stats_, JobRegistryOptions{.max_jobs_per_user = 2});
  ASSERT_TRUE(registry.ok());
  MakeJob(**registry, "a", 1234);
  MakeJob(**registry, "b", 1234);
  auto third = (*registry)->Acquire("c", 1234);
  EXPECT_EQ(third.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_NE(third.status().message().find("max_jobs_per_user (2)"), std::string::npos) << third.status();
  EXPECT_FALSE(fs::exists(JobDir(0, 1234, "c")));
  // Existing jobs still open; other users have their own count.
  auto again = (*registry)->Acquire("a", 1234);
  ASSERT_TRUE(again.ok());
  (*registry)->Release(**again);
  auto other = (*registry)->Acquire("c", 4321);
  ASSERT_TRUE(other.ok());
  (*registry)->Release(**other);
}

// Item 10: a job made by a session that never committed a chunk is removed when
// the session lets it go; a job with chunks is kept.
TEST_F(JobTest, ReleasingAnEmptyNewJobRemovesIt) {
  auto registry = JobRegistry::Create(roots_, *io_, *stats_);
  ASSERT_TRUE(registry.ok());
  auto job = (*registry)->Acquire("empty", 1234);
  ASSERT_TRUE(job.ok());
  EXPECT_TRUE(fs::exists(JobDir(0, 1234, "empty") / "manifest.pb"));
  (*registry)->Release(**job);
  EXPECT_FALSE(fs::exists(JobDir(0, 1234, "empty")));
  EXPECT_FALSE(fs::exists(JobDir(1, 1234, "empty")));
  MakeJob(**registry, "kept", 1234);
  EXPECT_TRUE(fs::exists(JobDir(0, 1234, "kept") / "manifest.pb"));
}

// Issue 20, item 6: users/<uid>/ goes with a user's last job, on every root.
TEST_F(JobTest, TheLastJobOfAUserTakesItsDirectoriesWithIt) {
  auto registry = JobRegistry::Create(roots_, *io_, *stats_);
  ASSERT_TRUE(registry.ok());
  auto job = (*registry)->Acquire("empty", 1234);
  ASSERT_TRUE(job.ok());
  (*registry)->Release(**job);
  for (const fs::path& root : roots_) EXPECT_FALSE(fs::exists(root / "users" / "1234")) << root;
  MakeJob(**registry, "a", 1234);
  MakeJob(**registry, "b", 1234);
  ASSERT_TRUE((*registry)->Delete("a", 1234).ok());
  EXPECT_TRUE(fs::exists(roots_[0] / "users" / "1234" / "jobs" / "b"));
  ASSERT_TRUE((*registry)->Delete("b", 1234).ok());
  for (const fs::path& root : roots_) {
    EXPECT_FALSE(fs::exists(root / "users" / "1234")) << root;
    EXPECT_TRUE(fs::exists(root / "users")) << "the users directory itself stays";
  }
}

// Issue 20, item 4: a copy is refused by the per-user storage limit before it
// creates anything, and the registry is free again afterwards.
TEST_F(JobTest, ACopyOverThePerUserStorageLimitLeavesNothing) {
  auto registry = JobRegistry::Create(
      roots_, *io_, *stats_,
      JobRegistryOptions{.storage = StorageBudgetOptions{.max_bytes_per_user = 1 << 20, .commit_reserve_bytes = 0}});
  ASSERT_TRUE(registry.ok());
  MakeJob(**registry, "src", 1234, 20000);  // about 480 KiB on storage each: a copy passes 1 MiB
  MakeJob(**registry, "src2", 1234, 20000);
  auto copied = (*registry)->Copy("src", "dst", 1234);
  ASSERT_FALSE(copied.ok());
  EXPECT_EQ(copied.status().code(), absl::StatusCode::kResourceExhausted) << copied.status();
  EXPECT_NE(copied.status().message().find("max_storage_bytes_per_user"), std::string::npos) << copied.status();
  EXPECT_FALSE(fs::exists(JobDir(0, 1234, "dst")));
  EXPECT_FALSE(fs::exists(JobDir(1, 1234, "dst")));
  // Neither name is left busy.
  auto src = (*registry)->Acquire("src", 1234);
  ASSERT_TRUE(src.ok()) << src.status();
  (*registry)->Release(**src);
}

// Migration: a data directory of the layout before namespaces moves, per owner.
TEST_F(JobTest, OldLayoutJobsMoveToTheirOwnersNamespace) {
  {
    auto registry = JobRegistry::Create(roots_, *io_, *stats_);
    ASSERT_TRUE(registry.ok());
    MakeJob(**registry, "gpt", 1234, 7000);
  }
  for (const fs::path& root : roots_) {
    fs::create_directories(root / "jobs");
    fs::rename(root / "users" / "1234" / "jobs" / "gpt", root / "jobs" / "gpt");
    fs::remove_all(root / "users");
  }
  fs::create_directories(roots_[0] / "jobs" / "broken");
  std::ofstream(roots_[0] / "jobs" / "broken" / "manifest.pb") << "garbage";
  auto registry = JobRegistry::Create(roots_, *io_, *stats_);
  ASSERT_TRUE(registry.ok());
  for (size_t root = 0; root < 2; ++root) {
    EXPECT_TRUE(fs::exists(JobDir(root, 1234, "gpt") / "states.bin"));
    EXPECT_FALSE(fs::exists(roots_[root] / "jobs" / "gpt"));
  }
  EXPECT_TRUE(fs::exists(roots_[0] / "jobs" / "broken" / "manifest.pb")) << "an unreadable job is left in place";
  auto job = (*registry)->Acquire("gpt", 1234);
  ASSERT_TRUE(job.ok()) << job.status();
  EXPECT_EQ((*job)->manifest().chunks(0).num_elements(), 7000u);
  (*registry)->Release(**job);
  EXPECT_EQ((*registry)->Acquire("gpt", 0).value()->manifest().chunks_size(), 0);
}

// Item 10: one errno table; ENOSPC (also from mkdir) is RESOURCE_EXHAUSTED.
TEST(ErrnoStatusTest, OneTableForEveryErrno) {
  EXPECT_EQ(ErrnoStatus(ENOSPC, "mkdir").code(), absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(ErrnoStatus(EDQUOT, "mkdir").code(), absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(ErrnoStatus(EMFILE, "open").code(), absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(ErrnoStatus(EIO, "read").code(), absl::StatusCode::kDataLoss);
  EXPECT_EQ(ErrnoStatus(ELOOP, "open").code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(ErrnoStatus(ENOENT, "open").code(), absl::StatusCode::kNotFound);
}

TEST_F(JobTest, MkdirOnAFullFilesystemIsResourceExhausted) {
  // A tmpfs of 4 inodes (itself, users, <uid>, jobs): the mkdir of the job
  // directory fails with ENOSPC.
  const fs::path mount = root_ / "small";
  fs::create_directories(mount);
  if (::mount("tmpfs", mount.c_str(), "tmpfs", 0, "size=4m,nr_inodes=4") != 0) {
    GTEST_SKIP() << "cannot mount a tmpfs here (needs root): " << std::strerror(errno);
  }
  std::vector<fs::path> roots = {mount};
  const absl::Status status = Job::Open(roots, "gpt", 1234, true, *io_, *stats_).status();
  ::umount2(mount.c_str(), MNT_DETACH);
  EXPECT_EQ(status.code(), absl::StatusCode::kResourceExhausted) << status;
  EXPECT_NE(status.message().find("cannot create directory"), std::string::npos) << status;
}

}  // namespace
}  // namespace fuyou
