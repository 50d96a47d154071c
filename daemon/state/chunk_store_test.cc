#include "state/chunk_store.h"

#include <gtest/gtest.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <condition_variable>
#include <filesystem>
#include <fstream>
#include <mutex>
#include <vector>

#include "common/status_util.h"
#include "fmt/format.h"
#include "optimizer/dtype_convert.h"
#include "stats/daemon_stats.h"
#include "storage/io_engine.h"
#include "test_support/temp_dir.h"

namespace fuyou {
namespace {
namespace fs = std::filesystem;

constexpr uint64_t kElements = 1000;  // 12000 bytes of states: one 12288-byte extent
constexpr uid_t kUid = 1000;

// One chunk's update as the session makes it: BeginUpdate, `update` on the
// staged states (the session's kernel), SubmitUpdate.
template <typename Update>
absl::Status StageUpdate(ChunkStore& store, uint32_t chunk_id, Update update,
                         std::vector<int64_t> segment_update_counts = {}) {
  absl::StatusOr<StagedUpdate> staged = store.BeginUpdate(chunk_id);
  if (!staged.ok()) return staged.status();
  update(staged->states());
  store.SubmitUpdate(*std::move(staged), std::move(segment_update_counts));
  return absl::OkStatus();
}

// The engine's own test seam: fails every write while `fail_writes` is set,
// every data sync (Sync and SyncAsync) while `fail_syncs` is, and holds every
// write's completion between HoldWrites and ReleaseWrites (on the engine's
// completion thread, so the completions behind it wait too): a write-back
// stays in flight for as long as a test needs, without timing. HoldSyncs and
// ReleaseSyncs do the same for data syncs (a background commit waits for them).
class WriteFailures final : public storage::FaultInjector {
 public:
  int64_t Adjust(Op op, const fs::path& /*file*/, uint64_t /*offset*/, uint64_t /*length*/,
                 int64_t result) override {
    if (op == Op::kSync && fail_syncs.load()) return -EIO;
    if (op == Op::kWrite) {
      std::unique_lock lock(mutex_);
      released_.wait(lock, [this] { return !hold_writes_; });
    }
    if (op == Op::kSync) {
      std::unique_lock lock(mutex_);
      released_.wait(lock, [this] { return !hold_syncs_; });
    }
    return op == Op::kWrite && fail_writes.load() ? -EIO : result;
  }
  void HoldWrites() {
    std::lock_guard lock(mutex_);
    hold_writes_ = true;
  }
  void ReleaseWrites() {
    std::lock_guard lock(mutex_);
    hold_writes_ = false;
    released_.notify_all();
  }
  void HoldSyncs() {
    std::lock_guard lock(mutex_);
    hold_syncs_ = true;
  }
  void ReleaseSyncs() {
    std::lock_guard lock(mutex_);
    hold_syncs_ = false;
    released_.notify_all();
  }
  std::atomic<bool> fail_writes{false};
  std::atomic<bool> fail_syncs{false};

 private:
  std::mutex mutex_;
  std::condition_variable released_;
  bool hold_writes_ = false;
  bool hold_syncs_ = false;
};

class ChunkStoreTest : public ::testing::Test {
 protected:
  void SetUp() override {
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
    faults_.ReleaseWrites();  // a test that failed while holding them
    faults_.ReleaseSyncs();
    store_.reset();
    cache_.reset();
    job_.reset();
    io_.reset();
  }

  std::unique_ptr<ChunkStore> MakeStore(StateCache& cache, unsigned prefetch_window = 2,
                                        DurabilityInterval durability = {}) {
    return std::make_unique<ChunkStore>(*job_, cache, stats_->ScopesOf(kUid),
                                        prefetch_window, durability);
  }
  uint64_t BytesWritten() { return stats_->ForUser(kUid).Get(Ticker::kBytesWritten); }
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
        reinterpret_cast<float*>(states.exp_avg())[i] = m;  // fp32 moments
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

  // ---- Working weights (issue 12): chunks of kElements bf16 weights.
  static constexpr uint64_t kWeightsBytes = kElements * 2;
  // Its extent: 12000 bytes of states padded to 12288, then the weights region.
  static constexpr uint64_t kWeightsOffset = 12288;
  static constexpr uint64_t kWeightsRegion = 4096;
  using Bytes = std::vector<std::byte>;

  // The bf16 bytes of kElements weights `base` + i / 1024 (distinct values, so
  // that equal bytes mean the same update).
  static Bytes Bf16Weights(float base) {
    std::vector<float> values(kElements);
    for (uint64_t i = 0; i < kElements; ++i) values[i] = base + static_cast<float>(i) / 1024.0f;
    Bytes bytes(kWeightsBytes);
    optimizer::ConvertFromFloat32(values.data(), bytes.data(), DType::kBFloat16, kElements);
    return bytes;
  }
  ChunkStore::Registration WeightsRegistration(uint32_t id, Bytes& slot, bool store_weights = true,
                                               DType param_dtype = DType::kBFloat16) {
    return {.chunk_id = id,
            .num_elements = kElements,
            .param_dtype = param_dtype,
            .grad_dtype = DType::kBFloat16,
            .layout_fingerprint = 42,
            .weights = std::span(slot),
            .store_weights = store_weights};
  }
  // Registers chunks 0..count-1 storing their bf16 working weights; chunk i
  // starts at Bf16Weights(i) (kept in slots_).
  void RegisterWithWeights(ChunkStore& store, uint32_t count) {
    slots_.clear();
    for (uint32_t id = 0; id < count; ++id) slots_.push_back(Bf16Weights(static_cast<float>(id)));
    std::vector<ChunkStore::Registration> chunks;
    for (uint32_t id = 0; id < count; ++id) chunks.push_back(WeightsRegistration(id, slots_[id]));
    auto registered = store.Register(chunks, /*job_quota_bytes=*/0);
    ASSERT_TRUE(registered.ok()) << registered.status();
  }
  // An update as the session's kernel makes it for a chunk with weights: adds
  // `delta` to master and m, then stores master in bf16 as the new working
  // weights; `*produced` gets those weights.
  static auto UpdateStoringWeights(float delta, Bytes* produced) {
    return [delta, produced](const ChunkStates& states) {
      ASSERT_NE(states.weights(), nullptr);
      ASSERT_EQ(states.weights_bytes(), kWeightsBytes);
      for (uint64_t i = 0; i < states.num_elements(); ++i) {
        states.master()[i] += delta;
        reinterpret_cast<float*>(states.exp_avg())[i] += delta;  // fp32 moments
      }
      optimizer::ConvertFromFloat32(states.master(), states.weights(), DType::kBFloat16, states.num_elements());
      produced->assign(states.weights(), states.weights() + states.weights_bytes());
    };
  }
  // FetchWeights of `chunk_id` through `store`; `*source` gets where from.
  static Bytes Fetch(ChunkStore& store, uint32_t chunk_id, ChunkStore::FetchSource* source = nullptr) {
    Bytes out(kWeightsBytes);
    auto fetched = store.FetchWeights(chunk_id, std::span(out));
    EXPECT_TRUE(fetched.ok()) << fetched.status();
    if (source != nullptr && fetched.ok()) *source = *fetched;
    return out;
  }
  // Bytes the I/O engine read from the storage path (every read, whoever made it).
  uint64_t StorageBytesRead() { return stats_->path_counters(0)->bytes_read.load(); }
  TickerCounts& UserCounts() { return stats_->ForUser(kUid); }
  fs::path StatesFile() const { return root_ / "users" / std::to_string(kUid) / "jobs" / "job" / "states.bin"; }

  const TempDir temp_dir_{"fuyou-chunk-store-test"};
  const fs::path root_ = temp_dir_.path();
  std::vector<Bytes> slots_;
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
  ASSERT_TRUE(StageUpdate(*store_, 0, AddToMaster(1.0f, 0.5f)).ok());
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
  ASSERT_TRUE(StageUpdate(*store_, 0, AddToMaster(1.0f)).ok());
  ASSERT_TRUE(store_->CommitStep(2).ok());
  EXPECT_EQ(store_->Find(0)->committed_version(), version_before);
  EXPECT_EQ(CommittedOnStorage(0, ChunkState::kMaster), std::vector<float>(kElements, 3.0f));
}

TEST_F(ChunkStoreTest, RollBackStepKeepsTheCommittedStates) {
  Register(2);
  ASSERT_TRUE(StageUpdate(*store_, 0, AddToMaster(5.0f)).ok());
  ASSERT_TRUE(StageUpdate(*store_, 1, AddToMaster(5.0f)).ok());
  store_->RollBackStep();
  EXPECT_EQ(store_->staged_count(), 0u);
  EXPECT_EQ(store_->committed_step(), 0);
  EXPECT_EQ(store_->Find(0)->update_count(), 0);
  // The cache does not hand out the rolled-back bytes as committed.
  EXPECT_EQ(Committed(*store_, 0, ChunkState::kMaster), std::vector<float>(kElements, 1.0f));
  EXPECT_EQ(CommittedOnStorage(1, ChunkState::kMaster), std::vector<float>(kElements, 1.0f));
  // The step can be done again.
  ASSERT_TRUE(StageUpdate(*store_, 0, AddToMaster(2.0f)).ok());
  ASSERT_TRUE(store_->CommitStep(1).ok());
  EXPECT_EQ(CommittedOnStorage(0, ChunkState::kMaster), std::vector<float>(kElements, 3.0f));
}

// A redo: one chunk's update is dropped and staged again in the same step.
TEST_F(ChunkStoreTest, RollBackChunkThenStageAgainCommitsTheSecondUpdate) {
  Register(2);
  EXPECT_EQ(store_->RollBackChunk(0).code(), absl::StatusCode::kFailedPrecondition);  // nothing staged
  ASSERT_TRUE(StageUpdate(*store_, 0, AddToMaster(1.0f, 7.0f)).ok());
  ASSERT_TRUE(StageUpdate(*store_, 1, AddToMaster(1.0f)).ok());
  ASSERT_TRUE(store_->RollBackChunk(0).ok());
  EXPECT_FALSE(store_->IsStaged(0));
  EXPECT_TRUE(store_->IsStaged(1));
  // The second staging starts from the committed states (1.0), not the first update's (2.0).
  ASSERT_TRUE(StageUpdate(*store_, 0, AddToMaster(10.0f, 3.0f)).ok());
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
  ASSERT_TRUE(StageUpdate(*store_, 0, AddToMaster(1.0f)).ok());
  ASSERT_TRUE(store_->WaitForWriteBacks().ok());  // chunk 0's write-back is done
  faults_.fail_writes = true;
  ASSERT_TRUE(StageUpdate(*store_, 1, AddToMaster(1.0f)).ok());  // submitted; fails on completion
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
  ASSERT_TRUE(StageUpdate(*store_, 1, AddToMaster(1.0f)).ok());
  ASSERT_TRUE(store_->CommitStep(1).ok());
  EXPECT_EQ(CommittedOnStorage(1, ChunkState::kMaster), std::vector<float>(kElements, 2.0f));
}

TEST_F(ChunkStoreTest, StagingPrefetchesTheChunksPredictedNext) {
  Register(4);
  cache_->DropJob(job_->key());  // a cold cache
  TickerCounts& user = stats_->ForUser(kUid);
  // Before any step the prediction is backward: 3, 2, 1, 0.
  ASSERT_TRUE(StageUpdate(*store_, 3, AddToMaster(1.0f)).ok());
  EXPECT_TRUE(cache_->Contains(job_->key(), 2));
  EXPECT_TRUE(cache_->Contains(job_->key(), 1));
  EXPECT_FALSE(cache_->Contains(job_->key(), 0));  // outside the window of 2
  const uint64_t hits = user.Get(Ticker::kCacheHits);
  const uint64_t misses = user.Get(Ticker::kCacheMisses);
  // Served by the prefetch, without a read of its own; but its bytes came from
  // storage, so it counts as a miss, not as a read served from DRAM.
  ASSERT_TRUE(StageUpdate(*store_, 2, AddToMaster(1.0f)).ok());
  EXPECT_EQ(user.Get(Ticker::kCacheHits), hits);
  EXPECT_EQ(user.Get(Ticker::kCacheMisses), misses + 1);
  ASSERT_TRUE(StageUpdate(*store_, 1, AddToMaster(1.0f)).ok());
  ASSERT_TRUE(StageUpdate(*store_, 0, AddToMaster(1.0f)).ok());
  ASSERT_TRUE(store_->CommitStep(1).ok());
  EXPECT_EQ(CommittedOnStorage(2, ChunkState::kMaster), std::vector<float>(kElements, 2.0f));
  // The next step finds every chunk resident (the budget holds them): hits.
  const uint64_t hits_before_step_2 = user.Get(Ticker::kCacheHits);
  for (uint32_t chunk : {3u, 2u, 1u, 0u}) ASSERT_TRUE(StageUpdate(*store_, chunk, AddToMaster(1.0f)).ok());
  EXPECT_EQ(user.Get(Ticker::kCacheHits), hits_before_step_2 + 4);
}

// One chunk's extent: kElements states padded to a block.
constexpr uint64_t kExtentBytes = 12288;

TEST_F(ChunkStoreTest, TheReadAheadFillsTheBudgetBesideTheWriteBacksInFlight) {
  // Room for five chunks, and a window of up to 32 chunks: the DRAM decides.
  store_.reset();
  cache_ = std::make_unique<StateCache>(5 * kExtentBytes);
  store_ = MakeStore(*cache_, /*prefetch_window=*/32);
  Register(8);
  cache_->DropJob(job_->key());  // a cold cache
  // Before any step the prediction is backward: 7, 6, ..., 0. Chunk 7's
  // write-back stays in flight (its buffer pinned): four chunks are read ahead.
  faults_.HoldWrites();
  ASSERT_TRUE(StageUpdate(*store_, 7, AddToMaster(1.0f)).ok());
  for (uint32_t chunk : {6u, 5u, 4u, 3u}) EXPECT_TRUE(cache_->Contains(job_->key(), chunk)) << chunk;
  EXPECT_FALSE(cache_->Contains(job_->key(), 2));
  EXPECT_TRUE(cache_->Contains(job_->key(), 7));  // pinned by its write-back: never evicted
  EXPECT_LE(cache_->bytes_in_use(), cache_->budget_bytes());
  faults_.ReleaseWrites();
  ASSERT_TRUE(store_->WaitForWriteBacks().ok());  // the reads too
  // The window moves with the updates: 6 is updated from its prefetch and, its
  // write-back in flight, 5..2 are ahead; 7 (written, needed last) made room.
  faults_.HoldWrites();
  ASSERT_TRUE(StageUpdate(*store_, 6, AddToMaster(1.0f)).ok());
  for (uint32_t chunk : {5u, 4u, 3u, 2u}) EXPECT_TRUE(cache_->Contains(job_->key(), chunk)) << chunk;
  EXPECT_FALSE(cache_->Contains(job_->key(), 1));
  EXPECT_FALSE(cache_->Contains(job_->key(), 7));
  EXPECT_LE(cache_->bytes_in_use(), cache_->budget_bytes());
  faults_.ReleaseWrites();
  for (uint32_t chunk : {5u, 4u, 3u, 2u, 1u, 0u}) ASSERT_TRUE(StageUpdate(*store_, chunk, AddToMaster(1.0f)).ok());
  ASSERT_TRUE(store_->CommitStep(1).ok());
  for (uint32_t chunk = 0; chunk < 8; ++chunk) {
    EXPECT_EQ(CommittedOnStorage(chunk, ChunkState::kMaster), std::vector<float>(kElements, 2.0f)) << chunk;
  }
}

TEST_F(ChunkStoreTest, HoldsNarrowTheReadAheadWindow) {
  store_.reset();
  cache_ = std::make_unique<StateCache>(6 * kExtentBytes);
  store_ = MakeStore(*cache_, /*prefetch_window=*/32);
  Register(8);
  cache_->DropJob(job_->key());
  // Two chunks held (say another session's pending states), one written back:
  // three of the six are left for the read-ahead.
  ASSERT_TRUE(cache_->TryHold(2 * kExtentBytes));
  faults_.HoldWrites();
  ASSERT_TRUE(StageUpdate(*store_, 7, AddToMaster(1.0f)).ok());
  for (uint32_t chunk : {6u, 5u, 4u}) EXPECT_TRUE(cache_->Contains(job_->key(), chunk)) << chunk;
  EXPECT_FALSE(cache_->Contains(job_->key(), 3));
  faults_.ReleaseWrites();
  ASSERT_TRUE(store_->WaitForWriteBacks().ok());
  cache_->ReleaseHold(2 * kExtentBytes);
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
      ASSERT_TRUE(StageUpdate(*store_, chunk, AddToMaster(1.0f)).ok()) << step << " " << chunk;
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
  ASSERT_TRUE(StageUpdate(*store_, 0, AddToMaster(1.0f), /*segment_update_counts=*/{1, 0}).ok());
  ASSERT_TRUE(store_->CommitStep(1).ok());
  const v1::ChunkRecord& record = *store_->Find(0);
  EXPECT_EQ(record.update_count(), 1);
  ASSERT_EQ(record.segment_update_counts_size(), 2);
  EXPECT_EQ(record.segment_update_counts(1), 0);
  // A step that updates every segment counts one more in each.
  ASSERT_TRUE(StageUpdate(*store_, 0, AddToMaster(1.0f)).ok());
  ASSERT_TRUE(store_->CommitStep(2).ok());
  EXPECT_EQ(store_->Find(0)->update_count(), 2);
  ASSERT_EQ(store_->Find(0)->segment_update_counts_size(), 2);
  EXPECT_EQ(store_->Find(0)->segment_update_counts(0), 2);
  EXPECT_EQ(store_->Find(0)->segment_update_counts(1), 1);
}

TEST_F(ChunkStoreTest, CloseRollsBackAndDropsWhatIsPending) {
  Register(2);
  ASSERT_TRUE(StageUpdate(*store_, 0, AddToMaster(1.0f)).ok());
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
  ASSERT_TRUE(StageUpdate(*store_, 0, AddToMaster(1.0f), {1, 0}).ok());
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

// ---- The commit off the critical path (ApplyStep, issue 22).

// ApplyStep returns with the step applied (what the next step reads) and its
// durable commit running; WaitForCommit makes it the durable step, and the
// next step's first update waits for it before it writes the extents the
// commit frees.
TEST_F(ChunkStoreTest, ApplyStepAnswersAppliedAndTheNextUpdateWaitsForTheDurableCommit) {
  Register(2);
  ASSERT_TRUE(StageUpdate(*store_, 0, AddToMaster(1.0f)).ok());
  ASSERT_TRUE(StageUpdate(*store_, 1, AddToMaster(2.0f)).ok());
  auto applied = store_->ApplyStep(1);
  ASSERT_TRUE(applied.ok()) << applied.status();
  EXPECT_EQ(*applied, 2u);
  EXPECT_EQ(store_->committed_step(), 1);
  EXPECT_TRUE(store_->commit_pending());
  EXPECT_EQ(store_->durable_step(), 0) << "durable before WaitForCommit adopted it";
  EXPECT_EQ(Committed(*store_, 0, ChunkState::kMaster), std::vector<float>(kElements, 2.0f));
  ASSERT_TRUE(store_->WaitForCommit().ok());
  EXPECT_FALSE(store_->commit_pending());
  EXPECT_EQ(store_->durable_step(), 1);
  EXPECT_EQ(CommittedOnStorage(1, ChunkState::kMaster), std::vector<float>(kElements, 3.0f));

  // Step 2 applied; step 3's first update finds step 2 durable before it stages.
  ASSERT_TRUE(StageUpdate(*store_, 0, AddToMaster(1.0f)).ok());
  ASSERT_TRUE(store_->ApplyStep(2).ok());
  absl::StatusOr<StagedUpdate> staged = store_->BeginUpdate(0);
  ASSERT_TRUE(staged.ok()) << staged.status();
  EXPECT_FALSE(store_->commit_pending());
  EXPECT_EQ(store_->durable_step(), 2);
  AddToMaster(1.0f)(staged->states());
  store_->SubmitUpdate(*std::move(staged));
  ASSERT_TRUE(store_->ApplyStep(3).ok());
  // A step without updates (a second EndStep) waits for the commit before it.
  ASSERT_TRUE(store_->ApplyStep(4).ok());
  EXPECT_EQ(store_->durable_step(), 3);
  store_->Close();  // waits for step 4's commit
  EXPECT_EQ(job_->manifest().committed_step(), 4);
  EXPECT_EQ(CommittedOnStorage(0, ChunkState::kMaster), std::vector<float>(kElements, 4.0f));
  EXPECT_EQ(CommittedOnStorage(1, ChunkState::kMaster), std::vector<float>(kElements, 3.0f));
}

// A background commit that fails (here the data sync a write-back started:
// EIO) after its step was applied: the error is the store's from then on, the
// step is forgotten, and the job on storage stays at the step before, intact.
TEST_F(ChunkStoreTest, AFailedBackgroundCommitIsTheStoresErrorAndTheJobKeepsTheStepBefore) {
  Register(1);
  ASSERT_TRUE(StageUpdate(*store_, 0, AddToMaster(1.0f, 0.5f)).ok());
  ASSERT_TRUE(store_->ApplyStep(1).ok());
  ASSERT_TRUE(store_->WaitForCommit().ok());
  faults_.fail_syncs = true;
  ASSERT_TRUE(StageUpdate(*store_, 0, AddToMaster(10.0f, 9.0f)).ok());
  ASSERT_TRUE(store_->ApplyStep(2).ok()) << "applied before its commit ran";
  EXPECT_EQ(store_->committed_step(), 2);
  const absl::Status failed = store_->WaitForCommit();
  EXPECT_EQ(failed.code(), absl::StatusCode::kDataLoss) << failed;
  EXPECT_NE(failed.message().find("step 2"), std::string::npos) << failed;
  EXPECT_NE(failed.message().find("durable step 1"), std::string::npos) << failed;
  EXPECT_EQ(store_->durable_step(), 1);
  EXPECT_EQ(store_->committed_step(), 1) << "the failed step is not acknowledged any more";
  EXPECT_EQ(store_->PollCommit(), failed);
  EXPECT_EQ(store_->BeginUpdate(0).status(), failed);
  EXPECT_EQ(store_->MakeDurable(), failed);
  EXPECT_EQ(store_->ApplyStep(2).status(), failed);
  faults_.fail_syncs = false;
  store_->Close();
  EXPECT_EQ(job_->manifest().committed_step(), 1);
  auto reopened = Job::Open({root_}, "job", kUid, /*create=*/false, *io_, *stats_);
  ASSERT_TRUE(reopened.ok()) << reopened.status();
  EXPECT_EQ((*reopened)->manifest().committed_step(), 1);
  EXPECT_EQ(CommittedOnStorage(0, ChunkState::kMaster), std::vector<float>(kElements, 2.0f));
  EXPECT_EQ(CommittedOnStorage(0, ChunkState::kExpAvg), std::vector<float>(kElements, 0.5f));
}

// WhenDurable (WaitDurable, issue 24): ready at once for a durable step; for
// the applied step, not before its background commit ends, then its step,
// before WaitForCommit adopted it. One chunk: its write-back completes before
// its data sync is held (the completion thread waits in the held sync).
TEST_F(ChunkStoreTest, WhenDurableIsReadyWhenTheBackgroundCommitEnds) {
  Register(1);
  Future<int64_t> durable = store_->WhenDurable(0);
  ASSERT_TRUE(durable.ready());
  EXPECT_EQ(durable.result().value_or(-1), 0);
  ASSERT_TRUE(StageUpdate(*store_, 0, AddToMaster(1.0f)).ok());
  faults_.HoldSyncs();
  ASSERT_TRUE(store_->ApplyStep(1).ok());
  durable = store_->WhenDurable(1);
  EXPECT_FALSE(durable.ready()) << "ready while the commit's syncs are held";
  EXPECT_EQ(store_->durable_step(), 0);
  faults_.ReleaseSyncs();
  EXPECT_EQ(durable.Wait().value_or(-1), 1);
  EXPECT_TRUE(store_->commit_pending()) << "answered without WaitForCommit";
  ASSERT_TRUE(store_->WaitForCommit().ok());
  durable = store_->WhenDurable(1);
  ASSERT_TRUE(durable.ready());
  EXPECT_EQ(durable.result().value_or(-1), 1);
}

// A background commit that fails answers WhenDurable with its error naming the
// step; afterwards every WhenDurable gets the store's error at once.
TEST_F(ChunkStoreTest, WhenDurableOfAFailedCommitIsItsError) {
  Register(1);
  ASSERT_TRUE(StageUpdate(*store_, 0, AddToMaster(1.0f)).ok());
  ASSERT_TRUE(store_->ApplyStep(1).ok());
  ASSERT_TRUE(store_->WaitForCommit().ok());
  faults_.fail_syncs = true;
  ASSERT_TRUE(StageUpdate(*store_, 0, AddToMaster(1.0f)).ok());
  ASSERT_TRUE(store_->ApplyStep(2).ok());
  Future<int64_t> waited = store_->WhenDurable(2);
  const absl::StatusOr<int64_t>& failed = waited.Wait();
  ASSERT_FALSE(failed.ok());
  EXPECT_EQ(failed.status().code(), absl::StatusCode::kDataLoss) << failed.status();
  // Asked while the commit runs: "step 2 is not durable: the durable commit of step 2
  // failed: ..."; asked after it failed (a loaded machine): the store's own error,
  // "step 2 was applied but its durable commit failed: ...". Both name the step.
  EXPECT_NE(failed.status().message().find("step 2 "), std::string::npos) << failed.status();
  EXPECT_NE(failed.status().message().find("durable commit"), std::string::npos) << failed.status();
  const absl::Status store_error = store_->WaitForCommit();
  Future<int64_t> after = store_->WhenDurable(1);
  ASSERT_TRUE(after.ready());
  EXPECT_EQ(after.result().status(), store_error);
  faults_.fail_syncs = false;
}

// ---- The durability interval (commit_every_steps > 1).

// A step acknowledged only is made durable by WhenDurable (between steps);
// with a chunk staged it is refused and nothing is written.
TEST_F(ChunkStoreTest, WithAnIntervalWhenDurableMakesTheAcknowledgedStepsDurable) {
  Register(1);
  store_ = MakeStore(*cache_, 2, {.every_steps = 10});
  ASSERT_TRUE(StageUpdate(*store_, 0, AddToMaster(1.0f)).ok());
  ASSERT_TRUE(store_->CommitStep(1).ok());
  ASSERT_EQ(store_->durable_step(), 0);
  Future<int64_t> durable = store_->WhenDurable(1);
  ASSERT_TRUE(durable.ready());
  EXPECT_EQ(durable.result().value_or(-1), 1);
  EXPECT_EQ(job_->manifest().committed_step(), 1);
  EXPECT_EQ(CommittedOnStorage(0, ChunkState::kMaster), std::vector<float>(kElements, 2.0f));
  ASSERT_TRUE(StageUpdate(*store_, 0, AddToMaster(1.0f)).ok());
  ASSERT_TRUE(store_->CommitStep(2).ok());
  ASSERT_TRUE(StageUpdate(*store_, 0, AddToMaster(1.0f)).ok());  // step 3 staged
  durable = store_->WhenDurable(2);
  ASSERT_TRUE(durable.ready());
  EXPECT_EQ(durable.result().status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(job_->manifest().committed_step(), 1);
  store_->RollBackStep();
}

TEST_F(ChunkStoreTest, WithAnIntervalOnlyEveryNthStepWritesAndCommits) {
  Register(2);
  store_ = MakeStore(*cache_, 2, {.every_steps = 3});
  const uint64_t written = BytesWritten();
  for (int64_t step = 1; step <= 2; ++step) {
    ASSERT_TRUE(StageUpdate(*store_, 0, AddToMaster(1.0f, 0.5f)).ok());
    ASSERT_TRUE(StageUpdate(*store_, 1, AddToMaster(2.0f)).ok());
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
  ASSERT_TRUE(StageUpdate(*store_, 0, AddToMaster(1.0f)).ok());
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
  ASSERT_TRUE(StageUpdate(*store_, 0, AddToMaster(1.0f, 0.5f)).ok());
  ASSERT_TRUE(store_->CommitStep(1).ok());
  ASSERT_TRUE(StageUpdate(*store_, 0, AddToMaster(10.0f, 9.0f)).ok());
  ASSERT_TRUE(store_->RollBackChunk(0).ok());
  ASSERT_TRUE(StageUpdate(*store_, 0, AddToMaster(1.0f, 0.25f)).ok());  // from step 1's 2.0
  ASSERT_TRUE(store_->CommitStep(2).ok());
  EXPECT_EQ(Committed(*store_, 0, ChunkState::kMaster), std::vector<float>(kElements, 3.0f));
  ASSERT_TRUE(StageUpdate(*store_, 0, AddToMaster(100.0f)).ok());
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
  ASSERT_TRUE(StageUpdate(*store_, 0, AddToMaster(1.0f)).ok());
  ASSERT_TRUE(store_->CommitStep(1).ok());
  ASSERT_TRUE(StageUpdate(*store_, 0, AddToMaster(5.0f)).ok());  // step 2, never committed
  store_->Close();
  EXPECT_EQ(job_->manifest().committed_step(), 1);
  EXPECT_EQ(CommittedOnStorage(0, ChunkState::kMaster), std::vector<float>(kElements, 2.0f));
}

// commit_every_seconds: a step is durable once the period passed (here a
// nanosecond, always passed by the next step), whatever the step count.
TEST_F(ChunkStoreTest, WithAnIntervalInSecondsAStepIsDurableOnceThePeriodPassed) {
  Register(1);
  store_ = MakeStore(*cache_, 2, {.every_steps = 1000, .every_seconds = 1e-9});
  ASSERT_TRUE(StageUpdate(*store_, 0, AddToMaster(1.0f)).ok());
  ASSERT_TRUE(store_->CommitStep(1).ok());
  EXPECT_EQ(store_->durable_step(), 1);
  store_ = MakeStore(*cache_, 2, {.every_steps = 1000, .every_seconds = 3600});
  ASSERT_TRUE(StageUpdate(*store_, 0, AddToMaster(1.0f)).ok());
  ASSERT_TRUE(store_->CommitStep(2).ok());
  EXPECT_EQ(store_->durable_step(), 1);
}

// Pending states are pinned: a job whose states (twice, with the undo copies)
// do not fit in half the DRAM budget commits every step, as with N = 1.
TEST_F(ChunkStoreTest, WithAnIntervalAJobTooLargeForDramCommitsEveryStep) {
  Register(2);
  StateCache small(3 * 12288);  // half: 18432 bytes, under 2 x 2 chunks x 12288
  store_ = MakeStore(small, 2, {.every_steps = 10});
  ASSERT_TRUE(StageUpdate(*store_, 0, AddToMaster(1.0f)).ok());
  ASSERT_TRUE(StageUpdate(*store_, 1, AddToMaster(1.0f)).ok());
  ASSERT_TRUE(store_->CommitStep(1).ok());
  EXPECT_EQ(store_->durable_step(), 1);
  EXPECT_EQ(CommittedOnStorage(1, ChunkState::kMaster), std::vector<float>(kElements, 2.0f));
  store_.reset();
}


// ---- Working weights (issue 12).

TEST_F(ChunkStoreTest, AFetchReadsOnlyTheWeightsAndReturnsWhatTheCommittedUpdateProduced) {
  RegisterWithWeights(*store_, 2);
  // A new chunk's weights are the slot's initial weights.
  EXPECT_EQ(Fetch(*store_, 1), Bf16Weights(1.0f));
  Bytes produced;
  ASSERT_TRUE(StageUpdate(*store_, 0, UpdateStoringWeights(1.5f, &produced)).ok());
  ASSERT_TRUE(store_->CommitStep(1).ok());
  ASSERT_NE(produced, Bf16Weights(0.0f));
  // The manifest carries their checksum beside the states'.
  const v1::StateExtent& committed = CommittedExtent(*store_->Find(0));
  EXPECT_EQ(committed.length(), kWeightsOffset + kWeightsRegion);
  EXPECT_EQ(committed.weights_checksum(), WeightsChecksum(produced.data(), ChunkLayout(kElements, DType::kBFloat16)));

  // Hot: the committed states in DRAM hold them; nothing is read.
  ASSERT_TRUE(store_->WaitForWriteBacks().ok());
  uint64_t before = StorageBytesRead();
  ChunkStore::FetchSource source;
  EXPECT_EQ(Fetch(*store_, 0, &source), produced);
  EXPECT_TRUE(source.from_dram);
  EXPECT_EQ(StorageBytesRead(), before);

  // Cold (a new store over an empty cache): only the weights region is read,
  // never master, m or v.
  StateCache cold(64 << 20);
  auto store = MakeStore(cold);
  const uint64_t fetches = UserCounts().Get(Ticker::kWeightsFetches);
  const uint64_t hits = UserCounts().Get(Ticker::kWeightsFetchCacheHits);
  const uint64_t weights_read = UserCounts().Get(Ticker::kWeightsBytesRead);
  before = StorageBytesRead();
  EXPECT_EQ(Fetch(*store, 0, &source), produced);
  ASSERT_TRUE(store->WaitForWriteBacks().ok());
  EXPECT_FALSE(source.from_dram);
  EXPECT_EQ(source.bytes_read, kWeightsRegion);
  EXPECT_EQ(StorageBytesRead() - before, kWeightsRegion);
  // Again: from the entry that read left in DRAM.
  before = StorageBytesRead();
  EXPECT_EQ(Fetch(*store, 0, &source), produced);
  EXPECT_TRUE(source.from_dram);
  EXPECT_EQ(StorageBytesRead(), before);
  EXPECT_EQ(UserCounts().Get(Ticker::kWeightsFetches) - fetches, 2u);
  EXPECT_EQ(UserCounts().Get(Ticker::kWeightsFetchCacheHits) - hits, 1u);
  EXPECT_EQ(UserCounts().Get(Ticker::kWeightsBytesRead) - weights_read, kWeightsRegion);
  EXPECT_GE(stats_->tickers.Get(Ticker::kWeightsFetches), 4u);

  // The weights are the committed master in bf16, as the kernel rounds it.
  Bytes rounded(kWeightsBytes);
  const std::vector<float> master = Committed(*store, 0, ChunkState::kMaster);
  optimizer::ConvertFromFloat32(master.data(), rounded.data(), DType::kBFloat16, kElements);
  EXPECT_EQ(rounded, produced);

  // A wrong-sized buffer is refused.
  Bytes small(kWeightsBytes - 2);
  EXPECT_EQ(store->FetchWeights(0, std::span(small)).status().code(), absl::StatusCode::kInvalidArgument);
}

TEST_F(ChunkStoreTest, DuringTheStepAfterARollBackOrARedoAFetchReturnsTheCommittedWeights) {
  RegisterWithWeights(*store_, 1);
  Bytes step1;
  ASSERT_TRUE(StageUpdate(*store_, 0, UpdateStoringWeights(1.0f, &step1)).ok());
  ASSERT_TRUE(store_->CommitStep(1).ok());
  // Step 2 updates the chunk: its DRAM entry holds the uncommitted update.
  Bytes step2;
  ASSERT_TRUE(StageUpdate(*store_, 0, UpdateStoringWeights(2.0f, &step2)).ok());
  ASSERT_NE(step2, step1);
  EXPECT_EQ(Fetch(*store_, 0), step1);
  // A redo drops the update and makes another.
  ASSERT_TRUE(store_->RollBackChunk(0).ok());
  EXPECT_EQ(Fetch(*store_, 0), step1);
  ASSERT_TRUE(StageUpdate(*store_, 0, UpdateStoringWeights(3.0f, &step2)).ok());
  EXPECT_EQ(Fetch(*store_, 0), step1);
  // An aborted step.
  store_->RollBackStep();
  EXPECT_EQ(Fetch(*store_, 0), step1);
  // Committed: the new weights, also once the chunk's states left DRAM and
  // the weights entry read during the step would have the committed extent's
  // version again (two commits later).
  ASSERT_TRUE(StageUpdate(*store_, 0, UpdateStoringWeights(4.0f, &step2)).ok());
  EXPECT_EQ(Fetch(*store_, 0), step1);  // read from the committed extent (version 1) during step 2
  ASSERT_TRUE(store_->CommitStep(2).ok());
  EXPECT_EQ(Fetch(*store_, 0), step2);
  Bytes step3;
  ASSERT_TRUE(StageUpdate(*store_, 0, UpdateStoringWeights(5.0f, &step3)).ok());
  ASSERT_TRUE(store_->CommitStep(3).ok());
  ASSERT_EQ(store_->Find(0)->committed_version(), 1u);
  ASSERT_TRUE(store_->WaitForWriteBacks().ok());
  cache_->Drop(job_->key(), 0);  // the states left DRAM
  ChunkStore::FetchSource source;
  EXPECT_EQ(Fetch(*store_, 0, &source), step3);
  EXPECT_FALSE(source.from_dram);
}

TEST_F(ChunkStoreTest, WithAnIntervalAFetchReturnsTheAcknowledgedWeights) {
  store_ = MakeStore(*cache_, 2, DurabilityInterval{.every_steps = 3});
  RegisterWithWeights(*store_, 1);
  Bytes step1;
  ASSERT_TRUE(StageUpdate(*store_, 0, UpdateStoringWeights(1.0f, &step1)).ok());
  ASSERT_TRUE(store_->CommitStep(1).ok());
  ASSERT_EQ(store_->durable_step(), 0);  // acknowledged only: in DRAM
  ChunkStore::FetchSource source;
  EXPECT_EQ(Fetch(*store_, 0, &source), step1);
  EXPECT_TRUE(source.from_dram);
  Bytes step2;
  ASSERT_TRUE(StageUpdate(*store_, 0, UpdateStoringWeights(2.0f, &step2)).ok());
  EXPECT_EQ(Fetch(*store_, 0), step1);  // the undo copy
  ASSERT_TRUE(store_->RollBackChunk(0).ok());
  EXPECT_EQ(Fetch(*store_, 0), step1);
  ASSERT_TRUE(StageUpdate(*store_, 0, UpdateStoringWeights(3.0f, &step2)).ok());
  ASSERT_TRUE(store_->CommitStep(2).ok());
  EXPECT_EQ(Fetch(*store_, 0), step2);
  // Closing makes step 2 durable, weights included.
  store_.reset();
  StateCache cold(64 << 20);
  auto store = MakeStore(cold);
  EXPECT_EQ(store->durable_step(), 2);
  EXPECT_EQ(Fetch(*store, 0), step2);
}

TEST_F(ChunkStoreTest, CorruptedWeightsAreDataLossAndNothingIsCopied) {
  RegisterWithWeights(*store_, 1);
  Bytes produced;
  ASSERT_TRUE(StageUpdate(*store_, 0, UpdateStoringWeights(1.0f, &produced)).ok());
  ASSERT_TRUE(store_->CommitStep(1).ok());
  const uint64_t weights_at = CommittedExtent(*store_->Find(0)).offset() + kWeightsOffset;
  store_.reset();
  {
    std::fstream file(StatesFile(), std::ios::in | std::ios::out | std::ios::binary);
    ASSERT_TRUE(file.is_open());
    file.seekp(static_cast<std::streamoff>(weights_at + 100));
    const char flipped = static_cast<char>(std::to_integer<char>(produced[100]) ^ 0x40);
    file.write(&flipped, 1);
  }
  StateCache cold(64 << 20);
  auto store = MakeStore(cold);
  Bytes out(kWeightsBytes, std::byte{0x55});
  auto fetched = store->FetchWeights(0, std::span(out));
  ASSERT_EQ(fetched.status().code(), absl::StatusCode::kDataLoss) << fetched.status();
  const std::string message(fetched.status().message());
  EXPECT_NE(message.find("job 'job' chunk 0"), std::string::npos) << message;
  EXPECT_NE(message.find("working weights"), std::string::npos) << message;
  EXPECT_NE(message.find("states.bin"), std::string::npos) << message;
  EXPECT_NE(message.find(std::to_string(weights_at)), std::string::npos) << message;
  EXPECT_EQ(out, Bytes(kWeightsBytes, std::byte{0x55}));
  // Again (nothing bad was kept in DRAM).
  EXPECT_EQ(store->FetchWeights(0, std::span(out)).status().code(), absl::StatusCode::kDataLoss);
  // An update reads only the states region (which is intact) and writes new
  // weights over the whole region: once committed, they are fetched again.
  Bytes step2;
  ASSERT_TRUE(StageUpdate(*store, 0, UpdateStoringWeights(1.0f, &step2)).ok());
  ASSERT_TRUE(store->CommitStep(2).ok());
  EXPECT_EQ(Fetch(*store, 0), step2);
}

TEST_F(ChunkStoreTest, AnUpdateOfAnEvictedChunkReadsOnlyItsStatesRegion) {
  RegisterWithWeights(*store_, 1);
  Bytes step1;
  ASSERT_TRUE(StageUpdate(*store_, 0, UpdateStoringWeights(1.0f, &step1)).ok());
  ASSERT_TRUE(store_->CommitStep(1).ok());
  ASSERT_TRUE(store_->WaitForWriteBacks().ok());
  cache_->DropJob(job_->key());  // evicted
  const uint64_t before = StorageBytesRead();
  const uint64_t weights_read = UserCounts().Get(Ticker::kWeightsBytesRead);
  Bytes step2;
  ASSERT_TRUE(StageUpdate(*store_, 0, UpdateStoringWeights(1.0f, &step2)).ok());
  // master|m|v padded to a block; never the weights region (the update writes it).
  EXPECT_EQ(StorageBytesRead() - before, kWeightsOffset);
  EXPECT_EQ(UserCounts().Get(Ticker::kWeightsBytesRead), weights_read);
  ASSERT_TRUE(store_->CommitStep(2).ok());
  ASSERT_TRUE(store_->WaitForWriteBacks().ok());
  // The write-back wrote the whole extent: the new weights are on storage.
  EXPECT_EQ(CommittedExtent(*store_->Find(0)).weights_checksum(),
            WeightsChecksum(step2.data(), ChunkLayout(kElements, DType::kBFloat16)));
  StateCache cold(64 << 20);
  auto store = MakeStore(cold);
  EXPECT_EQ(Fetch(*store, 0), step2);
}

TEST_F(ChunkStoreTest, AFetchAfterAStatesOnlyLoadReturnsTheCommittedWeights) {
  RegisterWithWeights(*store_, 2);
  std::vector<Bytes> step1(2);
  ASSERT_TRUE(StageUpdate(*store_, 1, UpdateStoringWeights(1.0f, &step1[1])).ok());
  ASSERT_TRUE(StageUpdate(*store_, 0, UpdateStoringWeights(2.0f, &step1[0])).ok());
  ASSERT_TRUE(store_->CommitStep(1).ok());
  ASSERT_TRUE(store_->WaitForWriteBacks().ok());
  cache_->DropJob(job_->key());  // evicted
  // Step 2 stages chunk 1 (acquired states only) and prefetches chunk 0 for
  // its update (states only): neither entry holds the weights.
  Bytes step2;
  ASSERT_TRUE(StageUpdate(*store_, 1, UpdateStoringWeights(3.0f, &step2)).ok());
  ASSERT_TRUE(store_->WaitForWriteBacks().ok());  // the prefetch too
  ASSERT_TRUE(cache_->Contains(job_->key(), 0));
  // A fetch of chunk 0 reads its weights region, not the prefetched entry's
  // bytes after the states.
  uint64_t before = StorageBytesRead();
  ChunkStore::FetchSource source;
  EXPECT_EQ(Fetch(*store_, 0, &source), step1[0]);
  EXPECT_FALSE(source.from_dram);
  EXPECT_EQ(source.bytes_read, kWeightsRegion);
  EXPECT_EQ(StorageBytesRead() - before, kWeightsRegion);
  EXPECT_EQ(Fetch(*store_, 1), step1[1]);  // staged: the committed extent's
  store_->RollBackStep();
  // Whole states wanted (a resumed registration returns the chunk's weights):
  // the states-only entry gets its weights region read, verified, kept.
  Bytes slot(kWeightsBytes, std::byte{0x55});
  ChunkStore::Registration again = WeightsRegistration(0, slot);
  before = StorageBytesRead();
  auto registered = store_->Register(std::span(&again, 1), 0);
  ASSERT_TRUE(registered.ok()) << registered.status();
  EXPECT_EQ(slot, step1[0]);
  EXPECT_EQ(StorageBytesRead() - before, kWeightsRegion);
  cache_->DropJob(job_->key() + "#weights");  // only the states entry is left
  ASSERT_TRUE(store_->WaitForWriteBacks().ok());  // no read in flight
  before = StorageBytesRead();
  EXPECT_EQ(Fetch(*store_, 0, &source), step1[0]);
  EXPECT_TRUE(source.from_dram);
  EXPECT_EQ(source.bytes_read, 0u);
  // The fetch read nothing itself; it read chunk 1's weights ahead (the
  // learned order is 0, 1 and its weights entry was dropped), which is counted
  // when that read completes: wait for it, then chunk 1 is a DRAM hit.
  ASSERT_TRUE(store_->WaitForWriteBacks().ok());
  EXPECT_EQ(StorageBytesRead() - before, kWeightsRegion);
  EXPECT_EQ(Fetch(*store_, 1, &source), step1[1]);
  EXPECT_TRUE(source.from_dram);
  EXPECT_EQ(StorageBytesRead() - before, kWeightsRegion);
}

TEST_F(ChunkStoreTest, PerStepWithStatesEvictedEachRegionIsReadOnceByItsUser) {
  constexpr uint32_t kChunks = 4;
  RegisterWithWeights(*store_, kChunks);
  std::vector<Bytes> produced(kChunks);
  for (int64_t number = 1; number <= 3; ++number) {
    ASSERT_TRUE(store_->WaitForWriteBacks().ok());  // also the commit's prefetch
    cache_->DropJob(job_->key());                    // a model larger than DRAM
    const uint64_t before = StorageBytesRead();
    const uint64_t weights_before = UserCounts().Get(Ticker::kWeightsBytesRead);
    for (uint32_t id = 0; id < kChunks; ++id) Fetch(*store_, id);  // forward
    for (uint32_t id = kChunks; id-- > 0;) {                        // backward and updates
      Fetch(*store_, id);
      ASSERT_TRUE(StageUpdate(*store_, id, UpdateStoringWeights(1.0f, &produced[id])).ok());
    }
    ASSERT_TRUE(store_->WaitForWriteBacks().ok());
    const uint64_t weights_read = UserCounts().Get(Ticker::kWeightsBytesRead) - weights_before;
    const uint64_t states_read = StorageBytesRead() - before - weights_read;
    // The weights: at most once for the forward and once for the backward
    // (here the backward finds the forward's entries); the states once, for
    // the update, without the weights region.
    EXPECT_LE(weights_read, 2 * kChunks * kWeightsRegion) << number;
    EXPECT_EQ(weights_read, kChunks * kWeightsRegion) << number;
    EXPECT_EQ(states_read, kChunks * kWeightsOffset) << number;
    ASSERT_TRUE(store_->CommitStep(number).ok());
  }
  for (uint32_t id = 0; id < kChunks; ++id) EXPECT_EQ(Fetch(*store_, id), produced[id]) << id;
}

TEST_F(ChunkStoreTest, TheSecondStepsFetchesHitReadAheadsInTheLearnedOrder) {
  constexpr uint32_t kChunks = 4;
  RegisterWithWeights(*store_, kChunks);
  // A model larger than DRAM: no chunk's states are cached when a step starts.
  auto evict_states = [&] {
    ASSERT_TRUE(store_->WaitForWriteBacks().ok());
    for (uint32_t id = 0; id < kChunks; ++id) cache_->Drop(job_->key(), id);
  };
  // One step as stream_parameters makes it: forward 0..3, then backward
  // 3..0, each chunk's update sent right after its backward.
  std::vector<Bytes> produced(kChunks);
  auto step = [&](int64_t number) {
    for (uint32_t id = 0; id < kChunks; ++id) Fetch(*store_, id);
    for (uint32_t id = kChunks; id-- > 0;) {
      Fetch(*store_, id);
      ASSERT_TRUE(StageUpdate(*store_, id, UpdateStoringWeights(1.0f, &produced[id])).ok());
    }
    ASSERT_TRUE(store_->CommitStep(number).ok());
  };
  evict_states();
  TickerCounts& counters = UserCounts();
  uint64_t hits = counters.Get(Ticker::kWeightsFetchCacheHits);
  uint64_t read = counters.Get(Ticker::kWeightsBytesRead);
  step(1);
  // Nothing learned yet: each forward fetch read its chunk, backward found them.
  EXPECT_EQ(counters.Get(Ticker::kWeightsFetchCacheHits) - hits, kChunks);
  EXPECT_EQ(counters.Get(Ticker::kWeightsBytesRead) - read, kChunks * kWeightsRegion);
  EXPECT_EQ(store_->fetch_order().predicted(), (std::vector<uint32_t>{0, 1, 2, 3, 3, 2, 1, 0}));

  evict_states();
  hits = counters.Get(Ticker::kWeightsFetchCacheHits);
  read = counters.Get(Ticker::kWeightsBytesRead);
  const uint64_t fetches = counters.Get(Ticker::kWeightsFetches);
  step(2);
  ASSERT_TRUE(store_->WaitForWriteBacks().ok());
  // The first fetch read on demand and every later one found its read-ahead
  // (done or in flight); each chunk's weights were read once.
  EXPECT_EQ(counters.Get(Ticker::kWeightsFetches) - fetches, 2 * kChunks);
  EXPECT_EQ(counters.Get(Ticker::kWeightsFetchCacheHits) - hits, 2 * kChunks - 1);
  EXPECT_EQ(counters.Get(Ticker::kWeightsBytesRead) - read, kChunks * kWeightsRegion);
  // And step 2's weights are what its updates produced.
  for (uint32_t id = 0; id < kChunks; ++id) EXPECT_EQ(Fetch(*store_, id), produced[id]) << id;
}

TEST_F(ChunkStoreTest, AResumedChunkKeepsWhetherItStoresWeightsAndTheirDType) {
  RegisterWithWeights(*store_, 1);  // chunk 0 stores weights
  Bytes plain_slot = Bf16Weights(7.0f);
  ChunkStore::Registration plain = WeightsRegistration(1, plain_slot, /*store_weights=*/false);
  ASSERT_TRUE(store_->Register(std::span(&plain, 1), 0).ok());
  const std::string manifest_before = job_->manifest().SerializeAsString();
  Bytes slot = Bf16Weights(9.0f);
  Bytes new_slot = Bf16Weights(9.0f);
  struct Case {
    const char* what;
    ChunkStore::Registration chunk;
    const char* says;
  };
  const std::vector<Case> cases = {
      {"weights chunk resumed without", WeightsRegistration(0, slot, false), "store_weights=true"},
      {"plain chunk resumed with", WeightsRegistration(1, slot, true), "store_weights=false"},
      {"weights chunk resumed as fp16", WeightsRegistration(0, slot, true, DType::kFloat16), "bfloat16"},
  };
  for (const Case& c : cases) {
    // With a new chunk in the same request: nothing at all is registered.
    std::vector<ChunkStore::Registration> chunks = {WeightsRegistration(5, new_slot), c.chunk};
    auto refused = store_->Register(chunks, 0);
    ASSERT_EQ(refused.status().code(), absl::StatusCode::kFailedPrecondition) << c.what << ": " << refused.status();
    const std::string message(refused.status().message());
    EXPECT_NE(message.find(fmt::format("job 'job' chunk {}", c.chunk.chunk_id)), std::string::npos) << message;
    EXPECT_NE(message.find(c.says), std::string::npos) << c.what << ": " << message;
    EXPECT_EQ(store_->chunk_count(), 2u) << c.what;
    EXPECT_EQ(job_->manifest().SerializeAsString(), manifest_before) << c.what;
    EXPECT_EQ(slot, Bf16Weights(9.0f)) << c.what;
  }
  // Resumed as created: the slot gets the committed weights.
  ChunkStore::Registration same = WeightsRegistration(0, slot);
  auto resumed = store_->Register(std::span(&same, 1), 0);
  ASSERT_TRUE(resumed.ok()) << resumed.status();
  EXPECT_TRUE((*resumed)[0].resumed);
  EXPECT_EQ(slot, Bf16Weights(0.0f));
}

TEST_F(ChunkStoreTest, AfterARestartAFetchAndAResumeGetTheCommittedWeights) {
  RegisterWithWeights(*store_, 2);
  std::vector<Bytes> produced(2);
  for (uint32_t id = 0; id < 2; ++id) {
    ASSERT_TRUE(StageUpdate(*store_, id, UpdateStoringWeights(0.5f, &produced[id])).ok());
  }
  ASSERT_TRUE(store_->CommitStep(1).ok());
  // A restart: new Job, cache and store over the same files.
  store_.reset();
  cache_.reset();
  job_.reset();
  auto job = Job::Open({root_}, "job", kUid, /*create=*/false, *io_, *stats_);
  ASSERT_TRUE(job.ok()) << job.status();
  job_ = std::move(*job);
  ASSERT_TRUE(job_->FindRecord(0)->stores_weights());
  cache_ = std::make_unique<StateCache>(64 << 20);
  store_ = MakeStore(*cache_);
  for (uint32_t id = 0; id < 2; ++id) EXPECT_EQ(Fetch(*store_, id), produced[id]) << id;
  Bytes slot(kWeightsBytes);
  ChunkStore::Registration again = WeightsRegistration(1, slot);
  auto registered = store_->Register(std::span(&again, 1), 0);
  ASSERT_TRUE(registered.ok()) << registered.status();
  EXPECT_EQ(slot, produced[1]);
}

TEST_F(ChunkStoreTest, AnImportOfMasterRefreshesTheWeights) {
  RegisterWithWeights(*store_, 1);
  std::vector<float> master(kElements);
  for (uint64_t i = 0; i < kElements; ++i) master[i] = -2.0f + static_cast<float>(i) / 512.0f;
  Bytes imported(kWeightsBytes);
  optimizer::ConvertFromFloat32(master.data(), imported.data(), DType::kBFloat16, kElements);
  ASSERT_NE(imported, Bf16Weights(0.0f));
  ASSERT_TRUE(store_->ImportState(0, ChunkState::kMaster, 0, master).ok());
  EXPECT_EQ(Fetch(*store_, 0), Bf16Weights(0.0f));  // not committed yet
  ASSERT_TRUE(store_->CommitImport().ok());
  EXPECT_EQ(Fetch(*store_, 0), imported);
  // m does not change them; storage holds them with a valid checksum.
  ASSERT_TRUE(store_->ImportState(0, ChunkState::kExpAvg, 0, std::vector<float>(kElements, 0.5f)).ok());
  ASSERT_TRUE(store_->CommitImport().ok());
  EXPECT_EQ(Fetch(*store_, 0), imported);
  StateCache cold(64 << 20);
  auto store = MakeStore(cold);
  EXPECT_EQ(Fetch(*store, 0), imported);
}

}  // namespace
}  // namespace fuyou
