#include "jobs/data_parallel_name.h"

#include <gtest/gtest.h>

namespace fuyou {
namespace {

TEST(DataParallelNameTest, ReadsTheRankJobsOfTheDataParallelClient) {
  const std::optional<DataParallelName> name = ParseDataParallelName("gpt.rank1-of4");
  ASSERT_TRUE(name.has_value());
  EXPECT_EQ(name->job, "gpt");
  EXPECT_EQ(name->rank, 1u);
  EXPECT_EQ(name->world_size, 4u);
  // The job's own name may hold dots and even ".rank": the last one counts.
  const std::optional<DataParallelName> dotted = ParseDataParallelName("a.rank.b.rank0-of2");
  ASSERT_TRUE(dotted.has_value());
  EXPECT_EQ(dotted->job, "a.rank.b");
  EXPECT_EQ(dotted->rank, 0u);
  EXPECT_EQ(dotted->world_size, 2u);
}

TEST(DataParallelNameTest, RoundTripsTheNameItBuilds) {
  for (uint32_t world : {1u, 2u, 3u, 8u, kMaxDataParallelWorldSize}) {
    for (uint32_t rank : {0u, world / 2, world - 1}) {
      const std::string job = DataParallelJobName("j-1_x", rank, world);
      const std::optional<DataParallelName> name = ParseDataParallelName(job);
      ASSERT_TRUE(name.has_value()) << job;
      EXPECT_EQ(name->job, "j-1_x");
      EXPECT_EQ(name->rank, rank);
      EXPECT_EQ(name->world_size, world);
    }
  }
}

TEST(DataParallelNameTest, AnythingElseIsAnOrdinaryJob) {
  for (const char* name : {"gpt", "", ".rank0-of2", "gpt.rank2-of2", "gpt.rank3-of2", "gpt.rank0-of0",
                           "gpt.rank01-of2", "gpt.rank0-of02", "gpt.rank-1-of2", "gpt.rank+1-of2", "gpt.rank1-of",
                           "gpt.rank-of2", "gpt.rank1of2", "gpt.rank1-of2x", "gpt.rank1-of2-of3", "gpt.rank 1-of2",
                           "gpt.rank0-of65537", "gpt.rank0-of4294967297", "gpt.rank0-of99999999999999999999",
                           "gpt_rank0-of2", "gpt.Rank0-of2"}) {
    EXPECT_FALSE(ParseDataParallelName(name).has_value()) << name;
  }
}

}  // namespace
}  // namespace fuyou
