#include "server/connection_table.h"

#include <gtest/gtest.h>
#include <sys/socket.h>
#include <unistd.h>

#include <string>
#include <vector>

namespace fuyou {
namespace {

// One end of a socket pair, the other kept open so that the connection lives.
struct Pair {
  int fds[2] = {-1, -1};
  Pair() { ::socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, fds); }
  ~Pair() { Close(); }
  void Close() {
    for (int& fd : fds) {
      if (fd >= 0) ::close(fd);
      fd = -1;
    }
  }
  int server() const { return fds[0]; }
};

void ExpectRefusal(const absl::Status& status, const std::vector<std::string>& words) {
  EXPECT_EQ(status.code(), absl::StatusCode::kResourceExhausted) << status;
  for (const std::string& word : words) {
    EXPECT_NE(status.message().find(word), std::string::npos) << word << " in: " << status.message();
  }
}

TEST(ConnectionTableTest, BoundsTheConnectionsOfOneUidAndInAll) {
  ConnectionTable table(ConnectionLimits{.max_connections = 3, .max_connections_per_user = 2});
  Pair a, b, c, d, e;
  ASSERT_TRUE(table.Admit(a.server(), {.uid = 1000}).ok());
  ASSERT_TRUE(table.Admit(b.server(), {.uid = 1000}).ok());
  ExpectRefusal(table.Admit(c.server(), {.uid = 1000}),
                {"uid 1000", "has 2 connections", "max_connections_per_user (2)", "--max-connections-per-user"});
  EXPECT_EQ(table.CountOf(1000), 2u);
  // Another user still gets in, up to the total.
  ASSERT_TRUE(table.Admit(d.server(), {.uid = 1001}).ok());
  ExpectRefusal(table.Admit(e.server(), {.uid = 1002}), {"3 connections are open", "max_connections (3)"});
  EXPECT_EQ(table.total(), 3u);
  EXPECT_EQ(table.PeerOf(d.server())->uid, 1001u);
}

TEST(ConnectionTableTest, ForgetsConnectionsWhoseFdWasClosedOrReused) {
  ConnectionTable table(ConnectionLimits{.max_connections = 10, .max_connections_per_user = 1});
  auto a = std::make_unique<Pair>();
  const int fd = a->server();
  ASSERT_TRUE(table.Admit(fd, {.uid = 7}).ok());
  a->Close();  // what gRPC does when the connection ends
  EXPECT_EQ(table.Sweep(), 0u);
  EXPECT_EQ(table.CountOf(7), 0u);
  // A call gRPC read before the end still runs as its user.
  EXPECT_EQ(table.PeerOf(fd)->uid, 7u);
  // The same number reused by another file is not the connection either.
  Pair b;
  ASSERT_TRUE(table.Admit(b.server(), {.uid = 7}).ok());
  const int number = b.server();
  ::close(b.fds[0]);
  Pair c;  // most likely gets `number` again
  b.fds[0] = -1;
  if (c.server() == number || c.fds[1] == number) {
    EXPECT_EQ(table.Sweep(), 0u);
  }
  ASSERT_TRUE(table.Admit(c.server(), {.uid = 7}).ok()) << "the closed connection must not count";
}

TEST(ConnectionTableTest, KeepsTheDescriptorsAboveTheBoundFree) {
  Pair a;
  ConnectionTable table(ConnectionLimits{.max_connections = 10, .max_connections_per_user = 10,
                                         .max_connection_fd = a.server()});
  ExpectRefusal(table.Admit(a.server(), {.uid = 5}), {"descriptors", "LimitNOFILE", "max_connections"});
  EXPECT_EQ(table.total(), 0u);
}

TEST(ConnectionTableTest, ShutsDownConnectionsThatCarryNoCall) {
  using std::chrono::seconds;
  ConnectionTable table(ConnectionLimits{.max_connections = 10, .max_connections_per_user = 10});
  Pair idle, busy;
  ASSERT_TRUE(table.Admit(idle.server(), {.uid = 1}).ok());
  ASSERT_TRUE(table.Admit(busy.server(), {.uid = 1}).ok());
  table.CallStarted(busy.server());
  const auto later = std::chrono::steady_clock::now() + seconds(10);
  EXPECT_EQ(table.CloseIdle(seconds(60), later), 0u) << "not idle for long enough";
  EXPECT_EQ(table.CloseIdle(seconds(5), later), 1u);
  EXPECT_EQ(table.total(), 1u);
  char byte = 0;
  EXPECT_EQ(::recv(idle.fds[1], &byte, 1, MSG_DONTWAIT), 0) << "the peer sees the end of the connection";
  // The busy one becomes idle when its call ends.
  table.CallEnded(busy.server());
  EXPECT_EQ(table.CloseIdle(seconds(30), later), 0u) << "idle only since now";
  EXPECT_EQ(table.CloseIdle(seconds(30), later + seconds(30)), 1u);
}

}  // namespace
}  // namespace fuyou
