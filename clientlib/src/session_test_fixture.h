// The fixture of the Session tests (session_*_test.cc, one binary): the fake
// Offload service of session_test_fake.h served on a Unix socket in a
// temporary directory, with its segment socket beside it, and small helpers.
#pragma once

#include <fcntl.h>
#include <poll.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <gtest/gtest.h>

#include <cstring>
#include <memory>
#include <span>
#include <string>
#include <thread>
#include <vector>

#include "fuyou/client.h"
#include "fuyou/segment_handover.h"
#include "grpcpp/server.h"
#include "grpcpp/server_builder.h"
#include "session_test_fake.h"
#include "test_support/temp_dir.h"

namespace fuyou::session_test {

// The segment socket of the fake: one handover at a time, on its own thread.
class FakeSegmentSocket {
 public:
  FakeSegmentSocket(const std::string& path, FakeOffload& fake) : fake_(fake) {
    listen_fd_ = ::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
    sockaddr_un address{};
    address.sun_family = AF_UNIX;
    std::strncpy(address.sun_path, path.c_str(), sizeof(address.sun_path) - 1);
    EXPECT_EQ(::bind(listen_fd_, reinterpret_cast<sockaddr*>(&address), sizeof address), 0);
    EXPECT_EQ(::listen(listen_fd_, 16), 0);
    EXPECT_EQ(::pipe2(stop_, O_CLOEXEC), 0);
    thread_ = std::thread([this] { Serve(); });
  }
  ~FakeSegmentSocket() {
    (void)::write(stop_[1], "x", 1);
    thread_.join();
    ::close(listen_fd_);
    ::close(stop_[0]);
    ::close(stop_[1]);
  }

 private:
  void Serve() {
    for (;;) {
      pollfd fds[2] = {{listen_fd_, POLLIN, 0}, {stop_[0], POLLIN, 0}};
      if (::poll(fds, 2, -1) < 0 || fds[1].revents != 0) return;
      const int connection = ::accept4(listen_fd_, nullptr, nullptr, SOCK_CLOEXEC);
      if (connection < 0) continue;
      char buffer[kMaxHandoverMessageBytes];
      alignas(cmsghdr) char control[CMSG_SPACE(sizeof(int))];
      iovec data{buffer, sizeof buffer};
      msghdr message{};
      message.msg_iov = &data;
      message.msg_iovlen = 1;
      message.msg_control = control;
      message.msg_controllen = sizeof control;
      const ssize_t got = ::recvmsg(connection, &message, MSG_CMSG_CLOEXEC);
      int fd = -1;
      cmsghdr* header = got > 0 ? CMSG_FIRSTHDR(&message) : nullptr;
      if (header != nullptr && header->cmsg_type == SCM_RIGHTS) std::memcpy(&fd, CMSG_DATA(header), sizeof fd);
      const std::string text(buffer, got > 0 ? static_cast<size_t>(got) : 0);
      absl::Status status = absl::InvalidArgumentError("malformed handover");
      if (fd >= 0 && !text.empty() && text.back() == '\n') {
        status = fake_.ReceiveSegment(text.substr(0, text.size() - 1), fd);
      }
      if (fd >= 0) ::close(fd);
      const std::string reply = FormatHandoverReply(status);
      (void)::send(connection, reply.data(), reply.size(), MSG_NOSIGNAL);
      ::close(connection);
    }
  }

  FakeOffload& fake_;
  int listen_fd_ = -1;
  int stop_[2] = {-1, -1};
  std::thread thread_;
};

inline std::span<std::byte> Bytes(std::vector<float>& v) { return std::as_writable_bytes(std::span(v)); }
inline std::span<const std::byte> ConstBytes(const std::vector<float>& v) { return std::as_bytes(std::span(v)); }

inline ChunkSpec Float32Chunk(uint32_t id, uint64_t elements) {
  return ChunkSpec{.chunk_id = id, .num_elements = elements};
}

inline bool Contains(const absl::Status& status, std::string_view text) {
  return std::string(status.message()).find(text) != std::string::npos;
}

class SessionTest : public ::testing::Test {
 protected:
  void SetUp() override {
    address_ = "unix:" + dir_ + "/fuyoud.sock";
    fake_.segment_socket = dir_ + "/fuyoud.sock" + std::string(kSegmentSocketSuffix);
    segment_socket_ = std::make_unique<FakeSegmentSocket>(fake_.segment_socket, fake_);
    grpc::ServerBuilder builder;
    builder.AddListeningPort(address_, grpc::InsecureServerCredentials());
    builder.RegisterService(&fake_);
    server_ = builder.BuildAndStart();
    ASSERT_NE(server_, nullptr);
  }
  void TearDown() override {
    ShutdownServer();
    segment_socket_.reset();
  }
  void ShutdownServer() {
    if (server_ != nullptr) {
      server_->Shutdown(std::chrono::system_clock::now() + milliseconds(200));
      server_->Wait();
      server_.reset();
    }
  }

  ClientOptions Client() const {
    ClientOptions client;
    client.address = address_;
    client.rpc_timeout = milliseconds(10000);
    client.connect_timeout = milliseconds(2000);
    return client;
  }
  absl::StatusOr<std::unique_ptr<Session>> Open(uint32_t slots = 2, uint64_t slot_bytes = 4000) {
    return Session::Open({.job = "test-job", .num_slots = slots, .slot_bytes = slot_bytes}, Client());
  }

  const TempDir temp_dir_{"fuyou-session-test"};
  const std::string dir_ = temp_dir_.path().string();
  std::string address_;
  FakeOffload fake_;
  std::unique_ptr<FakeSegmentSocket> segment_socket_;
  std::unique_ptr<grpc::Server> server_;
};

inline ChunkSpec StoredWeightsChunk(uint32_t id, uint64_t elements) {
  return ChunkSpec{.chunk_id = id, .num_elements = elements, .store_weights = true};
}

inline std::vector<float> SlotFloats(Session& s, uint32_t slot, size_t n) {
  const auto* p = reinterpret_cast<const float*>(s.ParamRegion(slot).data());
  return std::vector<float>(p, p + n);
}

}  // namespace fuyou::session_test
