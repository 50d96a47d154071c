// OffloadService: fuyou.v1.Offload on top of the SessionRegistry.
#pragma once

#include <string>

#include "fuyou/v1/offload.grpc.pb.h"
#include "server/peer_listener.h"
#include "session/session_registry.h"

namespace fuyou {

class OffloadService final : public v1::Offload::Service {
 public:
  // `listener` (may be null, not owned) tells who each call comes from;
  // `segment_socket` is the absolute path OpenSession names for the handover.
  OffloadService(SessionRegistry& sessions, const PeerListener* listener, std::string segment_socket)
      : sessions_(sessions), listener_(listener), segment_socket_(std::move(segment_socket)) {}

  grpc::Status OpenSession(grpc::ServerContext* context, const v1::OpenSessionRequest* request,
                           v1::OpenSessionResponse* response) override;
  grpc::Status RegisterChunks(grpc::ServerContext* context, const v1::RegisterChunksRequest* request,
                              v1::RegisterChunksResponse* response) override;
  // Serves one session's stream on the calling gRPC thread: messages are read
  // and handled in order; their answers are written by the stream's
  // ReplyWriter, each as soon as it is made: at once for most, when its
  // transfer completes for SpillActivation and RecallActivation (which may be
  // after the answers of later messages; a message with request_id 0 is
  // answered before the next is read). The session closes when the stream
  // ends, whatever the reason.
  grpc::Status Stream(grpc::ServerContext* context,
                      grpc::ServerReaderWriter<v1::DaemonMessage, v1::ClientMessage>* stream) override;
  grpc::Status CloseSession(grpc::ServerContext* context, const v1::CloseSessionRequest* request,
                            v1::CloseSessionResponse* response) override;

 private:
  // The session `id` if the caller may use it: NOT_FOUND for an unknown id and
  // for another user's session alike (ids are not disclosed across users).
  absl::StatusOr<std::shared_ptr<Session>> FindOwn(grpc::ServerContext* context, const std::string& id) const;

  SessionRegistry& sessions_;
  const PeerListener* listener_;
  const std::string segment_socket_;
};

}  // namespace fuyou
