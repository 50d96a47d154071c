#include "journal/activation_spill.h"

#include <fcntl.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <filesystem>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "test_support/temp_dir.h"

namespace fuyou {
namespace {

namespace fs = std::filesystem;

std::vector<std::byte> Pattern(size_t bytes, uint8_t seed) {
  std::vector<std::byte> out(bytes);
  for (size_t i = 0; i < bytes; ++i) out[i] = static_cast<std::byte>(seed + i * 13);
  return out;
}

class ActivationSpillTest : public ::testing::Test {
 protected:
  void SetUp() override {
    auto io = storage::IoEngine::Create({});
    ASSERT_TRUE(io.ok()) << io.status();
    io_ = std::move(*io);
    auto scratch = JournalScratch::Create({root_a_, root_b_}, *io_, {}, JournalScratch::kActivationDirName);
    ASSERT_TRUE(scratch.ok()) << scratch.status();
    scratch_ = std::move(*scratch);
  }

  // A spill charged to `taken` against a limit of `limit` bytes (and to
  // `storage`, when given, for this process's uid).
  std::unique_ptr<ActivationSpill> MakeSpill(const std::string& session, uint64_t limit = UINT64_MAX,
                                             StorageBudget* storage = nullptr) {
    JournalQuotaHooks quota;
    quota.take = [this, limit](uint64_t bytes) {
      if (bytes > limit - taken_) return absl::ResourceExhaustedError("over max_activation_bytes_per_user");
      taken_ += bytes;
      return absl::OkStatus();
    };
    quota.give = [this](uint64_t bytes) { taken_ -= bytes; };
    return std::make_unique<ActivationSpill>(
        scratch_->ForSession(session,
                             ScratchCharge{.budget = storage, .uid = ::geteuid(), .what = "the activation scratch"}),
        std::move(quota));
  }

  size_t FilesIn(const fs::path& root) const {
    size_t n = 0;
    for ([[maybe_unused]] const auto& entry : fs::directory_iterator(root / "activations")) ++n;
    return n;
  }

  const TempDir temp_dir_{"fuyou-activation-test"};
  const fs::path root_a_ = [this] { fs::create_directories(temp_dir_.path() / "a"); return temp_dir_.path() / "a"; }();
  const fs::path root_b_ = [this] { fs::create_directories(temp_dir_.path() / "b"); return temp_dir_.path() / "b"; }();
  std::unique_ptr<storage::IoEngine> io_;
  std::unique_ptr<JournalScratch> scratch_;
  uint64_t taken_ = 0;
};

TEST_F(ActivationSpillTest, RecallGivesBackTheSameBytesStripedOverThePaths) {
  auto spill = MakeSpill("s1");
  const auto first = Pattern(5000, 1);  // not whole blocks
  const auto second = Pattern(4096, 2);
  ASSERT_TRUE(spill->Spill(7, first).status().ok());
  ASSERT_TRUE(spill->Spill(8, second).status().ok());
  EXPECT_EQ(spill->spilled(), 2u);
  EXPECT_EQ(spill->scratch_bytes(), 8192u + 4096u);
  EXPECT_EQ(taken_, 8192u + 4096u);
  // One activation per storage path in turn.
  EXPECT_EQ(spill->Locate(7)->file.parent_path().parent_path(), root_a_);
  EXPECT_EQ(spill->Locate(8)->file.parent_path().parent_path(), root_b_);

  std::vector<std::byte> out(8192, std::byte{0xEE});
  auto recalled = spill->Recall(8, out).Wait();
  ASSERT_TRUE(recalled.ok()) << recalled.status();
  EXPECT_EQ(*recalled, 4096u);
  EXPECT_TRUE(std::equal(second.begin(), second.end(), out.begin()));
  recalled = spill->Recall(7, out).Wait();
  ASSERT_TRUE(recalled.ok()) << recalled.status();
  EXPECT_EQ(*recalled, 5000u);
  EXPECT_TRUE(std::equal(first.begin(), first.end(), out.begin()));
  EXPECT_EQ(spill->spilled(), 0u);
}

TEST_F(ActivationSpillTest, RecallOfAnUnknownOrRecalledKeyIsNotFound) {
  auto spill = MakeSpill("s1");
  std::vector<std::byte> out(4096);
  auto unknown = spill->Recall(42, out).Wait();
  EXPECT_EQ(unknown.status().code(), absl::StatusCode::kNotFound);
  EXPECT_NE(unknown.status().message().find("activation 42 is not spilled"), std::string::npos)
      << unknown.status();
  ASSERT_TRUE(spill->Spill(42, Pattern(100, 3)).status().ok());
  ASSERT_TRUE(spill->Recall(42, out).Wait().ok());
  EXPECT_EQ(spill->Recall(42, out).Wait().status().code(), absl::StatusCode::kNotFound);
}

TEST_F(ActivationSpillTest, AKeySpilledTwiceOrAShortRecallIsRefused) {
  auto spill = MakeSpill("s1");
  ASSERT_TRUE(spill->Spill(1, Pattern(6000, 3)).status().ok());
  EXPECT_EQ(spill->Spill(1, Pattern(10, 3)).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(spill->Spill(2, {}).status().code(), absl::StatusCode::kInvalidArgument);
  std::vector<std::byte> small(4096);
  EXPECT_EQ(spill->Recall(1, small).Wait().status().code(), absl::StatusCode::kInvalidArgument);
  std::vector<std::byte> out(6000);
  EXPECT_TRUE(spill->Recall(1, out).Wait().ok());  // the short recall did not forget it
}

TEST_F(ActivationSpillTest, ACorruptedActivationIsDataLoss) {
  auto spill = MakeSpill("s1");
  ASSERT_TRUE(spill->Spill(5, Pattern(4096, 9)).status().ok());
  auto where = spill->Locate(5);
  ASSERT_TRUE(where.ok());
  const int fd = ::open(where->file.c_str(), O_WRONLY);
  ASSERT_GE(fd, 0);
  const char flipped = 0x5A;
  ASSERT_EQ(::pwrite(fd, &flipped, 1, static_cast<off_t>(where->offset + 100)), 1);
  ::close(fd);
  std::vector<std::byte> out(4096);
  auto recalled = spill->Recall(5, out).Wait();
  EXPECT_EQ(recalled.status().code(), absl::StatusCode::kDataLoss) << recalled.status();
  EXPECT_NE(recalled.status().message().find(where->file.string()), std::string::npos) << recalled.status();
}

TEST_F(ActivationSpillTest, TheUserLimitRefusesASpillAndChangesNothing) {
  auto spill = MakeSpill("s1", /*limit=*/8192);
  ASSERT_TRUE(spill->Spill(1, Pattern(4096, 1)).status().ok());
  const absl::Status refused = spill->Spill(2, Pattern(4097, 1)).status();  // two blocks: over
  EXPECT_EQ(refused.code(), absl::StatusCode::kResourceExhausted) << refused;
  EXPECT_EQ(spill->spilled(), 1u);
  EXPECT_EQ(taken_, 4096u);
  EXPECT_TRUE(spill->Spill(3, Pattern(4096, 1)).status().ok());
}

void ExpectRefusal(const absl::Status& refused, const std::vector<std::string>& words) {
  EXPECT_EQ(refused.code(), absl::StatusCode::kResourceExhausted) << refused;
  for (const std::string& word : words) {
    EXPECT_NE(refused.message().find(word), std::string::npos) << word << " in: " << refused.message();
  }
}

TEST_F(ActivationSpillTest, TheStorageBudgetBoundsTheScratchWithTheUsersJobsAndTheSessionGoesOn) {
  StorageBudget budget({root_a_, root_b_}, StorageBudgetOptions{.max_bytes_per_user = 3 * 4096,
                                                               .commit_reserve_bytes = 0});
  auto spill = MakeSpill("s1", UINT64_MAX, &budget);
  ASSERT_TRUE(spill->Spill(1, Pattern(4096, 1)).status().ok());
  ASSERT_TRUE(spill->Spill(2, Pattern(8192, 2)).status().ok());  // the limit, exactly
  ExpectRefusal(spill->Spill(3, Pattern(10, 3)).status(),
                {"activation 3: the activation scratch of uid", "max_storage_bytes_per_user (12288 bytes",
                 "12288 of them scratch", "--max-storage-per-user", "the session goes on"});
  EXPECT_EQ(spill->spilled(), 2u);
  EXPECT_EQ(taken_, 3 * 4096u);  // the refusal gave the activation limit's charge back
  // The scratch counts against the user's jobs too.
  EXPECT_FALSE(budget.Admit(::geteuid(), 4096, "job 'x'").ok());
  // The session goes on: its activations come back; a recall frees nothing
  // until the drop, which gives it all back.
  std::vector<std::byte> out(8192);
  ASSERT_TRUE(spill->Recall(2, out).Wait().ok());
  EXPECT_EQ(spill->Spill(4, Pattern(10, 4)).status().code(), absl::StatusCode::kResourceExhausted);
  spill->Drop();
  ASSERT_TRUE(spill->Spill(5, Pattern(3 * 4096, 5)).status().ok());
  spill.reset();  // the session's end gives it back too
  EXPECT_TRUE(budget.Admit(::geteuid(), 3 * 4096, "job 'x'").ok());
}

TEST_F(ActivationSpillTest, TheStorageBudgetKeepsTheFreeSpaceForCommits) {
  // Everything free on the paths is kept for commits: no spill fits.
  StorageBudget budget({root_a_, root_b_}, StorageBudgetOptions{.commit_reserve_bytes = UINT64_MAX / 4});
  auto spill = MakeSpill("s1", UINT64_MAX, &budget);
  ExpectRefusal(spill->Spill(1, Pattern(4096, 1)).status(), {"activation 1: the activation scratch", "kept free",
                                                    "for the commits of running jobs"});
  EXPECT_EQ(spill->spilled(), 0u);
  EXPECT_EQ(spill->scratch_bytes(), 0u);
  EXPECT_EQ(taken_, 0u);
  EXPECT_EQ(FilesIn(root_a_) + FilesIn(root_b_), 0u);  // nothing was allocated
}

TEST_F(ActivationSpillTest, DropFreesEverythingAndTheEndRemovesTheFiles) {
  auto spill = MakeSpill("s1");
  ASSERT_TRUE(spill->Spill(1, Pattern(4096, 1)).status().ok());
  ASSERT_TRUE(spill->Spill(2, Pattern(4096, 1)).status().ok());
  std::vector<std::byte> out(4096);
  ASSERT_TRUE(spill->Recall(1, out).Wait().ok());
  const ActivationSpill::Dropped dropped = spill->Drop();
  EXPECT_EQ(dropped.activations, 1u);
  EXPECT_EQ(dropped.scratch_bytes, 8192u);
  EXPECT_EQ(taken_, 0u);
  EXPECT_EQ(spill->Recall(2, out).Wait().status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(fs::file_size(root_a_ / "activations" / "s1.spill"), 0u);  // truncated
  ASSERT_TRUE(spill->Spill(3, Pattern(4096, 4)).status().ok());
  EXPECT_EQ(FilesIn(root_a_), 1u);
  spill.reset();  // the session's end
  EXPECT_EQ(FilesIn(root_a_), 0u);
  EXPECT_EQ(FilesIn(root_b_), 0u);
  EXPECT_EQ(taken_, 0u);
}

TEST_F(ActivationSpillTest, SessionsDoNotSeeEachOthersActivations) {
  auto mine = MakeSpill("s1");
  auto theirs = MakeSpill("s2");
  ASSERT_TRUE(mine->Spill(1, Pattern(4096, 1)).status().ok());
  std::vector<std::byte> out(4096);
  EXPECT_EQ(theirs->Recall(1, out).Wait().status().code(), absl::StatusCode::kNotFound);
  EXPECT_TRUE(mine->Recall(1, out).Wait().ok());
}

// Holds every write's completion until Release: a transfer in flight for as
// long as the test wants, without timing.
class WriteGate final : public storage::FaultInjector {
 public:
  int64_t Adjust(Op op, const std::filesystem::path&, uint64_t, uint64_t, int64_t result) override {
    if (op != Op::kWrite) return result;
    std::unique_lock lock(mutex_);
    released_cv_.wait(lock, [&] { return released_; });
    return result;
  }
  void Release() {
    std::lock_guard lock(mutex_);
    released_ = true;
    released_cv_.notify_all();
  }

 private:
  std::mutex mutex_;
  std::condition_variable released_cv_;
  bool released_ = false;
};

TEST_F(ActivationSpillTest, ASpillReturnsBeforeItsWriteWithTheBytesItWasGiven) {
  WriteGate gate;
  auto io = storage::IoEngine::Create({.fault_injector = &gate});
  ASSERT_TRUE(io.ok()) << io.status();
  auto scratch = JournalScratch::Create({root_a_}, **io, {}, JournalScratch::kActivationDirName);
  ASSERT_TRUE(scratch.ok()) << scratch.status();
  {
    ActivationSpill spill((*scratch)->ForSession("s9"), {});
    std::vector<std::byte> bytes = Pattern(6000, 4);
    const std::vector<std::byte> sent = bytes;
    Future<void> written = spill.Spill(1, bytes);
    EXPECT_FALSE(written.ready()) << "Spill waited for its write";
    std::fill(bytes.begin(), bytes.end(), std::byte{0});  // the caller's memory is free again at once
    Future<void> second = spill.Spill(2, Pattern(100, 5));
    EXPECT_FALSE(second.ready());
    gate.Release();
    ASSERT_TRUE(written.status().ok()) << written.status();
    ASSERT_TRUE(second.status().ok()) << second.status();
    std::vector<std::byte> out(6000);
    auto recalled = spill.Recall(1, out).Wait();
    ASSERT_TRUE(recalled.ok()) << recalled.status();
    EXPECT_EQ(out, sent);
  }  // the spill ends before its engine
  scratch->reset();
}

TEST_F(ActivationSpillTest, DropWaitsForTheTransfersInFlight) {
  WriteGate gate;
  auto io = storage::IoEngine::Create({.fault_injector = &gate});
  ASSERT_TRUE(io.ok()) << io.status();
  auto scratch = JournalScratch::Create({root_a_}, **io, {}, JournalScratch::kActivationDirName);
  ASSERT_TRUE(scratch.ok()) << scratch.status();
  ActivationSpill spill((*scratch)->ForSession("s8"), {});
  Future<void> written = spill.Spill(1, Pattern(4096, 1));
  std::atomic<bool> dropped{false};
  std::thread dropper([&] {
    EXPECT_EQ(spill.Drop().activations, 1u);
    dropped = true;
  });
  for (int i = 0; i < 20; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
    EXPECT_FALSE(dropped) << "Drop did not wait for the write in flight";
  }
  gate.Release();
  dropper.join();
  EXPECT_TRUE(written.ready());
  EXPECT_EQ(fs::file_size(root_a_ / "activations" / "s8.spill"), 0u);
}

TEST_F(ActivationSpillTest, ARestartEmptiesTheScratch) {
  auto spill = MakeSpill("s1");
  ASSERT_TRUE(spill->Spill(1, Pattern(4096, 1)).status().ok());
  EXPECT_EQ(FilesIn(root_a_), 1u);
  auto again = JournalScratch::Create({root_a_}, *io_, {}, JournalScratch::kActivationDirName);  // a new daemon
  ASSERT_TRUE(again.ok());
  EXPECT_EQ(FilesIn(root_a_), 0u);
}

}  // namespace
}  // namespace fuyou
