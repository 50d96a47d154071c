#include "state/chunk_store.h"

#include <gtest/gtest.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <filesystem>
#include <vector>

#include "common/status_util.h"
#include "stats/daemon_stats.h"
#include "storage/io_engine.h"

namespace fuyou {
namespace {
namespace fs = std::filesystem;

constexpr uint64_t kElements = 1000;  // 12000 bytes of states: one 12288-byte extent
constexpr uid_t kUid = 1000;

// The engine's own test seam: fails every write while `fail_writes` is set.
class WriteFailures final : public storage::FaultInjector {
 public:
  int64_t Adjust(Op op, const fs::path& /*file*/, uint64_t /*offset*/, uint64_t /*length*/,
                 int64_t result) override {
    return op == Op::kWrite && fail_writes.load() ? -EIO : result;
  }
  std::atomic<bool> fail_writes{false};
};

class ChunkStoreTest : public ::testing::Test {
 protected:
  void SetUp() override {
    char pattern[] = "/tmp/fuyou-chunk-store-test-XXXXXX";
    ASSERT_NE(::mkdtemp(pattern), nullptr);
    root_ = pattern;
    stats_ = std::make_unique<DaemonStats>(std::vector<fs::path>{root_});
    storage::IoEngineOptions options;
    options.fault_injector = &faults_;
    auto io = storage::IoEngine::Create(options);
    ASSERT_TRUE(io.ok()) << io.status();
    io_ = std::move(*io);
    auto job = Job::Open({root_}, "job", kUid, /*create=*/true, *io_, *stats_);
    ASSERT_TRUE(job.ok()) << job.status();
    job_ = std::move(*job);
    cache_ = std::make_unique<StateCache>(64 << 20);
    store_ = MakeStore(*cache_);
  }
  void TearDown() override {
    store_.reset();
    cache_.reset();
    job_.reset();
    io_.reset();
    fs::remove_all(root_);
  }

  std::unique_ptr<ChunkStore> MakeStore(StateCache& cache, unsigned prefetch_window = 2,
                                        DurabilityInterval durability = {}) {
    return std::make_unique<ChunkStore>(*job_, cache, StoreCounters{*stats_, stats_->ForUser(kUid)},
                                        prefetch_window, durability);
  }
  uint64_t BytesWritten() { return stats_->ForUser(kUid).bytes_written.load(); }
  // Registers chunks 0..count-1 of kElements fp32 weights equal to `weight`.
  void Register(uint32_t count, float weight = 1.0f) {
    weights_.assign(count, std::vector<float>(kElements, weight));
    std::vector<ChunkStore::Registration> chunks;
    for (uint32_t id = 0; id < count; ++id) {
      chunks.push_back({.chunk_id = id,
                        .num_elements = kElements,
                        .layout_fingerprint = 42,
                        .weights = std::as_writable_bytes(std::span(weights_[id]))});
    }
    auto registered = store_->Register(chunks, /*job_quota_bytes=*/0);
    ASSERT_TRUE(registered.ok()) << registered.status();
    for (const ChunkStore::Registered& chunk : *registered) EXPECT_FALSE(chunk.resumed);
  }
  // Adds `delta` to every master weight and sets m to `m`.
  static auto AddToMaster(float delta, float m = 0.0f) {
    return [delta, m](const ChunkStates& states) {
      for (uint64_t i = 0; i < states.num_elements(); ++i) {
        states.master()[i] += delta;
        states.exp_avg()[i] = m;
      }
    };
  }
  // State `which` of chunk `chunk_id` as committed, read through `store`.
  static std::vector<float> Committed(ChunkStore& store, uint32_t chunk_id, ChunkState which) {
    std::vector<float> values(kElements);
    absl::Status read = store.ExportState(chunk_id, which, 0, std::span(values));
    EXPECT_TRUE(read.ok()) << read;
    return values;
  }
  // The committed states as storage holds them: a cold cache, a new store.
  std::vector<float> CommittedOnStorage(uint32_t chunk_id, ChunkState which) {
    StateCache cold(64 << 20);
    auto store = MakeStore(cold);
    return Committed(*store, chunk_id, which);
  }

  fs::path root_;
  WriteFailures faults_;
  std::unique_ptr<DaemonStats> stats_;
  std::unique_ptr<storage::IoEngine> io_;
  std::unique_ptr<Job> job_;
  std::unique_ptr<StateCache> cache_;
  std::unique_ptr<ChunkStore> store_;
  std::vector<std::vector<float>> weights_;
};

TEST_F(ChunkStoreTest, RegistrationWritesInitialStatesAndResumesThem) {
  Register(2, 3.0f);
  EXPECT_EQ(store_->chunk_count(), 2u);
  EXPECT_EQ(CommittedOnStorage(1, ChunkState::kMaster), std::vector<float>(kElements, 3.0f));
  EXPECT_EQ(CommittedOnStorage(1, ChunkState::kExpAvgSq), std::vector<float>(kElements, 0.0f));
  // A second registration of chunk 1 resumes it: its master into the weights.
  std::vector<float> weights(kElements, 0.0f);
  ChunkStore::Registration again{.chunk_id = 1, .num_elements = kElements, .layout_fingerprint = 42,
                                 .weights = std::as_writable_bytes(std::span(weights))};
  auto resumed = store_->Register(std::span(&again, 1), 0);
  ASSERT_TRUE(resumed.ok()) << resumed.status();
  EXPECT_TRUE((*resumed)[0].resumed);
  EXPECT_EQ(weights, std::vector<float>(kElements, 3.0f));
}

TEST_F(ChunkStoreTest, RegistrationOverTheQuotaReservesAndWritesNothing) {
  std::vector<float> weights(kElements, 1.0f);
  ChunkStore::Registration chunk{.chunk_id = 0, .num_elements = kElements,
                                 .weights = std::as_writable_bytes(std::span(weights))};
  auto refused = store_->Register(std::span(&chunk, 1), /*job_quota_bytes=*/4096);
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(store_->chunk_count(), 0u);
  EXPECT_EQ(job_->bytes_on_storage(), 0u);
}

TEST_F(ChunkStoreTest, CommitStepMakesTheShadowTheCommittedExtent) {
  Register(1);
  const uint32_t version_before = store_->Find(0)->committed_version();
  ASSERT_TRUE(store_->StageUpdate(0, AddToMaster(1.0f, 0.5f)).ok());
  EXPECT_TRUE(store_->IsStaged(0));
  auto committed = store_->CommitStep(1);
  ASSERT_TRUE(committed.ok()) << committed.status();
  EXPECT_EQ(*committed, 1u);
  EXPECT_EQ(store_->committed_step(), 1);
  EXPECT_EQ(store_->Find(0)->update_count(), 1);
  EXPECT_EQ(store_->Find(0)->committed_version(), 1 - version_before);
  EXPECT_EQ(store_->staged_count(), 0u);
  // From the cache (marked committed) and from storage alike.
  EXPECT_EQ(Committed(*store_, 0, ChunkState::kMaster), std::vector<float>(kElements, 2.0f));
  EXPECT_EQ(CommittedOnStorage(0, ChunkState::kMaster), std::vector<float>(kElements, 2.0f));
  EXPECT_EQ(CommittedOnStorage(0, ChunkState::kExpAvg), std::vector<float>(kElements, 0.5f));
  // The next step writes the other extent: the flip goes back.
  ASSERT_TRUE(store_->StageUpdate(0, AddToMaster(1.0f)).ok());
  ASSERT_TRUE(store_->CommitStep(2).ok());
  EXPECT_EQ(store_->Find(0)->committed_version(), version_before);
  EXPECT_EQ(CommittedOnStorage(0, ChunkState::kMaster), std::vector<float>(kElements, 3.0f));
}

TEST_F(ChunkStoreTest, RollBackStepKeepsTheCommittedStates) {
  Register(2);
  ASSERT_TRUE(store_->StageUpdate(0, AddToMaster(5.0f)).ok());
  ASSERT_TRUE(store_->StageUpdate(1, AddToMaster(5.0f)).ok());
  store_->RollBackStep();
  EXPECT_EQ(store_->staged_count(), 0u);
  EXPECT_EQ(store_->committed_step(), 0);
  EXPECT_EQ(store_->Find(0)->update_count(), 0);
  // The cache does not hand out the rolled-back bytes as committed.
  EXPECT_EQ(Committed(*store_, 0, ChunkState::kMaster), std::vector<float>(kElements, 1.0f));
  EXPECT_EQ(CommittedOnStorage(1, ChunkState::kMaster), std::vector<float>(kElements, 1.0f));
  // The step can be done again.
  ASSERT_TRUE(store_->StageUpdate(0, AddToMaster(2.0f)).ok());
  ASSERT_TRUE(store_->CommitStep(1).ok());
  EXPECT_EQ(CommittedOnStorage(0, ChunkState::kMaster), std::vector<float>(kElements, 3.0f));
}

// A redo: one chunk's update is dropped and staged again in the same step.
TEST_F(ChunkStoreTest, RollBackChunkThenStageAgainCommitsTheSecondUpdate) {
  Register(2);
  EXPECT_EQ(store_->RollBackChunk(0).code(), absl::StatusCode::kFailedPrecondition);  // nothing staged
  ASSERT_TRUE(store_->StageUpdate(0, AddToMaster(1.0f, 7.0f)).ok());
  ASSERT_TRUE(store_->StageUpdate(1, AddToMaster(1.0f)).ok());
  ASSERT_TRUE(store_->RollBackChunk(0).ok());
  EXPECT_FALSE(store_->IsStaged(0));
  EXPECT_TRUE(store_->IsStaged(1));
  // The second staging starts from the committed states (1.0), not the first update's (2.0).
  ASSERT_TRUE(store_->StageUpdate(0, AddToMaster(10.0f, 3.0f)).ok());
  auto committed = store_->CommitStep(1);
  ASSERT_TRUE(committed.ok()) << committed.status();
  EXPECT_EQ(*committed, 2u);
  EXPECT_EQ(store_->Find(0)->update_count(), 1);
  EXPECT_EQ(CommittedOnStorage(0, ChunkState::kMaster), std::vector<float>(kElements, 11.0f));
  EXPECT_EQ(CommittedOnStorage(0, ChunkState::kExpAvg), std::vector<float>(kElements, 3.0f));
  EXPECT_EQ(CommittedOnStorage(1, ChunkState::kMaster), std::vector<float>(kElements, 2.0f));
}

TEST_F(ChunkStoreTest, AFailedWriteBackRollsTheStepBack) {
  Register(2);
  ASSERT_TRUE(store_->StageUpdate(0, AddToMaster(1.0f)).ok());
  ASSERT_TRUE(store_->WaitForWriteBacks().ok());  // chunk 0's write-back is done
  faults_.fail_writes = true;
  ASSERT_TRUE(store_->StageUpdate(1, AddToMaster(1.0f)).ok());  // submitted; fails on completion
  const absl::Status failed = store_->WaitForWriteBacks();
  EXPECT_FALSE(failed.ok());
  EXPECT_NE(failed.message().find("write-back of chunk 1"), std::string::npos) << failed;
  faults_.fail_writes = false;
  auto committed = store_->CommitStep(1);
  EXPECT_FALSE(committed.ok());
  EXPECT_EQ(store_->committed_step(), 0);
  EXPECT_EQ(store_->staged_count(), 0u);
  EXPECT_TRUE(store_->StepError().ok());
  EXPECT_EQ(CommittedOnStorage(0, ChunkState::kMaster), std::vector<float>(kElements, 1.0f));
  // The next try of the step succeeds.
  ASSERT_TRUE(store_->StageUpdate(1, AddToMaster(1.0f)).ok());
  ASSERT_TRUE(store_->CommitStep(1).ok());
  EXPECT_EQ(CommittedOnStorage(1, ChunkState::kMaster), std::vector<float>(kElements, 2.0f));
}

TEST_F(ChunkStoreTest, StagingPrefetchesTheChunksPredictedNext) {
  Register(4);
  cache_->DropJob(job_->key());  // a cold cache
  UserCounters& user = stats_->ForUser(kUid);
  // Before any step the prediction is backward: 3, 2, 1, 0.
  ASSERT_TRUE(store_->StageUpdate(3, AddToMaster(1.0f)).ok());
  EXPECT_TRUE(cache_->Contains(job_->key(), 2));
  EXPECT_TRUE(cache_->Contains(job_->key(), 1));
  EXPECT_FALSE(cache_->Contains(job_->key(), 0));  // outside the window of 2
  const uint64_t hits = user.cache_hits.load();
  const uint64_t misses = user.cache_misses.load();
  // Served by the prefetch, without a read of its own; but its bytes came from
  // storage, so it counts as a miss, not as a read served from DRAM.
  ASSERT_TRUE(store_->StageUpdate(2, AddToMaster(1.0f)).ok());
  EXPECT_EQ(user.cache_hits.load(), hits);
  EXPECT_EQ(user.cache_misses.load(), misses + 1);
  ASSERT_TRUE(store_->StageUpdate(1, AddToMaster(1.0f)).ok());
  ASSERT_TRUE(store_->StageUpdate(0, AddToMaster(1.0f)).ok());
  ASSERT_TRUE(store_->CommitStep(1).ok());
  EXPECT_EQ(CommittedOnStorage(2, ChunkState::kMaster), std::vector<float>(kElements, 2.0f));
  // The next step finds every chunk resident (the budget holds them): hits.
  const uint64_t hits_before_step_2 = user.cache_hits.load();
  for (uint32_t chunk : {3u, 2u, 1u, 0u}) ASSERT_TRUE(store_->StageUpdate(chunk, AddToMaster(1.0f)).ok());
  EXPECT_EQ(user.cache_hits.load(), hits_before_step_2 + 4);
}

TEST_F(ChunkStoreTest, StepsUnderATightBudgetEvictAndStayWithinIt) {
  // Room for three chunks' states; four chunks, two of them prefetched ahead.
  store_.reset();
  cache_ = std::make_unique<StateCache>(3 * *ChunkStateBytes(kElements));
  store_ = MakeStore(*cache_);
  StateCache& small = *cache_;
  Register(4);
  for (int64_t step = 1; step <= 3; ++step) {
    for (uint32_t chunk = 0; chunk < 4; ++chunk) {
      ASSERT_TRUE(store_->StageUpdate(chunk, AddToMaster(1.0f)).ok()) << step << " " << chunk;
      EXPECT_LE(small.bytes_in_use(), small.budget_bytes());
    }
    ASSERT_TRUE(store_->CommitStep(step).ok());
  }
  for (uint32_t chunk = 0; chunk < 4; ++chunk) {
    EXPECT_EQ(CommittedOnStorage(chunk, ChunkState::kMaster), std::vector<float>(kElements, 4.0f));
    EXPECT_EQ(store_->Find(chunk)->update_count(), 3);
  }
}

TEST_F(ChunkStoreTest, ImportCommitsInOneManifestCommit) {
  Register(2);
  std::vector<float> m(kElements, 0.25f);
  ASSERT_TRUE(store_->ImportState(0, ChunkState::kExpAvg, 0, m).ok());
  // Evicted before CommitImport: a second piece is read back from the shadow extent.
  cache_->DropJob(job_->key());
  std::vector<float> master(10, 9.0f);
  ASSERT_TRUE(store_->ImportState(0, ChunkState::kMaster, 0, master).ok());
  store_->ImportUpdateCount(1, 7);
  EXPECT_TRUE(store_->HasPendingImport(0));
  EXPECT_EQ(store_->pending_imports(), 2u);
  EXPECT_EQ(CommittedOnStorage(0, ChunkState::kExpAvg), std::vector<float>(kElements, 0.0f));  // not yet
  auto changed = store_->CommitImport();
  ASSERT_TRUE(changed.ok()) << changed.status();
  EXPECT_EQ(*changed, 2u);
  EXPECT_EQ(store_->pending_imports(), 0u);
  EXPECT_EQ(store_->committed_step(), 0);
  EXPECT_EQ(store_->Find(1)->update_count(), 7);
  EXPECT_EQ(CommittedOnStorage(0, ChunkState::kExpAvg), m);
  std::vector<float> expected(kElements, 1.0f);
  std::fill_n(expected.begin(), 10, 9.0f);
  EXPECT_EQ(CommittedOnStorage(0, ChunkState::kMaster), expected);
  EXPECT_EQ(Committed(*store_, 0, ChunkState::kMaster), expected);
}

TEST_F(ChunkStoreTest, ADroppedImportLeavesTheCommittedStates) {
  Register(1);
  std::vector<float> v(kElements, 5.0f);
  ASSERT_TRUE(store_->ImportState(0, ChunkState::kExpAvgSq, 0, v).ok());
  store_->ImportUpdateCount(0, 3);
  store_->DropImport();
  EXPECT_EQ(store_->pending_imports(), 0u);
  EXPECT_EQ(store_->Find(0)->update_count(), 0);
  EXPECT_EQ(Committed(*store_, 0, ChunkState::kExpAvgSq), std::vector<float>(kElements, 0.0f));
  // A failed import write drops the whole pending import.
  store_->ImportUpdateCount(0, 3);
  faults_.fail_writes = true;
  EXPECT_FALSE(store_->ImportState(0, ChunkState::kExpAvgSq, 0, v).ok());
  faults_.fail_writes = false;
  EXPECT_EQ(store_->pending_imports(), 0u);
  EXPECT_EQ(CommittedOnStorage(0, ChunkState::kExpAvgSq), std::vector<float>(kElements, 0.0f));
}

TEST_F(ChunkStoreTest, SegmentCountsAfterAStepAreCommitted) {
  Register(1);
  ASSERT_TRUE(store_->StageUpdate(0, AddToMaster(1.0f), /*segment_update_counts=*/{1, 0}).ok());
  ASSERT_TRUE(store_->CommitStep(1).ok());
  const v1::ChunkRecord& record = *store_->Find(0);
  EXPECT_EQ(record.update_count(), 1);
  ASSERT_EQ(record.segment_update_counts_size(), 2);
  EXPECT_EQ(record.segment_update_counts(1), 0);
  // A step that updates every segment counts one more in each.
  ASSERT_TRUE(store_->StageUpdate(0, AddToMaster(1.0f)).ok());
  ASSERT_TRUE(store_->CommitStep(2).ok());
  EXPECT_EQ(store_->Find(0)->update_count(), 2);
  ASSERT_EQ(store_->Find(0)->segment_update_counts_size(), 2);
  EXPECT_EQ(store_->Find(0)->segment_update_counts(0), 2);
  EXPECT_EQ(store_->Find(0)->segment_update_counts(1), 1);
}

TEST_F(ChunkStoreTest, CloseRollsBackAndDropsWhatIsPending) {
  Register(2);
  ASSERT_TRUE(store_->StageUpdate(0, AddToMaster(1.0f)).ok());
  store_->Close();
  store_ = MakeStore(*cache_);
  EXPECT_EQ(store_->committed_step(), 0);
  EXPECT_EQ(Committed(*store_, 0, ChunkState::kMaster), std::vector<float>(kElements, 1.0f));
}

// Segments (ChunkSpec.segment_elements): a new chunk stores them, a chunk stored
// without adopts the first ones a resume sends, a chunk stored with keeps them;
// per-segment counts staged with an update are committed, and returned on resume.
TEST_F(ChunkStoreTest, SegmentsAreStoredAdoptedAndTheirCountsCommitted) {
  std::vector<float> weights(kElements, 1.0f);
  const auto bytes = std::as_writable_bytes(std::span(weights));
  ChunkStore::Registration with{.chunk_id = 0, .num_elements = kElements, .segment_elements = {400, 600},
                                .weights = bytes};
  ChunkStore::Registration without{.chunk_id = 1, .num_elements = kElements, .weights = bytes};
  ASSERT_TRUE(store_->Register(std::vector{with, without}, 0).ok());
  EXPECT_EQ(std::vector<uint64_t>(store_->Find(0)->segment_elements().begin(), store_->Find(0)->segment_elements().end()),
            (std::vector<uint64_t>{400, 600}));
  EXPECT_TRUE(store_->Find(1)->segment_elements().empty());

  // Step 1: chunk 0's second segment had no gradient.
  ASSERT_TRUE(store_->StageUpdate(0, AddToMaster(1.0f), {1, 0}).ok());
  ASSERT_TRUE(store_->CommitStep(1).ok());
  EXPECT_EQ(store_->Find(0)->update_count(), 1);
  EXPECT_EQ(std::vector<int64_t>(store_->Find(0)->segment_update_counts().begin(),
                                 store_->Find(0)->segment_update_counts().end()),
            (std::vector<int64_t>{1, 0}));

  // A resume: chunk 1 adopts the segments sent; chunk 0 keeps its own.
  store_.reset();
  store_ = MakeStore(*cache_);
  with.segment_elements = {999, 1};
  without.segment_elements = {10, 990};
  auto resumed = store_->Register(std::vector{with, without}, 0);
  ASSERT_TRUE(resumed.ok()) << resumed.status();
  EXPECT_EQ((*resumed)[0].update_count, 1);
  EXPECT_EQ((*resumed)[0].segment_update_counts, (std::vector<int64_t>{1, 0}));
  EXPECT_TRUE((*resumed)[1].segment_update_counts.empty());
  EXPECT_EQ(std::vector<uint64_t>(store_->Find(0)->segment_elements().begin(), store_->Find(0)->segment_elements().end()),
            (std::vector<uint64_t>{400, 600}))
      << "stored segments are kept (the caller refuses others before Register)";
  EXPECT_EQ(std::vector<uint64_t>(store_->Find(1)->segment_elements().begin(), store_->Find(1)->segment_elements().end()),
            (std::vector<uint64_t>{10, 990}));
}

// ---- The durability interval (commit_every_steps > 1).

TEST_F(ChunkStoreTest, WithAnIntervalOnlyEveryNthStepWritesAndCommits) {
  Register(2);
  store_ = MakeStore(*cache_, 2, {.every_steps = 3});
  const uint64_t written = BytesWritten();
  for (int64_t step = 1; step <= 2; ++step) {
    ASSERT_TRUE(store_->StageUpdate(0, AddToMaster(1.0f, 0.5f)).ok());
    ASSERT_TRUE(store_->StageUpdate(1, AddToMaster(2.0f)).ok());
    auto committed = store_->CommitStep(step);
    ASSERT_TRUE(committed.ok()) << committed.status();
    EXPECT_EQ(store_->committed_step(), step);
    EXPECT_EQ(store_->durable_step(), 0);
  }
  EXPECT_EQ(BytesWritten(), written) << "acknowledged steps wrote states";
  EXPECT_EQ(store_->Find(0)->update_count(), 2);
  EXPECT_EQ(Committed(*store_, 0, ChunkState::kMaster), std::vector<float>(kElements, 3.0f));
  // Storage (what a crash keeps) is still step 0.
  EXPECT_EQ(job_->manifest().committed_step(), 0);
  EXPECT_EQ(CommittedOnStorage(0, ChunkState::kMaster), std::vector<float>(kElements, 1.0f));
  // Step 3 is durable: every chunk's states written once, the manifest at step 3.
  ASSERT_TRUE(store_->StageUpdate(0, AddToMaster(1.0f)).ok());
  ASSERT_TRUE(store_->CommitStep(3).ok());
  EXPECT_EQ(store_->durable_step(), 3);
  EXPECT_EQ(BytesWritten() - written, 2 * ShadowExtent(*store_->Find(0)).length());
  EXPECT_EQ(CommittedOnStorage(0, ChunkState::kMaster), std::vector<float>(kElements, 4.0f));
  EXPECT_EQ(CommittedOnStorage(1, ChunkState::kMaster), std::vector<float>(kElements, 5.0f));
  EXPECT_EQ(job_->FindRecord(0)->update_count(), 3);
  EXPECT_EQ(job_->FindRecord(1)->update_count(), 2);
}

// A redo or a roll-back of a chunk whose acknowledged states exist only in DRAM
// returns to them (the undo copy), not to the durable ones on storage.
TEST_F(ChunkStoreTest, WithAnIntervalRedoAndRollBackReturnToTheAcknowledgedStates) {
  Register(1);
  store_ = MakeStore(*cache_, 2, {.every_steps = 10});
  ASSERT_TRUE(store_->StageUpdate(0, AddToMaster(1.0f, 0.5f)).ok());
  ASSERT_TRUE(store_->CommitStep(1).ok());
  ASSERT_TRUE(store_->StageUpdate(0, AddToMaster(10.0f, 9.0f)).ok());
  ASSERT_TRUE(store_->RollBackChunk(0).ok());
  ASSERT_TRUE(store_->StageUpdate(0, AddToMaster(1.0f, 0.25f)).ok());  // from step 1's 2.0
  ASSERT_TRUE(store_->CommitStep(2).ok());
  EXPECT_EQ(Committed(*store_, 0, ChunkState::kMaster), std::vector<float>(kElements, 3.0f));
  ASSERT_TRUE(store_->StageUpdate(0, AddToMaster(100.0f)).ok());
  store_->RollBackStep();
  EXPECT_EQ(Committed(*store_, 0, ChunkState::kMaster), std::vector<float>(kElements, 3.0f));
  EXPECT_EQ(Committed(*store_, 0, ChunkState::kExpAvg), std::vector<float>(kElements, 0.25f));
  EXPECT_EQ(store_->durable_step(), 0);
  ASSERT_TRUE(store_->MakeDurable().ok());
  EXPECT_EQ(store_->durable_step(), 2);
  EXPECT_EQ(CommittedOnStorage(0, ChunkState::kMaster), std::vector<float>(kElements, 3.0f));
  EXPECT_EQ(job_->FindRecord(0)->update_count(), 2);
}

TEST_F(ChunkStoreTest, WithAnIntervalClosingTheStoreMakesTheLastStepDurable) {
  Register(1);
  store_ = MakeStore(*cache_, 2, {.every_steps = 10});
  ASSERT_TRUE(store_->StageUpdate(0, AddToMaster(1.0f)).ok());
  ASSERT_TRUE(store_->CommitStep(1).ok());
  ASSERT_TRUE(store_->StageUpdate(0, AddToMaster(5.0f)).ok());  // step 2, never committed
  store_->Close();
  EXPECT_EQ(job_->manifest().committed_step(), 1);
  EXPECT_EQ(CommittedOnStorage(0, ChunkState::kMaster), std::vector<float>(kElements, 2.0f));
}

// commit_every_seconds: a step is durable once the period passed (here a
// nanosecond, always passed by the next step), whatever the step count.
TEST_F(ChunkStoreTest, WithAnIntervalInSecondsAStepIsDurableOnceThePeriodPassed) {
  Register(1);
  store_ = MakeStore(*cache_, 2, {.every_steps = 1000, .every_seconds = 1e-9});
  ASSERT_TRUE(store_->StageUpdate(0, AddToMaster(1.0f)).ok());
  ASSERT_TRUE(store_->CommitStep(1).ok());
  EXPECT_EQ(store_->durable_step(), 1);
  store_ = MakeStore(*cache_, 2, {.every_steps = 1000, .every_seconds = 3600});
  ASSERT_TRUE(store_->StageUpdate(0, AddToMaster(1.0f)).ok());
  ASSERT_TRUE(store_->CommitStep(2).ok());
  EXPECT_EQ(store_->durable_step(), 1);
}

// Pending states are pinned: a job whose states (twice, with the undo copies)
// do not fit in half the DRAM budget commits every step, as with N = 1.
TEST_F(ChunkStoreTest, WithAnIntervalAJobTooLargeForDramCommitsEveryStep) {
  Register(2);
  StateCache small(3 * 12288);  // half: 18432 bytes, under 2 x 2 chunks x 12288
  store_ = MakeStore(small, 2, {.every_steps = 10});
  ASSERT_TRUE(store_->StageUpdate(0, AddToMaster(1.0f)).ok());
  ASSERT_TRUE(store_->StageUpdate(1, AddToMaster(1.0f)).ok());
  ASSERT_TRUE(store_->CommitStep(1).ok());
  EXPECT_EQ(store_->durable_step(), 1);
  EXPECT_EQ(CommittedOnStorage(1, ChunkState::kMaster), std::vector<float>(kElements, 2.0f));
  store_.reset();
}

}  // namespace
}  // namespace fuyou
