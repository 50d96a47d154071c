// SessionSegment::FromClientFd against real fds: only a memfd of the session's
// size, sealed against shrinking and growing and mappable read-write, becomes a
// segment; once it is one, nobody can shrink it under the daemon.
#include "session/session_segment.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <gtest/gtest.h>

#include <cstring>
#include <string>

#include "fmt/format.h"

namespace fuyou {
namespace {

constexpr SegmentLayout kLayout = *SegmentLayout::Checked(2, 8192, UINT64_MAX);

// An fd closed at the end of the test.
struct Fd {
  int fd = -1;
  ~Fd() {
    if (fd >= 0) ::close(fd);
  }
};

// A memfd of `bytes`, sealed with `seals` (0: none).
Fd Memfd(uint64_t bytes, int seals) {
  Fd result{::memfd_create("session-segment-test", MFD_CLOEXEC | MFD_ALLOW_SEALING)};
  EXPECT_GE(result.fd, 0);
  EXPECT_EQ(::ftruncate(result.fd, static_cast<off_t>(bytes)), 0);
  if (seals != 0) {
    EXPECT_EQ(::fcntl(result.fd, F_ADD_SEALS, seals), 0) << std::strerror(errno);
  }
  return result;
}

bool Contains(const absl::Status& status, const std::string& text) {
  return std::string(status.message()).find(text) != std::string::npos;
}

void ExpectNotSealedError(const absl::Status& status) {
  EXPECT_EQ(status.code(), absl::StatusCode::kFailedPrecondition) << status;
  EXPECT_TRUE(Contains(status, "must be a memfd sealed with F_SEAL_SHRINK|F_SEAL_GROW")) << status;
}

TEST(SessionSegmentTest, ASealedMemfdIsMappedAndGetsTheHeader) {
  Fd fd = Memfd(kLayout.TotalBytes(), F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL);
  auto segment = SessionSegment::FromClientFd(fd.fd, kLayout);
  ASSERT_TRUE(segment.ok()) << segment.status();
  // What the daemon writes, the client sees in its own mapping of the memfd.
  void* client = ::mmap(nullptr, kLayout.TotalBytes(), PROT_READ | PROT_WRITE, MAP_SHARED, fd.fd, 0);
  ASSERT_NE(client, MAP_FAILED);
  SegmentHeader header;
  std::memcpy(&header, client, sizeof header);
  EXPECT_EQ(header.magic, kSegmentMagic);
  EXPECT_EQ(header.num_slots, kLayout.num_slots);
  EXPECT_EQ(header.slot_bytes, kLayout.slot_bytes);
  EXPECT_EQ(header.total_bytes, kLayout.TotalBytes());
  std::memset(static_cast<std::byte*>(client) + kLayout.GradOffset(1), 0x5a, kLayout.slot_bytes);
  EXPECT_EQ((*segment)->GradRegion(1).size(), kLayout.slot_bytes);
  EXPECT_EQ((*segment)->GradRegion(1).back(), std::byte{0x5a});
  (*segment)->ParamRegion(1).back() = std::byte{0x17};
  EXPECT_EQ(static_cast<std::byte*>(client)[kLayout.TotalBytes() - 1], std::byte{0x17});
  ::munmap(client, kLayout.TotalBytes());
}

// The crash of the /dev/shm design: the client owned the object and could
// truncate it while the daemon had it mapped; the daemon's next access was a
// SIGBUS. An unsealed segment is now refused, and a sealed one cannot shrink.
TEST(SessionSegmentTest, AnUnsealedMemfdIsRefused) {
  Fd fd = Memfd(kLayout.TotalBytes(), 0);
  ExpectNotSealedError(SessionSegment::FromClientFd(fd.fd, kLayout).status());
}

TEST(SessionSegmentTest, AMemfdSealedOnlyAgainstGrowingIsRefused) {
  Fd fd = Memfd(kLayout.TotalBytes(), F_SEAL_GROW | F_SEAL_SEAL);
  ExpectNotSealedError(SessionSegment::FromClientFd(fd.fd, kLayout).status());
}

TEST(SessionSegmentTest, AfterAdoptionNobodyCanShrinkTheSegment) {
  Fd fd = Memfd(kLayout.TotalBytes(), F_SEAL_SHRINK | F_SEAL_GROW);
  auto segment = SessionSegment::FromClientFd(fd.fd, kLayout);
  ASSERT_TRUE(segment.ok()) << segment.status();
  EXPECT_EQ(::ftruncate(fd.fd, 0), -1);
  EXPECT_EQ(errno, EPERM);
  // Nor remove the seal (not sealed with F_SEAL_SEAL here, but seals only add).
  EXPECT_EQ(::fcntl(fd.fd, F_ADD_SEALS, F_SEAL_WRITE), -1);  // EBUSY: the daemon maps it writable
  // The daemon still reaches the last byte of the last slot.
  (*segment)->ParamRegion(kLayout.num_slots - 1).back() = std::byte{1};
  struct stat info {};
  ASSERT_EQ(::fstat(fd.fd, &info), 0);
  EXPECT_EQ(static_cast<uint64_t>(info.st_size), kLayout.TotalBytes());
}

TEST(SessionSegmentTest, AWrongSizeIsRefused) {
  for (uint64_t bytes : {kLayout.TotalBytes() - 4096, kLayout.TotalBytes() + 4096, uint64_t{0}}) {
    Fd fd = Memfd(bytes, F_SEAL_SHRINK | F_SEAL_GROW);
    absl::Status status = SessionSegment::FromClientFd(fd.fd, kLayout).status();
    EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument) << status;
    EXPECT_TRUE(Contains(status, fmt::format("the segment is {} bytes but the session's segment_bytes is {}", bytes,
                                             kLayout.TotalBytes())))
        << status;
  }
}

TEST(SessionSegmentTest, WhatIsNotARegularFileIsRefused) {
  int pipe_fds[2];
  ASSERT_EQ(::pipe(pipe_fds), 0);
  Fd read_end{pipe_fds[0]}, write_end{pipe_fds[1]};
  absl::Status status = SessionSegment::FromClientFd(read_end.fd, kLayout).status();
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument) << status;
  EXPECT_TRUE(Contains(status, "not a regular file")) << status;
}

TEST(SessionSegmentTest, AFileThatIsNotAMemfdIsRefused) {
  char path[] = "/tmp/session-segment-test-XXXXXX";
  Fd fd{::mkstemp(path)};
  ASSERT_GE(fd.fd, 0);
  ::unlink(path);
  ASSERT_EQ(::ftruncate(fd.fd, static_cast<off_t>(kLayout.TotalBytes())), 0);
  ExpectNotSealedError(SessionSegment::FromClientFd(fd.fd, kLayout).status());
}

TEST(SessionSegmentTest, AReadOnlyFdOfASealedMemfdIsRefused) {
  Fd fd = Memfd(kLayout.TotalBytes(), F_SEAL_SHRINK | F_SEAL_GROW);
  Fd read_only{::open(fmt::format("/proc/self/fd/{}", fd.fd).c_str(), O_RDONLY | O_CLOEXEC)};
  ASSERT_GE(read_only.fd, 0);
  absl::Status status = SessionSegment::FromClientFd(read_only.fd, kLayout).status();
  EXPECT_EQ(status.code(), absl::StatusCode::kFailedPrecondition) << status;
  EXPECT_TRUE(Contains(status, "cannot map the segment shared read-write")) << status;
}

TEST(SessionSegmentTest, AWriteSealedMemfdIsRefused) {
  Fd fd = Memfd(kLayout.TotalBytes(), F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_WRITE);
  absl::Status status = SessionSegment::FromClientFd(fd.fd, kLayout).status();
  EXPECT_EQ(status.code(), absl::StatusCode::kFailedPrecondition) << status;
  EXPECT_TRUE(Contains(status, "cannot map the segment shared read-write")) << status;
}

}  // namespace
}  // namespace fuyou
