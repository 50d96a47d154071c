// ConnectTrusted (issues 20 and 32): a client refuses a socket directory or a
// link another user controls, and a daemon run by another unprivileged user;
// the connection it checks is the one it returns, even while the socket at the
// path is swapped between a trusted listener and an untrusted one.
#include "trusted_socket.h"

#include <gtest/gtest.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <cstring>
#include <filesystem>
#include <string>
#include <thread>

#include "fuyou/daemon_trust.h"
#include "test_support/temp_dir.h"

namespace fuyou::internal {
namespace {
namespace fs = std::filesystem;
using std::chrono::milliseconds;

constexpr uid_t kNobody = 65534;

class TrustedSocketTest : public ::testing::Test {
 protected:
  const TempDir temp_dir_{"fuyou-trusted-socket-test"};
  const fs::path dir_ = temp_dir_.path();
};

// Listens on `path`; returns the listening fd, or -1.
int Listen(const fs::path& path) {
  const int fd = ::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
  sockaddr_un address{};
  address.sun_family = AF_UNIX;
  std::strncpy(address.sun_path, path.c_str(), sizeof(address.sun_path) - 1);
  if (::bind(fd, reinterpret_cast<sockaddr*>(&address), sizeof(address)) != 0 || ::listen(fd, 64) != 0) return -1;
  return fd;
}

// Accepts and closes connections on `listener` until it is shut down.
void AcceptAll(int listener) {
  for (;;) {
    const int connection = ::accept(listener, nullptr, nullptr);
    if (connection < 0) return;
    ::close(connection);
  }
}

// A process of uid 65534 that listens on `path` and accepts everything: another
// user's "daemon". Killed by the destructor.
class OtherUsersListener {
 public:
  explicit OtherUsersListener(const fs::path& path) {
    int ready[2];
    EXPECT_EQ(::pipe(ready), 0);
    pid_ = ::fork();
    if (pid_ == 0) {
      if (::setgid(kNobody) != 0 || ::setuid(kNobody) != 0) ::_exit(1);
      const int fd = Listen(path);
      char byte = fd >= 0 ? 'y' : 'n';
      (void)::write(ready[1], &byte, 1);
      if (fd >= 0) AcceptAll(fd);
      ::_exit(0);
    }
    char byte = 0;
    ok_ = ::read(ready[0], &byte, 1) == 1 && byte == 'y';
    ::close(ready[0]);
    ::close(ready[1]);
  }
  ~OtherUsersListener() {
    ::kill(pid_, SIGKILL);
    ::waitpid(pid_, nullptr, 0);
  }
  bool ok() const { return ok_; }

 private:
  pid_t pid_ = -1;
  bool ok_ = false;
};

pid_t PeerPid(int fd) {
  ucred peer{};
  socklen_t length = sizeof peer;
  EXPECT_EQ(::getsockopt(fd, SOL_SOCKET, SO_PEERCRED, &peer, &length), 0);
  return peer.pid;
}

TEST_F(TrustedSocketTest, ConnectsToItsOwnDaemonInItsOwnDirectory) {
  const int listener = Listen(dir_ / "fuyoud.sock");
  ASSERT_GE(listener, 0);
  absl::StatusOr<ConnectedSocket> socket = ConnectTrusted((dir_ / "fuyoud.sock").string(), milliseconds(1000));
  ASSERT_TRUE(socket.ok()) << socket.status();
  EXPECT_EQ(socket->peer_uid(), ::geteuid());
  EXPECT_EQ(PeerPid(socket->fd()), ::getpid());
  ::close(listener);
  EXPECT_TRUE(CheckSocketPath((dir_ / "missing" / "fuyoud.sock").string()).ok()) << "nothing to check yet";
}

TEST_F(TrustedSocketTest, ReportsAMissingDaemonAfterWaitingForIt) {
  const auto start = std::chrono::steady_clock::now();
  absl::StatusOr<ConnectedSocket> socket = ConnectTrusted((dir_ / "fuyoud.sock").string(), milliseconds(300));
  EXPECT_GE(std::chrono::steady_clock::now() - start, milliseconds(250));
  EXPECT_EQ(socket.status().code(), absl::StatusCode::kUnavailable) << socket.status();
  EXPECT_NE(socket.status().message().find("does not exist"), std::string::npos) << socket.status();
}

TEST_F(TrustedSocketTest, RefusesADirectoryOthersCanWrite) {
  ASSERT_EQ(::chmod(dir_.c_str(), 0777), 0);
  const absl::Status status = CheckSocketPath((dir_ / "fuyoud.sock").string());
  EXPECT_TRUE(IsUntrustedDaemon(status)) << status;
  EXPECT_NE(status.message().find(dir_.string()), std::string::npos) << status;
  EXPECT_NE(status.message().find("chmod go-w"), std::string::npos) << status;
}

TEST_F(TrustedSocketTest, RefusesADirectoryOfAnotherUser) {
  if (::geteuid() != 0) GTEST_SKIP() << "needs root to chown";
  const fs::path squatted = dir_ / "fuyou-1000";
  ASSERT_EQ(::mkdir(squatted.c_str(), 0755), 0);
  ASSERT_EQ(::chown(squatted.c_str(), kNobody, kNobody), 0);
  absl::StatusOr<ConnectedSocket> socket = ConnectTrusted((squatted / "fuyoud.sock").string(), milliseconds(1000));
  EXPECT_TRUE(IsUntrustedDaemon(socket.status())) << socket.status();
  EXPECT_NE(socket.status().message().find("belongs to uid 65534"), std::string::npos) << socket.status();
  EXPECT_NE(socket.status().message().find((squatted / "fuyoud.sock").string()), std::string::npos);
  EXPECT_NE(socket.status().message().find("nothing was sent"), std::string::npos);
}

TEST_F(TrustedSocketTest, RefusesALinkOfAnotherUserOnTheWay) {
  if (::geteuid() != 0) GTEST_SKIP() << "needs root to give a link away";
  // Root's sticky directory (as /tmp), with the trusted daemon in it...
  const fs::path shared = dir_ / "shared";
  ASSERT_EQ(::mkdir(shared.c_str(), 01777), 0);
  ASSERT_EQ(::chmod(shared.c_str(), 01777), 0);
  const int listener = Listen(shared / "fuyoud.sock");
  ASSERT_GE(listener, 0);
  // ...reached through another user's link (/tmp/fuyou-<uid> -> /tmp), which
  // that user may point elsewhere at any time.
  const fs::path link = dir_ / "fuyou-1000";
  ASSERT_EQ(::symlink(shared.c_str(), link.c_str()), 0);
  ASSERT_EQ(::lchown(link.c_str(), kNobody, kNobody), 0);
  absl::StatusOr<ConnectedSocket> socket = ConnectTrusted((link / "fuyoud.sock").string(), milliseconds(1000));
  EXPECT_TRUE(IsUntrustedDaemon(socket.status())) << socket.status();
  EXPECT_NE(socket.status().message().find("symbolic link " + link.string()), std::string::npos) << socket.status();
  EXPECT_NE(socket.status().message().find("uid 65534"), std::string::npos) << socket.status();
  // The socket itself as another user's link, in a directory that is trusted.
  const fs::path flipped = shared / "other.sock";
  ASSERT_EQ(::symlink((shared / "fuyoud.sock").c_str(), flipped.c_str()), 0);
  ASSERT_EQ(::lchown(flipped.c_str(), kNobody, kNobody), 0);
  EXPECT_TRUE(IsUntrustedDaemon(CheckSocketPath(flipped.string())));
  // Root's own link is trusted.
  ASSERT_EQ(::lchown(link.c_str(), 0, 0), 0);
  EXPECT_TRUE(ConnectTrusted((link / "fuyoud.sock").string(), milliseconds(1000)).ok());
  ::close(listener);
}

TEST_F(TrustedSocketTest, RefusesADaemonOfAnotherUnprivilegedUser) {
  if (::geteuid() != 0) GTEST_SKIP() << "needs root to act as another user";
  // A directory the client may trust (root's, sticky, as /tmp)...
  ASSERT_EQ(::chmod(dir_.c_str(), 01777), 0);
  const fs::path path = dir_ / "fuyoud.sock";
  // ...and a "daemon" of uid 65534 behind the socket.
  OtherUsersListener other(path);
  ASSERT_TRUE(other.ok());
  absl::StatusOr<ConnectedSocket> socket = ConnectTrusted(path.string(), milliseconds(1000));
  EXPECT_TRUE(IsUntrustedDaemon(socket.status())) << socket.status();
  EXPECT_NE(socket.status().message().find("runs as uid 65534"), std::string::npos) << socket.status();
  EXPECT_NE(socket.status().message().find(path.string()), std::string::npos) << socket.status();
}

// Issue 32: the socket at the path flips between a trusted listener (this
// process, root) and another user's, as fast as renames go. Every connection
// ConnectTrusted returns is the trusted listener's; every other try is refused
// as an untrusted daemon. (The old check probed with one connection and let
// gRPC make another.)
TEST_F(TrustedSocketTest, AFlippedSocketNeverHandsOverTheOtherUsersConnection) {
  if (::geteuid() != 0) GTEST_SKIP() << "needs root to act as another user";
  ASSERT_EQ(::chmod(dir_.c_str(), 01777), 0);
  OtherUsersListener other(dir_ / "other.sock");
  ASSERT_TRUE(other.ok());
  const int trusted = Listen(dir_ / "trusted.sock");
  ASSERT_GE(trusted, 0);
  std::thread accepter(AcceptAll, trusted);
  // Plain sockets renamed into place (no link for CheckSocketPath to see): only
  // the check of the connection itself can tell them apart.
  const fs::path path = dir_ / "fuyoud.sock";
  std::atomic<bool> stop{false};
  std::thread flipper([&] {
    for (int i = 0; !stop.load(); ++i) {
      const fs::path from = dir_ / (i % 2 == 0 ? "trusted.sock" : "other.sock");
      const fs::path staged = dir_ / "staged.sock";
      ::unlink(staged.c_str());
      if (::link(from.c_str(), staged.c_str()) == 0) ::rename(staged.c_str(), path.c_str());
    }
  });
  int connected = 0, refused = 0;
  for (int attempt = 0; attempt < 3000 && (attempt < 500 || connected == 0 || refused == 0); ++attempt) {
    absl::StatusOr<ConnectedSocket> socket = ConnectTrusted(path.string(), milliseconds(1000));
    if (socket.ok()) {
      ++connected;
      ASSERT_EQ(PeerPid(socket->fd()), ::getpid()) << "a connection to the other user's listener was returned";
      ASSERT_EQ(socket->peer_uid(), 0u);
    } else {
      ++refused;
      ASSERT_TRUE(IsUntrustedDaemon(socket.status())) << socket.status();
      ASSERT_NE(socket.status().message().find("runs as uid 65534"), std::string::npos) << socket.status();
    }
  }
  stop = true;
  flipper.join();
  ::shutdown(trusted, SHUT_RDWR);
  accepter.join();
  ::close(trusted);
  EXPECT_GT(connected, 0);
  EXPECT_GT(refused, 0) << "the flip never showed the other user's listener";
}

TEST_F(TrustedSocketTest, ASecondSocketMustBeServedByTheSameUid) {
  if (::geteuid() != 0) GTEST_SKIP() << "needs root to act as another user";
  ASSERT_EQ(::chmod(dir_.c_str(), 01777), 0);
  OtherUsersListener other(dir_ / "segment.sock");
  ASSERT_TRUE(other.ok());
  const int fd = ::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
  sockaddr_un address{};
  address.sun_family = AF_UNIX;
  std::strncpy(address.sun_path, (dir_ / "segment.sock").c_str(), sizeof(address.sun_path) - 1);
  ASSERT_EQ(::connect(fd, reinterpret_cast<sockaddr*>(&address), sizeof(address)), 0);
  EXPECT_TRUE(CheckPeerIs(fd, kNobody, "segment.sock").ok());
  const absl::Status status = CheckPeerIs(fd, 0, (dir_ / "segment.sock").string());
  EXPECT_TRUE(IsUntrustedDaemon(status)) << status;
  EXPECT_NE(status.message().find("served by uid 65534"), std::string::npos) << status;
  ::close(fd);
}

}  // namespace
}  // namespace fuyou::internal
