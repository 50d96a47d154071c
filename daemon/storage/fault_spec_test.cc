#include "storage/fault_spec.h"

#include <gtest/gtest.h>

#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <chrono>
#include <filesystem>
#include <fstream>
#include <string>
#include <thread>

namespace fuyou::storage {
namespace {

using Op = FaultInjector::Op;

TEST(FaultSpecTest, ParsesRulesWithOptions) {
  auto rules = ParseFaultSpec("write:ENOSPC:after=3:job=big;reserve:EDQUOT;read:EIO:job=b:after=0;sync:EROFS");
  ASSERT_TRUE(rules.ok()) << rules.status().message();
  ASSERT_EQ(rules->size(), 4u);
  EXPECT_EQ((*rules)[0].op, Op::kWrite);
  EXPECT_EQ((*rules)[0].error, ENOSPC);
  EXPECT_EQ((*rules)[0].after, 3u);
  EXPECT_EQ((*rules)[0].job, "big");
  EXPECT_EQ((*rules)[1].op, Op::kReserve);
  EXPECT_EQ((*rules)[1].error, EDQUOT);
  EXPECT_EQ((*rules)[1].after, 0u);
  EXPECT_EQ((*rules)[1].job, "");
  EXPECT_EQ((*rules)[2].op, Op::kRead);
  EXPECT_EQ((*rules)[2].job, "b");
  EXPECT_EQ((*rules)[3].op, Op::kSync);
  EXPECT_EQ((*rules)[3].error, EROFS);
}

TEST(FaultSpecTest, RefusesMalformedRulesNamingThem) {
  for (const char* bad : {"", ";", "write", "write:", "erase:EIO", "write:EAGAIN", "write:ENOSPC:after=",
                          "write:ENOSPC:after=x", "write:ENOSPC:after=-1", "write:ENOSPC:job=", "write:ENOSPC:job=a/b",
                          "write:ENOSPC:after=1:after=2", "write:ENOSPC:every=2", "write:ENOSPC;job=a",
                          "write:HOLD", "write:HOLD:until=relative", "write:ENOSPC:until=/x", "write:EIO:dir=",
                          "write:EIO:dir=a/b"}) {
    auto rules = ParseFaultSpec(bad);
    EXPECT_EQ(rules.status().code(), absl::StatusCode::kInvalidArgument) << "'" << bad << "' was accepted";
  }
  auto rules = ParseFaultSpec("write:EAGAIN");
  EXPECT_NE(std::string(rules.status().message()).find("write:EAGAIN"), std::string::npos);
}

TEST(FaultSpecTest, FailsFromTheOperationAfterN) {
  auto injector = SpecFaultInjector::FromSpec("write:ENOSPC:after=2");
  ASSERT_TRUE(injector.ok());
  const std::filesystem::path file = "/data/jobs/a/states.bin";
  EXPECT_EQ((*injector)->Adjust(Op::kWrite, file, 0, 4096, 4096), 4096);
  EXPECT_EQ((*injector)->Adjust(Op::kRead, file, 0, 4096, 4096), 4096);  // other ops do not count
  EXPECT_EQ((*injector)->Adjust(Op::kWrite, file, 0, 4096, 4096), 4096);
  EXPECT_EQ((*injector)->Adjust(Op::kWrite, file, 0, 4096, 4096), -ENOSPC);
  EXPECT_EQ((*injector)->Adjust(Op::kWrite, file, 0, 4096, 4096), -ENOSPC);
  EXPECT_EQ((*injector)->Adjust(Op::kWrite, file, 0, 4096, -EIO), -EIO);  // a real error stays
  EXPECT_EQ((*injector)->injected(), 2u);
}

TEST(FaultSpecTest, AJobFilterMatchesOnlyThatJobsFiles) {
  auto injector = SpecFaultInjector::FromSpec("reserve:ENOSPC:job=big");
  ASSERT_TRUE(injector.ok());
  EXPECT_EQ((*injector)->Adjust(Op::kReserve, "/d/jobs/big/states.bin", 0, 0, 0), -ENOSPC);
  EXPECT_EQ((*injector)->Adjust(Op::kReserve, "/d/jobs/small/states.bin", 0, 0, 0), 0);
  EXPECT_EQ((*injector)->Adjust(Op::kReserve, "/d/jobs/bigger/states.bin", 0, 0, 0), 0);
  EXPECT_EQ((*injector)->Adjust(Op::kReserve, "/d/big/states.bin", 0, 0, 0), 0);
  EXPECT_EQ((*injector)->Adjust(Op::kReserve, "/d/.fuyoud-probe", 0, 0, 0), 0);
}

TEST(FaultSpecTest, ADirFilterMatchesOnlyFilesInThatDirectory) {
  auto injector = SpecFaultInjector::FromSpec("write:EIO:dir=activations");
  ASSERT_TRUE(injector.ok()) << injector.status();
  EXPECT_EQ((*injector)->Adjust(Op::kWrite, "/d/activations/s1.spill", 0, 4096, 4096), -EIO);
  EXPECT_EQ((*injector)->Adjust(Op::kWrite, "/d/journal/s1.spill", 0, 4096, 4096), 4096);
  EXPECT_EQ((*injector)->Adjust(Op::kWrite, "/d/jobs/activations", 0, 4096, 4096), 4096);  // a file of that name
}

TEST(FaultSpecTest, AHoldWaitsForItsFileAndChangesNothing) {
  const std::filesystem::path gate =
      std::filesystem::temp_directory_path() / ("fuyou-hold-" + std::to_string(::getpid()));
  std::filesystem::remove(gate);
  auto injector = SpecFaultInjector::FromSpec("write:HOLD:until=" + gate.string() + ":dir=activations:after=1");
  ASSERT_TRUE(injector.ok()) << injector.status();
  const std::filesystem::path file = "/d/activations/s1.spill";
  EXPECT_EQ((*injector)->Adjust(Op::kWrite, file, 0, 4096, 4096), 4096);  // the first passes
  EXPECT_EQ((*injector)->Adjust(Op::kWrite, "/d/jobs/a/states.bin", 0, 4096, 4096), 4096);  // not in the dir
  std::atomic<bool> done{false};
  std::thread held([&] {
    EXPECT_EQ((*injector)->Adjust(Op::kWrite, file, 0, 4096, 4096), 4096);
    done = true;
  });
  // Held until the file exists: not done while it does not (however long the
  // machine takes, the hold cannot end on its own before kHoldLimitSeconds).
  for (int i = 0; i < 20; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
    EXPECT_FALSE(done);
  }
  { std::ofstream(gate.string()) << "go"; }
  held.join();
  EXPECT_TRUE(done);
  EXPECT_EQ((*injector)->injected(), 1u);
  std::filesystem::remove(gate);
}

}  // namespace
}  // namespace fuyou::storage
