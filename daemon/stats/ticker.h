// Tickers: the daemon's named counters, as RocksDB's are. One table
// (ticker.cc) gives each ticker its GetStatsResponse field and, when it has
// one, its Prometheus sample; GetStats (FillTickers) and /metrics
// (metrics/metrics_text.cc) are both driven by it, so a new counter is one
// enum value and one table entry.
//
// Every ticker is a monotonic count (a Prometheus counter); what is not
// counted (the DRAM budget and use, live sessions, the uptime, rates) is not a
// ticker. An event is counted once, with StatsScopes::Bump, into both scopes
// it belongs to: the daemon's and its user's.
#pragma once

#include <array>
#include <atomic>
#include <cstddef>
#include <cstdint>
#include <span>
#include <string_view>

#include "fuyou/v1/admin.pb.h"

namespace fuyou {

enum class Ticker : uint8_t {
  kBytesRead,     // optimizer states read from storage
  kBytesWritten,  // and written
  kChunkUpdates,
  kParamsUpdated,
  kCacheHits,
  kCacheMisses,
  kStepsCommitted,
  kChunksSpeculative,
  kChunksRedoneChanged,
  kChunksRedoneClipped,
  kChunksRolledBackSkippedStep,
  kRedoNanoseconds,
  kWeightsFetches,
  kWeightsFetchCacheHits,
  kWeightsBytesRead,
  kJournalBytes,
  kJournalSpilledBytes,
  kJournalReplays,
  kJournalReplayNanoseconds,
  kActivationSpilledBytes,
  kActivationRecalledBytes,
  kCount,  // not a ticker: how many there are
};

inline constexpr size_t kTickerCount = static_cast<size_t>(Ticker::kCount);

enum class TickerUnit : uint8_t {
  kAsCounted,    // shown as counted, in a uint64 field
  kNanoseconds,  // counted in nanoseconds, shown in seconds in a double field
};

struct TickerInfo {
  Ticker ticker;
  // The GetStatsResponse field that shows it (uint64 for kAsCounted, double for
  // kNanoseconds).
  std::string_view proto_field;
  TickerUnit unit;
  // In STATS_SCOPE_DAEMON the field is the storage paths' sum instead
  // (server/stats_report.cc: the engine's per-path traffic), and the ticker
  // has no Prometheus sample (the per-path families are its).
  bool daemon_from_storage_paths;
  // Its Prometheus family, or empty for none. Samples of one family are
  // adjacent in the table; the first carries the family's help.
  std::string_view metric;
  std::string_view labels;  // the sample's labels, e.g. reason="changed"; may be empty
  std::string_view help;    // the family's HELP text; empty after a family's first sample
};

// Every ticker, in enum order (AllTickers()[i].ticker == Ticker(i)).
std::span<const TickerInfo> AllTickers();
const TickerInfo& InfoOf(Ticker ticker);

// One scope's counts (the daemon's, or one user's). Thread-safe, lock-free.
class TickerCounts {
 public:
  void Add(Ticker ticker, uint64_t n) { counts_[static_cast<size_t>(ticker)].fetch_add(n, std::memory_order_relaxed); }
  uint64_t Get(Ticker ticker) const { return counts_[static_cast<size_t>(ticker)].load(std::memory_order_relaxed); }

 private:
  std::array<std::atomic<uint64_t>, kTickerCount> counts_{};
};

// The two scopes an event of one user counts in. Cheap to copy; the counts
// outlive it.
class StatsScopes {
 public:
  StatsScopes(TickerCounts& daemon, TickerCounts& user) : daemon_(&daemon), user_(&user) {}

  // Counts `n` of `ticker` into the daemon's and the user's counts.
  void Bump(Ticker ticker, uint64_t n = 1) const {
    daemon_->Add(ticker, n);
    user_->Add(ticker, n);
  }
  const TickerCounts& daemon() const { return *daemon_; }
  const TickerCounts& user() const { return *user_; }

 private:
  TickerCounts* daemon_;
  TickerCounts* user_;
};

// The GetStatsResponse field of `info` (never null for a table entry: the
// table's test checks every one).
const google::protobuf::FieldDescriptor* ProtoFieldOf(const TickerInfo& info);

// Sets every ticker's field of `response` from `counts`, but in
// STATS_SCOPE_DAEMON those that come from the storage paths.
void FillTickers(const TickerCounts& counts, v1::StatsScope scope, v1::GetStatsResponse& response);

}  // namespace fuyou
