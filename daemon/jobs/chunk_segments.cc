#include "jobs/chunk_segments.h"

#include <algorithm>
#include <optional>

#include "fmt/format.h"
#include "fuyou/checked_math.h"
#include "jobs/job.h"

namespace fuyou {
namespace {

// "" when `segments` is a valid segment list for a chunk of `num_elements`;
// else what is wrong with it, starting with "segment_elements".
template <typename Segments>
std::string SegmentListProblem(const Segments& segments, uint64_t num_elements) {
  if (segments.empty()) return "";
  if (segments.size() > kMaxChunkSegments) {
    return fmt::format("segment_elements has {} entries, more than the {} segments a chunk may have",
                       segments.size(), kMaxChunkSegments);
  }
  std::optional<uint64_t> sum = 0;
  for (int i = 0; i < segments.size(); ++i) {
    if (segments[i] == 0) return fmt::format("segment_elements[{}] is 0; every segment holds at least one element", i);
    sum = CheckedAdd(sum, segments[i]);
  }
  if (!sum) return fmt::format("segment_elements add up to more than 2^64, not to the chunk's {} elements", num_elements);
  if (*sum != num_elements) {
    return fmt::format("segment_elements add up to {} elements, but the chunk has {}", *sum, num_elements);
  }
  return "";
}

// Whether a segment list means one segment (empty, or exactly {num_elements}).
template <typename Segments>
bool IsOneSegment(const Segments& segments, uint64_t num_elements) {
  return segments.empty() || (segments.size() == 1 && segments[0] == num_elements);
}

template <typename Segments>
std::string Describe(const Segments& segments) {
  if (segments.empty()) return "none (one segment)";
  constexpr int kShown = 8;
  std::string text = "[";
  for (int i = 0; i < segments.size() && i < kShown; ++i) text += fmt::format("{}{}", i == 0 ? "" : ", ", segments[i]);
  if (segments.size() > kShown) text += fmt::format(", ... {} in all", segments.size());
  return text + "]";
}

}  // namespace

absl::Status CheckSegmentElements(const v1::ChunkSpec& spec) {
  if (std::string problem = SegmentListProblem(spec.segment_elements(), spec.num_elements()); !problem.empty()) {
    return absl::InvalidArgumentError(fmt::format("chunk {}: {}", spec.chunk_id(), problem));
  }
  return absl::OkStatus();
}

absl::Status CheckResumedSegments(std::string_view job, const v1::ChunkRecord& record, const v1::ChunkSpec& spec) {
  const uint64_t n = record.num_elements();
  const bool stored_one = IsOneSegment(record.segment_elements(), n);
  const bool sent_one = IsOneSegment(spec.segment_elements(), n);
  if (stored_one) return absl::OkStatus();  // the same list, or adopted (AdoptsSegments)
  if (!sent_one && std::equal(record.segment_elements().begin(), record.segment_elements().end(),
                              spec.segment_elements().begin(), spec.segment_elements().end())) {
    return absl::OkStatus();
  }
  return absl::FailedPreconditionError(fmt::format(
      "chunk {} of job '{}' was created with segments {} (the element counts of the parameters packed into it), but "
      "this model registers {}: its parameters are packed differently, so each segment's update count would apply "
      "to the wrong parameters; resume with the model (and chunking) the job was created with, or use a new job "
      "name",
      record.chunk_id(), job, Describe(record.segment_elements()), Describe(spec.segment_elements())));
}

bool AdoptsSegments(const v1::ChunkRecord& record, const v1::ChunkSpec& spec) {
  return IsOneSegment(record.segment_elements(), record.num_elements()) &&
         !IsOneSegment(spec.segment_elements(), spec.num_elements());
}

std::vector<uint64_t> SegmentsToStore(const v1::ChunkSpec& spec) {
  if (IsOneSegment(spec.segment_elements(), spec.num_elements())) return {};
  return {spec.segment_elements().begin(), spec.segment_elements().end()};
}

absl::Status CheckSegmentsWithoutGrad(const v1::GradReady& request, size_t num_segments) {
  const auto& without = request.segments_without_grad();
  for (int i = 0; i < without.size(); ++i) {
    if (without[i] >= num_segments) {
      return absl::InvalidArgumentError(fmt::format(
          "chunk {}: segments_without_grad[{}] names segment {}, but the chunk has {} segment{} (0..{})",
          request.chunk_id(), i, without[i], num_segments, num_segments == 1 ? "" : "s", num_segments - 1));
    }
    if (i > 0 && without[i] <= without[i - 1]) {
      return absl::InvalidArgumentError(fmt::format(
          "chunk {}: segments_without_grad must be ascending without repeats, but entry {} ({}) follows {}",
          request.chunk_id(), i, without[i], without[i - 1]));
    }
  }
  return absl::OkStatus();
}

std::string SegmentRecordProblem(const v1::ChunkRecord& record) {
  if (std::string problem = SegmentListProblem(record.segment_elements(), record.num_elements());
      !problem.empty()) {
    return "has an invalid segment list: " + problem;
  }
  const auto& counts = record.segment_update_counts();
  if (counts.empty()) return "";
  const size_t segments = SegmentCount(record);
  if (static_cast<size_t>(counts.size()) != segments) {
    return fmt::format("has {} segment update counts for {} segments", counts.size(), segments);
  }
  int64_t largest = 0;
  for (int i = 0; i < counts.size(); ++i) {
    if (counts[i] < 0 || counts[i] > kMaxUpdateCount) {
      return fmt::format("has segment update count {} (segment {}), outside 0..{}", counts[i], i, kMaxUpdateCount);
    }
    largest = std::max(largest, counts[i]);
  }
  if (largest != record.update_count()) {
    return fmt::format("has update count {}, but its segments' largest update count is {}", record.update_count(),
                       largest);
  }
  return "";
}

size_t SegmentCount(const v1::ChunkRecord& record) {
  return record.segment_elements().empty() ? 1 : static_cast<size_t>(record.segment_elements_size());
}

std::vector<int64_t> SegmentUpdateCounts(const v1::ChunkRecord& record) {
  if (record.segment_update_counts().empty()) {
    return std::vector<int64_t>(SegmentCount(record), record.update_count());
  }
  return {record.segment_update_counts().begin(), record.segment_update_counts().end()};
}

}  // namespace fuyou
