#include "offload_connection.h"

#include <utility>

namespace fuyou::internal {

void OffloadConnection::StartStream(MessageHandler on_message, EndHandler on_end) {
  on_message_ = std::move(on_message);
  on_end_ = std::move(on_end);
  context_ = std::make_unique<grpc::ClientContext>();
  stream_ = stub_->Stream(context_.get());
  reader_ = std::thread([this] { ReadLoop(); });
}

bool OffloadConnection::Write(const v1::ClientMessage& message) {
  std::lock_guard lock(write_mu_);
  return stream_ != nullptr && !writes_closed_ && stream_->Write(message);
}

void OffloadConnection::CloseWrites() {
  std::lock_guard lock(write_mu_);
  if (stream_ == nullptr || writes_closed_) return;
  writes_closed_ = true;
  stream_->WritesDone();
}

void OffloadConnection::Cancel() {
  if (context_ != nullptr) context_->TryCancel();
}

void OffloadConnection::JoinReader() {
  if (reader_.joinable()) reader_.join();
}

void OffloadConnection::ReadLoop() {
  v1::DaemonMessage message;
  while (stream_->Read(&message)) on_message_(message);
  grpc::Status status;
  {
    std::lock_guard lock(write_mu_);
    writes_closed_ = true;
    status = stream_->Finish();
  }
  on_end_(status);
}

}  // namespace fuyou::internal
