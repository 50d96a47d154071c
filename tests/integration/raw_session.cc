#include "raw_session.h"

#include <chrono>
#include <cstring>

#include "daemon_process.h"
#include "fmt/format.h"
#include "fuyou/segment_layout.h"

namespace fuyou::testing {
namespace {

absl::Status FromGrpc(const grpc::Status& status) {
  return absl::Status(static_cast<absl::StatusCode>(status.error_code()), status.error_message());
}

}  // namespace

absl::StatusOr<std::unique_ptr<RawSession>> RawSession::Open(const ClientOptions& options, const std::string& job,
                                                             uint32_t slots, uint64_t slot_bytes) {
  std::unique_ptr<RawSession> session(new RawSession());
  session->stub_ =
      v1::Offload::NewStub(grpc::CreateChannel(options.address, grpc::InsecureChannelCredentials()));
  {
    grpc::ClientContext context;
    context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(20));
    v1::OpenSessionRequest request;
    request.set_job(job);
    request.set_num_slots(slots);
    request.set_slot_bytes(slot_bytes);
    grpc::Status status = session->stub_->OpenSession(&context, request, &session->opened_);
    if (!status.ok()) return FromGrpc(status);
  }
  auto segment = HandOverNewSegment(session->opened_);
  if (!segment.ok()) return segment.status();
  session->segment_ = std::move(*segment);
  session->context_ = std::make_unique<grpc::ClientContext>();
  // Generous: a daemon that stops answering fails the test instead of hanging it.
  session->context_->set_deadline(std::chrono::system_clock::now() + std::chrono::minutes(5));
  session->stream_ = session->stub_->Stream(session->context_.get());
  v1::ClientMessage attach;
  attach.mutable_attach()->set_session_id(session->opened_.session_id());
  v1::DaemonMessage reply = session->Exchange(attach);
  if (!reply.has_attached()) {
    return absl::InternalError(fmt::format("Attach was answered with {}", reply.ShortDebugString()));
  }
  return session;
}

RawSession::~RawSession() { Close(); }

grpc::Status RawSession::Register(const std::vector<v1::ChunkSpec>& chunks, v1::RegisterChunksResponse* response) {
  grpc::ClientContext context;
  context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(20));
  v1::RegisterChunksRequest request;
  request.set_session_id(opened_.session_id());
  for (const v1::ChunkSpec& spec : chunks) *request.add_chunks() = spec;
  return stub_->RegisterChunks(&context, request, response);
}

std::span<std::byte> RawSession::GradRegion(uint32_t slot) {
  const SegmentLayout layout{opened_.num_slots(), opened_.slot_bytes()};
  return segment_->bytes().subspan(layout.GradOffset(slot), layout.slot_bytes);
}

std::span<std::byte> RawSession::ParamRegion(uint32_t slot) {
  const SegmentLayout layout{opened_.num_slots(), opened_.slot_bytes()};
  return segment_->bytes().subspan(layout.ParamOffset(slot), layout.slot_bytes);
}

v1::DaemonMessage RawSession::Exchange(const v1::ClientMessage& message) {
  v1::DaemonMessage reply;
  if (closed_ || !stream_->Write(message) || !stream_->Read(&reply)) return v1::DaemonMessage();
  return reply;
}

bool RawSession::Send(const v1::ClientMessage& message) { return !closed_ && stream_->Write(message); }

v1::DaemonMessage RawSession::Read() {
  v1::DaemonMessage reply;
  if (closed_ || !stream_->Read(&reply)) return v1::DaemonMessage();
  return reply;
}

v1::DaemonMessage RawSession::SendGrad(const v1::GradReady& grad, const std::vector<float>& grads) {
  std::memcpy(GradRegion(grad.slot()).data(), grads.data(), grads.size() * sizeof(float));
  v1::ClientMessage message;
  *message.mutable_grad_ready() = grad;
  return Exchange(message);
}

std::vector<float> RawSession::Weights(uint32_t slot, size_t n) {
  std::vector<float> weights(n);
  std::memcpy(weights.data(), ParamRegion(slot).data(), n * sizeof(float));
  return weights;
}

absl::StatusOr<std::vector<float>> RawSession::ReadState(uint32_t chunk_id, v1::StateKind which, uint32_t slot,
                                                         size_t n, int64_t* t) {
  v1::ClientMessage message;
  v1::ReadState* read = message.mutable_read_state();
  read->set_chunk_id(chunk_id);
  read->set_which(which);
  read->set_slot(slot);
  read->set_first_element(0);
  read->set_num_elements(n);
  v1::DaemonMessage reply = Exchange(message);
  if (reply.has_error()) {
    return absl::Status(static_cast<absl::StatusCode>(reply.error().code()), reply.error().message());
  }
  if (!reply.has_state_read()) return absl::InternalError("ReadState got no StateRead: " + reply.ShortDebugString());
  if (t != nullptr) *t = reply.state_read().update_count();
  return Weights(slot, n);
}

v1::DaemonMessage RawSession::EndStep(int64_t step) {
  v1::ClientMessage message;
  message.mutable_end_step()->set_step(step);
  return Exchange(message);
}

v1::DaemonMessage RawSession::AbortStep(int64_t step, v1::AbortReason reason) {
  v1::ClientMessage message;
  message.mutable_abort_step()->set_step(step);
  message.mutable_abort_step()->set_reason(reason);
  return Exchange(message);
}

grpc::Status RawSession::Close() {
  if (closed_) return grpc::Status::OK;
  closed_ = true;
  // CloseSession first: a stream that ends before it closes the session itself
  // (the daemon takes it for a client gone), and CloseSession would not find it.
  grpc::ClientContext context;
  context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(20));
  v1::CloseSessionRequest request;
  request.set_session_id(opened_.session_id());
  v1::CloseSessionResponse response;
  grpc::Status closed = stub_->CloseSession(&context, request, &response);
  stream_->WritesDone();
  stream_->Finish();  // the daemon ends the stream of a closed session: its status says nothing more
  return closed;
}

v1::ChunkSpec ChunkSpecOf(uint32_t chunk_id, uint64_t n, uint32_t slot, std::vector<uint64_t> segments) {
  v1::ChunkSpec spec;
  spec.set_chunk_id(chunk_id);
  spec.set_num_elements(n);
  spec.set_param_dtype(v1::DTYPE_FLOAT32);
  spec.set_grad_dtype(v1::DTYPE_FLOAT32);
  spec.set_slot(slot);
  for (uint64_t s : segments) spec.add_segment_elements(s);
  return spec;
}

v1::GradReady GradReadyOf(int64_t step, uint32_t chunk_id, uint32_t slot, const v1::AdamWHyper& hyper) {
  v1::GradReady grad;
  grad.set_step(step);
  grad.set_chunk_id(chunk_id);
  grad.set_slot(slot);
  *grad.mutable_hyper() = hyper;
  return grad;
}

}  // namespace fuyou::testing
