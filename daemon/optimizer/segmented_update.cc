#include "optimizer/segmented_update.h"

#include <algorithm>
#include <cassert>

#include "optimizer/dtype_convert.h"

namespace fuyou::optimizer {
namespace {

size_t SegmentCount(const SegmentedUpdateSpec& spec) {
  return spec.segment_elements.empty() ? 1 : spec.segment_elements.size();
}

int64_t CountOf(const SegmentedUpdateSpec& spec, size_t segment) {
  return spec.update_counts.empty() ? spec.uniform_count : spec.update_counts[segment];
}

// The buffers of elements [begin, end) of `b`, as a chunk of their own.
AdamWBuffers SubRange(const AdamWBuffers& b, size_t begin, size_t end) {
  AdamWBuffers sub = b;
  sub.master = b.master + begin;
  sub.exp_avg = static_cast<std::byte*>(b.exp_avg) + begin * MomentCodeBytes(b.moments_dtype);
  sub.exp_avg_sq = static_cast<std::byte*>(b.exp_avg_sq) + begin * MomentCodeBytes(b.moments_dtype);
  sub.first_element = b.first_element + begin;
  sub.grad = static_cast<const std::byte*>(b.grad) + begin * DTypeSize(b.grad_dtype);
  if (b.weights_out != nullptr) {
    sub.weights_out = static_cast<std::byte*>(b.weights_out) + begin * DTypeSize(b.weight_dtype);
  }
  sub.n = end - begin;
  return sub;
}

}  // namespace

std::vector<SegmentRun> PlanSegmentedUpdate(size_t n, const SegmentedUpdateSpec& spec) {
  const size_t segments = SegmentCount(spec);
  assert(spec.update_counts.empty() || spec.update_counts.size() == segments);
  std::vector<SegmentRun> runs;
  size_t begin = 0;
  size_t next_without = 0;  // index into spec.without_grad
  for (size_t s = 0; s < segments; ++s) {
    const size_t length = spec.segment_elements.empty() ? n : static_cast<size_t>(spec.segment_elements[s]);
    const bool has_grad = !(next_without < spec.without_grad.size() && spec.without_grad[next_without] == s);
    if (!has_grad) ++next_without;
    SegmentRun run{begin, begin + length, has_grad, has_grad ? CountOf(spec, s) + 1 : 0};
    begin += length;
    if (!runs.empty() && runs.back().update == run.update && runs.back().step == run.step) {
      runs.back().end = run.end;  // same kind and t as the run before: one call
    } else {
      runs.push_back(run);
    }
  }
  assert(begin == n);
  return runs;
}

void SegmentedUpdate(AdamWKernel& kernel, const AdamWStepParams& params, const AdamWBuffers& buffers,
                     const SegmentedUpdateSpec& spec, FairKey tenant) {
  for (const SegmentRun& run : PlanSegmentedUpdate(buffers.n, spec)) {
    const AdamWBuffers sub = SubRange(buffers, run.begin, run.end);
    if (run.update) {
      AdamWStepParams at = params;
      at.step = run.step;
      kernel.Update(at, sub, tenant);
    } else if (sub.weights_out != nullptr) {
      ConvertFromFloat32(sub.master, sub.weights_out, sub.weight_dtype, sub.n);
    }
  }
}

std::vector<int64_t> CountsAfterUpdate(const SegmentedUpdateSpec& spec) {
  const size_t segments = SegmentCount(spec);
  std::vector<int64_t> counts(segments);
  size_t next_without = 0;
  for (size_t s = 0; s < segments; ++s) {
    const bool has_grad = !(next_without < spec.without_grad.size() && spec.without_grad[next_without] == s);
    if (!has_grad) ++next_without;
    counts[s] = CountOf(spec, s) + (has_grad ? 1 : 0);
  }
  return counts;
}

}  // namespace fuyou::optimizer
