#include "session/session.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <optional>
#include <set>

#include "common/crash_point.h"
#include "common/log.h"
#include "common/status_util.h"
#include "common/trace.h"
#include "fmt/format.h"
#include "fuyou/checked_math.h"
#include "jobs/job_registry.h"
#include "optimizer/adamw_kernel.h"
#include "session/stream_replies.h"
#include "stats/daemon_stats.h"

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

}  // namespace

uint64_t Session::PayloadChecksum(const CacheEntry& entry, uint64_t num_elements) {
  return ChunkPayloadChecksum(entry.buffer.data(), num_elements);
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
        record.chunk_id(), job_name_, stored));
  }
  return absl::FailedPreconditionError(fmt::format(
      "chunk {} of job '{}' was created for the parameter layout with fingerprint {:#018x}, but this model registers "
      "fingerprint {:#018x}: the same number of elements, other parameter shapes, dtypes or order, so its states "
      "would land in the wrong parameters; use a new job name or the model the job was created with",
      record.chunk_id(), job_name_, stored, sent));
}

Session::Session(SessionServices services, std::string id, std::shared_ptr<Job> job, SegmentLayout layout,
                 ClientIdentity client, std::string client_info)
    : services_(services),
      id_(std::move(id)),
      job_name_(job->name()),
      job_key_(job->key()),
      client_(client),
      client_info_(std::move(client_info)),
      opened_(std::chrono::steady_clock::now()),
      layout_(layout),
      user_stats_(services.stats.ForUser(client.uid)),
      job_(std::move(job)) {
  step_ = job_->manifest().committed_step() + 1;
  // Until a step has been seen, expect backward order: the reverse of registration.
  for (auto it = job_->manifest().chunks().rbegin(); it != job_->manifest().chunks().rend(); ++it) {
    order_.push_back(it->chunk_id());
  }
}

Session::~Session() { Close(); }

int64_t Session::committed_step() const {
  std::lock_guard lock(mutex_);
  return step_ - 1;
}

uint32_t Session::existing_chunks() const {
  std::lock_guard lock(mutex_);
  return job_ ? static_cast<uint32_t>(job_->manifest().chunks_size()) : 0;
}

absl::Status Session::AdoptSegment(std::unique_ptr<SessionSegment> segment) {
  std::lock_guard lock(mutex_);
  if (closed_) return absl::FailedPreconditionError(fmt::format("session {} is closed", id_));
  if (segment_) {
    return absl::FailedPreconditionError(
        fmt::format("session {} already has its segment; a segment is handed over once per session", id_));
  }
  if (segment->layout().num_slots != layout_.num_slots || segment->layout().slot_bytes != layout_.slot_bytes) {
    return absl::InternalError(fmt::format("session {}: the segment's layout is not the session's", id_));
  }
  segment_ = std::move(segment);
  has_segment_.store(true, std::memory_order_release);
  return absl::OkStatus();
}

absl::Status Session::Attach() {
  std::lock_guard lock(mutex_);
  if (closed_) return absl::FailedPreconditionError(fmt::format("session {} is closed", id_));
  if (!segment_) return NoSegmentError();
  if (attached_) return absl::FailedPreconditionError(fmt::format("session {} already has a stream attached", id_));
  attached_ = true;
  return absl::OkStatus();
}

absl::Status Session::NoSegmentError() const {
  return absl::FailedPreconditionError(fmt::format(
      "session {} has no segment yet: send the segment first (a sealed memfd of {} bytes, on the segment socket "
      "that OpenSession named)",
      id_, layout_.TotalBytes()));
}

bool Session::attached() const {
  std::lock_guard lock(mutex_);
  return attached_;
}

bool Session::closed() const {
  std::lock_guard lock(mutex_);
  return closed_;
}

void Session::WaitForIo() {
  std::unique_lock lock(io_mutex_);
  io_done_.wait(lock, [&] { return inflight_io_ == 0; });
}

absl::Status Session::StepError() const {
  std::lock_guard lock(io_mutex_);
  return write_error_;
}

int64_t Session::Close() {
  std::lock_guard lock(mutex_);
  if (closed_) return step_ - 1;
  closed_ = true;
  FUYOU_CRASH_POINT("session_close");
  WaitForIo();
  if (!updated_.empty()) {
    log::Info("session {} of job '{}' ended in step {}: {} chunk updates rolled back to step {}", id_, job_name_,
              step_, updated_.size(), step_ - 1);
  }
  RollBackStepLocked();
  if (!imported_.empty()) {
    log::Info("session {} of job '{}' ended with an import of {} chunks not committed: dropped", id_, job_name_,
              imported_.size());
  }
  DropImportLocked();
  services_.cache.Demote(job_key_);  // kept for a quick resume, evicted first
  segment_.reset();
  services_.jobs.Release(*job_);
  job_.reset();
  return step_ - 1;
}

void Session::RollBackStepLocked() {
  for (const auto& [chunk_id, updated] : updated_) services_.cache.Drop(job_key_, chunk_id);
  updated_.clear();
  arrivals_.clear();
  std::lock_guard lock(io_mutex_);
  write_error_ = absl::OkStatus();
}

absl::Status Session::VerifyChecksum(const CacheEntry& entry, uint32_t chunk_id, uint64_t num_elements,
                                     const v1::StateExtent& extent) const {
  if (PayloadChecksum(entry, num_elements) == extent.checksum()) return absl::OkStatus();
  return absl::DataLossError(fmt::format(
      "job '{}' chunk {}: the states read from {} at offset {} fail their checksum; the extent is corrupt and "
      "nothing was returned from it",
      job_name_, chunk_id, job_->states().path().string(), extent.offset()));
}

absl::StatusOr<CacheEntryPtr> Session::AcquireStates(const v1::ChunkRecord& record) {
  const uint32_t version = record.committed_version();
  if (CacheEntryPtr entry = services_.cache.Pin(job_key_, record.chunk_id())) {
    if (entry->load_status.ok() && entry->version == version && !entry->uncommitted) {
      services_.stats.cache_hits.fetch_add(1, std::memory_order_relaxed);
      user_stats_.cache_hits.fetch_add(1, std::memory_order_relaxed);
      return entry;
    }
    services_.cache.Unpin(entry);
    services_.cache.Drop(job_key_, record.chunk_id());
  }
  services_.stats.cache_misses.fetch_add(1, std::memory_order_relaxed);
  user_stats_.cache_misses.fetch_add(1, std::memory_order_relaxed);
  const v1::StateExtent& extent = record.extents(static_cast<int>(version));
  auto created = services_.cache.Create(job_key_, record.chunk_id(), extent.length(), /*wait=*/true);
  if (!created.ok()) return created.status();
  CacheEntryPtr entry = std::move(*created);
  entry->version = version;
  const int64_t read_start = trace::NowUs();
  absl::Status status = job_->states().Read(extent.offset(), entry->buffer.span().first(extent.length()));
  trace::Record("ssd_read", record.chunk_id(), read_start, trace::NowUs());
  if (status.ok()) user_stats_.bytes_read.fetch_add(extent.length(), std::memory_order_relaxed);
  if (!status.ok()) {
    status = absl::Status(status.code(), fmt::format("job '{}' chunk {}: cannot read its committed states: {}",
                                                     job_name_, record.chunk_id(), status.message()));
  } else {
    status = VerifyChecksum(*entry, record.chunk_id(), record.num_elements(), extent);
  }
  if (!status.ok()) {
    services_.cache.FinishLoad(entry, status);
    services_.cache.Unpin(entry);
    return status;
  }
  return entry;
}

void Session::Prefetch(const v1::ChunkRecord& record) {
  if (services_.cache.Contains(job_key_, record.chunk_id())) return;
  const uint32_t version = record.committed_version();
  const v1::StateExtent& extent = record.extents(static_cast<int>(version));
  auto created = services_.cache.Create(job_key_, record.chunk_id(), extent.length(), /*wait=*/false,
                                        /*loading=*/true);
  if (!created.ok()) return;  // no budget free now: the update will read on demand
  CacheEntryPtr entry = std::move(*created);
  entry->version = version;
  {
    std::lock_guard lock(io_mutex_);
    ++inflight_io_;
  }
  // By value: a commit may replace the manifest `record` lives in meanwhile.
  const uint64_t num_elements = record.num_elements();
  job_->states()
      .ReadAsync(extent.offset(), entry->buffer.span().first(extent.length()),
                 [this, entry, num_elements, extent, chunk_id = record.chunk_id(),
                  read_start = trace::NowUs()](absl::Status status) {
                   trace::Record("ssd_read", chunk_id, read_start, trace::NowUs());
                   if (status.ok()) user_stats_.bytes_read.fetch_add(extent.length(), std::memory_order_relaxed);
                   if (status.ok()) status = VerifyChecksum(*entry, chunk_id, num_elements, extent);
                   services_.cache.FinishLoad(entry, status);
                   services_.cache.Unpin(entry);
                   std::lock_guard lock(io_mutex_);
                   --inflight_io_;
                   io_done_.notify_all();
                 });
}

void Session::PrefetchAfter(size_t position) {
  for (size_t i = position; i < order_.size() && i < position + services_.prefetch_window; ++i) {
    int index = job_->FindChunk(order_[i]);
    if (index < 0 || updated_.count(order_[i]) != 0) continue;
    Prefetch(job_->manifest().chunks(index));
  }
}

absl::Status Session::ValidateRegistrationLocked(const v1::RegisterChunksRequest& request) const {
  const SegmentLayout& layout = layout_;
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
    if (spec.num_elements() == 0) return absl::InvalidArgumentError(fmt::format("chunk {} has no elements", id));
    // Cap the element count by the slot before anything is multiplied by it: a
    // division cannot overflow, and the slot is capped by max_segment_bytes.
    const uint64_t widest = std::max(DTypeSize(param_dtype), DTypeSize(grad_dtype));
    if (spec.num_elements() > layout.slot_bytes / widest) {
      return absl::InvalidArgumentError(fmt::format(
          "chunk {} has {} elements of up to {} bytes, more than the {} bytes per slot region of the session hold "
          "({} elements at most); open the session with a larger slot_bytes",
          id, spec.num_elements(), widest, layout.slot_bytes, layout.slot_bytes / widest));
    }
    const std::optional<uint64_t> state_bytes = ChunkStateBytes(spec.num_elements());
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
    if (int index = job_->FindChunk(id); index >= 0) {
      const v1::ChunkRecord& record = job_->manifest().chunks(index);
      const uint64_t stored = record.num_elements();
      if (stored != spec.num_elements()) {
        return absl::InvalidArgumentError(fmt::format(
            "chunk {} of job '{}' has {} elements on the daemon but the request says {}; a resumed job must "
            "register the same chunks",
            id, job_name_, stored, spec.num_elements()));
      }
      FUYOU_RETURN_IF_ERROR(CheckLayoutFingerprint(record, spec));
    }
  }
  return absl::OkStatus();
}

absl::StatusOr<v1::RegisterChunksResponse> Session::RegisterChunks(const v1::RegisterChunksRequest& request) {
  std::lock_guard lock(mutex_);
  if (closed_) return absl::FailedPreconditionError(fmt::format("session {} is closed", id_));
  if (!broken_.ok()) return broken_;
  if (!segment_) return NoSegmentError();
  // Validate everything before changing anything.
  FUYOU_RETURN_IF_ERROR(ValidateRegistrationLocked(request));

  // Reserve the extents of every new chunk before writing anything: a job that
  // does not fit (the per-job quota, or the storage paths) is refused with nothing
  // written and nothing committed.
  v1::JobManifest next = job_->manifest();
  bool manifest_changed = false;
  std::map<uint32_t, int> new_chunks;  // chunk id -> index in next.chunks()
  // Each chunk's states are below half the DRAM budget (validated); the sums
  // are checked all the same.
  std::optional<uint64_t> new_bytes = 0;
  for (const v1::ChunkSpec& spec : request.chunks()) {
    if (job_->FindChunk(spec.chunk_id()) < 0) {
      new_bytes = CheckedAdd(new_bytes, CheckedMul(ChunkStateBytes(spec.num_elements()), 2));
    }
  }
  if (!new_bytes) {
    return absl::InvalidArgumentError(fmt::format(
        "job '{}': the chunks of this request need more than 2^64 bytes of states; nothing was written", job_name_));
  }
  if (const uint64_t quota = services_.job_quota_bytes; quota != 0 && *new_bytes != 0) {
    const std::optional<uint64_t> needed = CheckedAdd(job_->bytes_on_storage(), *new_bytes);
    if (!needed || *needed > quota) {
      return absl::ResourceExhaustedError(fmt::format(
          "job '{}' needs {} bytes on storage, over the per-job quota of {} ({} bytes already reserved, {} more for "
          "the chunks of this request); nothing was written. Use fewer or smaller chunks, or raise [storage] "
          "job_quota / --job-quota",
          job_name_, needed ? fmt::format("{}", *needed) : std::string("more than 2^64"), quota,
          job_->bytes_on_storage(), *new_bytes));
    }
  }
  for (const v1::ChunkSpec& spec : request.chunks()) {
    if (job_->FindChunk(spec.chunk_id()) >= 0) continue;
    FUYOU_RETURN_IF_ERROR(job_->AddChunk(next, spec.chunk_id(), spec.num_elements(),
                                         static_cast<DType>(spec.param_dtype()),
                                         static_cast<DType>(spec.grad_dtype())));
    next.mutable_chunks(next.chunks_size() - 1)->set_layout_fingerprint(spec.layout_fingerprint());
    new_chunks[spec.chunk_id()] = next.chunks_size() - 1;
    manifest_changed = true;
  }
  if (!new_chunks.empty()) FUYOU_CRASH_POINT("registration_reserved");
  // On failure, forget the states of new chunks: the manifest never named them.
  std::vector<uint32_t> cached_new;
  auto fail = [&](absl::Status status) {
    for (uint32_t id : cached_new) services_.cache.Drop(job_key_, id);
    job_->GiveBackUncommitted();  // the reservations of this request, unless committed
    return status;
  };

  v1::RegisterChunksResponse response;
  for (const v1::ChunkSpec& spec : request.chunks()) {
    const uint32_t id = spec.chunk_id();
    const auto param_dtype = static_cast<DType>(spec.param_dtype());
    std::span<std::byte> weights = segment_->ParamRegion(spec.slot());
    v1::RegisteredChunk* result = response.add_chunks();
    result->set_chunk_id(id);
    if (new_chunks.count(id) == 0) {
      const int index = job_->FindChunk(id);
      const v1::ChunkRecord& record = job_->manifest().chunks(index);
      auto entry = AcquireStates(record);
      if (!entry.ok()) return fail(entry.status());
      optimizer::ConvertFromFloat32(reinterpret_cast<const float*>((*entry)->buffer.data()), weights.data(),
                                    param_dtype, record.num_elements());
      services_.cache.Unpin(*entry);
      result->set_resumed(true);
      result->set_update_count(record.update_count());
      v1::ChunkRecord* next_record = next.mutable_chunks(index);
      if (next_record->param_dtype() != spec.param_dtype() || next_record->grad_dtype() != spec.grad_dtype()) {
        next_record->set_param_dtype(spec.param_dtype());
        next_record->set_grad_dtype(spec.grad_dtype());
        manifest_changed = true;
      }
      if (next_record->layout_fingerprint() == 0 && spec.layout_fingerprint() != 0) {
        next_record->set_layout_fingerprint(spec.layout_fingerprint());  // adopted (CheckLayoutFingerprint)
        manifest_changed = true;
      }
      continue;
    }
    v1::ChunkRecord* record = next.mutable_chunks(new_chunks[id]);
    v1::StateExtent* extent = record->mutable_extents(0);
    auto created = services_.cache.Create(job_key_, id, extent->length(), /*wait=*/true);
    if (!created.ok()) return fail(created.status());
    cached_new.push_back(id);
    CacheEntryPtr entry = std::move(*created);
    const uint64_t n = spec.num_elements();
    auto* master = reinterpret_cast<float*>(entry->buffer.data());
    optimizer::ConvertToFloat32(weights.data(), param_dtype, master, n);
    std::memset(master + n, 0, entry->buffer.size() - 4 * n);  // m, v and the padding
    extent->set_checksum(PayloadChecksum(*entry, n));
    entry->version = 0;
    absl::Status written = job_->states().Write(extent->offset(), entry->buffer.span().first(extent->length()));
    if (written.ok()) user_stats_.bytes_written.fetch_add(extent->length(), std::memory_order_relaxed);
    services_.cache.Unpin(entry);
    if (!written.ok()) {
      return fail(absl::Status(written.code(),
                               fmt::format("job '{}': cannot write the initial states of chunk {}: {}; nothing of "
                                           "this registration was committed",
                                           job_name_, id, written.message())));
    }
    result->set_resumed(false);
    result->set_update_count(0);
  }
  if (!new_chunks.empty()) FUYOU_CRASH_POINT("registration_states_written");
  if (manifest_changed) {
    if (absl::Status committed = CommitJobLocked(std::move(next)); !committed.ok()) return fail(committed);
  }
  if (!new_chunks.empty()) FUYOU_CRASH_POINT("registration_committed");
  for (const v1::ChunkSpec& spec : request.chunks()) {
    registered_[spec.chunk_id()] = RegisteredChunk{spec.num_elements(), static_cast<DType>(spec.param_dtype()),
                                                   static_cast<DType>(spec.grad_dtype())};
    if (std::find(order_.begin(), order_.end(), spec.chunk_id()) == order_.end()) {
      order_.insert(order_.begin(), spec.chunk_id());  // newest registered: first in backward
    }
  }
  return response;
}

absl::Status Session::CommitJobLocked(v1::JobManifest next) {
  absl::Status committed = job_->Commit(std::move(next));
  if (absl::IsAborted(committed)) {
    log::Error("session {}: {}", id_, committed.message());
    broken_ = committed;
  }
  return committed;
}

v1::DaemonMessage Session::Handle(const v1::ClientMessage& message) {
  std::lock_guard lock(mutex_);
  if (closed_) return ErrorReply(absl::FailedPreconditionError(fmt::format("session {} is closed", id_)), {}, {});
  if (!broken_.ok()) return ErrorReply(broken_, {}, {});
  if (!segment_) return ErrorReply(NoSegmentError(), {}, {});  // streams attach only with a segment
  switch (message.kind_case()) {
    case v1::ClientMessage::kGradReady: return OnGradReady(message.grad_ready());
    case v1::ClientMessage::kEndStep: return OnEndStep(message.end_step());
    case v1::ClientMessage::kAbortStep: return OnAbortStep(message.abort_step());
    case v1::ClientMessage::kReadState: return OnReadState(message.read_state());
    case v1::ClientMessage::kWriteState: return OnWriteState(message.write_state());
    case v1::ClientMessage::kSetUpdateCount: return OnSetUpdateCount(message.set_update_count());
    case v1::ClientMessage::kCommitImport: return OnCommitImport();
    case v1::ClientMessage::kAttach:
      return ErrorReply(absl::FailedPreconditionError("the stream is already attached; Attach is sent once"), {}, {});
    default:
      return ErrorReply(absl::InvalidArgumentError("malformed message: ClientMessage has no kind set"), {}, {});
  }
}

absl::Status Session::CheckSlotExists(uint32_t chunk_id, uint32_t slot) const {
  if (slot < layout_.num_slots) return absl::OkStatus();
  return absl::InvalidArgumentError(
      fmt::format("chunk {}: slot {} does not exist (the session has {} slots)", chunk_id, slot, layout_.num_slots));
}

absl::Status Session::CheckStepInOrder(std::string_view request, int64_t step) const {
  if (step == step_) return absl::OkStatus();
  return absl::FailedPreconditionError(
      fmt::format("{} for step {} is out of order: job '{}' is at committed step {}, so the next step is {}", request,
                  step, job_name_, step_ - 1, step_));
}

v1::DaemonMessage Session::OnGradReady(const v1::GradReady& request) {
  const uint32_t chunk_id = request.chunk_id();
  const int64_t step = request.step();
  auto refuse = [&](const absl::Status& status) { return ErrorReply(status, chunk_id, step); };
  if (absl::Status in_order = CheckStepInOrder("GradReady", step); !in_order.ok()) return refuse(in_order);
  auto registered = registered_.find(chunk_id);
  if (registered == registered_.end()) {
    return refuse(absl::InvalidArgumentError(
        fmt::format("chunk {} is not registered in this session of job '{}'", chunk_id, job_name_)));
  }
  if (absl::Status slot = CheckSlotExists(chunk_id, request.slot()); !slot.ok()) return refuse(slot);
  if (!request.has_hyper()) return refuse(absl::InvalidArgumentError(fmt::format("chunk {}: hyper is missing", chunk_id)));
  if (std::string problem = HyperProblem(request.hyper()); !problem.empty()) {
    return refuse(absl::InvalidArgumentError(fmt::format("chunk {}: {}", chunk_id, problem)));
  }
  if (updated_.count(chunk_id) != 0) {
    return refuse(absl::FailedPreconditionError(
        fmt::format("chunk {} was already updated in step {}; each chunk is sent once per step", chunk_id, step)));
  }
  if (!imported_.empty()) {
    return refuse(absl::FailedPreconditionError(fmt::format(
        "job '{}' has an import of {} chunks not yet committed; send CommitImport before the next step", job_name_,
        imported_.size())));
  }
  if (absl::Status failed = StepError(); !failed.ok()) {
    return refuse(absl::Status(failed.code(), fmt::format("step {} already failed: {}", step, failed.message())));
  }
  const v1::ChunkRecord& record = job_->manifest().chunks(job_->FindChunk(chunk_id));
  // update_count <= kMaxUpdateCount (SetUpdateCount and ValidateManifest), so t
  // is computed without overflow; a chunk at the maximum takes no more updates.
  if (record.update_count() < 0 || record.update_count() >= kMaxUpdateCount) {
    return refuse(absl::FailedPreconditionError(fmt::format(
        "chunk {} of job '{}' has {} updates, the most a chunk may count ({}); it takes no further update",
        chunk_id, job_name_, record.update_count(), kMaxUpdateCount)));
  }
  FUYOU_CRASH_POINT("grad_received");
  auto acquired = AcquireStates(record);
  if (!acquired.ok()) return refuse(acquired.status());
  CacheEntryPtr entry = std::move(*acquired);

  const uint64_t n = record.num_elements();
  const v1::AdamWHyper& hyper = request.hyper();
  optimizer::AdamWStepParams params;
  params.lr = hyper.lr();
  params.beta1 = hyper.beta1();
  params.beta2 = hyper.beta2();
  params.eps = hyper.eps();
  params.weight_decay = hyper.weight_decay();
  params.grad_scale = hyper.grad_scale() == 0 ? 1.0f : hyper.grad_scale();
  params.step = record.update_count() + 1;
  auto* master = reinterpret_cast<float*>(entry->buffer.data());
  optimizer::AdamWBuffers buffers;
  buffers.master = master;
  buffers.exp_avg = master + n;
  buffers.exp_avg_sq = master + 2 * n;
  buffers.grad = segment_->GradRegion(request.slot()).data();
  buffers.grad_dtype = registered->second.grad_dtype;
  buffers.weights_out = segment_->ParamRegion(request.slot()).data();
  buffers.weight_dtype = registered->second.param_dtype;
  buffers.n = n;
  const int64_t update_start = trace::NowUs();
  services_.kernel.Update(params, buffers);
  trace::Record("update", chunk_id, update_start, trace::NowUs());
  services_.stats.chunk_updates.fetch_add(1, std::memory_order_relaxed);
  services_.stats.params_updated.fetch_add(n, std::memory_order_relaxed);
  user_stats_.chunk_updates.fetch_add(1, std::memory_order_relaxed);
  user_stats_.params_updated.fetch_add(n, std::memory_order_relaxed);
  FUYOU_CRASH_POINT("after_kernel");

  // Write the new states to the shadow extent; the committed one stays intact.
  const uint32_t new_version = 1 - record.committed_version();
  entry->version = new_version;
  entry->uncommitted = true;
  // The checksum is computed when the write completes (the bytes stay pinned until
  // then), so ParamsReady does not wait for a pass over 12 bytes a parameter.
  auto checksum = std::make_shared<uint64_t>(0);
  updated_[chunk_id] = UpdatedChunk{entry, new_version, checksum};
  arrivals_.push_back(chunk_id);
  const v1::StateExtent& extent = record.extents(static_cast<int>(new_version));
  {
    std::lock_guard io_lock(io_mutex_);
    ++inflight_io_;
  }
  job_->states()
      .WriteAsync(extent.offset(), entry->buffer.span().first(extent.length()),
                  [this, entry, chunk_id, n, checksum, length = extent.length(),
                   write_start = trace::NowUs()](absl::Status status) {
                    trace::Record("ssd_write", chunk_id, write_start, trace::NowUs());
                    if (status.ok()) *checksum = PayloadChecksum(*entry, n);
                    if (status.ok()) user_stats_.bytes_written.fetch_add(length, std::memory_order_relaxed);
                    FUYOU_CRASH_POINT("writeback_completed");
                    services_.cache.Unpin(entry);
                    std::lock_guard io_lock(io_mutex_);
                    if (!status.ok() && write_error_.ok()) {
                      write_error_ = absl::Status(
                          status.code(), fmt::format("job '{}': write-back of chunk {} failed: {}", job_name_,
                                                     chunk_id, status.message()));
                    }
                    --inflight_io_;
                    io_done_.notify_all();
                  });
  FUYOU_CRASH_POINT("writeback_submitted");

  // Read ahead: the chunks that followed this one in the last step.
  auto position = std::find(order_.begin(), order_.end(), chunk_id);
  if (position != order_.end()) PrefetchAfter(static_cast<size_t>(position - order_.begin()) + 1);

  v1::DaemonMessage reply;
  v1::ParamsReady* ready = reply.mutable_params_ready();
  ready->set_step(step);
  ready->set_chunk_id(chunk_id);
  ready->set_slot(request.slot());
  return reply;
}

v1::DaemonMessage Session::OnEndStep(const v1::EndStep& request) {
  const int64_t step = request.step();
  if (absl::Status in_order = CheckStepInOrder("EndStep", step); !in_order.ok()) return ErrorReply(in_order, {}, step);
  FUYOU_CRASH_POINT("end_step_received");
  WaitForIo();
  if (absl::Status failed = StepError(); !failed.ok()) {
    RollBackStepLocked();
    return ErrorReply(absl::Status(failed.code(), fmt::format("step {} was rolled back to step {}: {}", step, step - 1,
                                                              failed.message())),
                      {}, step);
  }
  v1::JobManifest next = job_->manifest();
  for (const auto& [chunk_id, updated] : updated_) {
    v1::ChunkRecord* record = next.mutable_chunks(job_->FindChunk(chunk_id));
    record->set_update_count(record->update_count() + 1);
    record->set_committed_version(updated.new_version);
    record->mutable_extents(static_cast<int>(updated.new_version))->set_checksum(*updated.checksum);
  }
  next.set_committed_step(step);
  if (absl::Status committed = CommitJobLocked(std::move(next)); !committed.ok()) {
    RollBackStepLocked();
    return ErrorReply(absl::Status(committed.code(), fmt::format("step {} could not commit and was rolled back: {}",
                                                                 step, committed.message())),
                      {}, step);
  }
  for (const auto& [chunk_id, updated] : updated_) services_.cache.MarkCommitted(updated.entry);
  services_.stats.steps_committed.fetch_add(1, std::memory_order_relaxed);
  user_stats_.steps_committed.fetch_add(1, std::memory_order_relaxed);
  const auto chunks_updated = static_cast<uint32_t>(updated_.size());
  // Next step's prediction: this step's arrivals, then chunks that did not come.
  std::vector<uint32_t> order = arrivals_;
  for (uint32_t chunk_id : order_) {
    if (updated_.count(chunk_id) == 0) order.push_back(chunk_id);
  }
  order_ = std::move(order);
  updated_.clear();
  arrivals_.clear();
  ++step_;
  PrefetchAfter(0);

  v1::DaemonMessage reply;
  reply.mutable_step_committed()->set_step(step);
  reply.mutable_step_committed()->set_chunks_updated(chunks_updated);
  return reply;
}

v1::DaemonMessage Session::OnAbortStep(const v1::AbortStep& request) {
  const int64_t step = request.step();
  if (absl::Status in_order = CheckStepInOrder("AbortStep", step); !in_order.ok()) {
    return ErrorReply(in_order, {}, step);
  }
  FUYOU_CRASH_POINT("abort_step_received");
  WaitForIo();
  RollBackStepLocked();
  v1::DaemonMessage reply;
  reply.mutable_step_aborted()->set_step(step);
  return reply;
}

v1::SessionInfo Session::Info() const {
  std::lock_guard lock(mutex_);
  v1::SessionInfo info;
  info.set_session_id(id_);
  info.set_job(job_name_);
  info.set_uid(client_.uid);
  info.set_pid(client_.pid);
  info.set_client_info(client_info_);
  info.set_chunks(static_cast<uint32_t>(registered_.size()));
  info.set_committed_step(step_ - 1);
  info.set_segment_bytes(layout_.TotalBytes());
  info.set_age_seconds(std::chrono::duration<double>(std::chrono::steady_clock::now() - opened_).count());
  return info;
}

}  // namespace fuyou
