// ConnectChannel and NeedsTrustCheck: which addresses are checked, and a checked
// channel that refuses an untrusted daemon before anything is sent (the checks
// themselves: trusted_socket_test.cc).
#include "channel.h"

#include <gtest/gtest.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <string>

#include "fuyou/daemon_trust.h"
#include "fuyou/defaults.h"
#include "test_support/temp_dir.h"

namespace fuyou::internal {
namespace {
namespace fs = std::filesystem;
using std::chrono::milliseconds;

// Sets an environment variable for one test.
class ScopedEnv {
 public:
  ScopedEnv(const char* name, const char* value) : name_(name) {
    if (const char* old = std::getenv(name); old != nullptr) old_ = old;
    if (value == nullptr) ::unsetenv(name);
    else ::setenv(name, value, 1);
  }
  ~ScopedEnv() {
    if (old_.has_value()) ::setenv(name_, old_->c_str(), 1);
    else ::unsetenv(name_);
  }

 private:
  const char* name_;
  std::optional<std::string> old_;
};

ClientOptions At(std::string address) {
  ClientOptions options;
  options.address = std::move(address);
  return options;
}

TEST(NeedsTrustCheckTest, TheDefaultSocketsAreCheckedHoweverTheyAreNamed) {
  const TempDir runtime("fuyou-channel-xdg");
  ScopedEnv no_socket("FUYOU_SOCKET", nullptr);
  ScopedEnv xdg("XDG_RUNTIME_DIR", runtime.path().c_str());
  const std::string user_socket = (runtime.path() / "fuyou" / "fuyoud.sock").string();
  EXPECT_TRUE(NeedsTrustCheck(At("")));
  EXPECT_TRUE(NeedsTrustCheck(At("unix:" + user_socket))) << "the Python client passes the default it resolved";
  EXPECT_TRUE(NeedsTrustCheck(At("unix://" + (runtime.path() / "fuyou" / "." / "fuyoud.sock").string())));
  EXPECT_TRUE(NeedsTrustCheck(At(std::string("unix:") + kSystemSocketPath)));
  // A socket the user named elsewhere is trusted as given.
  EXPECT_FALSE(NeedsTrustCheck(At("unix:" + (runtime.path() / "mine.sock").string())));
  EXPECT_FALSE(NeedsTrustCheck(At("localhost:5000")));
  // FUYOU_SOCKET names the socket the user chose, default path or not.
  ScopedEnv socket("FUYOU_SOCKET", user_socket.c_str());
  EXPECT_FALSE(NeedsTrustCheck(At("")));
  EXPECT_FALSE(NeedsTrustCheck(At("unix:" + user_socket)));
  EXPECT_TRUE(NeedsTrustCheck(At(std::string("unix:") + kSystemSocketPath)));
}

TEST(ConnectChannelTest, ACheckedChannelRefusesAnotherUsersDaemonAndSendsNothing) {
  if (::geteuid() != 0) GTEST_SKIP() << "needs root to act as another user";
  const TempDir temp("fuyou-channel-test");
  ASSERT_EQ(::chmod(temp.path().c_str(), 01777), 0);
  const fs::path path = temp.path() / "fuyoud.sock";
  int ready[2], received[2];
  ASSERT_EQ(::pipe(ready), 0);
  ASSERT_EQ(::pipe(received), 0);
  const pid_t child = ::fork();
  if (child == 0) {
    // Another user's "daemon": reports how many bytes the client sent it.
    if (::setgid(65534) != 0 || ::setuid(65534) != 0) ::_exit(1);
    const int fd = ::socket(AF_UNIX, SOCK_STREAM, 0);
    sockaddr_un address{};
    address.sun_family = AF_UNIX;
    std::strncpy(address.sun_path, path.c_str(), sizeof(address.sun_path) - 1);
    const bool ok = ::bind(fd, reinterpret_cast<sockaddr*>(&address), sizeof(address)) == 0 && ::listen(fd, 8) == 0;
    char byte = ok ? 'y' : 'n';
    (void)::write(ready[1], &byte, 1);
    const int connection = ::accept(fd, nullptr, nullptr);
    char buffer[256];
    long total = 0;
    for (ssize_t got; (got = ::read(connection, buffer, sizeof buffer)) > 0;) total += got;
    (void)::write(received[1], &total, sizeof total);
    ::_exit(0);
  }
  char byte = 0;
  ASSERT_EQ(::read(ready[0], &byte, 1), 1);
  ASSERT_EQ(byte, 'y');
  absl::StatusOr<DaemonChannel> channel = ConnectChannel("unix:" + path.string(), milliseconds(2000), true);
  EXPECT_EQ(channel.status().code(), absl::StatusCode::kFailedPrecondition) << channel.status();
  EXPECT_TRUE(IsUntrustedDaemon(channel.status())) << channel.status();
  EXPECT_NE(channel.status().message().find("runs as uid 65534"), std::string::npos) << channel.status();
  long total = -1;
  ASSERT_EQ(::read(received[0], &total, sizeof total), static_cast<ssize_t>(sizeof total));
  EXPECT_EQ(total, 0) << "bytes reached the other user's daemon";
  ::waitpid(child, nullptr, 0);
}

}  // namespace
}  // namespace fuyou::internal
