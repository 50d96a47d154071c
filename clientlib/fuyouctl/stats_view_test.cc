// `fuyouctl stats`'s view: every field of GetStatsResponse is in its output,
// whether a hand-made part shows it or it gets a row of its own from the
// descriptor; so a counter added to admin.proto and left out of the view fails
// here.
#include "stats_view.h"

#include <gtest/gtest.h>

#include <set>
#include <sstream>
#include <string>

#include "google/protobuf/descriptor.h"
#include "google/protobuf/message.h"

namespace fuyou::ctl {
namespace {

using google::protobuf::FieldDescriptor;

v1::GetStatsResponse Empty(v1::StatsScope scope) {
  v1::GetStatsResponse stats;
  stats.set_scope(scope);
  return stats;
}

// Sets `field` of `stats` to a value unlike any other's; false for a field
// that cannot be set that way (repeated, message).
bool SetDistinct(v1::GetStatsResponse& stats, const FieldDescriptor& field) {
  const google::protobuf::Reflection& reflection = *stats.GetReflection();
  if (field.is_repeated()) return false;
  switch (field.cpp_type()) {
    case FieldDescriptor::CPPTYPE_UINT64: reflection.SetUInt64(&stats, &field, 987654321987); return true;
    case FieldDescriptor::CPPTYPE_UINT32: reflection.SetUInt32(&stats, &field, 4242); return true;
    case FieldDescriptor::CPPTYPE_INT64: reflection.SetInt64(&stats, &field, 987654321987); return true;
    case FieldDescriptor::CPPTYPE_INT32: reflection.SetInt32(&stats, &field, 4242); return true;
    case FieldDescriptor::CPPTYPE_DOUBLE: reflection.SetDouble(&stats, &field, 98765.4321); return true;
    case FieldDescriptor::CPPTYPE_FLOAT: reflection.SetFloat(&stats, &field, 98765.4f); return true;
    case FieldDescriptor::CPPTYPE_BOOL: reflection.SetBool(&stats, &field, true); return true;
    case FieldDescriptor::CPPTYPE_STRING: reflection.SetString(&stats, &field, "distinct"); return true;
    default: return false;
  }
}

// For each scope, every scalar field changes the output when it changes, but
// those the scope does not show by design: `scope` itself (it picks the view),
// in STATS_SCOPE_DAEMON the uid (a user's) and the traffic totals (shown per
// storage path), in STATS_SCOPE_USER the DRAM (the daemon's).
void ExpectEveryFieldShown(v1::StatsScope scope, const std::set<std::string>& not_in_scope) {
  const v1::GetStatsResponse empty = Empty(scope);
  const std::string before = RenderStats(empty);
  const google::protobuf::Descriptor& descriptor = *v1::GetStatsResponse::descriptor();
  int checked = 0;
  for (int i = 0; i < descriptor.field_count(); ++i) {
    const FieldDescriptor& field = *descriptor.field(i);
    if (field.name() == "scope" || not_in_scope.contains(std::string(field.name()))) continue;
    v1::GetStatsResponse changed = empty;
    if (!SetDistinct(changed, field)) continue;
    ++checked;
    EXPECT_NE(RenderStats(changed), before) << "fuyouctl stats does not show GetStatsResponse." << field.name()
                                            << " in scope " << v1::StatsScope_Name(scope);
  }
  EXPECT_GE(checked, 25) << "the scalar fields of GetStatsResponse (32 in all when this was written)";
}

TEST(StatsViewTest, EveryFieldIsShownInTheDaemonsScope) {
  ExpectEveryFieldShown(v1::STATS_SCOPE_DAEMON, {"uid", "bytes_read", "bytes_written", "read_gbps", "write_gbps"});
}

TEST(StatsViewTest, EveryFieldIsShownInAUsersScope) {
  ExpectEveryFieldShown(v1::STATS_SCOPE_USER, {"dram_bytes_in_use", "dram_budget_bytes"});
}

TEST(StatsViewTest, TheDaemonsTrafficIsShownPerStoragePath) {
  v1::GetStatsResponse stats = Empty(v1::STATS_SCOPE_DAEMON);
  v1::StoragePathStats* path = stats.add_storage();
  path->set_path("/srv/nvme0");
  path->set_bytes_read(uint64_t{3} << 30);
  EXPECT_NE(RenderStats(stats).find("/srv/nvme0    3.00 GiB"), std::string::npos) << RenderStats(stats);
}

// The line of the output that starts with `name`, or "".
std::string LineOf(const std::string& text, const std::string& name) {
  std::istringstream lines(text);
  for (std::string line; std::getline(lines, line);) {
    if (line.starts_with(name + " ")) return line;
  }
  return "";
}

TEST(StatsViewTest, AFieldNoPartShowsGetsARowUnderItsProtoName) {
  for (v1::StatsScope scope : {v1::STATS_SCOPE_DAEMON, v1::STATS_SCOPE_USER}) {
    v1::GetStatsResponse stats = Empty(scope);
    stats.set_activation_spilled_bytes_total(uint64_t{3} << 20);
    stats.set_activation_recalled_bytes_total(512);
    const std::string text = RenderStats(stats);
    const std::string spilled = LineOf(text, "activation_spilled_bytes_total");
    EXPECT_TRUE(spilled.ends_with(" 3.00 MiB")) << text;
    EXPECT_TRUE(LineOf(text, "activation_recalled_bytes_total").ends_with(" 512 B")) << text;
    // Every scalar field the hand-made parts do not show has its row.
    const google::protobuf::Descriptor& descriptor = *v1::GetStatsResponse::descriptor();
    for (int i = 0; i < descriptor.field_count(); ++i) {
      const FieldDescriptor& field = *descriptor.field(i);
      if (field.is_repeated() || ShownFields().contains(std::string_view(field.name()))) continue;
      EXPECT_NE(LineOf(text, std::string(field.name())), "") << field.name() << " has no row:\n" << text;
    }
  }
}

TEST(StatsViewTest, ShownFieldsAreFieldsOfTheResponse) {
  for (std::string_view name : ShownFields()) {
    EXPECT_NE(v1::GetStatsResponse::descriptor()->FindFieldByName(std::string(name)), nullptr) << name;
  }
}

// The summary's columns are its own: a long proto name in the rows after it
// does not move them (tests/integration read "weights      fetches ...").
TEST(StatsViewTest, TheSummaryKeepsItsColumns) {
  v1::GetStatsResponse stats = Empty(v1::STATS_SCOPE_DAEMON);
  stats.set_weights_fetches(8);
  stats.set_chunks_speculative(6);
  stats.set_chunks_rolled_back_skipped_step(4);
  const std::string text = RenderStats(stats);
  EXPECT_NE(text.find("weights      fetches 8, 0 from DRAM"), std::string::npos) << text;
  EXPECT_NE(text.find("speculation  speculative updates 6, redone 0 (changed 0, clipped 0), rolled back (skipped "
                      "steps) 4"),
            std::string::npos)
      << text;
  EXPECT_NE(text.find("DRAM         0 B of 0 B (-)"), std::string::npos) << text;
}

TEST(StatsViewTest, AUserSeesTheirOwnActivityAndTheNote) {
  v1::GetStatsResponse stats = Empty(v1::STATS_SCOPE_USER);
  stats.set_uid(1000);
  stats.set_live_sessions(2);
  const std::string text = RenderStats(stats);
  EXPECT_TRUE(text.starts_with("your sessions (uid 1000): 2 live, 0 steps committed; fuyoud up 0s\n")) << text;
  EXPECT_EQ(LineOf(text, "DRAM"), "") << "no DRAM row:\n" << text;
  EXPECT_TRUE(text.ends_with(
      "(storage paths, DRAM and other users' activity are shown to root and the daemon's user only)\n"))
      << text;
}

// Sets the scalar `field` of `message` to a value unlike any other's; false
// for a repeated or message field.
bool SetDistinctScalar(google::protobuf::Message& message, const FieldDescriptor& field) {
  const google::protobuf::Reflection& reflection = *message.GetReflection();
  if (field.is_repeated()) return false;
  switch (field.cpp_type()) {
    case FieldDescriptor::CPPTYPE_UINT64: reflection.SetUInt64(&message, &field, 987654321987); return true;
    case FieldDescriptor::CPPTYPE_UINT32: reflection.SetUInt32(&message, &field, 4242); return true;
    case FieldDescriptor::CPPTYPE_INT64: reflection.SetInt64(&message, &field, 987654321987); return true;
    case FieldDescriptor::CPPTYPE_DOUBLE: reflection.SetDouble(&message, &field, 98765.4321); return true;
    case FieldDescriptor::CPPTYPE_STRING: reflection.SetString(&message, &field, "distinct"); return true;
    default: return false;
  }
}

v1::GetStatsResponse WithDataParallelJob(v1::StatsScope scope) {
  v1::GetStatsResponse stats = Empty(scope);
  v1::DataParallelJob* job = stats.add_data_parallel_jobs();
  job->set_job("gpt");
  job->set_uid(1000);
  job->set_world_size(2);
  job->set_live_ranks(2);
  job->set_committed_step(5);
  job->set_newest_committed_step(6);
  job->set_chunk_updates(30);
  job->set_update_seconds(1.5);
  for (uint32_t r = 0; r < 2; ++r) {
    v1::DataParallelRank* rank = job->add_ranks();
    rank->set_rank(r);
    rank->set_job("gpt.rank" + std::to_string(r) + "-of2");
    rank->set_session_id("s" + std::to_string(r));
    rank->set_committed_step(5 + r);
    rank->set_chunk_updates(10 + 10 * r);
  }
  return stats;
}

TEST(StatsViewTest, ADataParallelJobIsOneRowWithItsRanksBeneath) {
  for (v1::StatsScope scope : {v1::STATS_SCOPE_DAEMON, v1::STATS_SCOPE_USER}) {
    const std::string text = RenderStats(WithDataParallelJob(scope));
    const std::string job = LineOf(text, "gpt");
    EXPECT_NE(job.find("2/2"), std::string::npos) << text;
    EXPECT_NE(job.find("5 (newest 6)"), std::string::npos) << text;
    EXPECT_NE(job.find(" 30 "), std::string::npos) << text;
    EXPECT_NE(job.find(" 1.50 "), std::string::npos) << text;
    const size_t rank0 = text.find("\n  gpt.rank0-of2  ");
    const size_t rank1 = text.find("\n  gpt.rank1-of2  ");
    ASSERT_NE(rank0, std::string::npos) << text;
    ASSERT_NE(rank1, std::string::npos) << text;
    EXPECT_LT(text.find("\ngpt "), rank0) << "the job's row comes first:\n" << text;
    EXPECT_LT(rank0, rank1);
    EXPECT_NE(text.find("rank 1"), std::string::npos) << text;
  }
  EXPECT_EQ(RenderStats(Empty(v1::STATS_SCOPE_DAEMON)).find("DATA-PARALLEL"), std::string::npos);
}

// Every field of a data-parallel job's row and of its ranks' rows changes the
// output (the session id is `fuyouctl sessions`'s).
TEST(StatsViewTest, EveryFieldOfADataParallelJobIsShown) {
  const v1::GetStatsResponse base = WithDataParallelJob(v1::STATS_SCOPE_DAEMON);
  const std::string before = RenderStats(base);
  int checked = 0;
  for (const google::protobuf::Descriptor* descriptor :
       {v1::DataParallelJob::descriptor(), v1::DataParallelRank::descriptor()}) {
    for (int i = 0; i < descriptor->field_count(); ++i) {
      const FieldDescriptor& field = *descriptor->field(i);
      if (field.name() == "session_id") continue;
      v1::GetStatsResponse changed = base;
      google::protobuf::Message& row = descriptor == v1::DataParallelJob::descriptor()
                                           ? static_cast<google::protobuf::Message&>(*changed.mutable_data_parallel_jobs(0))
                                           : *changed.mutable_data_parallel_jobs(0)->mutable_ranks(1);
      if (!SetDistinctScalar(row, field)) continue;
      ++checked;
      EXPECT_NE(RenderStats(changed), before) << descriptor->name() << "." << field.name() << " is not shown";
    }
  }
  EXPECT_EQ(checked, 13 + 10);
}

}  // namespace
}  // namespace fuyou::ctl
