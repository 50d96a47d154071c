#include "state/chunk_registration.h"

#include <gtest/gtest.h>

#include "state/state_test_env.h"

namespace fuyou {
namespace {
using testing_env::kElements;
using testing_env::StateTestEnv;

TEST(ChunkRegistrationTest, NewChunksAreWrittenAndResumedChunksGetTheirMaster) {
  StateTestEnv env;
  CommittedReader reader(env.context());
  env.Register(reader, 2, 3.0f);
  EXPECT_EQ(env.job().manifest().chunks_size(), 2);
  env.Reopen();
  CommittedReader again(env.context());
  env.cache().DropJob(env.job().key());
  std::vector<float> weights(kElements, 0.0f);
  ChunkRegistration chunk{.chunk_id = 1, .num_elements = kElements, .layout_fingerprint = 42,
                          .weights = std::as_writable_bytes(std::span(weights))};
  ASSERT_TRUE(CheckResumable(env.context(), std::span(&chunk, 1)).ok());
  LearnedOrder order(std::vector<uint32_t>{});
  auto resumed = RegisterChunks(env.context(), again, order, std::span(&chunk, 1), 0);
  ASSERT_TRUE(resumed.ok()) << resumed.status();
  EXPECT_TRUE((*resumed)[0].resumed);
  EXPECT_EQ(weights, std::vector<float>(kElements, 3.0f));
}

TEST(ChunkRegistrationTest, OverTheQuotaNothingIsReserved) {
  StateTestEnv env;
  CommittedReader reader(env.context());
  std::vector<float> weights(kElements, 1.0f);
  ChunkRegistration chunk{.chunk_id = 0, .num_elements = kElements,
                          .weights = std::as_writable_bytes(std::span(weights))};
  LearnedOrder order(std::vector<uint32_t>{});
  auto refused = RegisterChunks(env.context(), reader, order, std::span(&chunk, 1), /*job_quota_bytes=*/4096);
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(env.job().manifest().chunks_size(), 0);
  EXPECT_EQ(env.job().bytes_on_storage(), 0u);
}

TEST(ChunkRegistrationTest, AResumedChunkKeepsStoreWeights) {
  StateTestEnv env;
  CommittedReader reader(env.context());
  env.Register(reader, 1, 1.0f, /*store_weights=*/true);
  std::vector<float> weights(kElements, 0.0f);
  ChunkRegistration chunk{.chunk_id = 0, .num_elements = kElements,
                          .weights = std::as_writable_bytes(std::span(weights)), .store_weights = false};
  const absl::Status refused = CheckResumable(env.context(), std::span(&chunk, 1));
  EXPECT_EQ(refused.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_NE(refused.message().find("store_weights=true"), std::string::npos) << refused;
}

// Issue 22: a chunk created with bf16 moments records them and takes 8 bytes an
// element; a resume asking for other moments is refused at once, saying what
// the job has; one asking for the same resumes.
TEST(ChunkRegistrationTest, Bf16MomentsAreRecordedAndAMismatchedResumeIsRefused) {
  StateTestEnv env;
  CommittedReader reader(env.context());
  env.Register(reader, 1, 2.0f, /*store_weights=*/false, DType::kBFloat16);
  const v1::ChunkRecord& record = env.job().manifest().chunks(0);
  EXPECT_EQ(record.moments_dtype(), v1::DTYPE_BFLOAT16);
  EXPECT_EQ(RecordLayout(record).moments_dtype, DType::kBFloat16);
  EXPECT_EQ(CommittedExtent(record).length(), 8192u);  // 8000 bytes of states: two blocks (fp32 moments: three)
  env.Reopen();
  env.cache().DropJob(env.job().key());
  std::vector<float> weights(kElements, 0.0f);
  ChunkRegistration chunk{.chunk_id = 0, .num_elements = kElements, .layout_fingerprint = 42,
                          .weights = std::as_writable_bytes(std::span(weights))};
  const absl::Status refused = CheckResumable(env.context(), std::span(&chunk, 1));
  EXPECT_EQ(refused.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_NE(refused.message().find("keeps its Adam moments (m, v) as bfloat16"), std::string::npos) << refused;
  EXPECT_NE(refused.message().find("state_dtype=\"bf16\""), std::string::npos) << refused;
  chunk.moments_dtype = DType::kBFloat16;
  ASSERT_TRUE(CheckResumable(env.context(), std::span(&chunk, 1)).ok());
  CommittedReader again(env.context());
  LearnedOrder order(std::vector<uint32_t>{});
  auto resumed = RegisterChunks(env.context(), again, order, std::span(&chunk, 1), 0);
  ASSERT_TRUE(resumed.ok()) << resumed.status();
  EXPECT_TRUE((*resumed)[0].resumed);
  EXPECT_EQ(weights, std::vector<float>(kElements, 2.0f));
}

TEST(ChunkRegistrationTest, AnFp32JobRefusesBf16Moments) {
  StateTestEnv env;
  CommittedReader reader(env.context());
  env.Register(reader, 1, 1.0f);
  EXPECT_EQ(env.job().manifest().chunks(0).moments_dtype(), v1::DTYPE_UNSPECIFIED);  // as before bf16 moments
  std::vector<float> weights(kElements, 0.0f);
  ChunkRegistration chunk{.chunk_id = 0, .num_elements = kElements, .layout_fingerprint = 42,
                          .weights = std::as_writable_bytes(std::span(weights)), .moments_dtype = DType::kBFloat16};
  const absl::Status refused = CheckResumable(env.context(), std::span(&chunk, 1));
  EXPECT_EQ(refused.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_NE(refused.message().find("as float32, but this registration asks for bfloat16"), std::string::npos)
      << refused;
}

// Issue 36: 8-bit moments are recorded and take about 6 bytes an element; a
// resume asking for bf16 (or fp32) is refused naming the job's dtype and
// the state_dtype to resume it with.
TEST(ChunkRegistrationTest, EightBitMomentsAreRecordedAndAMismatchedResumeIsRefused) {
  StateTestEnv env;
  CommittedReader reader(env.context());
  env.Register(reader, 1, 2.0f, /*store_weights=*/false, DType::kBlock8);
  const v1::ChunkRecord& record = env.job().manifest().chunks(0);
  EXPECT_EQ(record.moments_dtype(), v1::DTYPE_BLOCK8);
  EXPECT_EQ(RecordLayout(record).moments_dtype, DType::kBlock8);
  EXPECT_EQ(CommittedExtent(record).length(), 8192u);  // 4000 + 2 * (1000 + 16) bytes of states
  env.Reopen();
  env.cache().DropJob(env.job().key());
  std::vector<float> weights(kElements, 0.0f);
  ChunkRegistration chunk{.chunk_id = 0, .num_elements = kElements, .layout_fingerprint = 42,
                          .weights = std::as_writable_bytes(std::span(weights)), .moments_dtype = DType::kBFloat16};
  const absl::Status refused = CheckResumable(env.context(), std::span(&chunk, 1));
  EXPECT_EQ(refused.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_NE(refused.message().find("as 8-bit blocks, but this registration asks for bfloat16"), std::string::npos)
      << refused;
  EXPECT_NE(refused.message().find("state_dtype=\"8bit\""), std::string::npos) << refused;
  chunk.moments_dtype = DType::kBlock8;
  EXPECT_TRUE(CheckResumable(env.context(), std::span(&chunk, 1)).ok());
}

}  // namespace
}  // namespace fuyou
