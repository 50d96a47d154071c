#include "jobs/chunk_segments.h"

#include <gtest/gtest.h>

#include <functional>
#include <string>
#include <vector>

#include "jobs/job.h"

namespace fuyou {
namespace {

v1::ChunkSpec Spec(uint32_t id, uint64_t n, std::vector<uint64_t> segments) {
  v1::ChunkSpec spec;
  spec.set_chunk_id(id);
  spec.set_num_elements(n);
  for (uint64_t s : segments) spec.add_segment_elements(s);
  return spec;
}

v1::ChunkRecord Record(uint32_t id, uint64_t n, std::vector<uint64_t> segments, int64_t update_count = 0,
                       std::vector<int64_t> counts = {}) {
  v1::ChunkRecord record;
  record.set_chunk_id(id);
  record.set_num_elements(n);
  record.set_update_count(update_count);
  for (uint64_t s : segments) record.add_segment_elements(s);
  for (int64_t c : counts) record.add_segment_update_counts(c);
  return record;
}

v1::GradReady Grad(uint32_t id, std::vector<uint32_t> without) {
  v1::GradReady request;
  request.set_chunk_id(id);
  for (uint32_t s : without) request.add_segments_without_grad(s);
  return request;
}

bool Mentions(const absl::Status& status, const std::string& text) {
  return status.message().find(text) != std::string_view::npos;
}

TEST(CheckSegmentElementsTest, AcceptsValidLists) {
  EXPECT_TRUE(CheckSegmentElements(Spec(1, 10, {})).ok()) << "empty: one segment";
  EXPECT_TRUE(CheckSegmentElements(Spec(1, 10, {10})).ok());
  EXPECT_TRUE(CheckSegmentElements(Spec(1, 10, {3, 3, 4})).ok());
  EXPECT_TRUE(CheckSegmentElements(Spec(1, kMaxChunkSegments, std::vector<uint64_t>(kMaxChunkSegments, 1))).ok());
}

TEST(CheckSegmentElementsTest, RefusesMalformedListsNamingTheChunk) {
  struct Case {
    const char* what;
    v1::ChunkSpec spec;
    const char* mentions;
  };
  const std::vector<Case> cases = {
      {"a zero segment", Spec(7, 10, {5, 0, 5}), "segment_elements[1] is 0"},
      {"sum too small", Spec(7, 10, {3, 3}), "add up to 6 elements, but the chunk has 10"},
      {"sum too large", Spec(7, 10, {8, 3}), "add up to 11"},
      {"sum wraps to n", Spec(7, 10, {UINT64_MAX, 11}), "more than 2^64"},
      {"too many", Spec(7, kMaxChunkSegments + 1, std::vector<uint64_t>(kMaxChunkSegments + 1, 1)), "4097 entries"},
  };
  for (const Case& c : cases) {
    const absl::Status status = CheckSegmentElements(c.spec);
    EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument) << c.what;
    EXPECT_TRUE(Mentions(status, "chunk 7")) << c.what << ": " << status;
    EXPECT_TRUE(Mentions(status, c.mentions)) << c.what << ": " << status;
  }
}

TEST(CheckResumedSegmentsTest, TheSameSegmentsResume) {
  EXPECT_TRUE(CheckResumedSegments("gpt", Record(1, 10, {}), Spec(1, 10, {})).ok());
  EXPECT_TRUE(CheckResumedSegments("gpt", Record(1, 10, {}), Spec(1, 10, {10})).ok()) << "one segment either way";
  EXPECT_TRUE(CheckResumedSegments("gpt", Record(1, 10, {10}), Spec(1, 10, {})).ok());
  EXPECT_TRUE(CheckResumedSegments("gpt", Record(1, 10, {4, 6}), Spec(1, 10, {4, 6})).ok());
  EXPECT_FALSE(AdoptsSegments(Record(1, 10, {4, 6}), Spec(1, 10, {4, 6})));
  EXPECT_FALSE(AdoptsSegments(Record(1, 10, {}), Spec(1, 10, {10})));
}

TEST(CheckResumedSegmentsTest, AChunkStoredWithoutSegmentsAdoptsTheSentOnes) {
  EXPECT_TRUE(CheckResumedSegments("gpt", Record(1, 10, {}), Spec(1, 10, {4, 6})).ok());
  EXPECT_TRUE(AdoptsSegments(Record(1, 10, {}), Spec(1, 10, {4, 6})));
}

TEST(CheckResumedSegmentsTest, OtherSegmentsAreRefused) {
  for (const v1::ChunkSpec& spec : {Spec(3, 10, {6, 4}), Spec(3, 10, {}), Spec(3, 10, {10}), Spec(3, 10, {4, 3, 3})}) {
    const absl::Status status = CheckResumedSegments("gpt", Record(3, 10, {4, 6}), spec);
    EXPECT_EQ(status.code(), absl::StatusCode::kFailedPrecondition) << spec.ShortDebugString();
    EXPECT_TRUE(Mentions(status, "chunk 3 of job 'gpt'")) << status;
    EXPECT_TRUE(Mentions(status, "[4, 6]")) << status;
  }
}

TEST(SegmentsToStoreTest, OneSegmentIsStoredAsNone) {
  EXPECT_TRUE(SegmentsToStore(Spec(1, 10, {})).empty());
  EXPECT_TRUE(SegmentsToStore(Spec(1, 10, {10})).empty());
  EXPECT_EQ(SegmentsToStore(Spec(1, 10, {4, 6})), (std::vector<uint64_t>{4, 6}));
}

TEST(CheckSegmentsWithoutGradTest, AcceptsAscendingSegmentsOfTheChunk) {
  EXPECT_TRUE(CheckSegmentsWithoutGrad(Grad(1, {}), 1).ok());
  EXPECT_TRUE(CheckSegmentsWithoutGrad(Grad(1, {0}), 1).ok());
  EXPECT_TRUE(CheckSegmentsWithoutGrad(Grad(1, {0, 2, 3}), 4).ok());
}

TEST(CheckSegmentsWithoutGradTest, RefusesRepeatsDisorderAndSegmentsBeyondTheChunk) {
  struct Case {
    std::vector<uint32_t> without;
    size_t segments;
    const char* mentions;
  };
  const std::vector<Case> cases = {
      {{4}, 4, "names segment 4, but the chunk has 4 segments"},
      {{1}, 1, "has 1 segment (0..0)"},
      {{UINT32_MAX}, 4, "4294967295"},
      {{1, 1}, 4, "ascending without repeats"},
      {{2, 1}, 4, "entry 1 (1) follows 2"},
  };
  for (const Case& c : cases) {
    const absl::Status status = CheckSegmentsWithoutGrad(Grad(9, c.without), c.segments);
    EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument) << c.mentions;
    EXPECT_TRUE(Mentions(status, "chunk 9: segments_without_grad")) << status;
    EXPECT_TRUE(Mentions(status, c.mentions)) << status;
  }
}

TEST(SegmentRecordTest, CountsAreRead) {
  EXPECT_EQ(SegmentCount(Record(1, 10, {})), 1u);
  EXPECT_EQ(SegmentCount(Record(1, 10, {4, 6})), 2u);
  EXPECT_EQ(SegmentUpdateCounts(Record(1, 10, {}, 3)), (std::vector<int64_t>{3}));
  EXPECT_EQ(SegmentUpdateCounts(Record(1, 10, {4, 6}, 3)), (std::vector<int64_t>{3, 3}));
  EXPECT_EQ(SegmentUpdateCounts(Record(1, 10, {4, 6}, 3, {3, 1})), (std::vector<int64_t>{3, 1}));
}

TEST(SegmentRecordTest, InconsistentRecordsAreNamed) {
  EXPECT_EQ(SegmentRecordProblem(Record(1, 10, {})), "");
  EXPECT_EQ(SegmentRecordProblem(Record(1, 10, {4, 6}, 2, {2, 0})), "");
  struct Case {
    v1::ChunkRecord record;
    const char* mentions;
  };
  const std::vector<Case> cases = {
      {Record(1, 10, {4, 5}), "add up to 9"},
      {Record(1, 10, {4, 0, 6}), "segment_elements[1] is 0"},
      {Record(1, 10, {4, 6}, 2, {2}), "1 segment update counts for 2 segments"},
      {Record(1, 10, {}, 2, {2, 2}), "2 segment update counts for 1 segments"},
      {Record(1, 10, {4, 6}, 2, {-1, 2}), "segment update count -1"},
      {Record(1, 10, {4, 6}, kMaxUpdateCount, {kMaxUpdateCount + 1, 2}), "outside 0.."},
      {Record(1, 10, {4, 6}, 3, {2, 1}), "update count 3, but its segments' largest update count is 2"},
  };
  for (const Case& c : cases) {
    const std::string problem = SegmentRecordProblem(c.record);
    EXPECT_NE(problem.find(c.mentions), std::string::npos) << c.record.ShortDebugString() << ": " << problem;
  }
}

// ValidateManifest (jobs/job.h) refuses a manifest whose segment fields are
// inconsistent, as DATA_LOSS naming the job and chunk.
TEST(SegmentRecordTest, ValidateManifestRefusesInconsistentSegments) {
  v1::JobManifest manifest;
  manifest.set_name("gpt");
  v1::ChunkRecord* record = manifest.add_chunks();
  *record = Record(5, 10, {4, 6}, 2, {2, 1});
  record->set_param_dtype(v1::DTYPE_FLOAT32);
  record->set_grad_dtype(v1::DTYPE_FLOAT32);
  for (int version = 0; version < 2; ++version) {
    v1::StateExtent* extent = record->add_extents();
    extent->set_offset(version * *ChunkStateBytes(10));
    extent->set_length(*ChunkStateBytes(10));
  }
  manifest.set_state_bytes(2 * *ChunkStateBytes(10));
  ASSERT_TRUE(ValidateManifest(manifest).ok()) << ValidateManifest(manifest);
  const std::vector<std::function<void(v1::ChunkRecord&)>> damages = {
      [](v1::ChunkRecord& r) { r.set_segment_elements(1, 7); },
      [](v1::ChunkRecord& r) { r.add_segment_update_counts(1); },
      [](v1::ChunkRecord& r) { r.set_segment_update_counts(0, 1); },
      [](v1::ChunkRecord& r) { r.set_segment_update_counts(1, -4); },
  };
  for (const auto& damage : damages) {
    v1::JobManifest damaged = manifest;
    damage(*damaged.mutable_chunks(0));
    const absl::Status status = ValidateManifest(damaged);
    EXPECT_EQ(status.code(), absl::StatusCode::kDataLoss) << status;
    EXPECT_TRUE(Mentions(status, "job 'gpt'")) << status;
    EXPECT_TRUE(Mentions(status, "chunk 5 ")) << status;
  }
}

}  // namespace
}  // namespace fuyou
