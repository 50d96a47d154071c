#include "server/offload_service.h"

#include <unistd.h>

#include "common/crash_point.h"
#include "common/log.h"
#include "common/status_util.h"
#include "fmt/format.h"
#include "server/reply_writer.h"

namespace fuyou {

absl::StatusOr<std::shared_ptr<Session>> OffloadService::FindOwn(grpc::ServerContext* context,
                                                                 const std::string& id) const {
  auto session = sessions_.Find(id);
  if (!session.ok()) return session.status();
  const uid_t caller = Caller(listener_, context->peer()).uid;
  if ((*session)->uid() != caller && !IsAdministrator(caller)) {
    return absl::NotFoundError(fmt::format("no open session has id {}", QuoteForError(id)));
  }
  return session;
}

grpc::Status OffloadService::OpenSession(grpc::ServerContext* context, const v1::OpenSessionRequest* request,
                                         v1::OpenSessionResponse* response) {
  // The session, its job and its segment belong to the uid that connected.
  const PeerCredentials peer = Caller(listener_, context->peer());
  auto session = sessions_.Open(*request, ClientIdentity{peer.uid, peer.pid});
  if (!session.ok()) return ToGrpcStatus(session.status());
  const SegmentLayout& layout = (*session)->layout();
  response->set_session_id((*session)->id());
  response->set_segment_socket(segment_socket_);
  response->set_segment_bytes(layout.TotalBytes());
  response->set_num_slots(layout.num_slots);
  response->set_slot_bytes(layout.slot_bytes);
  response->set_committed_step((*session)->committed_step());
  response->set_existing_chunks((*session)->existing_chunks());
  return grpc::Status::OK;
}

grpc::Status OffloadService::RegisterChunks(grpc::ServerContext* context, const v1::RegisterChunksRequest* request,
                                            v1::RegisterChunksResponse* response) {
  auto session = FindOwn(context, request->session_id());
  if (!session.ok()) return ToGrpcStatus(session.status());
  std::shared_ptr<StreamActivity> activity = sessions_.ActivityOf(request->session_id());
  if (activity) activity->BeginMessage();  // a long registration is not idleness
  auto result = (*session)->RegisterChunks(*request);
  if (activity) activity->EndMessage();
  if (!result.ok()) return ToGrpcStatus(result.status());
  *response = std::move(*result);
  return grpc::Status::OK;
}

grpc::Status OffloadService::Stream(grpc::ServerContext* context,
                                    grpc::ServerReaderWriter<v1::DaemonMessage, v1::ClientMessage>* stream) {
  v1::ClientMessage message;
  if (!stream->Read(&message)) return grpc::Status(grpc::StatusCode::CANCELLED, "stream ended before Attach");
  if (!message.has_attach()) {
    return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT, "the first message of a stream must be Attach");
  }
  const std::string id = message.attach().session_id();
  auto found = FindOwn(context, id);
  if (!found.ok()) return ToGrpcStatus(found.status());
  std::shared_ptr<Session> session = std::move(*found);
  if (absl::Status attached = session->Attach(); !attached.ok()) return ToGrpcStatus(attached);
  // The idle reaper may end this stream (TryCancel) until the handler returns.
  std::shared_ptr<StreamActivity> activity = sessions_.WatchStream(id, [context] { context->TryCancel(); });
  struct Detach {
    StreamActivity* activity;
    ~Detach() {
      if (activity != nullptr) activity->Detach();
    }
  } detach{activity.get()};
  v1::DaemonMessage attached;
  attached.mutable_attached()->set_session_id(id);
  attached.set_request_id(message.request_id());  // echoed, never checked
  if (!stream->Write(attached)) {
    (void)sessions_.Close(id);
    return grpc::Status::OK;
  }
  {
    // Every later answer goes through the writer: an activation transfer's
    // answer comes from an I/O completion thread when it is done, and may
    // follow the answers of messages read after it (they name their request
    // by id). A message without an id (an older client) is answered before
    // the next is read, so such a client gets its answers in order.
    ReplyWriter writer(*stream, [activity](const v1::DaemonMessage& reply) {
      if (activity) activity->EndMessage();
      if (reply.has_step_committed()) FUYOU_CRASH_POINT("step_committed_reply_sent");
    });
    InFlight answers;  // the writer outlives every answer given to it
    while (!writer.broken() && stream->Read(&message)) {
      if (activity) activity->BeginMessage();
      Future<void> answered = session->Handle(
          message, [&writer](v1::DaemonMessage reply, bool deferred) { writer.Send(std::move(reply), !deferred); });
      if (message.request_id() == 0) {
        answered.Wait();
      } else {
        answers.Add(std::move(answered));
      }
    }
    if (!session->closed()) {
      log::Info("session {}: stream of job '{}' ended without CloseSession (client gone?)", id, session->job_name());
      (void)sessions_.Close(id);  // waits for its transfers, whose answers the writer drops or writes
    }
    answers.WaitAll().IgnoreError();
  }  // the writer has written or dropped every answer
  return grpc::Status::OK;
}

grpc::Status OffloadService::CloseSession(grpc::ServerContext* context, const v1::CloseSessionRequest* request,
                                          v1::CloseSessionResponse* response) {
  if (auto own = FindOwn(context, request->session_id()); !own.ok()) return ToGrpcStatus(own.status());
  auto committed = sessions_.Close(request->session_id());
  if (!committed.ok()) return ToGrpcStatus(committed.status());
  response->set_committed_step(*committed);
  return grpc::Status::OK;
}

}  // namespace fuyou
