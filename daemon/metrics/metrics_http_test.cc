#include "metrics/metrics_http.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <gtest/gtest.h>

#include <atomic>
#include <string>

namespace fuyou::metrics {
namespace {

// A client socket connected to 127.0.0.1:port (-1 on failure).
int Connect(uint16_t port) {
  const int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  sockaddr_in address{};
  address.sin_family = AF_INET;
  address.sin_port = htons(port);
  address.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  if (::connect(fd, reinterpret_cast<sockaddr*>(&address), sizeof address) != 0) {
    ::close(fd);
    return -1;
  }
  return fd;
}

// Sends `request` and reads until the server closes the connection.
std::string Exchange(uint16_t port, const std::string& request) {
  const int fd = Connect(port);
  if (fd < 0) return "connect failed";
  size_t sent = 0;
  while (sent < request.size()) {
    const ssize_t n = ::send(fd, request.data() + sent, request.size() - sent, MSG_NOSIGNAL);
    if (n <= 0) break;
    sent += static_cast<size_t>(n);
  }
  std::string answer;
  char buffer[4096];
  for (ssize_t n; (n = ::recv(fd, buffer, sizeof buffer, 0)) > 0;) answer.append(buffer, static_cast<size_t>(n));
  ::close(fd);
  return answer;
}

std::string StatusLine(const std::string& answer) { return answer.substr(0, answer.find("\r\n")); }

class MetricsHttpTest : public ::testing::Test {
 protected:
  void SetUp() override {
    auto server = MetricsHttpServer::Start("127.0.0.1:0", [this] {
      ++renders_;
      return std::string("fuyou_sessions 3\n");
    });
    ASSERT_TRUE(server.ok()) << server.status();
    server_ = std::move(*server);
    ASSERT_NE(server_->port(), 0);
  }

  std::atomic<int> renders_{0};
  std::unique_ptr<MetricsHttpServer> server_;
};

TEST_F(MetricsHttpTest, GetMetricsAnswersTheRenderedTextInTheExpositionFormat) {
  const std::string answer = Exchange(server_->port(), "GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n");
  EXPECT_EQ(StatusLine(answer), "HTTP/1.1 200 OK");
  EXPECT_NE(answer.find("Content-Type: text/plain; version=0.0.4; charset=utf-8\r\n"), std::string::npos) << answer;
  EXPECT_EQ(answer.substr(answer.find("\r\n\r\n") + 4), "fuyou_sessions 3\n");
  EXPECT_EQ(renders_.load(), 1);
}

TEST_F(MetricsHttpTest, OtherPathsAreNotFoundAndOtherMethodsNotAllowed) {
  EXPECT_EQ(StatusLine(Exchange(server_->port(), "GET / HTTP/1.1\r\nHost: x\r\n\r\n")), "HTTP/1.1 404 Not Found");
  EXPECT_EQ(StatusLine(Exchange(server_->port(), "GET /metricsx HTTP/1.1\r\nHost: x\r\n\r\n")),
            "HTTP/1.1 404 Not Found");
  EXPECT_EQ(StatusLine(Exchange(server_->port(), "POST /metrics HTTP/1.1\r\nHost: x\r\nContent-Length: 0\r\n\r\n")),
            "HTTP/1.1 405 Method Not Allowed");
  EXPECT_EQ(StatusLine(Exchange(server_->port(), "GET /metrics?x=1 HTTP/1.1\r\nHost: x\r\n\r\n")),
            "HTTP/1.1 200 OK");
  EXPECT_EQ(renders_.load(), 1) << "only the GET of /metrics renders";
}

TEST_F(MetricsHttpTest, OversizedOrMalformedRequestsAreRefused) {
  const std::string huge = "GET /metrics HTTP/1.1\r\nHost: x\r\nX-Pad: " +
                           std::string(MetricsHttpServer::kMaxHeaderBytes * 2, 'a') + "\r\n\r\n";
  EXPECT_EQ(StatusLine(Exchange(server_->port(), huge)), "HTTP/1.1 431 Request Header Fields Too Large");
  EXPECT_EQ(StatusLine(Exchange(server_->port(), "GET /metrics HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\n\r\nhello")),
            "HTTP/1.1 413 Payload Too Large");
  EXPECT_EQ(StatusLine(Exchange(server_->port(), "NOT HTTP AT ALL\r\n\r\n")), "HTTP/1.1 400 Bad Request");
  EXPECT_EQ(renders_.load(), 0);
}

TEST_F(MetricsHttpTest, AClientThatSendsNothingDoesNotHoldUpOthers) {
  std::vector<int> idle;
  for (int i = 0; i < 5; ++i) idle.push_back(Connect(server_->port()));
  const int partial = Connect(server_->port());
  ASSERT_GE(partial, 0);
  ASSERT_GT(::send(partial, "GET /met", 8, MSG_NOSIGNAL), 0);
  EXPECT_EQ(StatusLine(Exchange(server_->port(), "GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n")), "HTTP/1.1 200 OK");
  for (int fd : idle) ::close(fd);
  ::close(partial);
}

TEST_F(MetricsHttpTest, AScrapeGetsThroughFortyHalfSentRequests) {
  // Issue 20: 40 half-sent request lines kept the 32-connection cap full.
  std::vector<int> held;
  for (int i = 0; i < 40; ++i) {
    const int fd = Connect(server_->port());
    ASSERT_GE(fd, 0);
    (void)::send(fd, "GET /met", 8, MSG_NOSIGNAL);
    held.push_back(fd);
  }
  EXPECT_EQ(StatusLine(Exchange(server_->port(), "GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n")), "HTTP/1.1 200 OK");
  for (int fd : held) ::close(fd);
}

TEST(SocketOwnerUidTest, FindsThePeersLineInProcNetTcp) {
  const std::string text =
      "  sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode\n"
      "   0: 0100007F:24FC 00000000:0000 0A 00000000:00000000 00:00000000 00000000     0        0 1 1 0\n"
      "   1: 0100007F:C350 0100007F:24FC 01 00000000:00000000 00:00000000 00000000 65534        0 2 1 0\n";
  const uint32_t loopback = 0x7F000001;
  EXPECT_EQ(SocketOwnerUid(text, loopback, 0xC350, loopback, 0x24FC), 65534u);
  EXPECT_FALSE(SocketOwnerUid(text, loopback, 0xC351, loopback, 0x24FC).has_value());
}

TEST_F(MetricsHttpTest, StopClosesThePort) {
  const uint16_t port = server_->port();
  server_->Stop();
  server_->Stop();  // idempotent
  EXPECT_EQ(Connect(port), -1);
}

TEST(MetricsHttpStartTest, RefusesBadAddressesWithTheSettingsForm) {
  for (const char* address : {"", "9464", "127.0.0.1", "127.0.0.1:", "127.0.0.1:70000", "::1:9464", "[::1:9464",
                              "127.0.0.1:94x4"}) {
    auto server = MetricsHttpServer::Start(address, [] { return std::string(); });
    ASSERT_FALSE(server.ok()) << address;
    EXPECT_EQ(server.status().code(), absl::StatusCode::kInvalidArgument) << address;
    EXPECT_NE(server.status().message().find("host:port"), std::string::npos) << server.status();
  }
  auto name = MetricsHttpServer::Start("example.com:9464", [] { return std::string(); });
  EXPECT_EQ(name.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(name.status().message().find("numeric IP"), std::string::npos) << name.status();
}

TEST(MetricsHttpStartTest, APortInUseIsUnavailable) {
  auto first = MetricsHttpServer::Start("127.0.0.1:0", [] { return std::string(); });
  ASSERT_TRUE(first.ok());
  auto second = MetricsHttpServer::Start("127.0.0.1:" + std::to_string((*first)->port()), [] { return std::string(); });
  ASSERT_FALSE(second.ok());
  EXPECT_EQ(second.status().code(), absl::StatusCode::kUnavailable) << second.status();
}

TEST(MetricsHttpStartTest, ServesOnIpv6LoopbackAndLocalhost) {
  EXPECT_TRUE(MetricsHttpServer::Start("localhost:0", [] { return std::string(); }).ok());
  auto v6 = MetricsHttpServer::Start("[::1]:0", [] { return std::string(); });
  if (!v6.ok()) GTEST_SKIP() << "no IPv6 loopback here: " << v6.status();
}

}  // namespace
}  // namespace fuyou::metrics
