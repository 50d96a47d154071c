// CheckTrustedSocket (issue 20): a client refuses a per-user socket directory
// another user controls, and a daemon run by another unprivileged user.
#include "channel.h"

#include <gtest/gtest.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstring>
#include <filesystem>
#include <string>
#include "test_support/temp_dir.h"

namespace fuyou::internal {
namespace {
namespace fs = std::filesystem;

class CheckTrustedSocketTest : public ::testing::Test {
 protected:
  const TempDir temp_dir_{"fuyou-channel-test"};
  const fs::path dir_ = temp_dir_.path();
};

// Listens on `path`; returns the listening fd.
int Listen(const fs::path& path) {
  const int fd = ::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
  sockaddr_un address{};
  address.sun_family = AF_UNIX;
  std::strncpy(address.sun_path, path.c_str(), sizeof(address.sun_path) - 1);
  if (::bind(fd, reinterpret_cast<sockaddr*>(&address), sizeof(address)) != 0 || ::listen(fd, 8) != 0) return -1;
  return fd;
}

TEST_F(CheckTrustedSocketTest, TrustsItsOwnDaemonInItsOwnDirectory) {
  const int fd = Listen(dir_ / "fuyoud.sock");
  ASSERT_GE(fd, 0);
  EXPECT_TRUE(CheckTrustedSocket((dir_ / "fuyoud.sock").string()).ok());
  ::close(fd);
  EXPECT_TRUE(CheckTrustedSocket((dir_ / "missing" / "fuyoud.sock").string()).ok()) << "nothing to trust yet";
}

TEST_F(CheckTrustedSocketTest, RefusesADirectoryOthersCanWrite) {
  ASSERT_EQ(::chmod(dir_.c_str(), 0777), 0);
  const absl::Status status = CheckTrustedSocket((dir_ / "fuyoud.sock").string());
  EXPECT_EQ(status.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_NE(status.message().find(dir_.string()), std::string::npos) << status;
  EXPECT_NE(status.message().find("chmod go-w"), std::string::npos) << status;
}

TEST_F(CheckTrustedSocketTest, RefusesADirectoryOfAnotherUser) {
  if (::geteuid() != 0) GTEST_SKIP() << "needs root to chown";
  const fs::path squatted = dir_ / "fuyou-1000";
  ASSERT_EQ(::mkdir(squatted.c_str(), 0755), 0);
  ASSERT_EQ(::chown(squatted.c_str(), 65534, 65534), 0);
  const absl::Status status = CheckTrustedSocket((squatted / "fuyoud.sock").string());
  EXPECT_EQ(status.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_NE(status.message().find("belongs to uid 65534"), std::string::npos) << status;
  EXPECT_NE(status.message().find((squatted / "fuyoud.sock").string()), std::string::npos) << status;
  EXPECT_NE(status.message().find("nothing was sent"), std::string::npos) << status;
}

TEST_F(CheckTrustedSocketTest, RefusesADaemonOfAnotherUnprivilegedUser) {
  if (::geteuid() != 0) GTEST_SKIP() << "needs root to act as another user";
  // A directory the client may trust (root's, sticky, as /tmp)...
  ASSERT_EQ(::chmod(dir_.c_str(), 01777), 0);
  const fs::path path = dir_ / "fuyoud.sock";
  int ready[2];
  ASSERT_EQ(::pipe(ready), 0);
  const pid_t child = ::fork();
  if (child == 0) {
    // ...and a "daemon" of uid 65534 behind the socket.
    if (::setgid(65534) != 0 || ::setuid(65534) != 0) ::_exit(1);
    const int fd = Listen(path);
    char byte = fd >= 0 ? 'y' : 'n';
    (void)::write(ready[1], &byte, 1);
    ::pause();
    ::_exit(0);
  }
  char byte = 0;
  ASSERT_EQ(::read(ready[0], &byte, 1), 1);
  ASSERT_EQ(byte, 'y');
  const absl::Status status = CheckTrustedSocket(path.string());
  ::kill(child, SIGKILL);
  ::waitpid(child, nullptr, 0);
  EXPECT_EQ(status.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_NE(status.message().find("runs as uid 65534"), std::string::npos) << status;
  EXPECT_NE(status.message().find(path.string()), std::string::npos) << status;
}

}  // namespace
}  // namespace fuyou::internal
