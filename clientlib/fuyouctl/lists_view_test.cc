#include "lists_view.h"

#include <gtest/gtest.h>

#include <sstream>
#include <string>
#include <vector>

namespace fuyou::ctl {
namespace {

std::string Name(uint32_t uid) { return uid == 1000 ? "alice" : std::to_string(uid); }
std::string Ago(int64_t unix_seconds) { return std::to_string(unix_seconds) + "s"; }

// The cells of the line whose first cell is `first` (split on two spaces or more).
std::vector<std::string> Cells(const std::string& text, const std::string& first) {
  std::istringstream lines(text);
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

v1::JobInfo Job(const std::string& name, const std::string& dp, uint32_t rank, uint32_t world, int64_t step) {
  v1::JobInfo j;
  j.set_name(name);
  j.set_owner_uid(1000);
  j.set_chunks(2);
  j.set_parameters(1000);
  j.set_bytes_on_storage(4096);
  j.set_committed_step(step);
  j.set_last_used_unix(7);
  j.set_data_parallel_job(dp);
  j.set_rank(rank);
  j.set_world_size(world);
  return j;
}

TEST(ListsViewTest, JobsShowADataParallelJobAsOneRowWithItsRanksBeneath) {
  v1::ListJobsResponse jobs;
  *jobs.add_jobs() = Job("dp.rank1-of2", "dp", 1, 2, 8);
  *jobs.add_jobs() = Job("plain", "", 0, 0, 3);
  *jobs.add_jobs() = Job("dp.rank0-of2", "dp", 0, 2, 9);
  v1::DataParallelJobInfo* dp = jobs.add_data_parallel_jobs();
  dp->set_name("dp");
  dp->set_owner_uid(1000);
  dp->set_world_size(2);
  dp->add_ranks(0);
  dp->add_ranks(1);
  dp->set_chunks(4);
  dp->set_parameters(2000);
  dp->set_bytes_on_storage(8192);
  dp->set_committed_step(8);
  dp->set_last_used_unix(7);
  dp->set_open_ranks(1);
  const std::string text = RenderJobs(jobs, Name, Ago);
  // JOB RANKS OWNER CHUNKS PARAMS ON STORAGE STEP LAST USED OPEN
  EXPECT_EQ(Cells(text, "dp"), (std::vector<std::string>{"dp", "2/2", "alice", "4", "2.00 K", "8.00 KiB", "8", "7s",
                                                          "1 of 2"}))
      << text;
  EXPECT_EQ(Cells(text, "plain")[1], "-");
  EXPECT_EQ(Cells(text, "dp.rank0-of2")[1], "rank 0");
  EXPECT_EQ(Cells(text, "dp.rank1-of2")[6], "8");
  // Ordinary jobs, then the data-parallel job, then its ranks by rank, indented.
  const size_t plain = text.find("\nplain ");
  const size_t group = text.find("\ndp ");
  const size_t r0 = text.find("\n  dp.rank0-of2 ");
  const size_t r1 = text.find("\n  dp.rank1-of2 ");
  ASSERT_NE(plain, std::string::npos) << text;
  ASSERT_NE(r0, std::string::npos) << text;
  ASSERT_NE(r1, std::string::npos) << text;
  EXPECT_LT(plain, group);
  EXPECT_LT(group, r0);
  EXPECT_LT(r0, r1);
}

TEST(ListsViewTest, AJobsRowCountsItsDamagedRanks) {
  v1::ListJobsResponse jobs;
  v1::JobInfo broken = Job("dp.rank0-of2", "dp", 0, 2, 0);
  broken.set_damaged("unreadable");
  *jobs.add_jobs() = broken;
  v1::DataParallelJobInfo* dp = jobs.add_data_parallel_jobs();
  dp->set_name("dp");
  dp->set_owner_uid(1000);
  dp->set_world_size(2);
  dp->add_ranks(0);
  dp->set_damaged_ranks(1);
  const std::string text = RenderJobs(jobs, Name, Ago);
  EXPECT_EQ(Cells(text, "dp")[1], "1/2") << text;
  EXPECT_EQ(Cells(text, "dp").back(), "0 of 1, 1 DAMAGED") << text;
  EXPECT_EQ(Cells(text, "dp.rank0-of2").back(), "DAMAGED (delete-job only)") << text;
}

TEST(ListsViewTest, SessionsShowADataParallelJobAsOneRowWithItsRanksBeneath) {
  v1::ListSessionsResponse sessions;
  for (uint32_t r : {1u, 0u}) {
    v1::SessionInfo* s = sessions.add_sessions();
    s->set_session_id("id" + std::to_string(r));
    s->set_job("dp.rank" + std::to_string(r) + "-of3");
    s->set_uid(1000);
    s->set_chunks(2);
    s->set_committed_step(4 + r);
    s->set_data_parallel_job("dp");
    s->set_rank(r);
    s->set_world_size(3);
  }
  v1::SessionInfo* plain = sessions.add_sessions();
  plain->set_session_id("id9");
  plain->set_job("plain");
  plain->set_uid(1000);
  v1::DataParallelJob* dp = sessions.add_data_parallel_jobs();
  dp->set_job("dp");
  dp->set_uid(1000);
  dp->set_world_size(3);
  dp->set_live_ranks(2);
  dp->set_chunks(4);
  dp->set_committed_step(4);
  dp->add_ranks()->set_rank(0);
  dp->add_ranks()->set_rank(1);
  const std::string text = RenderSessions(sessions, Name);
  // SESSION JOB RANKS USER PID CHUNKS STEP ...: the job's row has no session.
  EXPECT_EQ(Cells(text, "dp"), (std::vector<std::string>{"dp", "2/3", "alice", "4", "4"})) << text;
  EXPECT_EQ(Cells(text, "id0")[1], "dp.rank0-of3") << text;
  EXPECT_EQ(Cells(text, "id0")[2], "rank 0") << text;
  EXPECT_EQ(Cells(text, "id9")[2], "-") << text;
  EXPECT_LT(text.find("id9"), text.find("  dp  ")) << text;
  EXPECT_LT(text.find("  dp  "), text.find("id0")) << text;
  EXPECT_LT(text.find("id0"), text.find("id1")) << "ranks by rank:\n" << text;
  EXPECT_EQ(RenderSessions({}, Name), "no live sessions\n");
  EXPECT_EQ(RenderJobs({}, Name, Ago), "no jobs\n");
}

}  // namespace
}  // namespace fuyou::ctl
