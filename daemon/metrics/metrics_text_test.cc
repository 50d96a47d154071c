#include "metrics/metrics_text.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <sstream>
#include <vector>

#include "fmt/format.h"
#include "stats/ticker.h"

namespace fuyou::metrics {
namespace {

std::vector<std::string> Lines(const std::string& text) {
  std::vector<std::string> lines;
  std::istringstream in(text);
  for (std::string line; std::getline(in, line);) lines.push_back(line);
  return lines;
}

bool Has(const std::vector<std::string>& lines, const std::string& line) {
  return std::find(lines.begin(), lines.end(), line) != lines.end();
}

v1::GetStatsResponse KnownStats() {
  v1::GetStatsResponse stats;
  stats.set_scope(v1::STATS_SCOPE_DAEMON);
  stats.set_uptime_seconds(12.5);
  v1::StoragePathStats* a = stats.add_storage();
  a->set_path("/srv/nvme0");
  a->set_bytes_read(4096);
  a->set_bytes_written(8192);
  v1::StoragePathStats* b = stats.add_storage();
  b->set_path("/srv/odd\"name\\");
  b->set_bytes_read(1);
  b->set_bytes_written(2);
  stats.set_chunk_updates(40);
  stats.set_params_updated(123456789012);
  stats.set_steps_committed(7);
  stats.set_cache_hits(30);
  stats.set_cache_misses(10);
  stats.set_dram_budget_bytes(uint64_t{2} << 30);
  stats.set_dram_bytes_in_use(1048576);
  stats.set_live_sessions(2);
  stats.set_chunks_speculative(11);
  stats.set_chunks_redone_changed(3);
  stats.set_chunks_redone_clipped(4);
  stats.set_chunks_rolled_back_skipped_step(5);
  stats.set_redo_seconds(0.25);
  stats.set_weights_fetches(60);
  stats.set_weights_fetch_cache_hits(45);
  stats.set_weights_bytes_read(3145728);
  stats.set_journal_bytes_total(8192);
  stats.set_journal_spilled_bytes_total(4096);
  stats.set_journal_replays_total(6);
  stats.set_journal_replay_seconds_total(0.5);
  stats.set_activation_spilled_bytes_total(12288);
  stats.set_activation_recalled_bytes_total(8192);
  return stats;
}

TEST(MetricsTextTest, RendersEveryFigureOfGetStatsWithItsTypeAndHelp) {
  const v1::GetStatsResponse stats = KnownStats();
  Histogram update({0.001, 0.01});
  update.Observe(0.0005);
  update.Observe(0.005);
  update.Observe(0.5);
  Histogram step({1});
  const std::vector<std::string> lines =
      Lines(RenderMetrics({stats, update.Snapshot(), step.Snapshot(), "1.2.3"}));
  for (const char* expected : {
           "# TYPE fuyou_build_info gauge",
           "fuyou_build_info{version=\"1.2.3\"} 1",
           "fuyou_uptime_seconds 12.5",
           "# TYPE fuyou_storage_read_bytes_total counter",
           "fuyou_storage_read_bytes_total{path=\"/srv/nvme0\"} 4096",
           "fuyou_storage_read_bytes_total{path=\"/srv/odd\\\"name\\\\\"} 1",
           "fuyou_storage_written_bytes_total{path=\"/srv/nvme0\"} 8192",
           "fuyou_storage_written_bytes_total{path=\"/srv/odd\\\"name\\\\\"} 2",
           "# TYPE fuyou_chunk_updates_total counter",
           "fuyou_chunk_updates_total 40",
           "fuyou_params_updated_total 123456789012",
           "fuyou_steps_committed_total 7",
           "fuyou_cache_hits_total 30",
           "fuyou_cache_misses_total 10",
           "# TYPE fuyou_dram_budget_bytes gauge",
           "fuyou_dram_budget_bytes 2147483648",
           "fuyou_dram_bytes_in_use 1048576",
           "# TYPE fuyou_sessions gauge",
           "fuyou_sessions 2",
           "fuyou_chunks_speculative_total 11",
           "fuyou_chunks_redone_total{reason=\"changed\"} 3",
           "fuyou_chunks_redone_total{reason=\"clipped\"} 4",
           "fuyou_chunks_rolled_back_total{reason=\"skipped_step\"} 5",
           "fuyou_redo_seconds_total 0.25",
           "# TYPE fuyou_weights_fetches_total counter",
           "fuyou_weights_fetches_total 60",
           "# TYPE fuyou_weights_fetch_cache_hits_total counter",
           "fuyou_weights_fetch_cache_hits_total 45",
           "# TYPE fuyou_weights_read_bytes_total counter",
           "fuyou_weights_read_bytes_total 3145728",
           "# TYPE fuyou_journal_bytes_total counter",
           "fuyou_journal_bytes_total 8192",
           "fuyou_journal_spilled_bytes_total 4096",
           "fuyou_journal_replays_total 6",
           "fuyou_journal_replay_seconds_total 0.5",
           "# TYPE fuyou_activation_spilled_bytes_total counter",
           "fuyou_activation_spilled_bytes_total 12288",
           "fuyou_activation_recalled_bytes_total 8192",
           "# TYPE fuyou_chunk_update_seconds histogram",
           "fuyou_chunk_update_seconds_bucket{le=\"0.001\"} 1",
           "fuyou_chunk_update_seconds_bucket{le=\"0.01\"} 2",
           "fuyou_chunk_update_seconds_bucket{le=\"+Inf\"} 3",
           "fuyou_chunk_update_seconds_sum 0.5055",
           "fuyou_chunk_update_seconds_count 3",
           "# TYPE fuyou_step_seconds histogram",
           "fuyou_step_seconds_bucket{le=\"1\"} 0",
           "fuyou_step_seconds_bucket{le=\"+Inf\"} 0",
           "fuyou_step_seconds_sum 0",
           "fuyou_step_seconds_count 0",
       }) {
    EXPECT_TRUE(Has(lines, expected)) << "missing line: " << expected;
  }
}

TEST(MetricsTextTest, EachFamilyHasHelpThenTypeBeforeItsSamples) {
  const v1::GetStatsResponse stats = KnownStats();
  Histogram update({0.001});
  const std::vector<std::string> lines = Lines(RenderMetrics({stats, update.Snapshot(), update.Snapshot(), "x"}));
  std::string family;
  int families = 0;
  for (size_t i = 0; i < lines.size(); ++i) {
    const std::string& line = lines[i];
    if (line.rfind("# HELP ", 0) == 0) {
      family = line.substr(7, line.find(' ', 7) - 7);
      ASSERT_LT(i + 1, lines.size());
      EXPECT_EQ(lines[i + 1].rfind("# TYPE " + family + " ", 0), 0u) << line;
      ++families;
      continue;
    }
    if (line.rfind("# TYPE ", 0) == 0) continue;
    ASSERT_FALSE(family.empty()) << "a sample before any family: " << line;
    EXPECT_EQ(line.rfind(family, 0), 0u) << "sample '" << line << "' outside its family " << family;
  }
  EXPECT_EQ(families, 34);
}

TEST(MetricsTextTest, RendersEveryTickerWithAMetricFromItsField) {
  // Each ticker's field a value of its own: the sample must carry that value
  // under the ticker's name and labels (stats/ticker.cc's table).
  v1::GetStatsResponse stats;
  const google::protobuf::Reflection* reflection = stats.GetReflection();
  for (const TickerInfo& info : AllTickers()) {
    const auto value = static_cast<uint64_t>(info.ticker) + 1000;
    if (info.unit == TickerUnit::kNanoseconds) {
      reflection->SetDouble(&stats, ProtoFieldOf(info), static_cast<double>(value) + 0.5);
    } else {
      reflection->SetUInt64(&stats, ProtoFieldOf(info), value);
    }
  }
  Histogram none({1});
  const std::vector<std::string> lines = Lines(RenderMetrics({stats, none.Snapshot(), none.Snapshot(), "x"}));
  int samples = 0;
  for (const TickerInfo& info : AllTickers()) {
    if (info.metric.empty()) continue;
    const uint64_t value = static_cast<uint64_t>(info.ticker) + 1000;
    const std::string name =
        info.labels.empty() ? std::string(info.metric) : fmt::format("{}{{{}}}", info.metric, info.labels);
    const std::string shown =
        info.unit == TickerUnit::kNanoseconds ? fmt::format("{}.5", value) : fmt::format("{}", value);
    EXPECT_TRUE(Has(lines, name + " " + shown)) << "missing: " << name << " " << shown;
    if (!info.help.empty()) {
      EXPECT_TRUE(Has(lines, fmt::format("# TYPE {} counter", info.metric))) << info.metric;
    }
    ++samples;
  }
  EXPECT_EQ(samples, 19);  // every ticker but the two the storage paths' families show
}

// A data-parallel job of `world_size` ranks, all live, rank r at step 10 + r.
v1::DataParallelJob DataParallelJobOf(const std::string& name, uint32_t uid, uint32_t world_size) {
  v1::DataParallelJob job;
  job.set_job(name);
  job.set_uid(uid);
  job.set_world_size(world_size);
  job.set_live_ranks(world_size);
  job.set_committed_step(10);
  job.set_newest_committed_step(10 + world_size - 1);
  for (uint32_t r = 0; r < world_size; ++r) {
    v1::DataParallelRank* rank = job.add_ranks();
    rank->set_rank(r);
    rank->set_committed_step(10 + r);
    rank->set_chunk_updates(100 + r);
    rank->set_update_seconds(0.5 + r);
    rank->set_state_wait_seconds(0.25 + r);
  }
  return job;
}

TEST(MetricsTextTest, ADataParallelJobIsOneJobWithPerRankSamples) {
  v1::GetStatsResponse stats = KnownStats();
  *stats.add_data_parallel_jobs() = DataParallelJobOf("gpt", 1000, 2);
  Histogram none({1});
  const std::vector<std::string> lines = Lines(RenderMetrics({stats, none.Snapshot(), none.Snapshot(), "x"}));
  const std::string job = "uid=\"1000\",data_parallel_job=\"gpt\",world_size=\"2\"";
  for (const std::string& expected : std::vector<std::string>{
           "# TYPE fuyou_data_parallel_live_ranks gauge",
           "fuyou_data_parallel_live_ranks{" + job + "} 2",
           "fuyou_data_parallel_committed_step{" + job + "} 10",
           "# TYPE fuyou_data_parallel_rank_committed_step gauge",
           "fuyou_data_parallel_rank_committed_step{" + job + ",rank=\"0\"} 10",
           "fuyou_data_parallel_rank_committed_step{" + job + ",rank=\"1\"} 11",
           "# TYPE fuyou_data_parallel_rank_chunk_updates_total counter",
           "fuyou_data_parallel_rank_chunk_updates_total{" + job + ",rank=\"0\"} 100",
           "fuyou_data_parallel_rank_chunk_updates_total{" + job + ",rank=\"1\"} 101",
           "fuyou_data_parallel_rank_update_seconds_total{" + job + ",rank=\"1\"} 1.5",
           "fuyou_data_parallel_rank_state_wait_seconds_total{" + job + ",rank=\"0\"} 0.25",
           "fuyou_data_parallel_jobs_not_shown 0",
       }) {
    EXPECT_TRUE(Has(lines, expected)) << "missing line: " << expected;
  }
}

TEST(MetricsTextTest, TheDataParallelLabelsAreBounded) {
  // More jobs than the cap: the first are shown, the rest counted.
  v1::GetStatsResponse many = KnownStats();
  for (int i = 0; i < kMaxDataParallelJobsInMetrics + 5; ++i) {
    *many.add_data_parallel_jobs() = DataParallelJobOf(fmt::format("job{:03}", i), 1000, 2);
  }
  Histogram none({1});
  std::vector<std::string> lines = Lines(RenderMetrics({many, none.Snapshot(), none.Snapshot(), "x"}));
  const auto count = [&](const std::string& prefix) {
    return std::count_if(lines.begin(), lines.end(), [&](const std::string& l) { return l.rfind(prefix, 0) == 0; });
  };
  EXPECT_EQ(count("fuyou_data_parallel_live_ranks{"), kMaxDataParallelJobsInMetrics);
  EXPECT_EQ(count("fuyou_data_parallel_rank_chunk_updates_total{"), 2 * kMaxDataParallelJobsInMetrics);
  EXPECT_TRUE(Has(lines, "fuyou_data_parallel_jobs_not_shown 5"));
  // Ranks past the per-family cap: the job that would pass it is left out whole.
  v1::GetStatsResponse wide = KnownStats();
  *wide.add_data_parallel_jobs() = DataParallelJobOf("a", 1, kMaxDataParallelRanksInMetrics - 1);
  *wide.add_data_parallel_jobs() = DataParallelJobOf("b", 1, 2);
  lines = Lines(RenderMetrics({wide, none.Snapshot(), none.Snapshot(), "x"}));
  EXPECT_EQ(count("fuyou_data_parallel_rank_committed_step{"), kMaxDataParallelRanksInMetrics - 1);
  EXPECT_EQ(count("fuyou_data_parallel_live_ranks{"), 1);
  EXPECT_TRUE(Has(lines, "fuyou_data_parallel_jobs_not_shown 1"));
}

TEST(MetricsTextTest, EscapesLabelValues) {
  EXPECT_EQ(EscapeLabelValue("a\\b\"c\nd"), "a\\\\b\\\"c\\nd");
  EXPECT_EQ(EscapeLabelValue("/srv/nvme0"), "/srv/nvme0");
}

}  // namespace
}  // namespace fuyou::metrics
