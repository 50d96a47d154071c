#include "jobs/storage_budget.h"

#include <fcntl.h>
#include <gtest/gtest.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <string>
#include <vector>
#include "test_support/temp_dir.h"

namespace fuyou {
namespace {
namespace fs = std::filesystem;
constexpr uint64_t kMiB = uint64_t{1} << 20;

class StorageBudgetTest : public ::testing::Test {
 protected:
  // A job of `uid` whose states.bin has `bytes` allocated.
  void MakeJob(uid_t uid, const std::string& name, uint64_t bytes) {
    const fs::path dir = root_ / "users" / std::to_string(uid) / "jobs" / name;
    fs::create_directories(dir);
    const int fd = ::open((dir / "states.bin").c_str(), O_CREAT | O_WRONLY | O_CLOEXEC, 0600);
    ASSERT_GE(fd, 0);
    ASSERT_EQ(::posix_fallocate(fd, 0, static_cast<off_t>(bytes)), 0);
    ::close(fd);
  }
  const TempDir temp_dir_{"fuyou-storage-budget-test"};
  const fs::path root_ = temp_dir_.path();
};

void ExpectRefusal(const absl::StatusOr<StorageBudget::Grant>& grant, const std::vector<std::string>& words) {
  ASSERT_FALSE(grant.ok());
  EXPECT_EQ(grant.status().code(), absl::StatusCode::kResourceExhausted);
  for (const std::string& word : words) {
    EXPECT_NE(grant.status().message().find(word), std::string::npos) << word << " in: " << grant.status().message();
  }
}

TEST_F(StorageBudgetTest, BoundsTheBytesOfAllOfAUsersJobs) {
  MakeJob(1000, "a", 4 * kMiB);
  MakeJob(1000, "b", 4 * kMiB);
  MakeJob(1001, "c", 8 * kMiB);
  StorageBudget budget({root_}, StorageBudgetOptions{.max_bytes_per_user = 10 * kMiB, .commit_reserve_bytes = 0});
  EXPECT_GE(budget.UsedBy(1000), 8 * kMiB);
  ExpectRefusal(budget.Admit(1000, 4 * kMiB, "job 'x'"),
                {"job 'x' of uid 1000", "max_storage_bytes_per_user (10485760 bytes", "--max-storage-per-user"});
  // What is in flight counts: two registrations cannot both take the rest.
  auto first = budget.Admit(1000, 1 * kMiB, "job 'y'");
  ASSERT_TRUE(first.ok()) << first.status();
  ExpectRefusal(budget.Admit(1000, 1 * kMiB + kMiB / 2, "job 'z'"), {"job 'z'"});
  first->Reset();
  EXPECT_TRUE(budget.Admit(1000, 1 * kMiB + kMiB / 2, "job 'z'").ok());
  // Another user is counted apart.
  EXPECT_TRUE(budget.Admit(1001, 2 * kMiB, "job 'w'").ok());
}

TEST_F(StorageBudgetTest, KeepsFreeSpaceForAdministratorsAndCommits) {
  struct statvfs info {};
  ASSERT_EQ(::statvfs(root_.c_str(), &info), 0);
  const uint64_t free = static_cast<uint64_t>(info.f_bavail) * info.f_frsize;
  ASSERT_GT(free, 64 * kMiB);
  // Keep all but 32 MiB of what is free for administrators.
  StorageBudget budget({root_}, StorageBudgetOptions{.reserved_free_bytes = free - 32 * kMiB,
                                                     .commit_reserve_bytes = 8 * kMiB});
  ExpectRefusal(budget.Admit(65534, 64 * kMiB, "job 'big'"), {"kept free", "reserved_free", "--reserved-free"});
  if (::geteuid() == 0) EXPECT_TRUE(budget.Admit(0, 64 * kMiB, "job 'root'").ok());
  // Nobody takes the space kept for commits.
  ExpectRefusal(budget.Admit(::geteuid(), free, "job 'all'"), {"for the commits of running jobs"});
}

// Issue 32: two users, each within a per-user limit of half the storage,
// filled it to the reserve and root's next job was refused. Ordinary users
// together stay within max_bytes_all_users, counted as one user's bytes are
// (jobs on disk, registrations in flight, scratch held); administrators are
// not bound by it and their jobs do not count in it.
TEST_F(StorageBudgetTest, OrdinaryUsersTogetherStayWithinTheAllUsersShare) {
  constexpr uid_t kAlice = 60001, kBob = 60002;
  if (::geteuid() == kAlice || ::geteuid() == kBob) GTEST_SKIP() << "the test's uids must be ordinary";
  MakeJob(kAlice, "a", 6 * kMiB);
  MakeJob(kBob, "b", 6 * kMiB);
  MakeJob(0, "root", 4 * kMiB);  // an administrator's job: not in the users' share
  StorageBudget budget({root_}, StorageBudgetOptions{.max_bytes_per_user = 8 * kMiB,
                                                     .max_bytes_all_users = 14 * kMiB,
                                                     .commit_reserve_bytes = 0});
  EXPECT_GE(budget.UsedByAllUsers(), 12 * kMiB);
  EXPECT_LT(budget.UsedByAllUsers(), 13 * kMiB);
  // Within both limits: 6 + 6 + 2 = 14 MiB.
  auto bob = budget.Admit(kBob, 2 * kMiB, "job 'b2'");
  ASSERT_TRUE(bob.ok()) << bob.status();
  // Alice is within her own limit (6 + 1 <= 8 MiB) but not within the share,
  // with Bob's registration in flight counted.
  ExpectRefusal(budget.Admit(kAlice, 1 * kMiB, "job 'a2'"),
                {"job 'a2' of uid 60001", "all users together", "max_storage_bytes_all_users (14680064 bytes",
                 "--max-storage-all-users", "kept for administrators"});
  // Root and the daemon's own user still admit (each within the per-user
  // limit, which binds them too): the rest is theirs.
  auto root = budget.Admit(0, 3 * kMiB, "job 'root2'");
  EXPECT_TRUE(root.ok()) << root.status();
  auto daemon = budget.Admit(::geteuid(), 1 * kMiB, "job 'daemon'");
  EXPECT_TRUE(daemon.ok()) << daemon.status();
  // Bob's grant given back, his held scratch counts the same way.
  bob->Reset();
  budget.HoldScratch(kBob, 2 * kMiB);
  ExpectRefusal(budget.Admit(kAlice, 1 * kMiB, "job 'a2'"), {"max_storage_bytes_all_users"});
  budget.GiveScratch(kBob, 2 * kMiB);
  EXPECT_TRUE(budget.Admit(kAlice, 1 * kMiB, "job 'a2'").ok());
  // The per-user limit still binds first.
  ExpectRefusal(budget.Admit(kAlice, 3 * kMiB, "job 'a3'"), {"max_storage_bytes_per_user"});
}

TEST_F(StorageBudgetTest, NoAllUsersShareWhenUnset) {
  MakeJob(60001, "a", 6 * kMiB);
  MakeJob(60002, "b", 6 * kMiB);
  StorageBudget budget({root_}, StorageBudgetOptions{.max_bytes_per_user = 8 * kMiB, .commit_reserve_bytes = 0});
  EXPECT_TRUE(budget.Admit(60001, 2 * kMiB, "job 'a2'").ok());
}

TEST(StorageDefaultsTest, ChoosesFiniteLimitsFromThePathsSize) {
  const StorageDefaults defaults = StorageDefaultsFor({fs::temp_directory_path()});
  ASSERT_GT(defaults.total_bytes, 0u);
  EXPECT_EQ(defaults.job_quota_bytes, defaults.total_bytes / 4);
  // Issue 32: users together hold at most half, one user a quarter (half of
  // the users' share); administrators keep the other half.
  EXPECT_EQ(defaults.max_bytes_per_user, defaults.total_bytes / 4);
  EXPECT_EQ(defaults.max_bytes_all_users, defaults.total_bytes / 2);
  EXPECT_LE(2 * defaults.max_bytes_per_user, defaults.max_bytes_all_users);
  EXPECT_LE(defaults.job_quota_bytes, defaults.max_bytes_per_user);
  EXPECT_GE(defaults.reserved_free_bytes, 64 * kMiB);
  EXPECT_LE(defaults.reserved_free_bytes, uint64_t{4} << 30);
}

}  // namespace
}  // namespace fuyou
