// StateTestEnv: one job whose state files live in memory
// (storage/memory_state_file.h), for the tests of state/'s parts. The job's
// directory and manifest are in a temporary directory, removed at the end.
#pragma once

#include <gtest/gtest.h>
#include <stdlib.h>

#include <filesystem>
#include <memory>
#include <span>
#include <vector>

#include "jobs/job.h"
#include "state/chunk_registration.h"
#include "state/committed_reader.h"
#include "state/learned_order.h"
#include "state/store_context.h"
#include "stats/daemon_stats.h"
#include "storage/aligned_buffer.h"
#include "storage/memory_state_file.h"
#include "test_support/temp_dir.h"

namespace fuyou::testing_env {

inline constexpr uint64_t kElements = 1000;  // 12000 bytes of states: one 12288-byte extent
inline constexpr uid_t kUid = 1000;

class StateTestEnv {
 public:
  // `faults`: optional, not owned (the in-memory engine's FaultInjector).
  explicit StateTestEnv(uint64_t budget_bytes = 64 << 20, storage::FaultInjector* faults = nullptr)
      : io_(faults), cache_(budget_bytes) {
    stats_ = std::make_unique<DaemonStats>(std::vector<std::filesystem::path>{root_});
    Reopen();
  }
  ~StateTestEnv() {
    context_.reset();
    job_.reset();
  }

  // Opens the job again from what its files hold (a restart), with a new context.
  void Reopen(unsigned prefetch_window = 2) {
    context_.reset();
    job_.reset();
    auto job = Job::Open({root_}, "job", kUid, /*create=*/true, io_, *stats_);
    EXPECT_TRUE(job.ok()) << job.status();
    job_ = std::move(*job);
    context_ = std::make_unique<StoreContext>(*job_, cache_, counters(), prefetch_window);
  }

  Job& job() { return *job_; }
  StateCache& cache() { return cache_; }
  DaemonStats& stats() { return *stats_; }
  TickerCounts& user() { return stats_->ForUser(kUid); }
  StoreCounters counters() { return stats_->ScopesOf(kUid); }
  StoreContext& context() { return *context_; }
  storage::MemoryIoEngine& io() { return io_; }

  // Registers chunks 0..count-1 of kElements fp32 weights equal to `weight`
  // (store_weights: bf16 working weights).
  // moments_dtype: m and v's dtype (ChunkRegistration::moments_dtype).
  void Register(CommittedReader& reader, uint32_t count, float weight = 1.0f, bool store_weights = false,
                DType moments_dtype = DType::kFloat32) {
    weights_.assign(count, std::vector<float>(kElements, weight));
    bf16_.assign(count, std::vector<uint16_t>(kElements, 0x3f80));  // bf16 1.0
    std::vector<ChunkRegistration> chunks;
    for (uint32_t id = 0; id < count; ++id) {
      ChunkRegistration chunk{.chunk_id = id, .num_elements = kElements, .layout_fingerprint = 42, .weights = {}};
      chunk.moments_dtype = moments_dtype;
      if (store_weights) {
        chunk.param_dtype = DType::kBFloat16;
        chunk.grad_dtype = DType::kBFloat16;
        chunk.weights = std::as_writable_bytes(std::span(bf16_[id]));
        chunk.store_weights = true;
      } else {
        chunk.weights = std::as_writable_bytes(std::span(weights_[id]));
      }
      chunks.push_back(chunk);
    }
    LearnedOrder order(std::vector<uint32_t>{});
    auto registered = RegisterChunks(*context_, reader, order, chunks, /*job_quota_bytes=*/0);
    ASSERT_TRUE(registered.ok()) << registered.status();
  }

  // Overwrites the first bytes of chunk `chunk_id`'s committed extent (a corrupt file).
  void Corrupt(uint32_t chunk_id, uint64_t at = 0) {
    const v1::ChunkRecord& record = *context_->Find(chunk_id);
    auto buffer = storage::AlignedBuffer::Allocate(storage::kBlockSize);
    ASSERT_TRUE(buffer.ok());
    const uint64_t offset = CommittedExtent(record).offset() + at;
    ASSERT_TRUE(job_->states().Read(offset, buffer->span()).ok());
    buffer->span()[0] ^= std::byte{0xff};
    ASSERT_TRUE(job_->states().Write(offset, buffer->span()).ok());
  }

 private:
  const TempDir temp_dir_{"fuyou-state-test"};
  const std::filesystem::path root_ = temp_dir_.path();
  storage::MemoryIoEngine io_;
  std::unique_ptr<DaemonStats> stats_;
  StateCache cache_;
  std::unique_ptr<Job> job_;
  std::unique_ptr<StoreContext> context_;
  std::vector<std::vector<float>> weights_;
  std::vector<std::vector<uint16_t>> bf16_;
};

}  // namespace fuyou::testing_env
