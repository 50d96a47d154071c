#include "stats/ticker.h"

#include <gtest/gtest.h>

#include <set>
#include <string>

namespace fuyou {
namespace {

using google::protobuf::FieldDescriptor;

TEST(TickerTableTest, EveryTickerHasAGetStatsFieldOfItsUnitsType) {
  ASSERT_EQ(AllTickers().size(), kTickerCount);
  std::set<std::string_view> fields;
  for (size_t i = 0; i < kTickerCount; ++i) {
    const TickerInfo& info = AllTickers()[i];
    EXPECT_EQ(static_cast<size_t>(info.ticker), i);
    EXPECT_EQ(&InfoOf(info.ticker), &info);
    const FieldDescriptor* field = ProtoFieldOf(info);
    ASSERT_NE(field, nullptr) << "no GetStatsResponse field " << info.proto_field;
    EXPECT_FALSE(field->is_repeated()) << info.proto_field;
    EXPECT_EQ(field->cpp_type(), info.unit == TickerUnit::kNanoseconds ? FieldDescriptor::CPPTYPE_DOUBLE
                                                                       : FieldDescriptor::CPPTYPE_UINT64)
        << info.proto_field;
    EXPECT_TRUE(fields.insert(info.proto_field).second) << "two tickers show " << info.proto_field;
  }
}

TEST(TickerTableTest, EveryCountedFieldOfGetStatsIsATickers) {
  // What GetStats shows that is not counted: who, the paths, rates, gauges,
  // the data-parallel jobs' rows (the live sessions' figures).
  const std::set<std::string> not_counted = {"scope",
                                             "uid",
                                             "storage",
                                             "read_gbps",
                                             "write_gbps",
                                             "chunk_updates_per_second",
                                             "params_updated_per_second",
                                             "dram_bytes_in_use",
                                             "dram_budget_bytes",
                                             "live_sessions",
                                             "uptime_seconds",
                                             "data_parallel_jobs"};
  std::set<std::string> tickers;
  for (const TickerInfo& info : AllTickers()) tickers.insert(std::string(info.proto_field));
  const google::protobuf::Descriptor* response = v1::GetStatsResponse::descriptor();
  for (int i = 0; i < response->field_count(); ++i) {
    const std::string& name = response->field(i)->name();
    EXPECT_NE(tickers.count(name) + not_counted.count(name), 0u) << name << " is neither a ticker nor listed here";
  }
}

TEST(TickerTableTest, PrometheusFamiliesAreAdjacentCountersWithHelpOnTheirFirstSample) {
  std::set<std::string_view> finished;
  std::set<std::pair<std::string_view, std::string_view>> samples;
  std::string_view family;
  for (const TickerInfo& info : AllTickers()) {
    if (info.metric.empty()) {
      EXPECT_TRUE(info.daemon_from_storage_paths) << info.proto_field << " is in neither /metrics nor a path family";
      continue;
    }
    EXPECT_TRUE(info.metric.starts_with("fuyou_") && info.metric.ends_with("_total")) << info.metric;
    EXPECT_TRUE(samples.insert({info.metric, info.labels}).second) << "two samples " << info.metric << info.labels;
    if (info.metric != family) {
      EXPECT_FALSE(finished.count(info.metric)) << info.metric << "'s samples are not adjacent";
      EXPECT_FALSE(info.help.empty()) << info.metric << " has no help";
      if (!family.empty()) finished.insert(family);
      family = info.metric;
    } else {
      EXPECT_TRUE(info.help.empty()) << info.metric << ": the help is its first sample's";
    }
  }
}

TEST(FillTickersTest, SetsEachTickersFieldFromItsCountNanosecondsAsSeconds) {
  TickerCounts counts;
  for (size_t i = 0; i < kTickerCount; ++i) counts.Add(static_cast<Ticker>(i), 1'000'000'000 * (i + 1));
  v1::GetStatsResponse user;
  FillTickers(counts, v1::STATS_SCOPE_USER, user);
  const google::protobuf::Reflection* reflection = user.GetReflection();
  for (size_t i = 0; i < kTickerCount; ++i) {
    const TickerInfo& info = AllTickers()[i];
    if (info.unit == TickerUnit::kNanoseconds) {
      EXPECT_DOUBLE_EQ(reflection->GetDouble(user, ProtoFieldOf(info)), static_cast<double>(i + 1))
          << info.proto_field;
    } else {
      EXPECT_EQ(reflection->GetUInt64(user, ProtoFieldOf(info)), 1'000'000'000 * (i + 1)) << info.proto_field;
    }
  }
  EXPECT_EQ(user.chunk_updates(), 3'000'000'000u);
  EXPECT_EQ(user.bytes_read(), 1'000'000'000u);

  // The daemon scope's traffic is the storage paths' (StatsReport), not a ticker's.
  v1::GetStatsResponse daemon;
  daemon.set_bytes_read(17);
  FillTickers(counts, v1::STATS_SCOPE_DAEMON, daemon);
  EXPECT_EQ(daemon.bytes_read(), 17u);
  EXPECT_EQ(daemon.bytes_written(), 0u);
  EXPECT_EQ(daemon.chunk_updates(), 3'000'000'000u);
}

}  // namespace
}  // namespace fuyou
