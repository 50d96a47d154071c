#include "top.h"

#include <gtest/gtest.h>

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

}  // namespace
}  // namespace fuyou::ctl
