#include "common/crash_point.h"

#include <gtest/gtest.h>
#include <stdlib.h>

#include <string>
#include <vector>

namespace fuyou::crash_point {
namespace {

std::vector<std::string> crashes;

void RecordCrash(const char* name, uint64_t hit) { crashes.push_back(std::string(name) + ":" + std::to_string(hit)); }

class CrashPointTest : public ::testing::Test {
 protected:
  void SetUp() override {
    crashes.clear();
    internal::on_crash = RecordCrash;
  }
  void TearDown() override {
    Arm({});
    ::unsetenv("FUYOU_CRASH_AT");
  }
};

TEST_F(CrashPointTest, ParsesNameAndHit) {
  auto spec = ParseCrashSpec("manifest_renamed:3");
  ASSERT_TRUE(spec.ok()) << spec.status().message();
  EXPECT_EQ(spec->name, "manifest_renamed");
  EXPECT_EQ(spec->hit, 3u);
}

TEST_F(CrashPointTest, RefusesMalformedSpecs) {
  for (const char* bad : {"", "manifest_renamed", "manifest_renamed:", ":3", "manifest_renamed:0",
                          "manifest_renamed:-1", "manifest_renamed:2x", "Manifest:1", "a b:1"}) {
    auto spec = ParseCrashSpec(bad);
    EXPECT_FALSE(spec.ok()) << "'" << bad << "' was accepted";
    EXPECT_EQ(spec.status().code(), absl::StatusCode::kInvalidArgument) << bad;
  }
  EXPECT_NE(std::string(ParseCrashSpec("x:0").status().message()).find(">= 1"), std::string::npos);
}

TEST_F(CrashPointTest, FiresOnTheNthPassOfTheArmedPointOnly) {
  Arm({"dir_synced", 3});
  EXPECT_TRUE(internal::armed);
  FUYOU_CRASH_POINT("dir_synced");
  FUYOU_CRASH_POINT("manifest_renamed");  // other points do not count
  FUYOU_CRASH_POINT("dir_synced");
  EXPECT_TRUE(crashes.empty());
  FUYOU_CRASH_POINT("dir_synced");
  ASSERT_EQ(crashes.size(), 1u);
  EXPECT_EQ(crashes[0], "dir_synced:3");
  FUYOU_CRASH_POINT("dir_synced");  // only the armed hit crashes
  EXPECT_EQ(crashes.size(), 1u);
}

TEST_F(CrashPointTest, UnarmedPointsCostNothingAndNeverFire) {
  Arm({});
  EXPECT_FALSE(internal::armed);
  for (int i = 0; i < 10; ++i) FUYOU_CRASH_POINT("dir_synced");
  EXPECT_EQ(Pass("dir_synced"), 0u);
  EXPECT_TRUE(crashes.empty());
}

TEST_F(CrashPointTest, ArmsFromTheEnvironment) {
  ::unsetenv("FUYOU_CRASH_AT");
  EXPECT_TRUE(ArmFromEnvironment().ok());
  EXPECT_FALSE(internal::armed);
  ::setenv("FUYOU_CRASH_AT", "after_kernel:2", 1);
  ASSERT_TRUE(ArmFromEnvironment().ok());
  EXPECT_TRUE(internal::armed);
  FUYOU_CRASH_POINT("after_kernel");
  FUYOU_CRASH_POINT("after_kernel");
  EXPECT_EQ(crashes, std::vector<std::string>{"after_kernel:2"});
  ::setenv("FUYOU_CRASH_AT", "after_kernel", 1);
  absl::Status bad = ArmFromEnvironment();
  EXPECT_EQ(bad.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(std::string(bad.message()).find("FUYOU_CRASH_AT"), std::string::npos);
}

}  // namespace
}  // namespace fuyou::crash_point
