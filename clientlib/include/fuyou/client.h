// clientlib: the C++ client side of the fuyou offload protocol.
//
// One Session trains one job on one fuyoud. Typical use:
//
//   auto session = fuyou::Session::Open({.job = "gpt-ft", .num_slots = 4,
//                                        .slot_bytes = max_chunk_bytes});
//   session->RegisterChunk(spec, weights);          // weights are in/out
//   for (step = committed + 1; ...; ++step) {
//     for (chunk in backward order) session->PushGradients(chunk, step, hyper, grads);
//     for (chunk) session->PullParams(chunk, weights);
//     session->EndStep(step);
//   }
//   session->Close();
//
// Every call has a deadline (ClientOptions::rpc_timeout, or the one it is given):
// a daemon that is down, a broken connection, a refused request and a bad argument
// each come back as a Status with a message, never as a hang or an exception.
// A Session is safe to use from several threads.
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "fuyou/dtype.h"

namespace fuyou {

// Where fuyoud listens when nothing else is said: $FUYOU_SOCKET if set, else
// /run/fuyou/fuyoud.sock. Returned as a gRPC target ("unix:/run/...").
std::string DefaultAddress();

struct ClientOptions {
  // gRPC target, e.g. "unix:/run/fuyou/fuyoud.sock". Empty means DefaultAddress().
  std::string address;
  // Deadline of each control call and of each wait that has no deadline of its own.
  std::chrono::milliseconds rpc_timeout{30000};
  // How long Open waits for the daemon's socket to accept a connection.
  std::chrono::milliseconds connect_timeout{5000};
};

struct SessionOptions {
  std::string job;
  uint32_t num_slots = 4;
  // Bytes of each gradient/parameter region: at least the largest chunk's
  // num_elements * max(param, grad dtype size).
  uint64_t slot_bytes = 0;
  std::string client_info{};  // {}: may be left out of a designated initializer
  // Resume the job at exactly this committed step: its own, or the one before
  // its last commit, which the daemon then commits again
  // (OpenSessionRequest.resume_at_step). Unset: the job's step.
  std::optional<int64_t> resume_at_step{};
};

struct ChunkSpec {
  uint32_t chunk_id = 0;
  uint64_t num_elements = 0;
  DType param_dtype = DType::kFloat32;
  DType grad_dtype = DType::kFloat32;
  // Fingerprint of the parameter layout packed into the chunk (shapes, dtypes,
  // order), or 0 for none. The daemon stores it with a new chunk and refuses to
  // resume a chunk created with another (FAILED_PRECONDITION); see
  // ChunkSpec.layout_fingerprint in proto/fuyou/v1/offload.proto.
  uint64_t layout_fingerprint = 0;
  // Element counts of the chunk's segments (the parameters or parameter pieces
  // packed into it), in order, summing to num_elements; at most 4096. Empty: one
  // segment. GradReadyOptions::segments_without_grad indexes them; each segment
  // keeps its own update count (ChunkSpec.segment_elements in offload.proto).
  std::vector<uint64_t> segment_elements{};
  // True: the daemon keeps the chunk's working weights (param_dtype) as a fourth
  // state and stores the new ones after every update; SendFetchWeights copies
  // the committed ones into a slot (streaming a model larger than the GPU).
  // Fixed when the chunk is created: resuming it with the other value is
  // refused (FAILED_PRECONDITION); see ChunkSpec.store_weights in offload.proto.
  bool store_weights = false;
  // The dtype the daemon keeps the chunk's Adam moments (m, v) in: kFloat32
  // (12 bytes a parameter with the fp32 master), kBFloat16 (8 bytes: m rounded
  // to nearest even, v stochastically; the master stays fp32) or kBlock8 (about
  // 6 bytes: 8-bit codes with a scale per block of 256). Fixed when the
  // chunk is created: resuming it with the other is refused
  // (FAILED_PRECONDITION); see ChunkSpec.moments_dtype in offload.proto.
  DType moments_dtype = DType::kFloat32;

  uint64_t param_bytes() const { return num_elements * DTypeSize(param_dtype); }
  uint64_t grad_bytes() const { return num_elements * DTypeSize(grad_dtype); }
};

struct AdamWHyper {
  float lr = 1e-3f;
  float beta1 = 0.9f;
  float beta2 = 0.999f;
  float eps = 1e-8f;
  float weight_decay = 1e-2f;
  // Multiplies each gradient before use (1/loss_scale * clip coefficient).
  float grad_scale = 1.0f;
};

struct RegisterResult {
  // True when the job already had the chunk and its weights were copied out.
  bool resumed = false;
  // Adam updates the chunk has received (the most any of its segments has).
  int64_t update_count = 0;
  // Per segment, when the segments' counts differ (a parameter had no gradient
  // in some step); empty when every segment has update_count.
  std::vector<int64_t> segment_update_counts{};
};

// Why a GradReady replaces the chunk's update already made in the step (values
// match fuyou.v1.RedoReason).
enum class RedoReason : int {
  kNone = 0,              // the chunk's first update of the step
  kGradientsChanged = 1,  // .grad changed after it was sent (clip, unscale, accumulation)
  kClipped = 2,           // the client's max_grad_norm clipped it (hyper.grad_scale)
};

// Why a step is abandoned (values match fuyou.v1.AbortReason).
enum class AbortReason : int {
  kUnspecified = 0,
  kSkippedStep = 1,  // the loop skipped step() (zero_grad or backward came first)
  kOverflow = 2,     // the client's loss scaler found inf or nan
};

// What a GradReady does with the chunk's gradient journal of the step (values
// match fuyou.v1.JournalUse; see offload.proto).
enum class JournalUse : int {
  kNone = 0,    // the slot's gradients only
  kKeep = 1,    // update from the slot and keep a copy as the chunk's journal
  kAdd = 2,     // journal = ops(journal) + slot, update from it (a redo)
  kReplay = 3,  // journal = ops(journal), update from it (a redo; the slot's gradients are not read)
};

// One in-place operation on a chunk's journaled gradients (fuyou.v1.GradOp),
// applied in the gradients' dtype as torch's .grad.mul_(x) / .grad.div_(x).
struct GradOp {
  enum class Kind : int { kMul = 1, kDiv = 2 };
  Kind kind = Kind::kMul;
  float operand = 1.0f;
};

// Statistics of a chunk's journaled gradients after an update that used the
// journal (ParamsReady fields 4-5), per segment: the sum of squares (fp64) and
// the largest |x| (NaN when any is NaN), before hyper.grad_scale.
struct JournalStats {
  std::vector<double> sum_squares;
  std::vector<float> max_abs;
};

// What a GradReady says besides the chunk, slot, step and hyper-parameters
// (GradReady fields 5-9 in offload.proto).
struct GradReadyOptions {
  // Segments (ascending, no repeats) whose parameters have no gradient in this
  // step: their weights, moments and update counts stay as they are.
  std::vector<uint32_t> segments_without_grad{};
  // Sent while backward may still change the gradients (validated at step()).
  bool speculative = false;
  // Not kNone: replaces the chunk's update of this step (which must have been
  // taken with WaitParams/PullParams first).
  RedoReason redo = RedoReason::kNone;
  // The chunk's gradient journal (streamed mode). With kReplay the slot's
  // gradient region is not read: the caller need not write it.
  JournalUse journal = JournalUse::kNone;
  // In-place ops on the journal before it is used; only with kAdd and kReplay
  // (the daemon refuses them otherwise, and more than 64).
  std::vector<GradOp> grad_ops{};
};

// One of the fp32 optimizer states the daemon keeps per chunk (values match
// fuyou.v1.StateKind).
enum class StateKind : int {
  kMaster = 1,    // fp32 master weights
  kExpAvg = 2,    // Adam's first moment (torch: exp_avg)
  kExpAvgSq = 3,  // Adam's second moment (torch: exp_avg_sq)
};

struct StepResult {
  int64_t step = 0;
  uint32_t chunks_updated = 0;
  // The last durable step, what a crash keeps (StepCommitted.durable_step): `step` - 1
  // (this step's commit is still running; the next step's answer reports it), or
  // older when fuyoud makes only every Nth step durable ([durability] commit_every_steps).
  int64_t durable_step = 0;
};

class Session {
 public:
  // Connects, opens a session on options.job and maps its segment.
  static absl::StatusOr<std::unique_ptr<Session>> Open(const SessionOptions& options,
                                                       const ClientOptions& client = {});
  // Closes the session if Close was not called (errors are logged, not thrown).
  ~Session();
  Session(const Session&) = delete;
  Session& operator=(const Session&) = delete;

  // Last committed step of the job when the session opened, advanced by EndStep.
  int64_t committed_step() const;
  uint32_t num_slots() const;
  uint64_t slot_bytes() const;
  const std::string& session_id() const;

  // --- registration -------------------------------------------------------
  // Registers one chunk. For a new chunk, `weights` (spec.param_bytes() bytes in
  // spec.param_dtype) become its initial master weights. For a chunk the job
  // already has, its current weights are written into `weights` and
  // result.resumed is true. Size or dtype mismatches are INVALID_ARGUMENT.
  absl::StatusOr<RegisterResult> RegisterChunk(const ChunkSpec& spec, std::span<std::byte> weights);

  // --- per step, copying API ------------------------------------------------
  // Takes a free slot (waiting up to the deadline), copies `gradients`
  // (spec.grad_bytes()) into it and sends GradReady for (chunk_id, step).
  absl::Status PushGradients(uint32_t chunk_id, int64_t step, const AdamWHyper& hyper,
                             std::span<const std::byte> gradients);
  // Waits until the daemon returns the new weights of chunk_id for the step in
  // flight, copies them into `weights` (spec.param_bytes()) and frees the slot.
  // A refusal of that chunk's GradReady comes back here as its Status.
  absl::Status PullParams(uint32_t chunk_id, std::span<std::byte> weights);

  // --- per step, zero-copy API -----------------------------------------------
  // Takes a free slot, waiting up to `timeout`.
  absl::StatusOr<uint32_t> AcquireSlot(std::chrono::milliseconds timeout);
  // The regions of a slot in the mapped segment (slot_bytes() long).
  std::span<std::byte> GradRegion(uint32_t slot);
  std::span<std::byte> ParamRegion(uint32_t slot);
  // Sends GradReady for gradients already written into GradRegion(slot).
  absl::Status SendGradReady(uint32_t chunk_id, uint32_t slot, int64_t step, const AdamWHyper& hyper);
  // The same, with segments without gradients, the speculative flag or a redo.
  // segments_without_grad not ascending, repeated, or past the chunk's segments
  // is INVALID_ARGUMENT (nothing sent).
  absl::Status SendGradReady(uint32_t chunk_id, uint32_t slot, int64_t step, const AdamWHyper& hyper,
                             const GradReadyOptions& options);
  // Waits for ParamsReady of chunk_id; returns the slot holding the new weights.
  // The caller reads ParamRegion(slot), then calls ReleaseSlot(slot). When the
  // daemon refused the chunk (or the connection was lost) the error comes back
  // here and the slot is already freed; on DEADLINE_EXCEEDED the chunk stays in
  // flight and WaitParams may be called again.
  absl::StatusOr<uint32_t> WaitParams(uint32_t chunk_id, std::chrono::milliseconds timeout);
  void ReleaseSlot(uint32_t slot);
  // The journal statistics of chunk_id's latest answered update, when that
  // update used a journal (GradReadyOptions.journal); nullopt otherwise. Valid
  // once WaitParams (or PullParams) returned for that update.
  std::optional<JournalStats> GetJournalStats(uint32_t chunk_id) const;

  // --- streaming weights (chunks registered with store_weights) -------------
  // Asks the daemon to copy the chunk's committed working weights (those of the
  // last committed step, spec.param_bytes() in param_dtype) into
  // ParamRegion(slot). `slot` must be held (AcquireSlot) and not in flight; it
  // is in flight until WaitWeights returns. Allowed during a step, also while
  // the chunk's own update is in flight (the fetch still returns the committed
  // weights). Several fetches may be in flight at once, of one chunk too (each
  // in its own slot). Refused locally, nothing sent: a chunk not registered in
  // this session (INVALID_ARGUMENT) or registered without store_weights, a slot
  // not held or in flight, an export or import in progress
  // (FAILED_PRECONDITION); a slot that does not exist (INVALID_ARGUMENT).
  absl::Status SendFetchWeights(uint32_t chunk_id, uint32_t slot);
  // Waits for WeightsFetched of the chunk's oldest fetch in flight; returns its
  // slot, whose parameter region now holds the weights. The caller reads
  // ParamRegion(slot), then calls ReleaseSlot(slot). When the daemon refused
  // the fetch (or the connection was lost) the error comes back here and the
  // slot is already freed; on DEADLINE_EXCEEDED the fetch stays in flight and
  // WaitWeights may be called again. FAILED_PRECONDITION when the chunk has no
  // fetch in flight.
  absl::StatusOr<uint32_t> WaitWeights(uint32_t chunk_id, std::chrono::milliseconds timeout);

  // --- activation offload's storage tier (SpillActivation, RecallActivation) --
  // Copies `bytes` to the daemon's activation scratch under `key` (the caller's
  // name, below kMaxActivationKey, not spilled yet in this session) and returns
  // once the daemon has written it. More than slot_bytes() goes in pieces, one
  // slot each (every piece is one daemon-side activation). Thread-safe, allowed
  // at any time, a step in flight included; each piece holds one slot for its
  // round trip. The daemon drops every spilled activation at EndStep, AbortStep,
  // DropActivations and the session's end. INVALID_ARGUMENT: an empty `bytes`,
  // a key too large or already spilled; RESOURCE_EXHAUSTED: the daemon's
  // per-user limit (max_activation_bytes_per_user); a daemon error unchanged.
  static constexpr uint64_t kMaxActivationKey = uint64_t{1} << 40;
  absl::Status SpillActivation(uint64_t key, std::span<const std::byte> bytes);
  // Copies `key`'s bytes back into `out`, which must be exactly as long as
  // what was spilled, and forgets the key (client and daemon). NOT_FOUND: not
  // spilled (or already recalled or dropped); DATA_LOSS: the daemon's copy
  // failed its checksum.
  absl::Status RecallActivation(uint64_t key, std::span<std::byte> out);
  // Forgets every activation this session spilled and frees their scratch.
  absl::Status DropActivations();

  // --- step boundaries --------------------------------------------------------
  // Commits `step` (waits for the daemon's StepCommitted): after this the job
  // resumes after `step` even if the daemon crashes.
  absl::StatusOr<StepResult> EndStep(int64_t step);
  // Waits until `step` (0 .. committed_step()) is durable: what a crash of
  // fuyoud or of the machine keeps. EndStep returns once its step is applied;
  // its durable commit ends during the next step's forward, so this usually
  // returns at once. Returns the job's durable step (>= step). Thread-safe and
  // allowed at any time: the daemon answers it when the commit ends, serving
  // the session's other requests meanwhile. A step fuyoud keeps acknowledged
  // only ([durability] commit_every_steps > 1) is made durable by this call.
  // INVALID_ARGUMENT: a negative step; FAILED_PRECONDITION: a step not yet
  // committed; the durable commit's own error when it failed (the session is
  // then over: reopen the job, which resumes at its durable step);
  // DEADLINE_EXCEEDED after the client's rpc_timeout.
  absl::StatusOr<int64_t> WaitDurable(int64_t step);
  // Abandons `step`: chunks already updated in it return to the last commit.
  // `reason` is counted by the daemon (GetStats).
  absl::Status AbortStep(int64_t step, AbortReason reason = AbortReason::kUnspecified);

  // --- export and import, between steps ------------------------------------
  // These refuse (FAILED_PRECONDITION) while a step has chunks (or weight
  // fetches) in flight. They
  // move values through one slot, in pieces of slot_bytes() / 4 elements, and
  // run one at a time per session. On DEADLINE_EXCEEDED the slot they used stays
  // held (the daemon may still write into it).
  //
  // Reads elements [first, first + out.size()) of a committed state of a
  // registered chunk into `out`; returns the chunk's update count (Adam's t).
  // FAILED_PRECONDITION also when the chunk has import changes not committed.
  absl::StatusOr<int64_t> ReadState(uint32_t chunk_id, StateKind which, uint64_t first, std::span<float> out);
  // Replaces elements [first, first + values.size()) of a state of a registered
  // chunk, as part of the pending import: durable at CommitImport, dropped if
  // the session ends before. A step cannot start while an import is pending.
  absl::Status WriteState(uint32_t chunk_id, StateKind which, uint64_t first, std::span<const float> values);
  // Sets a registered chunk's update count (Adam's t), as part of the pending
  // import; with `segment_update_counts` (one per segment, the largest equal to
  // update_count) each segment's own count (offload.proto SetUpdateCount).
  absl::Status SetUpdateCount(uint32_t chunk_id, int64_t update_count,
                              std::span<const int64_t> segment_update_counts = {});
  // Commits the pending import in one atomic manifest commit; the committed step
  // does not change, unless `resume_step` > 0: a job that committed no step yet
  // (FAILED_PRECONDITION otherwise) then is at step `resume_step`, in the same
  // commit (a reshard continuing the old jobs' count), and committed_step()
  // says so. Returns the number of chunks the import changed.
  absl::StatusOr<uint32_t> CommitImport(int64_t resume_step = 0);

  // Ends the session: pending work is finished, the segment unmapped. Spans from
  // GradRegion/ParamRegion must not be used after Close.
  absl::Status Close();

  class Impl;

 private:
  explicit Session(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace fuyou
