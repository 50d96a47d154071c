#include "state/job_cache.h"

#include <gtest/gtest.h>

namespace fuyou {
namespace {

TEST(JobCacheTest, EachSpaceIsItsOwnEntry) {
  StateCache cache(1 << 20);
  const JobCache job(cache, "1000/job");
  for (CacheSpace space : {CacheSpace::kStates, CacheSpace::kUndo, CacheSpace::kWeights}) {
    auto pin = job.Create(space, 7, 4096, /*wait=*/false);
    ASSERT_TRUE(pin.ok()) << pin.status();
  }
  EXPECT_TRUE(job.Contains(CacheSpace::kStates, 7));
  EXPECT_TRUE(cache.Contains("1000/job", 7));  // the states keep the job's own name
  job.Drop(CacheSpace::kUndo, 7);
  EXPECT_FALSE(job.Contains(CacheSpace::kUndo, 7));
  EXPECT_TRUE(job.Contains(CacheSpace::kWeights, 7));
  job.DropAll(CacheSpace::kWeights);
  EXPECT_FALSE(job.Contains(CacheSpace::kWeights, 7));
  EXPECT_TRUE(job.Contains(CacheSpace::kStates, 7));
  const JobCache other(cache, "1000/other");
  EXPECT_FALSE(other.Contains(CacheSpace::kStates, 7));
}

}  // namespace
}  // namespace fuyou
