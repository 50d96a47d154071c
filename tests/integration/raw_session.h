// RawSession: one session of the offload protocol driven message by message
// over raw gRPC, for tests that send what clientlib does not (redo, segments
// without gradient, hostile segment lists). It opens the session, hands over a
// segment as clientlib does (HandOverNewSegment) and attaches the stream; each
// stream message then gets exactly one reply (Exchange; or Send, then Read).
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "fuyou/client.h"
#include "fuyou/client_segment.h"
#include "fuyou/v1/offload.grpc.pb.h"
#include "grpcpp/grpcpp.h"

namespace fuyou::testing {

class RawSession {
 public:
  // Opens a session of `job` with `slots` slots of `slot_bytes`, hands over its
  // segment and attaches the stream.
  static absl::StatusOr<std::unique_ptr<RawSession>> Open(const ClientOptions& options, const std::string& job,
                                                          uint32_t slots, uint64_t slot_bytes);
  ~RawSession();

  const v1::OpenSessionResponse& opened() const { return opened_; }
  int64_t committed_step() const { return opened_.committed_step(); }

  grpc::Status Register(const std::vector<v1::ChunkSpec>& chunks, v1::RegisterChunksResponse* response);

  // The slot's regions in the mapped segment (slot_bytes long).
  std::span<std::byte> GradRegion(uint32_t slot);
  std::span<std::byte> ParamRegion(uint32_t slot);

  // Writes `message` to the stream and reads one reply; a reply with no kind
  // set when the stream broke (e.g. the daemon died).
  v1::DaemonMessage Exchange(const v1::ClientMessage& message);
  // The two halves of Exchange, for tests of answers that come out of order
  // (messages with request ids, issue 23): Send writes without reading
  // (false when the stream broke); Read reads the next reply (no kind set when
  // the stream broke).
  bool Send(const v1::ClientMessage& message);
  v1::DaemonMessage Read();
  // Copies `grads` (fp32) into the slot's gradient region and sends `grad`
  // (whose slot names it); returns the reply.
  v1::DaemonMessage SendGrad(const v1::GradReady& grad, const std::vector<float>& grads);
  // The fp32 weights in the slot's parameter region (n elements).
  std::vector<float> Weights(uint32_t slot, size_t n);
  // ReadState of elements [0, n) of a committed state through `slot`; `t`
  // receives the committed update count.
  absl::StatusOr<std::vector<float>> ReadState(uint32_t chunk_id, v1::StateKind which, uint32_t slot, size_t n,
                                               int64_t* t = nullptr);
  v1::DaemonMessage EndStep(int64_t step);
  v1::DaemonMessage AbortStep(int64_t step, v1::AbortReason reason);

  // Ends the stream and closes the session.
  grpc::Status Close();

 private:
  RawSession() = default;

  std::unique_ptr<v1::Offload::Stub> stub_;
  v1::OpenSessionResponse opened_;
  std::unique_ptr<ClientSegment> segment_;
  std::unique_ptr<grpc::ClientContext> context_;
  std::unique_ptr<grpc::ClientReaderWriter<v1::ClientMessage, v1::DaemonMessage>> stream_;
  bool closed_ = false;
};

// Builders of the messages the tests send.
v1::ChunkSpec ChunkSpecOf(uint32_t chunk_id, uint64_t n, uint32_t slot, std::vector<uint64_t> segments = {});
v1::GradReady GradReadyOf(int64_t step, uint32_t chunk_id, uint32_t slot, const v1::AdamWHyper& hyper);

}  // namespace fuyou::testing
