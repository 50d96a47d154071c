// Histogram: a latency distribution in fixed buckets, as Prometheus histograms
// are (cumulative `le` buckets, a sum and a count). Observe is lock-free and
// cheap enough for the hot path (one bucket search, three relaxed atomic adds);
// Snapshot reads the buckets without stopping writers, so a snapshot taken
// during an observation may count it in `count` but not yet in its bucket (the
// next scrape agrees again).
#pragma once

#include <atomic>
#include <cstdint>
#include <memory>
#include <vector>

namespace fuyou {

struct HistogramSnapshot {
  std::vector<double> upper_bounds;         // seconds, increasing; +Inf is implied
  std::vector<uint64_t> cumulative_counts;  // one per bound, then one for +Inf (== count)
  double sum_seconds = 0;
  uint64_t count = 0;
};

class Histogram {
 public:
  // `upper_bounds` in seconds, strictly increasing, finite.
  explicit Histogram(std::vector<double> upper_bounds);

  void Observe(double seconds);
  HistogramSnapshot Snapshot() const;

  // Bounds for one chunk update's kernel time: 10 us .. 10 s.
  static std::vector<double> ChunkUpdateBounds();
  // Bounds for one training step: 10 ms .. 10 min.
  static std::vector<double> StepBounds();

 private:
  const std::vector<double> bounds_;
  std::unique_ptr<std::atomic<uint64_t>[]> buckets_;  // bounds_.size() + 1, not cumulative
  std::atomic<uint64_t> sum_nanoseconds_{0};
};

}  // namespace fuyou
