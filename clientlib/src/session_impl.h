// Session::Impl: one client session, over parts that each hold one idea; its
// methods are spread over files, one idea each. Private to clientlib.
//   session.cc                 Session (the public API) over Impl; Open and Close
//   session_open.cc            OpenSession, the segment's creation and handover
//   session_stream.cc          requests written with their ids, routing answers
//                              by request id (on the reader thread), waiting for one
//   session_chunks.cc          registration, slots and their regions
//   session_steps.cc           GradReady/ParamsReady, EndStep, AbortStep, WaitDurable
//   session_weights.cc         FetchWeights/WeightsFetched
//   session_activations.cc     SpillActivation, RecallActivation, DropActivations
//   session_state_transfer.cc  ReadState, WriteState, SetUpdateCount, CommitImport
// The parts, one idea each (their headers say more):
//   OffloadConnection   the stub, the Stream and its reader thread, rpc_timeout
//   SlotMemory          the segment, its layout and the slot pool
//   PendingRequests     every stream request that expects an answer, from
//                       before it is written until its waiter takes the answer
//   SessionHealth       whether the session may still be used, and why not
//   RegisteredChunks    the chunks' specs and their latest journal stats
//   SpilledActivations  the activations spilled and not yet recalled
//   CommittedStep, SessionName, CloseOnce
//
// Threads: the caller's threads, plus one reader thread per session that reads
// the daemon's messages from the Stream and wakes whoever waits for them.
// Locks: `mu_` guards the waiting state (the request table, the health, the
// chunks, the activations); the connection's write lock serializes writes on
// the stream and is never taken while `mu_` is held; `control_mu_` (one
// export/import request at a time) is taken before `mu_`. The slot pool has its
// own lock.
#pragma once

#include <chrono>
#include <condition_variable>
#include <memory>
#include <mutex>
#include <span>
#include <string>
#include <string_view>

#include "close_once.h"
#include "committed_step.h"
#include "fmt/format.h"
#include "fuyou/client.h"
#include "fuyou/segment_layout.h"
#include "fuyou/v1/offload.grpc.pb.h"
#include "grpcpp/grpcpp.h"
#include "offload_connection.h"
#include "pending_requests.h"
#include "registered_chunks.h"
#include "session_health.h"
#include "session_name.h"
#include "slot_memory.h"
#include "spilled_activations.h"

namespace fuyou {

class Session::Impl {
 public:
  // `daemon_uid`: the uid of the daemon behind `channel` when its connection
  // was checked (DaemonChannel::peer_uid); the segment socket must be its too.
  Impl(const SessionOptions& options, const ClientOptions& client, std::shared_ptr<grpc::Channel> channel,
       std::optional<uid_t> daemon_uid = std::nullopt)
      : name_{.job = options.job, .id = {}}, connection_(std::move(channel), client.rpc_timeout),
        daemon_uid_(daemon_uid) {}

  ~Impl() {
    // A Close the caller already made has reported its own result.
    if (close_.done()) return;
    absl::Status status = Close();
    if (!status.ok() && !absl::IsUnavailable(status) && !name_.id.empty()) {
      fmt::print(stderr, "fuyou: closing session {} of job '{}' failed: {}\n", name_.id, name_.job,
                 status.ToString());
    }
  }

  // Opens the session as `options` ask (the options this Impl was made with).
  absl::Status Start(const SessionOptions& options);

  int64_t committed_step() const { return committed_step_.get(); }
  uint32_t num_slots() const { return memory_.num_slots(); }
  uint64_t slot_bytes() const { return memory_.slot_bytes(); }
  const std::string& session_id() const { return name_.id; }

  absl::StatusOr<RegisterResult> RegisterChunk(const ChunkSpec& spec, std::span<std::byte> weights);
  absl::Status PushGradients(uint32_t chunk_id, int64_t step, const AdamWHyper& hyper,
                             std::span<const std::byte> gradients);
  absl::Status PullParams(uint32_t chunk_id, std::span<std::byte> weights);
  absl::StatusOr<uint32_t> AcquireSlot(std::chrono::milliseconds timeout);
  std::span<std::byte> GradRegion(uint32_t slot) { return memory_.GradRegion(slot); }
  std::span<std::byte> ParamRegion(uint32_t slot) { return memory_.ParamRegion(slot); }
  absl::Status SendGradReady(uint32_t chunk_id, uint32_t slot, int64_t step, const AdamWHyper& hyper,
                             const GradReadyOptions& options);
  absl::StatusOr<uint32_t> WaitParams(uint32_t chunk_id, std::chrono::milliseconds timeout);
  std::optional<JournalStats> GetJournalStats(uint32_t chunk_id);
  void ReleaseSlot(uint32_t slot);
  absl::Status SendFetchWeights(uint32_t chunk_id, uint32_t slot);
  absl::StatusOr<uint32_t> WaitWeights(uint32_t chunk_id, std::chrono::milliseconds timeout);
  absl::Status SpillActivation(uint64_t key, std::span<const std::byte> bytes);
  absl::Status RecallActivation(uint64_t key, std::span<std::byte> out);
  absl::Status DropActivations();
  absl::StatusOr<StepResult> EndStep(int64_t step);
  absl::Status AbortStep(int64_t step, AbortReason reason);
  absl::StatusOr<int64_t> WaitDurable(int64_t step);
  absl::StatusOr<int64_t> ReadState(uint32_t chunk_id, StateKind which, uint64_t first, std::span<float> out);
  absl::Status WriteState(uint32_t chunk_id, StateKind which, uint64_t first, std::span<const float> values);
  absl::Status SetUpdateCount(uint32_t chunk_id, int64_t update_count, std::span<const int64_t> segment_update_counts);
  absl::StatusOr<uint32_t> CommitImport(int64_t resume_step);
  absl::Status Close();

 private:
  std::string Who() const { return name_.Who(); }
  absl::Status ClosedError() const {
    return absl::FailedPreconditionError(fmt::format("session of {} is closed", Who()));
  }
  std::chrono::milliseconds rpc_timeout() const { return connection_.rpc_timeout(); }
  internal::SlotPool& slots() { return *memory_.pool(); }
  // Close's work, run once (close_).
  absl::Status CloseNow();
  // Creates the segment (a sealed memfd), hands it to fuyoud over the segment
  // socket, and checks the header fuyoud wrote into it.
  absl::Status CreateSegment(const v1::OpenSessionResponse& response);
  // Opens the Stream, starts the reader and sends Attach (a request like any other).
  absl::Status Attach();
  // The status that refuses a new call, if any (SessionHealth::CheckUsable).
  absl::Status CheckUsableLocked() { return health_.CheckUsable(ClosedError()); }
  absl::Status Write(const v1::ClientMessage& message, std::string_view what);
  // Writes `message` as request `id`, which the caller added to requests_ (so
  // that an answer arriving before this returns finds it); when the write
  // fails the request is taken out of the table again.
  absl::Status WriteRequest(uint64_t id, v1::ClientMessage& message, std::string_view what);
  // Writes request `id` and waits up to `timeout` for its answer, which it
  // takes: the answer, or the request's error. DEADLINE_EXCEEDED when none came
  // (the request is abandoned: its late answer is dropped).
  absl::StatusOr<v1::DaemonMessage> Call(uint64_t id, v1::ClientMessage& message, const std::string& what,
                                         std::chrono::milliseconds timeout);
  enum class Awaited { kAnswered, kTimedOut, kTakenByAnother };
  // Waits, `lock` held on mu_, up to `timeout` for request `id` to be answered.
  Awaited AwaitLocked(std::unique_lock<std::mutex>& lock, uint64_t id, std::chrono::milliseconds timeout);
  absl::StatusOr<StepResult> WaitStep(int64_t step, bool abort,
                                      AbortReason reason = AbortReason::kUnspecified);
  // Sends an export/import request (`kind`, about `chunk_id`) and waits for its
  // answer; the caller holds control_mu_.
  absl::StatusOr<v1::DaemonMessage> Control(internal::RequestKind kind, uint32_t chunk_id,
                                            v1::ClientMessage& message, const std::string& what);
  // The registered chunk's spec, checking [first, first + count) lies in it.
  absl::StatusOr<ChunkSpec> CheckStateRange(uint32_t chunk_id, uint64_t first, uint64_t count, const char* verb);
  // One spill/recall piece through a held slot: sends `message` (kind `kind`)
  // and waits for its answer. The caller releases the slot after an answer; on
  // an error this releases it, unless it timed out (the daemon may still use it).
  absl::StatusOr<v1::DaemonMessage> ActivationCall(internal::RequestKind kind, uint32_t slot,
                                                   v1::ClientMessage& message, const std::string& what);
  // Routes one message of the daemon to the request its id names (on the reader thread).
  void Dispatch(const v1::DaemonMessage& message);
  // What an answer means beyond its request's status (called with mu_ held):
  // a slot back from the daemon, a mismatch of the answer with its request
  // (INTERNAL for that request), the journal stats, the committed step.
  // `request` is null when its waiter had given up.
  void OnAnswerLocked(internal::RequestKind kind, internal::PendingRequest* request,
                      const v1::DaemonMessage& message);
  // The daemon broke the protocol (called with mu_ held): every pending request
  // and every later call fails with INTERNAL naming `why`.
  void BreakProtocolLocked(const absl::Status& why);
  // The stream ended (on the reader thread): every pending request fails.
  void OnStreamEnd(const grpc::Status& status);

  internal::SessionName name_;
  internal::OffloadConnection connection_;
  const std::optional<uid_t> daemon_uid_;
  internal::SlotMemory memory_;  // filled by Start
  internal::CommittedStep committed_step_;

  std::mutex mu_;
  std::condition_variable cv_;  // notified on every answer and at the stream's end
  // Guarded by mu_:
  internal::PendingRequests requests_;  // every request waiting for its answer
  internal::SessionHealth health_;
  internal::RegisteredChunks chunks_;
  internal::SpilledActivations activations_;

  std::mutex control_mu_;  // one export/import request at a time; taken before mu_
  internal::CloseOnce close_;
};

}  // namespace fuyou
