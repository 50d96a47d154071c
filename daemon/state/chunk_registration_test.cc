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

}  // namespace
}  // namespace fuyou
