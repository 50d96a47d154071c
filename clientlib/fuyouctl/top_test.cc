#include "top.h"

#include <gtest/gtest.h>

#include <sstream>
#include <string>
#include <vector>

namespace fuyou::ctl {
namespace {

TopSample Sample(double at_seconds, uint64_t updates, double update_s, double wait_s) {
  TopSample sample;
  sample.when =
      std::chrono::steady_clock::time_point{} + std::chrono::milliseconds(static_cast<int>(at_seconds * 1000));
  v1::GetStatsResponse& stats = sample.stats;
  stats.set_scope(v1::STATS_SCOPE_DAEMON);
  stats.set_uptime_seconds(65);
  stats.set_live_sessions(1);
  stats.set_steps_committed(12);
  stats.set_dram_budget_bytes(uint64_t{1} << 30);
  stats.set_dram_bytes_in_use(uint64_t{256} << 20);
  stats.set_cache_hits(3);
  stats.set_cache_misses(1);
  v1::StoragePathStats* path = stats.add_storage();
  path->set_path("/srv/nvme0");
  path->set_read_gbps(1.5);
  path->set_write_gbps(0.25);
  path->set_bytes_read(uint64_t{3} << 30);
  v1::SessionInfo* session = sample.sessions.add_sessions();
  session->set_session_id("s1");
  session->set_job("gpt");
  session->set_uid(1000);
  session->set_committed_step(12);
  session->set_chunk_updates(updates);
  session->set_update_seconds(update_s);
  session->set_state_wait_seconds(wait_s);
  session->set_chunks_speculative(7);
  session->set_chunks_redone(2);
  session->set_chunks_rolled_back(1);
  return sample;
}

std::string Name(uint32_t uid) { return uid == 1000 ? "alice" : std::to_string(uid); }

TEST(TopTest, ShowsDaemonStoragePathsAndSessionRatesOverTheInterval) {
  const std::string frame = RenderTop(Sample(10, 100, 1.0, 0.5), Sample(12, 300, 1.2, 0.9), Name);
  EXPECT_NE(frame.find("fuyoud up 1m 5s · 1 session · 12 steps committed"), std::string::npos) << frame;
  EXPECT_NE(frame.find("DRAM 256 MiB of 1.00 GiB (25.0%) · cache hit rate 75.0% (3 hits, 1 misses)"),
            std::string::npos)
      << frame;
  EXPECT_NE(frame.find("/srv/nvme0"), std::string::npos);
  EXPECT_NE(frame.find("1.50 GB/s"), std::string::npos) << frame;
  // 200 updates in 2 s; 0.2 s of kernel and 0.4 s of waiting over them.
  const std::string row = frame.substr(frame.find("gpt"));
  EXPECT_NE(row.find("alice"), std::string::npos) << row;
  EXPECT_NE(row.find(" 100 "), std::string::npos) << row;
  EXPECT_NE(row.find("1.000"), std::string::npos) << row;
  EXPECT_NE(row.find("2.000"), std::string::npos) << row;
}

TEST(TopTest, ANewSessionHasNoRatesYet) {
  TopSample before = Sample(10, 0, 0, 0);
  before.sessions.clear_sessions();
  const std::string frame = RenderTop(before, Sample(11, 50, 0.1, 0.1), Name);
  const std::string row = frame.substr(frame.find("gpt"));
  EXPECT_NE(row.find("12    -"), std::string::npos) << row;
}

TEST(TopTest, AUserSeesTheirOwnActivityOnly) {
  TopSample sample = Sample(10, 0, 0, 0);
  sample.stats.set_scope(v1::STATS_SCOPE_USER);
  sample.stats.set_uid(1000);
  sample.stats.clear_storage();
  const std::string frame = RenderTop(sample, sample, Name);
  EXPECT_NE(frame.find("your activity only, uid 1000"), std::string::npos) << frame;
  EXPECT_EQ(frame.find("DRAM"), std::string::npos) << frame;
  EXPECT_NE(frame.find("YOUR JOBS"), std::string::npos) << frame;
}

TEST(TopTest, NoSessions) {
  TopSample sample = Sample(10, 0, 0, 0);
  sample.sessions.clear_sessions();
  EXPECT_NE(RenderTop(sample, sample, Name).find("no live sessions"), std::string::npos);
}

// A data-parallel job of two ranks (and an ordinary session), as fuyoud lists
// them: each rank's session marked, and the job's row with the totals.
TopSample DataParallelSample(double at_seconds, uint64_t rank0_updates, uint64_t rank1_updates) {
  TopSample sample = Sample(at_seconds, 0, 0, 0);
  v1::DataParallelJob* job = sample.sessions.add_data_parallel_jobs();
  job->set_job("dp");
  job->set_uid(1000);
  job->set_world_size(2);
  job->set_live_ranks(2);
  job->set_committed_step(4);
  job->set_newest_committed_step(5);
  const uint64_t updates[] = {rank0_updates, rank1_updates};
  for (uint32_t r = 0; r < 2; ++r) {
    v1::SessionInfo* s = sample.sessions.add_sessions();
    s->set_session_id("dp" + std::to_string(r));
    s->set_job("dp.rank" + std::to_string(r) + "-of2");
    s->set_uid(1000);
    s->set_data_parallel_job("dp");
    s->set_rank(r);
    s->set_world_size(2);
    s->set_committed_step(4 + r);
    s->set_chunk_updates(updates[r]);
    s->set_update_seconds(0.001 * static_cast<double>(updates[r]));
    job->add_ranks()->set_rank(r);
    job->mutable_ranks(r)->set_session_id(s->session_id());
    job->set_chunk_updates(job->chunk_updates() + updates[r]);
  }
  return sample;
}

// The cells of the line whose first cell is `first` (split on two spaces or more).
std::vector<std::string> Cells(const std::string& frame, const std::string& first) {
  std::istringstream lines(frame);
  for (std::string line; std::getline(lines, line);) {
    std::vector<std::string> cells;
    size_t at = line.find_first_not_of(' ');
    while (at != std::string::npos) {
      size_t end = line.find("  ", at);
      cells.push_back(line.substr(at, end == std::string::npos ? std::string::npos : end - at));
      at = end == std::string::npos ? end : line.find_first_not_of(' ', end);
    }
    if (!cells.empty() && cells[0] == first) return cells;
  }
  return {};
}

TEST(TopTest, TheRanksOfADataParallelJobAreOneRowWithTheRanksBeneath) {
  const std::string frame = RenderTop(DataParallelSample(10, 100, 50), DataParallelSample(12, 300, 150), Name);
  // JOB RANKS USER STEP UPDATES/S UPDATE MS ...: the job's rate is its ranks' sum.
  const std::vector<std::string> job = Cells(frame, "dp");
  ASSERT_GE(job.size(), 6u) << frame;
  EXPECT_EQ(job[1], "2/2") << frame;
  EXPECT_EQ(job[2], "alice");
  EXPECT_EQ(job[3], "4") << "the step every rank committed:\n" << frame;
  EXPECT_EQ(job[4], "150") << frame;  // (200 + 100) updates in 2 s
  EXPECT_EQ(job[5], "1.000") << frame;
  const std::vector<std::string> rank1 = Cells(frame, "dp.rank1-of2");
  ASSERT_GE(rank1.size(), 5u) << frame;
  EXPECT_EQ(rank1[1], "rank 1");
  EXPECT_EQ(rank1[3], "5");
  EXPECT_EQ(rank1[4], "50") << frame;
  // The job's row, then its ranks indented beneath it, after the ordinary session.
  const size_t gpt = frame.find("\ngpt ");
  const size_t dp = frame.find("\ndp ");
  const size_t r0 = frame.find("\n  dp.rank0-of2 ");
  const size_t r1 = frame.find("\n  dp.rank1-of2 ");
  ASSERT_NE(gpt, std::string::npos) << frame;
  ASSERT_NE(r1, std::string::npos) << frame;
  EXPECT_LT(gpt, dp);
  EXPECT_LT(dp, r0);
  EXPECT_LT(r0, r1);
  EXPECT_EQ(Cells(frame, "gpt")[1], "-");
}

}  // namespace
}  // namespace fuyou::ctl
