// Session: the gradient journal of a GradReady (GradReady.journal), written
// before the update runs from it. See journal/grad_journal.h for where the
// bytes live, and offload.proto (JournalUse, GradOp) for the contract.
#include <algorithm>
#include <cstring>
#include <vector>

#include "common/status_util.h"
#include "fmt/format.h"
#include "jobs/chunk_segments.h"
#include "optimizer/grad_ops.h"
#include "session/session.h"
#include "stats/daemon_stats.h"

namespace fuyou {

absl::StatusOr<JournalAccess> Session::PrepareJournal(const v1::GradReady& request, v1::ParamsReady& ready) {
  const uint32_t chunk_id = request.chunk_id();
  const RegisteredChunk& registered = registered_.at(chunk_id);
  const DType dtype = registered.grad_dtype;
  const uint64_t n = registered.num_elements;
  const uint64_t bytes = n * DTypeSize(dtype);  // <= slot_bytes (registration)
  // The chunk's segments as [begin, end) element ranges, and which have no gradient.
  const v1::ChunkRecord& record = *held_.store->Find(chunk_id);
  std::vector<uint64_t> bounds{0};
  if (record.segment_elements().empty()) {
    bounds.push_back(n);
  } else {
    for (uint64_t elements : record.segment_elements()) bounds.push_back(bounds.back() + elements);
  }
  std::vector<bool> without(bounds.size() - 1, false);
  for (uint32_t s : request.segments_without_grad()) without[s] = true;  // validated indices
  std::vector<optimizer::GradOp> ops;
  for (const v1::GradOp& op : request.grad_ops()) {
    ops.push_back({op.kind() == v1::GradOp::KIND_DIV ? optimizer::GradOp::Kind::kDiv : optimizer::GradOp::Kind::kMul,
                   op.operand()});
  }
  const std::byte* slot = held_.segment->GradRegion(request.slot()).data();
  bool changed = true;
  absl::StatusOr<JournalAccess> access;
  switch (request.journal()) {
    case v1::JOURNAL_USE_KEEP: {
      access = held_.journal->Begin(chunk_id, bytes);
      if (!access.ok()) return access.status();
      std::memcpy(access->data(), slot, bytes);
      for (size_t s = 0; s < without.size(); ++s) {
        if (without[s]) optimizer::ZeroGrads(access->data(), dtype, bounds[s], bounds[s + 1]);
      }
      break;
    }
    case v1::JOURNAL_USE_ADD:
    case v1::JOURNAL_USE_REPLAY: {
      access = held_.journal->Open(chunk_id);
      if (!access.ok()) {
        return absl::Status(access.status().code(), fmt::format("step {} of job '{}': {}", request.step(),
                                                                identity_.job_name, access.status().message()));
      }
      optimizer::ApplyGradOps(access->data(), dtype, n, ops);
      if (request.journal() == v1::JOURNAL_USE_ADD) {
        for (size_t s = 0; s < without.size(); ++s) {
          if (!without[s]) optimizer::AddGrads(access->data(), slot, dtype, bounds[s], bounds[s + 1]);
        }
      } else {
        changed = !ops.empty();
      }
      break;
    }
    default: return absl::InternalError("PrepareJournal without a journal use");  // CheckJournalUse
  }
  if (absl::Status saved = held_.journal->Save(*access, changed); !saved.ok()) {
    return absl::Status(saved.code(),
                        fmt::format("step {} of job '{}': {}", request.step(), identity_.job_name, saved.message()));
  }
  if (changed) {
    counters_.Bump(Ticker::kJournalBytes, bytes);
    if (access->spilled()) counters_.Bump(Ticker::kJournalSpilledBytes, bytes);
  }
  for (size_t s = 0; s + 1 < bounds.size(); ++s) {
    const optimizer::GradStats stats = optimizer::ComputeGradStats(access->data(), dtype, bounds[s], bounds[s + 1]);
    ready.add_segment_sum_squares(stats.sum_squares);
    ready.add_segment_max_abs(stats.max_abs);
  }
  return access;
}

}  // namespace fuyou
