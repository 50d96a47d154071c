// OffloadConnection against a small echo service on a Unix socket: the reader
// hands over every message in order and reports the stream's end once; writes
// fail after the end and after CloseWrites.
#include "offload_connection.h"

#include <gtest/gtest.h>

#include <condition_variable>
#include <mutex>
#include <vector>

#include "grpcpp/server.h"
#include "grpcpp/server_builder.h"
#include "test_support/temp_dir.h"

namespace fuyou::internal {
namespace {

using std::chrono::milliseconds;

// Answers every ClientMessage with a DaemonMessage of the same request id; a
// request id of 0 ends the stream with UNAVAILABLE "told to end".
class EchoOffload final : public v1::Offload::Service {
 public:
  grpc::Status Stream(grpc::ServerContext*,
                      grpc::ServerReaderWriter<v1::DaemonMessage, v1::ClientMessage>* stream) override {
    v1::ClientMessage in;
    while (stream->Read(&in)) {
      if (in.request_id() == 0) return grpc::Status(grpc::StatusCode::UNAVAILABLE, "told to end");
      v1::DaemonMessage out;
      out.set_request_id(in.request_id());
      stream->Write(out);
    }
    return grpc::Status::OK;  // the client closed its writes
  }
};

// What the reader handed over.
struct Received {
  std::mutex mu;
  std::condition_variable cv;
  std::vector<uint64_t> ids;
  int ends = 0;
  grpc::Status end;

  bool WaitForEnd() {
    std::unique_lock lock(mu);
    return cv.wait_for(lock, std::chrono::seconds(10), [&] { return ends > 0; });
  }
};

class OffloadConnectionTest : public ::testing::Test {
 protected:
  void SetUp() override {
    builder_.AddListeningPort(address_, grpc::InsecureServerCredentials());
    builder_.RegisterService(&service_);
    server_ = builder_.BuildAndStart();
    ASSERT_NE(server_, nullptr);
  }
  void TearDown() override {
    server_->Shutdown(std::chrono::system_clock::now() + milliseconds(200));
    server_->Wait();
  }
  void Start(OffloadConnection& connection) {
    connection.StartStream(
        [this](const v1::DaemonMessage& message) {
          std::lock_guard lock(received_.mu);
          received_.ids.push_back(message.request_id());
        },
        [this](const grpc::Status& status) {
          std::lock_guard lock(received_.mu);
          ++received_.ends;
          received_.end = status;
          received_.cv.notify_all();
        });
  }
  static v1::ClientMessage Request(uint64_t id) {
    v1::ClientMessage message;
    message.set_request_id(id);
    return message;
  }
  std::shared_ptr<grpc::Channel> Channel() {
    return grpc::CreateChannel(address_, grpc::InsecureChannelCredentials());
  }

  const TempDir dir_{"fuyou-connection-test"};
  const std::string address_ = "unix:" + (dir_.path() / "fuyoud.sock").string();
  EchoOffload service_;
  grpc::ServerBuilder builder_;
  std::unique_ptr<grpc::Server> server_;
  Received received_;
};

TEST_F(OffloadConnectionTest, HandsOverEveryMessageInOrderAndEndsOnce) {
  OffloadConnection connection(Channel(), milliseconds(1234));
  EXPECT_EQ(connection.rpc_timeout(), milliseconds(1234));
  EXPECT_FALSE(connection.has_stream());
  EXPECT_FALSE(connection.Write(Request(1))) << "no stream yet";
  Start(connection);
  ASSERT_TRUE(connection.has_stream());
  for (uint64_t id = 1; id <= 5; ++id) ASSERT_TRUE(connection.Write(Request(id)));
  connection.CloseWrites();
  EXPECT_FALSE(connection.Write(Request(6))) << "after CloseWrites";
  connection.CloseWrites();  // a second half-close is a no-op
  ASSERT_TRUE(received_.WaitForEnd());
  connection.JoinReader();
  std::lock_guard lock(received_.mu);
  EXPECT_EQ(received_.ids, (std::vector<uint64_t>{1, 2, 3, 4, 5}));
  EXPECT_EQ(received_.ends, 1);
  EXPECT_TRUE(received_.end.ok()) << received_.end.error_message();
}

TEST_F(OffloadConnectionTest, TheDaemonsEndReachesTheEndHandlerAndStopsWrites) {
  OffloadConnection connection(Channel(), milliseconds(1000));
  Start(connection);
  ASSERT_TRUE(connection.Write(Request(0)));
  ASSERT_TRUE(received_.WaitForEnd());
  {
    std::lock_guard lock(received_.mu);
    EXPECT_EQ(received_.end.error_code(), grpc::StatusCode::UNAVAILABLE);
    EXPECT_EQ(received_.end.error_message(), "told to end");
  }
  EXPECT_FALSE(connection.Write(Request(1))) << "the stream has ended";
  connection.JoinReader();
}

TEST_F(OffloadConnectionTest, CancelEndsTheReadersWait) {
  OffloadConnection connection(Channel(), milliseconds(1000));
  Start(connection);
  ASSERT_TRUE(connection.Write(Request(1)));
  connection.Cancel();
  ASSERT_TRUE(received_.WaitForEnd());
  connection.JoinReader();
  std::lock_guard lock(received_.mu);
  EXPECT_EQ(received_.end.error_code(), grpc::StatusCode::CANCELLED);
  EXPECT_EQ(received_.ends, 1);
}

}  // namespace
}  // namespace fuyou::internal
