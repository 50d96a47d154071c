// RegisteredChunks: specs by chunk id, and each chunk's journal stats from its
// latest ParamsReady that carried any.
#include "registered_chunks.h"

#include <gtest/gtest.h>

namespace fuyou::internal {
namespace {

TEST(RegisteredChunksTest, FindsTheSpecsRegistered) {
  RegisteredChunks chunks;
  EXPECT_EQ(chunks.Find(3), nullptr);
  EXPECT_FALSE(chunks.contains(3));
  ChunkSpec spec;
  spec.chunk_id = 3;
  spec.num_elements = 1000;
  spec.store_weights = true;
  chunks.Add(spec);
  ASSERT_NE(chunks.Find(3), nullptr);
  EXPECT_TRUE(chunks.contains(3));
  EXPECT_EQ(chunks.Find(3)->num_elements, 1000u);
  EXPECT_TRUE(chunks.Find(3)->store_weights);
  EXPECT_EQ(chunks.Find(4), nullptr);
}

TEST(RegisteredChunksTest, KeepsTheLatestJournalStatsOfEachChunk) {
  RegisteredChunks chunks;
  v1::ParamsReady ready;
  ready.set_chunk_id(1);
  ready.add_segment_sum_squares(4.0);
  ready.add_segment_sum_squares(9.0);
  ready.add_segment_max_abs(2.0);
  ready.add_segment_max_abs(3.0);
  chunks.RecordJournalStats(ready);
  std::optional<JournalStats> stats = chunks.JournalStatsOf(1);
  ASSERT_TRUE(stats.has_value());
  EXPECT_EQ(stats->sum_squares, (std::vector<double>{4.0, 9.0}));
  EXPECT_EQ(stats->max_abs, (std::vector<float>{2.0f, 3.0f}));
  EXPECT_FALSE(chunks.JournalStatsOf(2).has_value());

  // An update without a journal forgets the chunk's earlier stats.
  v1::ParamsReady plain;
  plain.set_chunk_id(1);
  chunks.RecordJournalStats(plain);
  EXPECT_FALSE(chunks.JournalStatsOf(1).has_value());
}

}  // namespace
}  // namespace fuyou::internal
