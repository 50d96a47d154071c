#include "server/socket_path.h"

#include <gtest/gtest.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <string>
#include "test_support/temp_dir.h"

namespace fuyou {
namespace {
namespace fs = std::filesystem;

class SocketPathTest : public ::testing::Test {
 protected:
  const TempDir temp_dir_{"fuyou-socket-path-test"};
  const fs::path dir_ = temp_dir_.path();
};

mode_t ModeOf(const fs::path& path) {
  struct stat info {};
  EXPECT_EQ(::lstat(path.c_str(), &info), 0) << path;
  return info.st_mode & 07777;
}

TEST_F(SocketPathTest, CreatesThePrivateDirectoryAndTheSocketWithItsMode) {
  const fs::path socket = dir_ / "run" / "fuyoud.sock";
  ::umask(0);  // the modes must not depend on the umask
  ASSERT_TRUE(PrepareSocketPath(socket, 0600).ok());
  ::umask(022);
  EXPECT_EQ(ModeOf(dir_ / "run"), 0700u);
  auto fd = ListenOnSocketPath(socket, 0600);
  ASSERT_TRUE(fd.ok()) << fd.status();
  EXPECT_EQ(ModeOf(socket), 0600u);
  ::close(*fd);
  // A socket others may use gets a directory they can only search.
  const fs::path shared = dir_ / "shared" / "fuyoud.sock";
  ASSERT_TRUE(PrepareSocketPath(shared, 0666).ok());
  EXPECT_EQ(ModeOf(dir_ / "shared"), 0711u);
  auto shared_fd = ListenOnSocketPath(shared, 0666);
  ASSERT_TRUE(shared_fd.ok());
  EXPECT_EQ(ModeOf(shared), 0666u);
  ::close(*shared_fd);
}

TEST_F(SocketPathTest, RefusesADirectoryOthersCanWrite) {
  const fs::path open = dir_ / "open";
  ASSERT_EQ(::mkdir(open.c_str(), 0700), 0);
  ASSERT_EQ(::chmod(open.c_str(), 0777), 0);
  const absl::Status status = PrepareSocketPath(open / "fuyoud.sock", 0600);
  EXPECT_EQ(status.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_NE(status.message().find(open.string()), std::string::npos) << status;
  EXPECT_NE(status.message().find("chmod go-w"), std::string::npos) << status;
  // Sticky, as /tmp: others cannot remove or rename what is not theirs.
  ASSERT_EQ(::chmod(open.c_str(), 01777), 0);
  EXPECT_TRUE(PrepareSocketPath(open / "fuyoud.sock", 0600).ok());
}

TEST_F(SocketPathTest, RefusesADirectoryOfAnotherUser) {
  if (::geteuid() != 0) GTEST_SKIP() << "needs root to chown";
  const fs::path squatted = dir_ / "fuyou-1000";
  ASSERT_EQ(::mkdir(squatted.c_str(), 0700), 0);
  ASSERT_EQ(::chown(squatted.c_str(), 65534, 65534), 0);
  const absl::Status status = PrepareSocketPath(squatted / "fuyoud.sock", 0600);
  EXPECT_EQ(status.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_NE(status.message().find("belongs to uid 65534"), std::string::npos) << status;
  EXPECT_NE(status.message().find("Remove it"), std::string::npos) << status;
}

TEST_F(SocketPathTest, RefusesADirectoryReachedThroughAnotherUsersLink) {
  if (::geteuid() != 0) GTEST_SKIP() << "needs root to give a link away";
  // Root's sticky directory (as /tmp), which the daemon would accept...
  const fs::path shared = dir_ / "shared";
  ASSERT_EQ(::mkdir(shared.c_str(), 0700), 0);
  ASSERT_EQ(::chmod(shared.c_str(), 01777), 0);
  ASSERT_TRUE(PrepareSocketPath(shared / "fuyoud.sock", 0600).ok());
  // ...reached through another user's link, as /tmp/fuyou-<uid> -> /tmp.
  const fs::path link = dir_ / "fuyou-1000";
  ASSERT_EQ(::symlink(shared.c_str(), link.c_str()), 0);
  ASSERT_EQ(::lchown(link.c_str(), 65534, 65534), 0);
  const absl::Status status = PrepareSocketPath(link / "fuyoud.sock", 0600);
  EXPECT_EQ(status.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_NE(status.message().find("symbolic link " + link.string()), std::string::npos) << status;
  EXPECT_NE(status.message().find("belongs to uid 65534"), std::string::npos) << status;
  // A link further up counts as well, and a link of root's or the daemon's own does not.
  const fs::path above = dir_ / "above";
  ASSERT_EQ(::symlink(dir_.c_str(), above.c_str()), 0);
  ASSERT_EQ(::lchown(above.c_str(), 65534, 65534), 0);
  EXPECT_EQ(PrepareSocketPath(above / "shared" / "fuyoud.sock", 0600).code(), absl::StatusCode::kFailedPrecondition);
  ASSERT_EQ(::lchown(link.c_str(), 0, 0), 0);
  EXPECT_TRUE(PrepareSocketPath(link / "fuyoud.sock", 0600).ok());
}

}  // namespace
}  // namespace fuyou
