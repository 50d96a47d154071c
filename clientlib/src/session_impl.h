// Session::Impl: the state of one client session, shared by the files that
// implement it, one idea each. Private to clientlib.
//   session.cc                 Session (the public API) over Impl; Open and Close
//   session_open.cc            OpenSession, the segment's creation and handover
//   session_stream.cc          the Stream: writes, the reader thread, routing
//                              answers by request id, waiting for one
//   session_chunks.cc          registration, slots and their regions
//   session_steps.cc           GradReady/ParamsReady, EndStep and AbortStep
//   session_weights.cc         FetchWeights/WeightsFetched
//   session_state_transfer.cc  ReadState, WriteState, SetUpdateCount, CommitImport
// Every stream request that expects an answer is a row of `requests_`
// (pending_requests.h) from before it is written until its waiter takes the
// answer.
//
// Threads: the caller's threads, plus one reader thread per session that reads
// the daemon's messages from the Stream and wakes whoever waits for them.
// Locks: `mu_` guards the waiting state (the request table, chunks, errors);
// `write_mu_` serializes writes on the stream and is never taken while `mu_` is
// held; `control_mu_` (one export/import request at a time) is taken before
// `mu_`. The slot pool has its own lock.
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <map>
#include <memory>
#include <mutex>
#include <span>
#include <string>
#include <string_view>
#include <thread>

#include "fmt/format.h"
#include "fuyou/client.h"
#include "fuyou/client_segment.h"
#include "fuyou/segment_layout.h"
#include "fuyou/v1/offload.grpc.pb.h"
#include "grpcpp/grpcpp.h"
#include "pending_requests.h"
#include "slot_pool.h"

namespace fuyou {

class Session::Impl {
 public:
  Impl(SessionOptions options, ClientOptions client, std::string address,
       std::shared_ptr<grpc::Channel> channel)
      : options_(std::move(options)),
        client_(std::move(client)),
        address_(std::move(address)),
        channel_(std::move(channel)),
        stub_(v1::Offload::NewStub(channel_)) {}

  ~Impl() {
    {
      // A Close the caller already made has reported its own result.
      std::lock_guard close_lock(close_mu_);
      if (close_done_) return;
    }
    absl::Status status = Close();
    if (!status.ok() && !absl::IsUnavailable(status) && !session_id_.empty()) {
      fmt::print(stderr, "fuyou: closing session {} of job '{}' failed: {}\n", session_id_,
                 options_.job, status.ToString());
    }
  }

  absl::Status Start();

  int64_t committed_step() const { return committed_step_.load(); }
  uint32_t num_slots() const { return num_slots_; }
  uint64_t slot_bytes() const { return slot_bytes_; }
  const std::string& session_id() const { return session_id_; }

  absl::StatusOr<RegisterResult> RegisterChunk(const ChunkSpec& spec, std::span<std::byte> weights);
  absl::Status PushGradients(uint32_t chunk_id, int64_t step, const AdamWHyper& hyper,
                             std::span<const std::byte> gradients);
  absl::Status PullParams(uint32_t chunk_id, std::span<std::byte> weights);
  absl::StatusOr<uint32_t> AcquireSlot(std::chrono::milliseconds timeout);
  std::span<std::byte> GradRegion(uint32_t slot);
  std::span<std::byte> ParamRegion(uint32_t slot);
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
  absl::StatusOr<int64_t> ReadState(uint32_t chunk_id, StateKind which, uint64_t first, std::span<float> out);
  absl::Status WriteState(uint32_t chunk_id, StateKind which, uint64_t first, std::span<const float> values);
  absl::Status SetUpdateCount(uint32_t chunk_id, int64_t update_count, std::span<const int64_t> segment_update_counts);
  absl::StatusOr<uint32_t> CommitImport();
  absl::Status Close();

 private:
  std::string Who() const { return fmt::format("job '{}' (session {})", options_.job, session_id_); }
  absl::Status ClosedError() const {
    return absl::FailedPreconditionError(fmt::format("session of {} is closed", Who()));
  }
  // Creates the segment (a sealed memfd), hands it to fuyoud over the segment
  // socket, and checks the header fuyoud wrote into it.
  absl::Status CreateSegment(const v1::OpenSessionResponse& response);
  // Opens the Stream, starts the reader and sends Attach (a request like any other).
  absl::Status Attach();
  // The status that refuses a new call, if any: closed, connection lost, a fatal
  // daemon error (ABORTED, INTERNAL, a broken protocol), or a session-level
  // error not yet reported (reported once).
  absl::Status CheckUsableLocked();
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
  void ReadLoop();
  // Routes one message of the daemon to the request its id names.
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
  void OnStreamEnd(const grpc::Status& status);

  const SessionOptions options_;
  const ClientOptions client_;
  const std::string address_;
  std::shared_ptr<grpc::Channel> channel_;
  std::unique_ptr<v1::Offload::Stub> stub_;

  // Set once by Start.
  std::string session_id_;
  uint32_t num_slots_ = 0;
  uint64_t slot_bytes_ = 0;
  std::unique_ptr<ClientSegment> segment_;
  std::byte* base_ = nullptr;
  std::unique_ptr<internal::SlotPool> slots_;
  std::atomic<int64_t> committed_step_{0};

  std::unique_ptr<grpc::ClientContext> stream_context_;
  std::unique_ptr<grpc::ClientReaderWriter<v1::ClientMessage, v1::DaemonMessage>> stream_;
  std::thread reader_;

  std::mutex write_mu_;
  bool writes_closed_ = false;  // guarded by write_mu_

  std::mutex mu_;
  std::condition_variable cv_;
  bool reader_done_ = false;
  bool closing_ = false;
  absl::Status lost_;            // connection to the daemon lost
  absl::Status fatal_;           // ABORTED / INTERNAL from the daemon, or protocol_error_
  absl::Status protocol_error_;  // the daemon broke the protocol: later messages are ignored
  absl::Status session_error_;   // refusal nobody waited for; reported once
  std::map<uint32_t, ChunkSpec> chunks_;
  // Activations spilled in this session (SpillActivation): the bytes of each,
  // or nullopt for one whose spill failed part-way (its pieces stay at the
  // daemon until the drop, so the key cannot be spilled again before).
  std::map<uint64_t, std::optional<uint64_t>> activations_;
  // One spill/recall piece through a held slot: sends `message` (kind `kind`)
  // and waits for its answer. The caller releases the slot after an answer; on
  // an error this releases it, unless it timed out (the daemon may still use it).
  absl::StatusOr<v1::DaemonMessage> ActivationCall(internal::RequestKind kind, uint32_t slot,
                                                   v1::ClientMessage& message, const std::string& what);
  std::map<uint32_t, JournalStats> journal_stats_;  // of each chunk's latest update that used a journal
  internal::PendingRequests requests_;              // every request waiting for its answer

  std::mutex control_mu_;  // one export/import request at a time; taken before mu_

  std::mutex close_mu_;
  bool close_done_ = false;
  absl::Status close_status_;
};

}  // namespace fuyou
