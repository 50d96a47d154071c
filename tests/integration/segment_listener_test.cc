// SegmentListener on a real socket, with a recording handler: the framing of a
// handover (one line, one fd), the reply line, the limits, and that a client
// that sends nothing holds no one up. The client side is clientlib's
// SendSegmentHandover, so both ends of the protocol are tested together.
#include "server/segment_listener.h"

#include <fcntl.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <gtest/gtest.h>

#include <atomic>
#include <cstring>
#include <mutex>
#include <string>
#include <vector>

#include "fmt/format.h"
#include "fuyou/client_segment.h"
#include "fuyou/segment_handover.h"
#include "server/socket_path.h"
#include "test_support/temp_dir.h"

namespace fuyou {
namespace {

using std::chrono::milliseconds;
constexpr milliseconds kClientTimeout{20000};

struct Call {
  PeerCredentials peer;
  std::string session_id;
  int64_t fd_size = -1;
  bool fd_cloexec = false;
};

class SegmentListenerTest : public ::testing::Test {
 protected:
  void SetUp() override {
    ::signal(SIGPIPE, SIG_IGN);
    path_ = dir_ + "/fuyoud.sock.seg";
  }
  void TearDown() override {
    listener_.reset();
  }
  void Start(SegmentListener::Options options = {}) {
    ASSERT_TRUE(PrepareSocketPath(path_).ok());
    auto listener = SegmentListener::Listen(
        path_, 0600,
        [this](const PeerCredentials& peer, const std::string& id, int fd) {
          struct stat info {};
          Call call{peer, id, ::fstat(fd, &info) == 0 ? info.st_size : -1,
                    (::fcntl(fd, F_GETFD) & FD_CLOEXEC) != 0};
          std::lock_guard lock(mu_);
          calls_.push_back(call);
          return reply_;
        },
        options);
    ASSERT_TRUE(listener.ok()) << listener.status();
    listener_ = std::move(*listener);
    listener_->Serve();
  }
  std::vector<Call> Calls() {
    std::lock_guard lock(mu_);
    return calls_;
  }
  // A connected client socket.
  int Connect() {
    int fd = ::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
    sockaddr_un address{};
    address.sun_family = AF_UNIX;
    std::strncpy(address.sun_path, path_.c_str(), sizeof(address.sun_path) - 1);
    EXPECT_EQ(::connect(fd, reinterpret_cast<sockaddr*>(&address), sizeof address), 0) << std::strerror(errno);
    return fd;
  }
  // Reads the reply line on `fd` (blocking).
  static std::string ReadLine(int fd) {
    std::string line;
    char c;
    while (::recv(fd, &c, 1, 0) == 1 && c != '\n') line += c;
    return line;
  }

  const TempDir temp_dir_{"segment-listener-test"};
  const std::string dir_ = temp_dir_.path().string();
  std::string path_;
  std::mutex mu_;
  std::vector<Call> calls_;
  absl::Status reply_;
  std::unique_ptr<SegmentListener> listener_;
};

TEST_F(SegmentListenerTest, AHandoverReachesTheHandlerWithTheCallerAndItsFd) {
  Start();
  auto segment = ClientSegment::Create(3 * 4096);
  ASSERT_TRUE(segment.ok()) << segment.status();
  absl::Status status = (*segment)->HandOver(path_, "s-0123", kClientTimeout);
  EXPECT_TRUE(status.ok()) << status;
  std::vector<Call> calls = Calls();
  ASSERT_EQ(calls.size(), 1u);
  EXPECT_EQ(calls[0].session_id, "s-0123");
  EXPECT_EQ(calls[0].peer.uid, ::getuid());
  EXPECT_EQ(calls[0].peer.pid, ::getpid());
  EXPECT_EQ(calls[0].fd_size, 3 * 4096);
  EXPECT_TRUE(calls[0].fd_cloexec) << "a received fd must not leak into a child the daemon might start";
}

TEST_F(SegmentListenerTest, TheHandlersStatusIsTheReply) {
  reply_ = absl::NotFoundError("no open session has id 's-1'");
  Start();
  auto segment = ClientSegment::Create(4096);
  ASSERT_TRUE(segment.ok());
  absl::Status status = (*segment)->HandOver(path_, "s-1", kClientTimeout);
  EXPECT_EQ(status.code(), absl::StatusCode::kNotFound) << status;
  EXPECT_EQ(status.message(), "no open session has id 's-1'");
}

TEST_F(SegmentListenerTest, AMessageWithoutAnFdIsRefused) {
  Start();
  absl::Status status = SendSegmentHandover(path_, "s-1\n", -1, kClientTimeout);
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument) << status;
  EXPECT_NE(std::string(status.message()).find("carried no fd"), std::string::npos) << status;
  EXPECT_TRUE(Calls().empty());
}

TEST_F(SegmentListenerTest, AMessageLongerThanTheLimitIsRefused) {
  Start();
  auto segment = ClientSegment::Create(4096);
  ASSERT_TRUE(segment.ok());
  const std::string id(kMaxHandoverMessageBytes, 'a');  // + '\n' is one byte too many
  absl::Status status = (*segment)->HandOver(path_, id, kClientTimeout);
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument) << status;
  EXPECT_NE(std::string(status.message()).find("at most 128 bytes"), std::string::npos) << status;
  // The longest allowed id passes.
  status = (*segment)->HandOver(path_, std::string(kMaxHandoverMessageBytes - 1, 'a'), kClientTimeout);
  EXPECT_TRUE(status.ok()) << status;
  ASSERT_EQ(Calls().size(), 1u);
}

TEST_F(SegmentListenerTest, AMessageWithoutNewlineIsRefusedWhenTheClientStopsSending) {
  Start();
  auto segment = ClientSegment::Create(4096);
  ASSERT_TRUE(segment.ok());
  const int fd = Connect();
  ASSERT_EQ(::send(fd, "s-1", 3, 0), 3);
  ::shutdown(fd, SHUT_WR);
  EXPECT_EQ(ReadLine(fd).rfind("ERR INVALID_ARGUMENT the handover message must be", 0), 0u);
  ::close(fd);
  EXPECT_TRUE(Calls().empty());
}

TEST_F(SegmentListenerTest, AMessageInPiecesIsAssembled) {
  Start();
  auto segment = ClientSegment::Create(4096);
  ASSERT_TRUE(segment.ok());
  const int fd = Connect();
  ASSERT_EQ(::send(fd, "s-", 2, 0), 2);
  // The fd travels with the second piece.
  const std::string rest = "42\n";
  const int memfd = (*segment)->fd();
  ASSERT_EQ(SendWithFds(fd, rest, std::span(&memfd, 1), 0), 3);
  EXPECT_EQ(ReadLine(fd), "OK");
  ::close(fd);
  ASSERT_EQ(Calls().size(), 1u);
  EXPECT_EQ(Calls()[0].session_id, "s-42");
}

TEST_F(SegmentListenerTest, ExtraFdsAreClosedAndTheFirstIsUsed) {
  Start();
  auto segment = ClientSegment::Create(2 * 4096);
  ASSERT_TRUE(segment.ok());
  // Two pipes' read ends go along as extra fds; once the listener has closed its
  // copies (and this process its own), their write ends have no reader left.
  int first[2], second[2];
  ASSERT_EQ(::pipe2(first, O_CLOEXEC), 0);
  ASSERT_EQ(::pipe2(second, O_CLOEXEC), 0);
  const int fds[3] = {(*segment)->fd(), first[0], second[0]};
  const int connection = Connect();
  const std::string payload = "s-7\n";
  ASSERT_EQ(SendWithFds(connection, payload, fds, 0), static_cast<long>(payload.size()));
  ::close(first[0]);
  ::close(second[0]);
  EXPECT_EQ(ReadLine(connection), "OK");
  ::close(connection);
  ASSERT_EQ(Calls().size(), 1u);
  EXPECT_EQ(Calls()[0].fd_size, 2 * 4096) << "the first fd is the segment";
  EXPECT_EQ(::write(first[1], "x", 1), -1);
  EXPECT_EQ(errno, EPIPE);
  EXPECT_EQ(::write(second[1], "x", 1), -1);
  EXPECT_EQ(errno, EPIPE);
  ::close(first[1]);
  ::close(second[1]);
}

TEST_F(SegmentListenerTest, AClientThatSendsNothingIsAnsweredAtItsDeadlineAndHoldsNoOneUp) {
  Start({.timeout = milliseconds(500)});
  const int idle = Connect();
  // Another client's handover is served while the idle one waits.
  auto segment = ClientSegment::Create(4096);
  ASSERT_TRUE(segment.ok());
  EXPECT_TRUE((*segment)->HandOver(path_, "s-2", kClientTimeout).ok());
  EXPECT_EQ(ReadLine(idle).rfind("ERR DEADLINE_EXCEEDED no complete handover message within 500 ms", 0), 0u);
  ::close(idle);
}

TEST_F(SegmentListenerTest, TooManyWaitingConnectionsOfOneUidAreRefusedAtOnce) {
  Start({.timeout = milliseconds(60000), .max_pending = 256, .max_pending_per_uid = 2});
  const int idle1 = Connect();
  const int idle2 = Connect();
  const int third = Connect();
  EXPECT_EQ(ReadLine(third).rfind("ERR RESOURCE_EXHAUSTED too many segment handovers waiting", 0), 0u);
  ::close(third);
  // Once one of the idle ones is gone, a handover is served again.
  ::close(idle1);
  auto segment = ClientSegment::Create(4096);
  ASSERT_TRUE(segment.ok());
  absl::Status status;
  // The listener notices the closed connection on its next poll; until then the
  // uid may still be at its limit.
  for (int attempt = 0; attempt < 100; ++attempt) {
    status = (*segment)->HandOver(path_, "s-3", kClientTimeout);
    if (status.code() != absl::StatusCode::kResourceExhausted) break;
    ::usleep(20000);
  }
  EXPECT_TRUE(status.ok()) << status;
  ::close(idle2);
}

TEST(HandoverReplyTest, EveryCodeRoundTrips) {
  EXPECT_EQ(FormatHandoverReply(absl::OkStatus()), "OK\n");
  EXPECT_TRUE(ParseHandoverReply("OK\n").ok());
  for (int code = 1; code <= 16; ++code) {
    const absl::Status status(static_cast<absl::StatusCode>(code), "what failed\nand why");
    const std::string line = FormatHandoverReply(status);
    EXPECT_EQ(line.find('\n'), line.size() - 1) << "one line: " << line;
    const absl::Status parsed = ParseHandoverReply(line);
    EXPECT_EQ(parsed.code(), status.code()) << line;
    EXPECT_EQ(parsed.message(), "what failed and why");
  }
  EXPECT_EQ(FormatHandoverReply(absl::FailedPreconditionError("x")), "ERR FAILED_PRECONDITION x\n");
  EXPECT_EQ(ParseHandoverReply("HTTP/1.1 400").code(), absl::StatusCode::kUnavailable);
  EXPECT_EQ(ParseHandoverReply("ERR NO_SUCH_CODE m").code(), absl::StatusCode::kUnknown);
}

}  // namespace
}  // namespace fuyou
