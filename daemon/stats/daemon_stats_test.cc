#include "stats/daemon_stats.h"

#include <gtest/gtest.h>

namespace fuyou {
namespace {

using std::chrono::milliseconds;
using std::chrono::seconds;

TEST(RateWindowTest, RatesAreZeroUntilTheFirstWindowCloses) {
  const auto start = std::chrono::steady_clock::time_point{} + seconds(100);
  RateWindow window({0, 10}, start);
  EXPECT_EQ(window.Update({50, 10}, start + milliseconds(200), milliseconds(1000)), (std::vector<double>{0, 0}));
  EXPECT_EQ(window.Update({200, 30}, start + seconds(2), milliseconds(1000)), (std::vector<double>{100, 10}));
  // Within the next window the last rates stay.
  EXPECT_EQ(window.Update({900, 30}, start + milliseconds(2500), milliseconds(1000)), (std::vector<double>{100, 10}));
  EXPECT_EQ(window.Update({400, 30}, start + seconds(4), milliseconds(1000)), (std::vector<double>{100, 0}));
}

TEST(DaemonStatsTest, EachUserHasCountersOfTheirOwn) {
  DaemonStats stats({"/a", "/b"});
  UserCounters& alice = stats.ForUser(1000);
  UserCounters& bob = stats.ForUser(1001);
  alice.chunk_updates += 3;
  alice.bytes_read += 4096;
  bob.chunk_updates += 1;
  EXPECT_EQ(&stats.ForUser(1000), &alice) << "the same counters for the same uid";
  EXPECT_EQ(stats.ForUser(1000).chunk_updates.load(), 3u);
  EXPECT_EQ(stats.ForUser(1001).chunk_updates.load(), 1u);
  EXPECT_EQ(stats.ForUser(1001).bytes_read.load(), 0u);
  EXPECT_EQ(stats.chunk_updates.load(), 0u) << "user counters are not the daemon's";
  const StatsRates user = stats.RatesForUser(1000, milliseconds(0));
  ASSERT_EQ(user.read_gbps.size(), 1u);
  EXPECT_GT(user.read_gbps[0], 0.0);
  EXPECT_GT(user.chunk_updates_per_second, 0.0);
  const StatsRates daemon = stats.Rates(milliseconds(0));
  EXPECT_EQ(daemon.read_gbps.size(), 2u);
}

TEST(RedoCountersTest, FillSetsTheIssue10Fields) {
  DaemonStats stats({"/a"});
  RedoCounters& mine = stats.ForUser(1000).redo;
  mine.chunks_speculative += 7;
  mine.chunks_redone_changed += 2;
  mine.chunks_redone_clipped += 3;
  mine.chunks_rolled_back_skipped_step += 4;
  mine.redo_nanoseconds += 1'500'000'000;
  v1::GetStatsResponse response;
  mine.Fill(response);
  EXPECT_EQ(response.chunks_speculative(), 7u);
  EXPECT_EQ(response.chunks_redone_changed(), 2u);
  EXPECT_EQ(response.chunks_redone_clipped(), 3u);
  EXPECT_EQ(response.chunks_rolled_back_skipped_step(), 4u);
  EXPECT_DOUBLE_EQ(response.redo_seconds(), 1.5);
  v1::GetStatsResponse daemon;
  stats.redo.Fill(daemon);
  EXPECT_EQ(daemon.chunks_speculative(), 0u) << "user counters are not the daemon's";
  EXPECT_EQ(daemon.redo_seconds(), 0.0);
}

}  // namespace
}  // namespace fuyou
