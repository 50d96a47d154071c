#include "stats/histogram.h"

#include <gtest/gtest.h>

#include <cmath>

namespace fuyou {
namespace {

TEST(HistogramTest, CountsEachObservationInTheFirstBucketItFitsCumulatively) {
  Histogram histogram({0.001, 0.01, 0.1});
  histogram.Observe(0.0005);
  histogram.Observe(0.001);  // le: on the bound counts in that bucket
  histogram.Observe(0.05);
  histogram.Observe(3.0);  // only in +Inf
  const HistogramSnapshot snapshot = histogram.Snapshot();
  EXPECT_EQ(snapshot.upper_bounds, (std::vector<double>{0.001, 0.01, 0.1}));
  EXPECT_EQ(snapshot.cumulative_counts, (std::vector<uint64_t>{2, 2, 3, 4}));
  EXPECT_EQ(snapshot.count, 4u);
  EXPECT_NEAR(snapshot.sum_seconds, 3.0515, 1e-9);
}

TEST(HistogramTest, NegativeOrNanObservationsCountAsZero) {
  Histogram histogram({0.001});
  histogram.Observe(-1.0);
  histogram.Observe(std::nan(""));
  const HistogramSnapshot snapshot = histogram.Snapshot();
  EXPECT_EQ(snapshot.cumulative_counts, (std::vector<uint64_t>{2, 2}));
  EXPECT_EQ(snapshot.sum_seconds, 0.0);
}

TEST(HistogramTest, DefaultBoundsIncrease) {
  for (const auto& bounds : {Histogram::ChunkUpdateBounds(), Histogram::StepBounds()}) {
    for (size_t i = 1; i < bounds.size(); ++i) EXPECT_LT(bounds[i - 1], bounds[i]);
  }
}

}  // namespace
}  // namespace fuyou
