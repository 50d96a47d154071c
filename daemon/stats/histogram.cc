#include "stats/histogram.h"

#include <algorithm>
#include <cmath>

namespace fuyou {

Histogram::Histogram(std::vector<double> upper_bounds)
    : bounds_(std::move(upper_bounds)), buckets_(new std::atomic<uint64_t>[bounds_.size() + 1]) {
  for (size_t i = 0; i <= bounds_.size(); ++i) buckets_[i].store(0, std::memory_order_relaxed);
}

void Histogram::Observe(double seconds) {
  if (!(seconds >= 0)) seconds = 0;  // a clock that went backwards, or NaN
  // The first bound >= seconds: Prometheus buckets are `le` (less or equal).
  const size_t bucket = std::lower_bound(bounds_.begin(), bounds_.end(), seconds) - bounds_.begin();
  buckets_[bucket].fetch_add(1, std::memory_order_relaxed);
  const double nanoseconds = std::min(seconds * 1e9, 1e18);
  sum_nanoseconds_.fetch_add(static_cast<uint64_t>(std::llround(nanoseconds)), std::memory_order_relaxed);
}

HistogramSnapshot Histogram::Snapshot() const {
  HistogramSnapshot snapshot;
  snapshot.upper_bounds = bounds_;
  uint64_t running = 0;
  for (size_t i = 0; i <= bounds_.size(); ++i) {
    running += buckets_[i].load(std::memory_order_relaxed);
    snapshot.cumulative_counts.push_back(running);
  }
  // The +Inf bucket and the count must agree for Prometheus: both are the total
  // of the buckets read.
  snapshot.count = running;
  snapshot.sum_seconds = static_cast<double>(sum_nanoseconds_.load(std::memory_order_relaxed)) / 1e9;
  return snapshot;
}

std::vector<double> Histogram::ChunkUpdateBounds() {
  return {0.00001, 0.000025, 0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01,
          0.025,   0.05,     0.1,     0.25,   0.5,     1,      2.5,   5,      10};
}

std::vector<double> Histogram::StepBounds() {
  return {0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600};
}

}  // namespace fuyou
