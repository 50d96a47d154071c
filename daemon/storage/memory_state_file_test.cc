#include "storage/memory_state_file.h"

#include <gtest/gtest.h>

#include <cerrno>
#include <cstring>

#include "storage/aligned_buffer.h"

namespace fuyou::storage {
namespace {

class FailWrites final : public FaultInjector {
 public:
  int64_t Adjust(Op op, const std::filesystem::path& /*file*/, uint64_t /*offset*/, uint64_t /*length*/,
                 int64_t result) override {
    return op == Op::kWrite ? -ENOSPC : result;
  }
};

AlignedBuffer Buffer(uint64_t bytes, char fill) {
  auto buffer = AlignedBuffer::Allocate(bytes);
  EXPECT_TRUE(buffer.ok()) << buffer.status();
  std::memset(buffer->data(), fill, bytes);
  return std::move(*buffer);
}

TEST(MemoryStateFileTest, WritesAreReadBackAndOutliveTheirHandle) {
  MemoryIoEngine engine;
  IoCounters counters;
  {
    auto file = engine.Open("/mem/states.bin", /*create=*/true, &counters, IoOwner());
    ASSERT_TRUE(file.ok()) << file.status();
    AlignedBuffer out = Buffer(2 * kBlockSize, 'a');
    IoFuture written = (*file)->WriteAsync(kBlockSize, out.span());
    ASSERT_TRUE(written.ready());  // in memory: done when the call returns
    EXPECT_TRUE(written.status().ok()) << written.status();
    EXPECT_EQ((*file)->size(), 3 * kBlockSize);
  }
  auto again = engine.Open("/mem/states.bin", /*create=*/false, nullptr, IoOwner());
  ASSERT_TRUE(again.ok()) << again.status();
  AlignedBuffer in = Buffer(kBlockSize, 0);
  EXPECT_TRUE((*again)->Read(2 * kBlockSize, in.span()).ok());
  EXPECT_EQ(static_cast<char>(in.span()[0]), 'a');
  EXPECT_EQ(counters.write_ops.load(), 1u);
  EXPECT_EQ(counters.bytes_written.load(), 2 * kBlockSize);
  EXPECT_EQ(engine.Contents("/mem/states.bin").size(), 3 * kBlockSize);
}

TEST(MemoryStateFileTest, KeepsTheEnginesStatusTable) {
  FailWrites faults;
  MemoryIoEngine engine(&faults);
  EXPECT_EQ(engine.Open("/mem/absent", /*create=*/false, nullptr, IoOwner()).status().code(), absl::StatusCode::kNotFound);
  auto file = engine.Open("/mem/states.bin", /*create=*/true, nullptr, IoOwner());
  ASSERT_TRUE(file.ok());
  AlignedBuffer buffer = Buffer(kBlockSize, 'b');
  EXPECT_EQ((*file)->Read(0, buffer.span()).code(), absl::StatusCode::kOutOfRange);
  EXPECT_EQ((*file)->Write(0, buffer.span()).code(), absl::StatusCode::kResourceExhausted);
  EXPECT_EQ((*file)->Read(1, buffer.span().first(kBlockSize - 1)).code(), absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace fuyou::storage
