// Session::Impl: the state of one client session, shared by the files that
// implement it (session.cc: connection, steps and close; session_state_transfer.cc:
// reading and writing optimizer states for export and import). Private to
// clientlib.
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <span>
#include <string>
#include <string_view>
#include <thread>

#include "fuyou/client.h"
#include "fuyou/client_segment.h"
#include "fuyou/segment_layout.h"
#include "fuyou/v1/offload.grpc.pb.h"
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
  absl::StatusOr<StepResult> EndStep(int64_t step);
  absl::Status AbortStep(int64_t step, AbortReason reason);
  absl::StatusOr<int64_t> ReadState(uint32_t chunk_id, StateKind which, uint64_t first, std::span<float> out);
  absl::Status WriteState(uint32_t chunk_id, StateKind which, uint64_t first, std::span<const float> values);
  absl::Status SetUpdateCount(uint32_t chunk_id, int64_t update_count, std::span<const int64_t> segment_update_counts);
  absl::StatusOr<uint32_t> CommitImport();
  absl::Status Close();

 private:
  // A chunk whose GradReady was sent and whose answer was not yet taken.
  struct PendingChunk {
    uint32_t slot = 0;
    int64_t step = 0;
    bool done = false;
    absl::Status status;  // of the answer: OK for ParamsReady
  };
  // A FetchWeights sent and whose answer was not yet taken. The daemon answers
  // a session's messages in order, so a chunk's fetches are answered in the
  // order they were sent: the oldest not yet answered gets the next answer.
  struct PendingFetch {
    uint32_t slot = 0;
    bool done = false;
    absl::Status status;  // of the answer: OK for WeightsFetched
  };
  // A ReadState, WriteState, SetUpdateCount or CommitImport waiting for its
  // answer; one at a time (control_mu_).
  struct ControlWaiter {
    bool active = false;
    bool done = false;
    absl::Status status;
    v1::DaemonMessage reply;
  };
  // An EndStep or AbortStep waiting for its answer.
  struct StepWaiter {
    bool abort = false;
    bool done = false;
    absl::Status status;
    StepResult result;
  };

  std::string Who() const { return fmt::format("job '{}' (session {})", options_.job, session_id_); }
  absl::Status ClosedError() const {
    return absl::FailedPreconditionError(fmt::format("session of {} is closed", Who()));
  }
  // Creates the segment (a sealed memfd), hands it to fuyoud over the segment
  // socket, and checks the header fuyoud wrote into it.
  absl::Status CreateSegment(const v1::OpenSessionResponse& response);
  absl::Status Attach();
  // The status that refuses a new call, if any: closed, connection lost, a fatal
  // daemon error, or a session-level error not yet reported (reported once).
  absl::Status CheckUsableLocked();
  absl::Status Write(const v1::ClientMessage& message, std::string_view what);
  absl::StatusOr<StepResult> WaitStep(int64_t step, bool abort,
                                      AbortReason reason = AbortReason::kUnspecified);
  // Sends a control message and waits for its answer; the caller holds control_mu_.
  absl::StatusOr<v1::DaemonMessage> Control(const v1::ClientMessage& message, const std::string& what);
  // The registered chunk's spec, checking [first, first + count) lies in it.
  absl::StatusOr<ChunkSpec> CheckStateRange(uint32_t chunk_id, uint64_t first, uint64_t count, const char* verb);
  void ReadLoop();
  void Dispatch(const v1::DaemonMessage& message);
  void DeliverError(const v1::Error& error);
  // Gives `status` to the chunk's oldest unanswered fetch; false when it has none.
  bool DeliverFetchError(uint32_t chunk_id, const absl::Status& status);
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
  bool attached_ = false;
  bool reader_done_ = false;
  bool closing_ = false;
  absl::Status lost_;           // connection to the daemon lost
  absl::Status fatal_;          // ABORTED / INTERNAL from the daemon
  absl::Status session_error_;  // refusal nobody waited for; reported once
  std::map<uint32_t, ChunkSpec> chunks_;
  std::map<uint32_t, PendingChunk> pending_;
  std::map<uint32_t, JournalStats> journal_stats_;  // of each chunk's latest update that used a journal
  std::map<uint32_t, std::deque<PendingFetch>> fetches_;  // by chunk, oldest first; never an empty deque
  std::map<int64_t, StepWaiter> steps_;
  ControlWaiter control_;

  std::mutex control_mu_;  // one control request at a time; taken before mu_

  std::mutex close_mu_;
  bool close_done_ = false;
  absl::Status close_status_;
};

}  // namespace fuyou
