// OffloadConnection: one session's gRPC connection to fuyoud: the Offload stub
// for its unary calls, the deadline each call and wait gets (rpc_timeout), and
// the one bidirectional Stream with the reader thread that reads it. Private
// to clientlib.
//
// The reader hands every message of the daemon to `on_message`, in order, and
// once the stream has ended (the daemon ended it, the connection broke, or
// Cancel) calls `on_end` with gRPC's final status; both run on the reader
// thread. Writes are serialized by the connection's own lock, which is never
// held while a callback runs; once the stream has ended or CloseWrites was
// called, Write returns false.
//
// Thread-safe, except StartStream, Cancel and JoinReader: the session calls
// them from one thread (Attach; Close).
#pragma once

#include <chrono>
#include <functional>
#include <memory>
#include <mutex>
#include <thread>

#include "fuyou/v1/offload.grpc.pb.h"
#include "grpcpp/grpcpp.h"

namespace fuyou::internal {

class OffloadConnection {
 public:
  using MessageHandler = std::function<void(const v1::DaemonMessage&)>;
  using EndHandler = std::function<void(const grpc::Status&)>;

  OffloadConnection(std::shared_ptr<grpc::Channel> channel, std::chrono::milliseconds rpc_timeout)
      : stub_(v1::Offload::NewStub(std::move(channel))), rpc_timeout_(rpc_timeout) {}
  // Joins the reader; the owner cancels the stream first (Cancel) if it may
  // still be open.
  ~OffloadConnection() { JoinReader(); }
  OffloadConnection(const OffloadConnection&) = delete;
  OffloadConnection& operator=(const OffloadConnection&) = delete;

  // For the unary calls (OpenSession, RegisterChunks, CloseSession).
  v1::Offload::Stub& stub() { return *stub_; }
  std::chrono::milliseconds rpc_timeout() const { return rpc_timeout_; }

  // Opens the Stream and starts its reader. At most once.
  void StartStream(MessageHandler on_message, EndHandler on_end);
  bool has_stream() const { return stream_ != nullptr; }
  // Writes one message; false when the stream is closed for writes or broken.
  bool Write(const v1::ClientMessage& message);
  // Half-closes the stream (WritesDone), once; later writes return false.
  void CloseWrites();
  // Cancels the stream, which ends the reader's wait for the daemon.
  void Cancel();
  void JoinReader();

 private:
  void ReadLoop();

  std::unique_ptr<v1::Offload::Stub> stub_;
  const std::chrono::milliseconds rpc_timeout_;
  MessageHandler on_message_;
  EndHandler on_end_;
  std::unique_ptr<grpc::ClientContext> context_;
  std::unique_ptr<grpc::ClientReaderWriter<v1::ClientMessage, v1::DaemonMessage>> stream_;
  std::thread reader_;
  std::mutex write_mu_;
  bool writes_closed_ = false;  // guarded by write_mu_
};

}  // namespace fuyou::internal
