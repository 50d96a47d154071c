#include "storage/dir_fd.h"

#include <fcntl.h>
#include <gtest/gtest.h>
#include <sys/stat.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>

#include "storage/io_engine.h"
#include "test_support/temp_dir.h"

namespace fuyou::storage {
namespace {
namespace fs = std::filesystem;

class DirFdTest : public ::testing::Test {
 protected:
  void SetUp() override {
    victim_ = root_ / "victim";
    std::ofstream(victim_) << "precious";
  }
  std::string Victim() {
    std::ifstream in(victim_);
    return std::string(std::istreambuf_iterator<char>(in), {});
  }

  const TempDir temp_dir_{"fuyou-dirfd-test"};
  const fs::path root_ = temp_dir_.path();
  fs::path victim_;
};

TEST_F(DirFdTest, CreatedDirectoriesHaveExactlyTheirModeWhateverTheUmask) {
  const mode_t old = ::umask(0);
  auto root = DirFd::OpenRoot(root_);
  ASSERT_TRUE(root.ok()) << root.status();
  bool created = false;
  auto dir = root->OpenOrCreateDir("job", 0700, &created);
  ::umask(old);
  ASSERT_TRUE(dir.ok()) << dir.status();
  EXPECT_TRUE(created);
  struct stat st {};
  ASSERT_EQ(::stat((root_ / "job").c_str(), &st), 0);
  EXPECT_EQ(st.st_mode & 07777, 0700u);
  auto again = root->OpenOrCreateDir("job", 0700, &created);
  ASSERT_TRUE(again.ok());
  EXPECT_FALSE(created);
}

TEST_F(DirFdTest, SymlinkedDirectoryIsRefusedNotFollowed) {
  fs::create_directory(root_ / "elsewhere");
  fs::create_directory_symlink(root_ / "elsewhere", root_ / "job");
  auto root = DirFd::OpenRoot(root_);
  ASSERT_TRUE(root.ok());
  auto dir = root->OpenOrCreateDir("job", 0700);
  EXPECT_EQ(dir.status().code(), absl::StatusCode::kFailedPrecondition) << dir.status();
  EXPECT_NE(dir.status().message().find("symbolic link"), std::string::npos) << dir.status();
  EXPECT_EQ(root->OpenDir("job").status().code(), absl::StatusCode::kFailedPrecondition);
}

TEST_F(DirFdTest, WriteNewFileReplacesAPlantedSymlinkInsteadOfWritingThroughIt) {
  fs::create_symlink(victim_, root_ / "manifest.tmp");
  auto root = DirFd::OpenRoot(root_);
  ASSERT_TRUE(root.ok());
  ASSERT_TRUE(root->WriteNewFile("manifest.tmp", "new").ok());
  EXPECT_EQ(Victim(), "precious");
  EXPECT_FALSE(fs::is_symlink(root_ / "manifest.tmp"));
  struct stat st {};
  ASSERT_EQ(::stat((root_ / "manifest.tmp").c_str(), &st), 0);
  EXPECT_EQ(st.st_mode & 0777, 0600u);
}

TEST_F(DirFdTest, OpenFileRefusesSymlinksAndHardLinks) {
  fs::create_symlink(victim_, root_ / "link");
  fs::create_hard_link(victim_, root_ / "hard");
  auto root = DirFd::OpenRoot(root_);
  ASSERT_TRUE(root.ok());
  EXPECT_EQ(root->OpenFile("link", O_RDWR | O_CREAT).status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(root->OpenFile("hard", O_RDWR).status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(root->ReadFile("link", 100).status().code(), absl::StatusCode::kFailedPrecondition);
  // Unlink removes the link, not what it points to.
  ASSERT_TRUE(root->Unlink("link").ok());
  EXPECT_EQ(Victim(), "precious");
}

TEST_F(DirFdTest, IoEngineOpenAtRefusesASymlinkedStateFile) {
  fs::create_symlink(victim_, root_ / "states.bin");
  auto io = IoEngine::Create({});
  ASSERT_TRUE(io.ok()) << io.status();
  auto root = DirFd::OpenRoot(root_);
  ASSERT_TRUE(root.ok());
  auto file = (*io)->OpenAt(*root, "states.bin", /*create=*/true, nullptr, IoOwner());
  EXPECT_EQ(file.status().code(), absl::StatusCode::kFailedPrecondition) << file.status();
  EXPECT_EQ(Victim(), "precious");
  EXPECT_TRUE(fs::is_symlink(root_ / "states.bin"));
}

TEST_F(DirFdTest, ListNamesEntries) {
  auto root = DirFd::OpenRoot(root_);
  ASSERT_TRUE(root.ok());
  auto names = root->List();
  ASSERT_TRUE(names.ok());
  EXPECT_EQ(*names, std::vector<std::string>{"victim"});
}

}  // namespace
}  // namespace fuyou::storage
