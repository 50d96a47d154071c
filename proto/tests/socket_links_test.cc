// FindUntrustedLink (issue 32): every symbolic link on the way to a path is
// seen, through relative and chained targets, and the first one refused is named.
#include "fuyou/socket_links.h"

#include <gtest/gtest.h>
#include <sys/stat.h>
#include <unistd.h>

#include <filesystem>
#include <string>
#include <vector>

#include "test_support/temp_dir.h"

namespace fuyou {
namespace {
namespace fs = std::filesystem;

class SocketLinksTest : public ::testing::Test {
 protected:
  void SetUp() override {
    ASSERT_EQ(::mkdir((dir_ / "real").c_str(), 0755), 0);
    ASSERT_EQ(::mkdir((dir_ / "real" / "run").c_str(), 0755), 0);
  }
  // Refuses the `refuse_at`-th link it is asked about (1-based); records each.
  auto RefuseAt(int refuse_at) {
    return [this, refuse_at](uid_t) { return ++asked_ != refuse_at; };
  }
  const TempDir temp_dir_{"fuyou-socket-links-test"};
  const fs::path dir_ = fs::canonical(temp_dir_.path());
  int asked_ = 0;
};

TEST_F(SocketLinksTest, APathWithoutLinksHasNone) {
  EXPECT_FALSE(FindUntrustedLink(dir_ / "real" / "run" / "fuyoud.sock", RefuseAt(1)).has_value());
  EXPECT_EQ(asked_, 0);
}

TEST_F(SocketLinksTest, TheFirstRefusedLinkIsNamedWithItsOwner) {
  ASSERT_EQ(::symlink((dir_ / "real").c_str(), (dir_ / "link").c_str()), 0);
  const std::optional<PathLink> found = FindUntrustedLink(dir_ / "link" / "run" / "fuyoud.sock", RefuseAt(1));
  ASSERT_TRUE(found.has_value());
  EXPECT_EQ(found->link, dir_ / "link");
  EXPECT_EQ(found->owner, ::geteuid());
  asked_ = 0;
  EXPECT_FALSE(FindUntrustedLink(dir_ / "link" / "run" / "fuyoud.sock", RefuseAt(0)).has_value()) << "all trusted";
}

TEST_F(SocketLinksTest, ChainedAndRelativeTargetsAreFollowed) {
  // chain -> hop (relative, with ..) -> real/run; the socket itself a link too.
  ASSERT_EQ(::mkdir((dir_ / "sub").c_str(), 0755), 0);
  ASSERT_EQ(::symlink("../real/run", (dir_ / "sub" / "hop").c_str()), 0);
  ASSERT_EQ(::symlink("sub/hop", (dir_ / "chain").c_str()), 0);
  ASSERT_EQ(::symlink("elsewhere.sock", (dir_ / "real" / "run" / "fuyoud.sock").c_str()), 0);
  const fs::path path = dir_ / "chain" / "fuyoud.sock";
  std::optional<PathLink> found = FindUntrustedLink(path, RefuseAt(2));
  ASSERT_TRUE(found.has_value());
  EXPECT_EQ(found->link, dir_ / "sub" / "hop") << "the second link, reached through the first's target";
  asked_ = 0;
  found = FindUntrustedLink(path, RefuseAt(3));
  ASSERT_TRUE(found.has_value());
  EXPECT_EQ(found->link, dir_ / "real" / "run" / "fuyoud.sock") << "the socket itself, in the resolved directory";
  asked_ = 0;
  EXPECT_FALSE(FindUntrustedLink(path, RefuseAt(4)).has_value());
  EXPECT_EQ(asked_, 3);
}

TEST_F(SocketLinksTest, AMissingComponentEndsTheWalk) {
  ASSERT_EQ(::symlink((dir_ / "real").c_str(), (dir_ / "link").c_str()), 0);
  EXPECT_FALSE(FindUntrustedLink(dir_ / "missing" / "link" / "fuyoud.sock", RefuseAt(1)).has_value());
  EXPECT_EQ(asked_, 0);
}

TEST_F(SocketLinksTest, ALoopStopsAfterFortyLinks) {
  ASSERT_EQ(::symlink("b", (dir_ / "a").c_str()), 0);
  ASSERT_EQ(::symlink("a", (dir_ / "b").c_str()), 0);
  EXPECT_FALSE(FindUntrustedLink(dir_ / "a" / "fuyoud.sock", RefuseAt(0)).has_value());
  EXPECT_EQ(asked_, 41);
}

}  // namespace
}  // namespace fuyou
