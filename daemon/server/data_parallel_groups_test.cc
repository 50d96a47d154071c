#include "server/data_parallel_groups.h"

#include <gtest/gtest.h>

namespace fuyou {
namespace {

v1::SessionInfo SessionOf(const std::string& job, uint32_t uid, int64_t step, uint64_t updates) {
  v1::SessionInfo s;
  s.set_session_id("s-" + job + "-" + std::to_string(uid));
  s.set_job(job);
  s.set_uid(uid);
  s.set_chunks(3);
  s.set_committed_step(step);
  s.set_chunk_updates(updates);
  s.set_update_seconds(0.5);
  s.set_state_wait_seconds(0.25);
  s.set_chunks_speculative(2);
  s.set_chunks_redone(1);
  s.set_chunks_rolled_back(4);
  MarkDataParallel(s);
  return s;
}

TEST(DataParallelGroupsTest, MarksARanksSessionAndLeavesAnOrdinaryOneAlone) {
  const v1::SessionInfo rank = SessionOf("gpt.rank1-of2", 1000, 7, 10);
  EXPECT_EQ(rank.data_parallel_job(), "gpt");
  EXPECT_EQ(rank.rank(), 1u);
  EXPECT_EQ(rank.world_size(), 2u);
  v1::SessionInfo plain = SessionOf("gpt.rank2-of2", 1000, 7, 10);  // not a rank: r >= w
  EXPECT_EQ(plain.data_parallel_job(), "");
  EXPECT_EQ(plain.world_size(), 0u);
  // A stale mark is cleared.
  plain.set_world_size(9);
  plain.set_data_parallel_job("x");
  MarkDataParallel(plain);
  EXPECT_EQ(plain.world_size(), 0u);
  EXPECT_EQ(plain.data_parallel_job(), "");
}

TEST(DataParallelGroupsTest, TheRanksOfOneJobAreOneRowWithTheirTotalsAndARowPerRank) {
  const std::vector<v1::SessionInfo> sessions = {
      SessionOf("gpt.rank2-of3", 1000, 5, 30), SessionOf("plain", 1000, 9, 99), SessionOf("gpt.rank0-of3", 1000, 6, 10),
      SessionOf("gpt.rank1-of3", 1000, 6, 20),
      // Another user's job of the same name, and the same job at another world
      // size, are other rows.
      SessionOf("gpt.rank0-of3", 1001, 1, 1), SessionOf("gpt.rank0-of2", 1000, 2, 2)};
  const std::vector<v1::DataParallelJob> rows = GroupDataParallelSessions(sessions);
  ASSERT_EQ(rows.size(), 3u);
  const v1::DataParallelJob& gpt = rows[1];  // by uid, job, world size: (1000 gpt 2), (1000 gpt 3), (1001 gpt 3)
  EXPECT_EQ(rows[0].world_size(), 2u);
  EXPECT_EQ(rows[0].live_ranks(), 1u);
  EXPECT_EQ(rows[2].uid(), 1001u);
  EXPECT_EQ(gpt.job(), "gpt");
  EXPECT_EQ(gpt.uid(), 1000u);
  EXPECT_EQ(gpt.world_size(), 3u);
  EXPECT_EQ(gpt.live_ranks(), 3u);
  EXPECT_EQ(gpt.committed_step(), 5);  // what every rank has committed
  EXPECT_EQ(gpt.newest_committed_step(), 6);
  EXPECT_EQ(gpt.chunks(), 9u);
  EXPECT_EQ(gpt.chunk_updates(), 60u);
  EXPECT_DOUBLE_EQ(gpt.update_seconds(), 1.5);
  EXPECT_DOUBLE_EQ(gpt.state_wait_seconds(), 0.75);
  EXPECT_EQ(gpt.chunks_speculative(), 6u);
  EXPECT_EQ(gpt.chunks_redone(), 3u);
  EXPECT_EQ(gpt.chunks_rolled_back(), 12u);
  ASSERT_EQ(gpt.ranks_size(), 3);
  for (uint32_t r = 0; r < 3; ++r) {
    EXPECT_EQ(gpt.ranks(r).rank(), r);
    EXPECT_EQ(gpt.ranks(r).job(), "gpt.rank" + std::to_string(r) + "-of3");
    EXPECT_EQ(gpt.ranks(r).session_id(), "s-gpt.rank" + std::to_string(r) + "-of3-1000");
    EXPECT_EQ(gpt.ranks(r).chunk_updates(), 10u * (r + 1));
  }
  EXPECT_EQ(gpt.ranks(0).committed_step(), 6);
  EXPECT_EQ(gpt.ranks(2).committed_step(), 5);
}

TEST(DataParallelGroupsTest, NoRowWithoutARank) {
  EXPECT_TRUE(GroupDataParallelSessions({SessionOf("a", 1, 1, 1), SessionOf("b.rank0", 1, 1, 1)}).empty());
}

v1::JobInfo JobOf(const std::string& name, uint32_t owner, int64_t step, bool open, std::string damaged = "") {
  v1::JobInfo j;
  j.set_name(name);
  j.set_owner_uid(owner);
  j.set_damaged(damaged);
  if (damaged.empty()) {
    j.set_chunks(2);
    j.set_parameters(1000);
    j.set_bytes_on_storage(4096);
    j.set_committed_step(step);
    j.set_last_used_unix(100 + step);
  }
  j.set_open(open);
  MarkDataParallel(j);
  return j;
}

TEST(DataParallelGroupsTest, TheRankJobsOnStorageAreOneRowWithTheirTotals) {
  google::protobuf::RepeatedPtrField<v1::JobInfo> jobs;
  *jobs.Add() = JobOf("dp.rank1-of4", 7, 12, true);
  *jobs.Add() = JobOf("dp.rank0-of4", 7, 11, false);
  *jobs.Add() = JobOf("dp.rank3-of4", 7, 0, false, "manifest unreadable");
  *jobs.Add() = JobOf("dp", 7, 3, false);  // the plain job of that name is no rank
  const std::vector<v1::DataParallelJobInfo> rows = GroupDataParallelJobs(jobs);
  ASSERT_EQ(rows.size(), 1u);
  const v1::DataParallelJobInfo& dp = rows[0];
  EXPECT_EQ(dp.name(), "dp");
  EXPECT_EQ(dp.owner_uid(), 7u);
  EXPECT_EQ(dp.world_size(), 4u);
  ASSERT_EQ(dp.ranks_size(), 3);  // rank 2 is not on this daemon
  EXPECT_EQ(dp.ranks(0), 0u);
  EXPECT_EQ(dp.ranks(1), 1u);
  EXPECT_EQ(dp.ranks(2), 3u);
  EXPECT_EQ(dp.chunks(), 4u);
  EXPECT_EQ(dp.parameters(), 2000u);
  EXPECT_EQ(dp.bytes_on_storage(), 8192u);
  EXPECT_EQ(dp.committed_step(), 11);
  EXPECT_EQ(dp.newest_committed_step(), 12);
  EXPECT_EQ(dp.last_used_unix(), 112);
  EXPECT_EQ(dp.open_ranks(), 1u);
  EXPECT_EQ(dp.damaged_ranks(), 1u);
  EXPECT_EQ(jobs[0].data_parallel_job(), "dp");
  EXPECT_EQ(jobs[0].rank(), 1u);
  EXPECT_EQ(jobs[3].world_size(), 0u);
}

}  // namespace
}  // namespace fuyou
