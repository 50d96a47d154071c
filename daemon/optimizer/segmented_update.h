// SegmentedUpdate: one chunk update whose segments (the parameters, or parameter
// pieces, packed into the chunk) each keep their own Adam t, and some of which
// may have no gradient in this step (`grad is None` in torch).
//
// For every segment, in order:
//   - with a gradient: AdamW over the segment's element range with
//     step = that segment's update count + 1 (AdamWKernel::Update on pointers
//     into master / m / v / grad / weights_out at the segment's first element);
//   - without a gradient: master, m and v stay as they are (no weight decay
//     either, as torch skips the parameter), the gradient bytes are not read,
//     and weights_out receives the segment's unchanged weights
//     (ConvertFromFloat32 of its master range).
// Adjacent segments with a gradient and the same count run as one kernel call,
// so the common chunk (every segment at the same t, all with gradients) is one
// call over the whole chunk, exactly as AdamWKernel::Update alone.
//
// The kernel's result for an element does not depend on where a range starts
// (adamw_kernel.h), so the segmented update of a segment equals the whole-chunk
// update of the same elements with the same t, bit for bit.
//
// Preconditions (the session validates them from client input with
// jobs/chunk_segments.h before calling): the segment sizes are > 0 and add up
// to buffers.n (an empty list is one segment of buffers.n); `update_counts` is
// empty (every segment at `uniform_count`) or has one entry per segment, each in
// [0, kMaxUpdateCount); `without_grad` is ascending, without repeats, each < the
// number of segments.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <vector>

#include "optimizer/adamw_kernel.h"

namespace fuyou::optimizer {

// What one chunk update runs: a list of element ranges, each either a kernel
// call at `step` or a copy of the unchanged weights. Ranges are in element
// order and cover [0, n) exactly once.
struct SegmentRun {
  size_t begin = 0;  // first element
  size_t end = 0;    // one past the last element
  bool update = true;  // false: no gradient, weights copied out unchanged
  int64_t step = 1;    // Adam's t for the kernel (update only)
};

// The per-segment description of one update.
struct SegmentedUpdateSpec {
  // Element counts per segment; empty: one segment of the chunk's n elements.
  std::span<const uint64_t> segment_elements;
  // Update count (Adam's t before this update) per segment; empty: every
  // segment has `uniform_count`.
  std::span<const int64_t> update_counts;
  int64_t uniform_count = 0;
  // Segments without a gradient in this update (ascending, no repeats).
  std::span<const uint32_t> without_grad;
};

// The runs an update of `n` elements makes: adjacent segments with a gradient
// and the same t merged into one run; adjacent segments without a gradient
// merged into one copy.
std::vector<SegmentRun> PlanSegmentedUpdate(size_t n, const SegmentedUpdateSpec& spec);

// Runs PlanSegmentedUpdate(buffers.n, spec) with `kernel`, in `tenant`'s turns
// (AdamWKernel::Update): `params.step` is ignored (each run has its own).
// Blocks until done.
void SegmentedUpdate(AdamWKernel& kernel, const AdamWStepParams& params, const AdamWBuffers& buffers,
                     const SegmentedUpdateSpec& spec, FairKey tenant = {});

// The per-segment update counts after the update `spec` describes: +1 for each
// segment with a gradient, unchanged for the others. One entry per segment.
std::vector<int64_t> CountsAfterUpdate(const SegmentedUpdateSpec& spec);

}  // namespace fuyou::optimizer
