// Session: the checks of every request, before anything changes. Each returns
// OK or the error the reply carries; a refused request changes nothing.
#include <algorithm>
#include <cmath>
#include <set>

#include "common/status_util.h"
#include "fmt/format.h"
#include "jobs/chunk_segments.h"
#include "session/session.h"

namespace fuyou {
namespace {

std::string HyperProblem(const v1::AdamWHyper& hyper) {
  auto finite = [](float x) { return std::isfinite(x); };
  if (!finite(hyper.lr()) || hyper.lr() < 0) return fmt::format("lr {} is not a finite value >= 0", hyper.lr());
  if (!(hyper.beta1() >= 0 && hyper.beta1() < 1)) return fmt::format("beta1 {} is outside [0, 1)", hyper.beta1());
  if (!(hyper.beta2() >= 0 && hyper.beta2() < 1)) return fmt::format("beta2 {} is outside [0, 1)", hyper.beta2());
  if (!finite(hyper.eps()) || hyper.eps() <= 0) return fmt::format("eps {} is not a finite value > 0", hyper.eps());
  if (!finite(hyper.weight_decay()) || hyper.weight_decay() < 0) {
    return fmt::format("weight_decay {} is not a finite value >= 0", hyper.weight_decay());
  }
  if (!finite(hyper.grad_scale())) return fmt::format("grad_scale {} is not finite", hyper.grad_scale());
  return "";
}

bool IsStateKind(int which) { return which >= v1::STATE_MASTER && which <= v1::STATE_EXP_AVG_SQ; }

}  // namespace

absl::Status Session::NoSegmentError() const {
  return absl::FailedPreconditionError(fmt::format(
      "session {} has no segment yet: send the segment first (a sealed memfd of {} bytes, on the segment socket "
      "that OpenSession named)",
      identity_.id, identity_.layout.TotalBytes()));
}

absl::Status Session::CheckLayoutFingerprint(const v1::ChunkRecord& record, const v1::ChunkSpec& spec) const {
  const uint64_t stored = record.layout_fingerprint();
  const uint64_t sent = spec.layout_fingerprint();
  if (stored == 0 || stored == sent) return absl::OkStatus();  // a stored 0 adopts what is sent
  if (sent == 0) {
    return absl::FailedPreconditionError(fmt::format(
        "chunk {} of job '{}' was created for the parameter layout with fingerprint {:#018x}, but this client sends "
        "no layout fingerprint, so the daemon cannot tell that its parameters (shapes, dtypes, order) are the same; "
        "resume with a client that sends ChunkSpec.layout_fingerprint, or use a new job name",
        record.chunk_id(), identity_.job_name, stored));
  }
  return absl::FailedPreconditionError(fmt::format(
      "chunk {} of job '{}' was created for the parameter layout with fingerprint {:#018x}, but this model registers "
      "fingerprint {:#018x}: the same number of elements, other parameter shapes, dtypes or order, so its states "
      "would land in the wrong parameters; use a new job name or the model the job was created with",
      record.chunk_id(), identity_.job_name, stored, sent));
}

absl::Status Session::CheckStoreWeights(const v1::ChunkRecord& record, const v1::ChunkSpec& spec) const {
  if (record.stores_weights() == spec.store_weights()) return absl::OkStatus();
  return absl::FailedPreconditionError(fmt::format(
      "chunk {} of job '{}' was created {} store_weights, but this registration sends store_weights = {}: whether "
      "the daemon keeps a chunk's working weights is fixed when the chunk is created; register it as it was "
      "created, or use a new job name",
      record.chunk_id(), identity_.job_name, record.stores_weights() ? "with" : "without", spec.store_weights()));
}

absl::Status Session::CheckSlotExists(uint32_t chunk_id, uint32_t slot) const {
  if (slot < identity_.layout.num_slots) return absl::OkStatus();
  return absl::InvalidArgumentError(fmt::format("chunk {}: slot {} does not exist (the session has {} slots)", chunk_id,
                                                slot, identity_.layout.num_slots));
}

absl::Status Session::CheckStepInOrder(std::string_view request, int64_t step) const {
  if (step == step_.current) return absl::OkStatus();
  return absl::FailedPreconditionError(
      fmt::format("{} for step {} is out of order: job '{}' is at committed step {}, so the next step is {}", request,
                  step, identity_.job_name, step_.current - 1, step_.current));
}

absl::Status Session::CheckWaitDurable(int64_t step) const {
  if (step < 0) return absl::InvalidArgumentError(fmt::format("WaitDurable for step {}: a step is >= 0", step));
  if (step <= step_.current - 1) return absl::OkStatus();
  return absl::FailedPreconditionError(
      fmt::format("WaitDurable for step {}: job '{}' is at committed step {}; only a step committed in this session "
                  "(EndStep answered) or before it can be waited for",
                  step, identity_.job_name, step_.current - 1));
}

absl::Status Session::ValidateRegistrationLocked(const v1::RegisterChunksRequest& request) const {
  const SegmentLayout& layout = identity_.layout;
  if (request.chunks().empty()) return absl::InvalidArgumentError("RegisterChunks names no chunk");
  std::set<uint32_t> ids;
  std::set<uint32_t> slots;
  for (const v1::ChunkSpec& spec : request.chunks()) {
    const uint32_t id = spec.chunk_id();
    const auto param_dtype = static_cast<DType>(spec.param_dtype());
    const auto grad_dtype = static_cast<DType>(spec.grad_dtype());
    if (!IsValidDType(param_dtype) || !IsValidDType(grad_dtype)) {
      return absl::InvalidArgumentError(
          fmt::format("chunk {}: param_dtype and grad_dtype must be FLOAT32, BFLOAT16 or FLOAT16", id));
    }
    if (spec.moments_dtype() != v1::DTYPE_UNSPECIFIED && spec.moments_dtype() != v1::DTYPE_FLOAT32 &&
        spec.moments_dtype() != v1::DTYPE_BFLOAT16 && spec.moments_dtype() != v1::DTYPE_BLOCK8) {
      return absl::InvalidArgumentError(fmt::format(
          "chunk {}: moments_dtype {} is not FLOAT32, BFLOAT16 or BLOCK8 (the dtypes the daemon keeps Adam's m and v "
          "in)",
          id,
          static_cast<int>(spec.moments_dtype())));
    }
    if (spec.num_elements() == 0) return absl::InvalidArgumentError(fmt::format("chunk {} has no elements", id));
    FUYOU_RETURN_IF_ERROR(CheckSegmentElements(spec));
    // Cap the element count by the slot before anything is multiplied by it: a
    // division cannot overflow, and the slot is capped by max_segment_bytes.
    const uint64_t widest = std::max(DTypeSize(param_dtype), DTypeSize(grad_dtype));
    if (spec.num_elements() > layout.slot_bytes / widest) {
      return absl::InvalidArgumentError(fmt::format(
          "chunk {} has {} elements of up to {} bytes, more than the {} bytes per slot region of the session hold "
          "({} elements at most); open the session with a larger slot_bytes",
          id, spec.num_elements(), widest, layout.slot_bytes, layout.slot_bytes / widest));
    }
    ChunkLayout chunk_layout{spec.num_elements()};
    if (spec.store_weights()) chunk_layout.weights_dtype = param_dtype;
    chunk_layout.moments_dtype = SpecMomentsDType(spec);
    const std::optional<uint64_t> state_bytes = chunk_layout.ExtentBytes();
    if (!state_bytes || *state_bytes > services_.cache.budget_bytes() / 2) {
      return absl::InvalidArgumentError(fmt::format(
          "chunk {} of {} elements has {} bytes of optimizer states, more than half the daemon's DRAM budget ({} "
          "bytes); use smaller chunks or a larger --dram-budget",
          id, spec.num_elements(),
          state_bytes ? fmt::format("{}", *state_bytes) : std::string("more than 2^64"),
          services_.cache.budget_bytes()));
    }
    if (absl::Status slot = CheckSlotExists(id, spec.slot()); !slot.ok()) return slot;
    if (!ids.insert(id).second) return absl::InvalidArgumentError(fmt::format("chunk {} is listed twice", id));
    if (!slots.insert(spec.slot()).second) {
      return absl::InvalidArgumentError(fmt::format("slot {} is used by two chunks in one request", spec.slot()));
    }
    if (registered_.count(id) != 0) {
      return absl::FailedPreconditionError(fmt::format("chunk {} is already registered in this session", id));
    }
    if (const v1::ChunkRecord* record = held_.store->Find(id)) {
      const uint64_t stored = record->num_elements();
      if (stored != spec.num_elements()) {
        return absl::InvalidArgumentError(fmt::format(
            "chunk {} of job '{}' has {} elements on the daemon but the request says {}; a resumed job must "
            "register the same chunks",
            id, identity_.job_name, stored, spec.num_elements()));
      }
      FUYOU_RETURN_IF_ERROR(CheckLayoutFingerprint(*record, spec));
      FUYOU_RETURN_IF_ERROR(CheckStoreWeights(*record, spec));
      FUYOU_RETURN_IF_ERROR(CheckResumedSegments(identity_.job_name, *record, spec));
    }
  }
  return absl::OkStatus();
}

absl::Status Session::CheckGradReady(const v1::GradReady& request) const {
  const uint32_t chunk_id = request.chunk_id();
  const int64_t step = request.step();
  FUYOU_RETURN_IF_ERROR(CheckStepInOrder("GradReady", step));
  if (registered_.count(chunk_id) == 0) {
    return absl::InvalidArgumentError(
        fmt::format("chunk {} is not registered in this session of job '{}'", chunk_id, identity_.job_name));
  }
  FUYOU_RETURN_IF_ERROR(CheckSlotExists(chunk_id, request.slot()));
  if (!request.has_hyper()) return absl::InvalidArgumentError(fmt::format("chunk {}: hyper is missing", chunk_id));
  if (std::string problem = HyperProblem(request.hyper()); !problem.empty()) {
    return absl::InvalidArgumentError(fmt::format("chunk {}: {}", chunk_id, problem));
  }
  if (!v1::RedoReason_IsValid(request.redo())) {
    return absl::InvalidArgumentError(fmt::format(
        "chunk {}: redo {} is not a RedoReason (REDO_REASON_GRADIENTS_CHANGED or REDO_REASON_CLIPPED, or unset)",
        chunk_id, static_cast<int>(request.redo())));
  }
  // Journal fields first: a REPLAY sent without redo is told so, not that the
  // chunk was already updated.
  FUYOU_RETURN_IF_ERROR(CheckJournalUse(request));
  const bool redo = request.redo() != v1::REDO_REASON_UNSPECIFIED;
  if (!redo && held_.store->IsStaged(chunk_id)) {
    return absl::FailedPreconditionError(fmt::format(
        "chunk {} was already updated in step {}; each chunk is sent once per step (to replace its update, send "
        "it again with GradReady.redo set)",
        chunk_id, step));
  }
  if (redo && !held_.store->IsStaged(chunk_id)) {
    return absl::FailedPreconditionError(fmt::format(
        "chunk {}: a redo ({}) replaces the chunk's update of step {}, but the chunk has not been updated in this "
        "step; send it without redo",
        chunk_id, v1::RedoReason_Name(request.redo()), step));
  }
  if (held_.store->pending_imports() != 0) {
    return absl::FailedPreconditionError(
        fmt::format("job '{}' has an import of {} chunks not yet committed; send CommitImport before the next step",
                    identity_.job_name, held_.store->pending_imports()));
  }
  if (absl::Status failed = step_.failed_redo.ok() ? held_.store->StepError() : step_.failed_redo; !failed.ok()) {
    return absl::Status(failed.code(), fmt::format("step {} already failed: {}", step, failed.message()));
  }
  // update_count <= kMaxUpdateCount (SetUpdateCount and ValidateManifest), so t
  // is computed without overflow; a chunk at the maximum takes no more updates.
  const v1::ChunkRecord& record = *held_.store->Find(chunk_id);
  if (record.update_count() < 0 || record.update_count() >= kMaxUpdateCount) {
    return absl::FailedPreconditionError(
        fmt::format("chunk {} of job '{}' has {} updates, the most a chunk may count ({}); it takes no further update",
                    chunk_id, identity_.job_name, record.update_count(), kMaxUpdateCount));
  }
  return CheckSegmentsWithoutGrad(request, SegmentCount(record));
}

absl::Status Session::CheckJournalUse(const v1::GradReady& request) const {
  const uint32_t chunk_id = request.chunk_id();
  const int64_t step = request.step();
  if (!v1::JournalUse_IsValid(request.journal())) {
    return absl::InvalidArgumentError(fmt::format(
        "chunk {} of job '{}', step {}: journal {} is not a JournalUse (JOURNAL_USE_KEEP, _ADD, _REPLAY, or unset)",
        chunk_id, identity_.job_name, step, static_cast<int>(request.journal())));
  }
  const bool from_journal =
      request.journal() == v1::JOURNAL_USE_ADD || request.journal() == v1::JOURNAL_USE_REPLAY;
  if (!request.grad_ops().empty() && !from_journal) {
    return absl::InvalidArgumentError(fmt::format(
        "chunk {} of job '{}', step {}: grad_ops ({}) apply to a journal and are allowed only with "
        "JOURNAL_USE_REPLAY or JOURNAL_USE_ADD, not with {}",
        chunk_id, identity_.job_name, step, request.grad_ops_size(), v1::JournalUse_Name(request.journal())));
  }
  if (request.grad_ops_size() > kMaxGradOps) {
    return absl::InvalidArgumentError(
        fmt::format("chunk {} of job '{}', step {}: {} grad_ops, more than the {} allowed", chunk_id,
                    identity_.job_name, step, request.grad_ops_size(), kMaxGradOps));
  }
  for (int i = 0; i < request.grad_ops_size(); ++i) {
    const v1::GradOp& op = request.grad_ops(i);
    if (op.kind() != v1::GradOp::KIND_MUL && op.kind() != v1::GradOp::KIND_DIV) {
      return absl::InvalidArgumentError(
          fmt::format("chunk {} of job '{}', step {}: grad_ops[{}] has kind {}, not KIND_MUL or KIND_DIV", chunk_id,
                      identity_.job_name, step, i, static_cast<int>(op.kind())));
    }
  }
  if (!from_journal) return absl::OkStatus();
  if (request.redo() == v1::REDO_REASON_UNSPECIFIED) {
    return absl::InvalidArgumentError(fmt::format(
        "chunk {} of job '{}', step {}: {} updates again from the chunk's journal and must be sent as a redo "
        "(GradReady.redo set)",
        chunk_id, identity_.job_name, step, v1::JournalUse_Name(request.journal())));
  }
  if (!held_.journal->Has(chunk_id)) {
    return absl::FailedPreconditionError(fmt::format(
        "chunk {} of job '{}' has no gradient journal in step {}, so {} has nothing to update from: a journal is "
        "written by a GradReady with JOURNAL_USE_KEEP and kept only until the step ends (EndStep, AbortStep)",
        chunk_id, identity_.job_name, step, v1::JournalUse_Name(request.journal())));
  }
  return absl::OkStatus();
}

absl::Status Session::CheckStateRequest(uint32_t chunk_id, int which, uint32_t slot, uint64_t first, uint64_t count,
                                        const char* verb) const {
  auto registered = registered_.find(chunk_id);
  if (registered == registered_.end()) {
    return absl::InvalidArgumentError(
        fmt::format("{}: chunk {} is not registered in this session of job '{}'", verb, chunk_id, identity_.job_name));
  }
  if (!IsStateKind(which)) {
    return absl::InvalidArgumentError(fmt::format(
        "{}: chunk {}: state {} is not STATE_MASTER, STATE_EXP_AVG or STATE_EXP_AVG_SQ", verb, chunk_id, which));
  }
  if (absl::Status exists = CheckSlotExists(chunk_id, slot); !exists.ok()) {
    return absl::InvalidArgumentError(fmt::format("{}: {}", verb, exists.message()));
  }
  const uint64_t n = registered->second.num_elements;
  // Compared without adding or multiplying client values: nothing can wrap.
  if (count == 0 || first > n || count > n - first) {
    return absl::InvalidArgumentError(fmt::format(
        "{}: chunk {}: {} elements from element {} are not a non-empty range of the chunk's {} elements", verb,
        chunk_id, count, first, n));
  }
  if (count > identity_.layout.slot_bytes / sizeof(float)) {
    return absl::InvalidArgumentError(
        fmt::format("{}: chunk {}: {} fp32 values are more than the session's slots of {} bytes hold ({})", verb,
                    chunk_id, count, identity_.layout.slot_bytes, identity_.layout.slot_bytes / sizeof(float)));
  }
  if (held_.store->staged_count() != 0) {
    return absl::FailedPreconditionError(fmt::format(
        "{}: chunk {}: step {} of job '{}' has {} chunk updates in flight; states are read and written only "
        "between steps (after EndStep or AbortStep)",
        verb, chunk_id, step_.current, identity_.job_name, held_.store->staged_count()));
  }
  return absl::OkStatus();
}

absl::Status Session::CheckFetchWeights(const v1::FetchWeights& request) const {
  const uint32_t chunk_id = request.chunk_id();
  const uint32_t slot = request.slot();
  auto registered = registered_.find(chunk_id);
  if (registered == registered_.end()) {
    return absl::InvalidArgumentError(fmt::format(
        "FetchWeights: chunk {} (into slot {}) is not registered in this session of job '{}'; register it with "
        "store_weights first",
        chunk_id, slot, identity_.job_name));
  }
  if (absl::Status exists = CheckSlotExists(chunk_id, slot); !exists.ok()) {
    return absl::InvalidArgumentError(fmt::format("FetchWeights: {}", exists.message()));
  }
  if (!registered->second.store_weights) {
    return absl::FailedPreconditionError(fmt::format(
        "FetchWeights: chunk {} of job '{}' (into slot {}) was registered without store_weights, so the daemon "
        "keeps no working weights for it; a chunk that streams its weights is created with "
        "ChunkSpec.store_weights (in a new job, since a chunk keeps what it was created with)",
        chunk_id, identity_.job_name, slot));
  }
  // The weights fit the slot's region: registration checked num_elements times
  // the wider of param_dtype and grad_dtype against slot_bytes.
  return absl::OkStatus();
}

}  // namespace fuyou
