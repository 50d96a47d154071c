#include "storage/striped_file.h"

#include <gtest/gtest.h>
#include <unistd.h>

#include <cstring>
#include <filesystem>
#include <numeric>

#include "storage/aligned_buffer.h"
#include "test_support/temp_dir.h"

namespace fuyou::storage {
namespace {
namespace fs = std::filesystem;

constexpr uint64_t kUnit = 64 * 1024;

class StripedFileTest : public ::testing::Test {
 protected:
  void SetUp() override {
    auto engine = IoEngine::Create({});
    ASSERT_TRUE(engine.ok()) << engine.status();
    engine_ = std::move(*engine);
  }
  void TearDown() override {
    file_.reset();
    engine_.reset();
  }
  void OpenStriped(size_t members) {
    std::vector<std::unique_ptr<StateFile>> files;
    counters_ = std::vector<IoCounters>(members);
    for (size_t i = 0; i < members; ++i) {
      auto file = engine_->Open(dir_ / ("member" + std::to_string(i)), true, &counters_[i], IoOwner());
      ASSERT_TRUE(file.ok()) << file.status();
      files.push_back(std::move(*file));
    }
    file_ = std::make_unique<StripedFile>(std::move(files), kUnit);
  }

  const TempDir temp_dir_{"fuyou-striped-test"};
  const fs::path dir_ = temp_dir_.path();
  std::unique_ptr<IoEngine> engine_;
  std::vector<IoCounters> counters_;
  std::unique_ptr<StripedFile> file_;
};

TEST_F(StripedFileTest, LocatesUnitsRoundRobin) {
  OpenStriped(3);
  EXPECT_EQ(file_->Locate(0).member, 0u);
  EXPECT_EQ(file_->Locate(kUnit).member, 1u);
  EXPECT_EQ(file_->Locate(2 * kUnit + 4096).member, 2u);
  EXPECT_EQ(file_->Locate(2 * kUnit + 4096).offset, 4096u);
  EXPECT_EQ(file_->Locate(3 * kUnit).member, 0u);
  EXPECT_EQ(file_->Locate(3 * kUnit).offset, kUnit);
  // 7.5 units over 3 members: 3, 2.5 and 2 units.
  const uint64_t bytes = 7 * kUnit + kUnit / 2;
  EXPECT_EQ(file_->MemberBytes(0, bytes), 3 * kUnit);
  EXPECT_EQ(file_->MemberBytes(1, bytes), 2 * kUnit + kUnit / 2);
  EXPECT_EQ(file_->MemberBytes(2, bytes), 2 * kUnit);
}

TEST_F(StripedFileTest, UnalignedToTheUnitRoundTripsAndSpreadsOverEveryMember) {
  OpenStriped(3);
  const uint64_t offset = kUnit - 8192;  // starts inside a unit
  const uint64_t length = 10 * kUnit + 4096;
  ASSERT_TRUE(file_->Reserve(offset + length).ok());
  auto out = AlignedBuffer::Allocate(length);
  auto in = AlignedBuffer::Allocate(length);
  ASSERT_TRUE(out.ok() && in.ok());
  for (size_t i = 0; i < length; ++i) out->data()[i] = std::byte(i * 7 + i / 4096);
  ASSERT_TRUE(file_->Write(offset, out->span().first(length)).ok());
  ASSERT_TRUE(file_->Read(offset, in->span().first(length)).ok());
  EXPECT_EQ(std::memcmp(out->data(), in->data(), length), 0);
  uint64_t total = 0;
  for (const IoCounters& counters : counters_) {
    EXPECT_GE(counters.bytes_written.load(), 3 * kUnit);  // each member took about a third
    total += counters.bytes_written.load();
  }
  EXPECT_EQ(total, length);
}

TEST_F(StripedFileTest, OneMemberIsAPassThrough) {
  OpenStriped(1);
  auto buffer = AlignedBuffer::Allocate(3 * kUnit);
  ASSERT_TRUE(buffer.ok());
  std::memset(buffer->data(), 0x5a, buffer->size());
  ASSERT_TRUE(file_->Reserve(3 * kUnit).ok());
  ASSERT_TRUE(file_->Write(0, buffer->span()).ok());
  EXPECT_EQ(counters_[0].write_ops.load(), 1u);  // one transfer, not one per unit
}

TEST_F(StripedFileTest, AnErrorOnOneMemberFailsTheTransferAfterEveryPieceIsDone) {
  OpenStriped(2);
  auto buffer = AlignedBuffer::Allocate(4 * kUnit);
  ASSERT_TRUE(buffer.ok());
  ASSERT_TRUE(file_->Reserve(2 * kUnit).ok());
  // Member files hold one unit each, so reading four units runs past their end.
  absl::Status status = file_->Read(0, buffer->span());
  EXPECT_FALSE(status.ok());
  EXPECT_EQ(file_->Read(4096, buffer->span().first(100)).code(), absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace fuyou::storage
