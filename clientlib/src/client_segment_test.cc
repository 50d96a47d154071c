// ClientSegment: the memfd a job creates for its session is the size asked,
// its pages reserved, sealed so that nobody (the job included) can shrink or
// grow it, and mapped read-write.
#include "fuyou/client_segment.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <gtest/gtest.h>

#include <cstring>
#include <fstream>
#include <string>

#include "fmt/format.h"

namespace fuyou {
namespace {

TEST(ClientSegmentTest, IsASealedMemfdOfTheSizeAsked) {
  auto segment = ClientSegment::Create(5 * 4096);
  ASSERT_TRUE(segment.ok()) << segment.status();
  const int fd = (*segment)->fd();
  struct stat info {};
  ASSERT_EQ(::fstat(fd, &info), 0);
  EXPECT_EQ(info.st_size, 5 * 4096);
  EXPECT_GE(info.st_blocks * 512, 5 * 4096) << "the pages are reserved at creation";
  const int seals = ::fcntl(fd, F_GET_SEALS);
  EXPECT_EQ(seals & (F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL), F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL);
  EXPECT_EQ(::ftruncate(fd, 0), -1);
  EXPECT_EQ(errno, EPERM);
  EXPECT_EQ(::ftruncate(fd, 6 * 4096), -1);
  EXPECT_EQ(errno, EPERM);
  EXPECT_NE(::fcntl(fd, F_GETFD) & FD_CLOEXEC, 0);
  std::span<std::byte> bytes = (*segment)->bytes();
  ASSERT_EQ(bytes.size(), 5u * 4096);
  bytes.back() = std::byte{7};
  char last = 0;
  ASSERT_EQ(::pread(fd, &last, 1, 5 * 4096 - 1), 1);
  EXPECT_EQ(last, 7);
  // Named for what it is in /proc/PID/maps.
  std::ifstream maps("/proc/self/maps");
  std::string line, all;
  while (std::getline(maps, line)) all += line + "\n";
  EXPECT_NE(all.find("/memfd:fuyou-segment"), std::string::npos);
}

TEST(ClientSegmentTest, CloseFdKeepsTheMapping) {
  auto segment = ClientSegment::Create(4096);
  ASSERT_TRUE(segment.ok());
  (*segment)->CloseFd();
  EXPECT_EQ((*segment)->fd(), -1);
  (*segment)->bytes()[100] = std::byte{1};
  EXPECT_EQ((*segment)->HandOver("/nonexistent.seg", "s-1", std::chrono::milliseconds(1000)).code(),
            absl::StatusCode::kFailedPrecondition);
}

TEST(ClientSegmentTest, ZeroBytesIsRefused) {
  EXPECT_EQ(ClientSegment::Create(0).status().code(), absl::StatusCode::kInvalidArgument);
}

TEST(ClientSegmentTest, NoDaemonIsUnavailable) {
  auto segment = ClientSegment::Create(4096);
  ASSERT_TRUE(segment.ok());
  absl::Status status = (*segment)->HandOver("/nonexistent/fuyoud.sock.seg", "s-1", std::chrono::milliseconds(1000));
  EXPECT_EQ(status.code(), absl::StatusCode::kUnavailable) << status;
  EXPECT_NE(std::string(status.message()).find("/nonexistent/fuyoud.sock.seg"), std::string::npos) << status;
}

}  // namespace
}  // namespace fuyou
