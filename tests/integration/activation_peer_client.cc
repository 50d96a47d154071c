// A client that activation_integration_test runs as another user (fork, setuid,
// exec: gRPC does not survive a fork without exec), to reach for the
// activations another user's session spilled.
//
//   activation_peer_client <socket> <session-id> <job> <key> <scratch-file>
//       Prints one "<what> key=value ..." line per attempt, exit 0 when every
//       attempt ran (whatever it was answered), 1 with a line saying what failed:
//         attach      a stream Attached to <session-id> (the other user's),
//                     then RecallActivation <key> and DropActivations on it:
//                     the stream's status (code=, message=) and replies=N;
//         close       CloseSession of <session-id>: code=, message=;
//         own-recall  RecallActivation <key> in a session of its own on <job>
//                     (the same name, its own namespace): code=;
//         own-drop    DropActivations there: activations=, scratch_bytes=;
//         read        open(2) of <scratch-file>: opened=0|1.
#include <fcntl.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <string>

#include "fuyou/v1/offload.grpc.pb.h"
#include "grpcpp/grpcpp.h"
#include "raw_session.h"

namespace {

using fuyou::testing::RawSession;
namespace v1 = fuyou::v1;

int Fail(const std::string& what) {
  std::printf("failed: %s\n", what.c_str());
  return 1;
}

std::string OneLine(std::string text) {
  for (char& c : text) {
    if (c == '\n') c = ' ';
  }
  return text;
}

void AttachToTheirs(v1::Offload::Stub& stub, const std::string& session_id, uint64_t key) {
  grpc::ClientContext context;
  context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(20));
  auto stream = stub.Stream(&context);
  v1::ClientMessage attach;
  attach.mutable_attach()->set_session_id(session_id);
  v1::ClientMessage recall;
  recall.mutable_recall_activation()->set_key(key);
  recall.mutable_recall_activation()->set_slot(0);
  v1::ClientMessage drop;
  drop.mutable_drop_activations();
  for (const v1::ClientMessage* message : {&attach, &recall, &drop}) {
    if (!stream->Write(*message)) break;
  }
  stream->WritesDone();
  int replies = 0;
  v1::DaemonMessage reply;
  while (stream->Read(&reply)) ++replies;
  const grpc::Status status = stream->Finish();
  std::printf("attach code=%d replies=%d message=%s\n", static_cast<int>(status.error_code()), replies,
              OneLine(status.error_message()).c_str());
}

void CloseTheirs(v1::Offload::Stub& stub, const std::string& session_id) {
  grpc::ClientContext context;
  context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(20));
  v1::CloseSessionRequest request;
  request.set_session_id(session_id);
  v1::CloseSessionResponse response;
  const grpc::Status status = stub.CloseSession(&context, request, &response);
  std::printf("close code=%d message=%s\n", static_cast<int>(status.error_code()),
              OneLine(status.error_message()).c_str());
}

int Run(const std::string& socket, const std::string& session_id, const std::string& job, uint64_t key,
        const std::string& scratch_file) {
  const std::string address = "unix:" + socket;
  auto stub = v1::Offload::NewStub(grpc::CreateChannel(address, grpc::InsecureChannelCredentials()));
  AttachToTheirs(*stub, session_id, key);
  CloseTheirs(*stub, session_id);

  fuyou::ClientOptions client;
  client.address = address;
  auto own = RawSession::Open(client, job, 1, 4096);
  if (!own.ok()) return Fail("open: " + std::string(own.status().message()));
  v1::ClientMessage recall;
  recall.mutable_recall_activation()->set_key(key);
  recall.mutable_recall_activation()->set_slot(0);
  const v1::DaemonMessage recalled = (*own)->Exchange(recall);
  std::printf("own-recall code=%d\n", recalled.has_error() ? recalled.error().code() : 0);
  v1::ClientMessage drop;
  drop.mutable_drop_activations();
  const v1::DaemonMessage dropped = (*own)->Exchange(drop);
  if (!dropped.has_activations_dropped()) return Fail("own drop: " + dropped.ShortDebugString());
  std::printf("own-drop activations=%u scratch_bytes=%llu\n", dropped.activations_dropped().activations(),
              static_cast<unsigned long long>(dropped.activations_dropped().scratch_bytes()));
  if (grpc::Status closed = (*own)->Close(); !closed.ok()) return Fail("close own: " + closed.error_message());

  const int fd = ::open(scratch_file.c_str(), O_RDONLY | O_CLOEXEC);
  std::printf("read opened=%d\n", fd >= 0 ? 1 : 0);
  if (fd >= 0) ::close(fd);
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc == 6) return Run(argv[1], argv[2], argv[3], std::stoull(argv[4]), argv[5]);
  std::fprintf(stderr, "usage: activation_peer_client <socket> <session-id> <job> <key> <scratch-file>\n");
  return 2;
}
