// OffloadService: fuyou.v1.Offload on top of the SessionRegistry.
#pragma once

#include "fuyou/v1/offload.grpc.pb.h"
#include "session/session_registry.h"

namespace fuyou {

class OffloadService final : public v1::Offload::Service {
 public:
  explicit OffloadService(SessionRegistry& sessions) : sessions_(sessions) {}

  grpc::Status OpenSession(grpc::ServerContext* context, const v1::OpenSessionRequest* request,
                           v1::OpenSessionResponse* response) override;
  grpc::Status RegisterChunks(grpc::ServerContext* context, const v1::RegisterChunksRequest* request,
                              v1::RegisterChunksResponse* response) override;
  // Serves one session's stream on the calling gRPC thread: messages are handled
  // in order, each answered before the next is read. The session closes when the
  // stream ends, whatever the reason.
  grpc::Status Stream(grpc::ServerContext* context,
                      grpc::ServerReaderWriter<v1::DaemonMessage, v1::ClientMessage>* stream) override;
  grpc::Status CloseSession(grpc::ServerContext* context, const v1::CloseSessionRequest* request,
                            v1::CloseSessionResponse* response) override;

 private:
  SessionRegistry& sessions_;
};

}  // namespace fuyou
