#include "journal/grad_journal.h"

#include <fcntl.h>
#include <gtest/gtest.h>
#include <stdlib.h>
#include <unistd.h>

#include <cstring>
#include <filesystem>
#include <fstream>

#include "fmt/format.h"
#include "test_support/temp_dir.h"

namespace fuyou {
namespace {

namespace fs = std::filesystem;

constexpr uint64_t kJournal = 12 * 1024;  // three blocks

class GradJournalTest : public ::testing::Test {
 protected:
  void SetUp() override {
    auto io = storage::IoEngine::Create({});
    ASSERT_TRUE(io.ok()) << io.status();
    io_ = std::move(*io);
    auto scratch = JournalScratch::Create({root_}, *io_);
    ASSERT_TRUE(scratch.ok()) << scratch.status();
    scratch_ = std::move(*scratch);
  }

  // A journal whose cache has room for two journals' holds (half of 64 KiB is
  // 32 KiB: two of 12 KiB), so the third spills.
  std::unique_ptr<GradJournal> MakeJournal(JournalQuotaHooks quota = {}) {
    return std::make_unique<GradJournal>(cache_, "journal:s1", scratch_->ForSession("s1"), std::move(quota));
  }

  static void Fill(JournalAccess& access, uint8_t seed) {
    for (uint64_t i = 0; i < kJournal; ++i) access.data()[i] = static_cast<std::byte>(seed + i * 7);
  }
  static bool Holds(const JournalAccess& access, uint8_t seed) {
    for (uint64_t i = 0; i < kJournal; ++i) {
      if (access.data()[i] != static_cast<std::byte>(seed + i * 7)) return false;
    }
    return true;
  }

  const TempDir temp_dir_{"fuyou-journal-test"};
  const fs::path root_ = temp_dir_.path();
  std::unique_ptr<storage::IoEngine> io_;
  std::unique_ptr<JournalScratch> scratch_;
  StateCache cache_{64 * 1024};
};

TEST_F(GradJournalTest, KeepsInDramThenSpillsAndReadsBackWhatWasSaved) {
  auto journal = MakeJournal();
  for (uint32_t chunk = 0; chunk < 3; ++chunk) {
    EXPECT_FALSE(journal->Has(chunk));
    auto access = journal->Begin(chunk, kJournal);
    ASSERT_TRUE(access.ok()) << access.status();
    EXPECT_EQ(access->spilled(), chunk == 2) << chunk;
    Fill(*access, static_cast<uint8_t>(chunk));
    ASSERT_TRUE(journal->Save(*access).ok());
    EXPECT_TRUE(journal->Has(chunk));
  }
  EXPECT_EQ(journal->bytes(), 3 * kJournal);
  EXPECT_EQ(journal->spilled_bytes(), kJournal);
  EXPECT_EQ(journal->spill_written_bytes(), kJournal);
  for (uint32_t chunk = 0; chunk < 3; ++chunk) {
    auto access = journal->Open(chunk);
    ASSERT_TRUE(access.ok()) << access.status();
    EXPECT_TRUE(Holds(*access, static_cast<uint8_t>(chunk))) << chunk;
  }
  // A changed spilled journal is written back and reads back changed.
  {
    auto access = journal->Open(2);
    ASSERT_TRUE(access.ok());
    Fill(*access, 99);
    ASSERT_TRUE(journal->Save(*access).ok());
  }
  auto again = journal->Open(2);
  ASSERT_TRUE(again.ok());
  EXPECT_TRUE(Holds(*again, 99));
}

TEST_F(GradJournalTest, ACorruptSpillIsDataLossAndTheJournalIsGone) {
  auto journal = MakeJournal();
  for (uint32_t chunk = 0; chunk < 3; ++chunk) {
    auto access = journal->Begin(chunk, kJournal);
    ASSERT_TRUE(access.ok());
    Fill(*access, 1);
    ASSERT_TRUE(journal->Save(*access).ok());
  }
  const fs::path file = journal->spill_files()->path(0);
  ASSERT_TRUE(fs::exists(file));
  {
    const int fd = ::open(file.c_str(), O_WRONLY);
    ASSERT_GE(fd, 0);
    const char junk = 0x5a;
    ASSERT_EQ(::pwrite(fd, &junk, 1, 100), 1);
    ::close(fd);
  }
  auto access = journal->Open(2);
  ASSERT_FALSE(access.ok());
  EXPECT_EQ(access.status().code(), absl::StatusCode::kDataLoss) << access.status();
  EXPECT_NE(access.status().message().find("checksum"), std::string::npos);
  EXPECT_FALSE(journal->Has(2));
  EXPECT_EQ(journal->Open(2).status().code(), absl::StatusCode::kFailedPrecondition);
}

TEST_F(GradJournalTest, ClearGivesEverythingBackAndTheEndOfTheSessionUnlinks) {
  uint64_t charged = 0;
  auto journal = MakeJournal({[&](uint64_t bytes) {
                                charged += bytes;
                                return absl::OkStatus();
                              },
                              [&](uint64_t bytes) { charged -= bytes; }});
  for (uint32_t chunk = 0; chunk < 4; ++chunk) {
    auto access = journal->Begin(chunk, kJournal);
    ASSERT_TRUE(access.ok());
    ASSERT_TRUE(journal->Save(*access).ok());
  }
  EXPECT_EQ(charged, 4 * kJournal);
  EXPECT_GT(cache_.bytes_in_use(), 0u);
  EXPECT_GT(journal->spill_files()->allocated_bytes(), 0u);
  journal->Clear();
  EXPECT_EQ(charged, 0u);
  EXPECT_EQ(cache_.bytes_in_use(), 0u);
  EXPECT_FALSE(journal->Has(0));
  EXPECT_EQ(journal->spill_files()->allocated_bytes(), 0u);
  EXPECT_EQ(fs::file_size(journal->spill_files()->path(0)), 0u);
  EXPECT_TRUE(cache_.TryHold(32 * 1024));  // the holds are back
  cache_.ReleaseHold(32 * 1024);
  const fs::path file = journal->spill_files()->path(0);
  journal.reset();
  EXPECT_FALSE(fs::exists(file));
}

TEST_F(GradJournalTest, QuotaRefusalIsResourceExhaustedAndKeepsNothing) {
  auto journal = MakeJournal({[](uint64_t bytes) {
                                return absl::ResourceExhaustedError(fmt::format("{} bytes over", bytes));
                              },
                              nullptr});
  auto access = journal->Begin(5, kJournal);
  ASSERT_FALSE(access.ok());
  EXPECT_EQ(access.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_NE(access.status().message().find("chunk 5"), std::string::npos);
  EXPECT_FALSE(journal->Has(5));
  EXPECT_EQ(cache_.bytes_in_use(), 0u);
}

TEST_F(GradJournalTest, WithoutScratchABeyondDramJournalIsRefused) {
  GradJournal journal(cache_, "journal:s2", nullptr, {});
  for (uint32_t chunk = 0; chunk < 2; ++chunk) {
    auto access = journal.Begin(chunk, kJournal);
    ASSERT_TRUE(access.ok());
    ASSERT_TRUE(journal.Save(*access).ok());
  }
  auto third = journal.Begin(2, kJournal);
  EXPECT_EQ(third.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_NE(third.status().message().find("--dram-budget"), std::string::npos) << third.status();
}

TEST_F(GradJournalTest, ASpilledJournalIsAdmittedByTheStorageBudgetAndGivenBackAtClear) {
  // Room for the user's scratch of one journal (three blocks), not two.
  StorageBudget budget({root_}, StorageBudgetOptions{.max_bytes_per_user = kJournal + 4096,
                                                      .commit_reserve_bytes = 0});
  uint64_t taken = 0;
  JournalQuotaHooks quota{[&](uint64_t bytes) {
                            taken += bytes;
                            return absl::OkStatus();
                          },
                          [&](uint64_t bytes) { taken -= bytes; }};
  GradJournal journal(cache_, "journal:s3",
                      scratch_->ForSession("s3", ScratchCharge{.budget = &budget, .uid = ::geteuid(),
                                                               .what = "the gradient journal scratch"}),
                      quota, JournalOptions{.max_dram_bytes = 0});  // every journal spills
  auto first = journal.Begin(0, kJournal);
  ASSERT_TRUE(first.ok()) << first.status();
  ASSERT_TRUE(first->spilled());
  Fill(*first, 1);
  ASSERT_TRUE(journal.Save(*first).ok());
  first = JournalAccess();
  // The scratch counts with the user's jobs: a job's registration sees it.
  EXPECT_FALSE(budget.Admit(::geteuid(), 8192, "job 'x'").ok());
  auto second = journal.Begin(1, kJournal);
  ASSERT_FALSE(second.ok());
  EXPECT_EQ(second.status().code(), absl::StatusCode::kResourceExhausted) << second.status();
  for (const char* word : {"chunk 1", "the gradient journal scratch of uid", "max_storage_bytes_per_user",
                           "--max-storage-per-user", "of them scratch", "nothing of the step changed"}) {
    EXPECT_NE(second.status().message().find(word), std::string::npos) << word << " in " << second.status();
  }
  EXPECT_FALSE(journal.Has(1));
  EXPECT_EQ(taken, kJournal);  // the refusal gave its quota back
  EXPECT_EQ(journal.spill_files()->allocated_bytes(), kJournal);  // and allocated nothing
  // The first journal is intact.
  auto open = journal.Open(0);
  ASSERT_TRUE(open.ok()) << open.status();
  EXPECT_TRUE(Holds(*open, 1));
  open = JournalAccess();
  journal.Clear();  // the step's end gives the scratch back
  EXPECT_TRUE(budget.Admit(::geteuid(), kJournal + 4096, "job 'x'").ok());
}

TEST_F(GradJournalTest, ScratchCreateRemovesLeftovers) {
  {
    std::ofstream leftover(root_ / "journal" / "dead-session.spill");
    leftover << "old";
  }
  auto scratch = JournalScratch::Create({root_}, *io_);
  ASSERT_TRUE(scratch.ok());
  EXPECT_FALSE(fs::exists(root_ / "journal" / "dead-session.spill"));
  EXPECT_TRUE(fs::is_directory(root_ / "journal"));
}

}  // namespace
}  // namespace fuyou
