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
  TickerCounts& alice = stats.ForUser(1000);
  TickerCounts& bob = stats.ForUser(1001);
  alice.Add(Ticker::kChunkUpdates, 3);
  alice.Add(Ticker::kBytesRead, 4096);
  bob.Add(Ticker::kChunkUpdates, 1);
  EXPECT_EQ(&stats.ForUser(1000), &alice) << "the same counters for the same uid";
  EXPECT_EQ(stats.ForUser(1000).Get(Ticker::kChunkUpdates), 3u);
  EXPECT_EQ(stats.ForUser(1001).Get(Ticker::kChunkUpdates), 1u);
  EXPECT_EQ(stats.ForUser(1001).Get(Ticker::kBytesRead), 0u);
  EXPECT_EQ(stats.tickers.Get(Ticker::kChunkUpdates), 0u) << "user counters are not the daemon's";
  const StatsRates user = stats.RatesForUser(1000, milliseconds(0));
  ASSERT_EQ(user.read_gbps.size(), 1u);
  EXPECT_GT(user.read_gbps[0], 0.0);
  EXPECT_GT(user.chunk_updates_per_second, 0.0);
  const StatsRates daemon = stats.Rates(milliseconds(0));
  EXPECT_EQ(daemon.read_gbps.size(), 2u);
}

TEST(DaemonStatsTest, ABumpCountsOnceIntoTheDaemonAndItsUserOnly) {
  DaemonStats stats({"/a"});
  const StatsScopes alice = stats.ScopesOf(1000);
  alice.Bump(Ticker::kChunksSpeculative);
  alice.Bump(Ticker::kChunksSpeculative, 6);
  stats.ScopesOf(1001).Bump(Ticker::kChunksSpeculative, 2);
  EXPECT_EQ(stats.ForUser(1000).Get(Ticker::kChunksSpeculative), 7u);
  EXPECT_EQ(stats.ForUser(1001).Get(Ticker::kChunksSpeculative), 2u);
  EXPECT_EQ(stats.tickers.Get(Ticker::kChunksSpeculative), 9u) << "the daemon counts every user's";
  EXPECT_EQ(stats.tickers.Get(Ticker::kChunksRedoneChanged), 0u) << "other tickers untouched";
}

TEST(RedoCountersTest, FillSetsTheIssue10Fields) {
  DaemonStats stats({"/a"});
  TickerCounts& mine = stats.ForUser(1000);
  mine.Add(Ticker::kChunksSpeculative, 7);
  mine.Add(Ticker::kChunksRedoneChanged, 2);
  mine.Add(Ticker::kChunksRedoneClipped, 3);
  mine.Add(Ticker::kChunksRolledBackSkippedStep, 4);
  mine.Add(Ticker::kRedoNanoseconds, 1'500'000'000);
  v1::GetStatsResponse response;
  FillTickers(mine, v1::STATS_SCOPE_USER, response);
  EXPECT_EQ(response.chunks_speculative(), 7u);
  EXPECT_EQ(response.chunks_redone_changed(), 2u);
  EXPECT_EQ(response.chunks_redone_clipped(), 3u);
  EXPECT_EQ(response.chunks_rolled_back_skipped_step(), 4u);
  EXPECT_DOUBLE_EQ(response.redo_seconds(), 1.5);
  v1::GetStatsResponse daemon;
  FillTickers(stats.tickers, v1::STATS_SCOPE_DAEMON, daemon);
  EXPECT_EQ(daemon.chunks_speculative(), 0u) << "user counters are not the daemon's";
  EXPECT_EQ(daemon.redo_seconds(), 0.0);
}

}  // namespace
}  // namespace fuyou
