#include "stats/ticker.h"

namespace fuyou {
namespace {

using enum Ticker;
using enum TickerUnit;

// The one table. A new counter: its enum value, its entry here (in enum
// order), its GetStatsResponse field, and its line in metrics_text_test.cc.
constexpr std::array<TickerInfo, kTickerCount> kTickers{{
    {.ticker = kBytesRead, .proto_field = "bytes_read", .unit = kAsCounted, .daemon_from_storage_paths = true},
    {.ticker = kBytesWritten, .proto_field = "bytes_written", .unit = kAsCounted, .daemon_from_storage_paths = true},
    {.ticker = kChunkUpdates,
     .proto_field = "chunk_updates",
     .unit = kAsCounted,
     .metric = "fuyou_chunk_updates_total",
     .help = "AdamW updates of one chunk (redone ones included)."},
    {.ticker = kParamsUpdated,
     .proto_field = "params_updated",
     .unit = kAsCounted,
     .metric = "fuyou_params_updated_total",
     .help = "Parameters updated by AdamW."},
    {.ticker = kCacheHits,
     .proto_field = "cache_hits",
     .unit = kAsCounted,
     .metric = "fuyou_cache_hits_total",
     .help = "State reads served from the DRAM tier without touching storage."},
    {.ticker = kCacheMisses,
     .proto_field = "cache_misses",
     .unit = kAsCounted,
     .metric = "fuyou_cache_misses_total",
     .help = "State reads that went to storage."},
    {.ticker = kStepsCommitted,
     .proto_field = "steps_committed",
     .unit = kAsCounted,
     .metric = "fuyou_steps_committed_total",
     .help = "Training steps committed, over all jobs."},
    {.ticker = kChunksSpeculative,
     .proto_field = "chunks_speculative",
     .unit = kAsCounted,
     .metric = "fuyou_chunks_speculative_total",
     .help = "Chunk updates sent while backward was still running (a subset of fuyou_chunk_updates_total)."},
    {.ticker = kChunksRedoneChanged,
     .proto_field = "chunks_redone_changed",
     .unit = kAsCounted,
     .metric = "fuyou_chunks_redone_total",
     .labels = "reason=\"changed\"",
     .help = "Chunk updates done again in the same step: the gradients changed after they were sent, or "
             "max_grad_norm clipped them."},
    {.ticker = kChunksRedoneClipped,
     .proto_field = "chunks_redone_clipped",
     .unit = kAsCounted,
     .metric = "fuyou_chunks_redone_total",
     .labels = "reason=\"clipped\""},
    {.ticker = kChunksRolledBackSkippedStep,
     .proto_field = "chunks_rolled_back_skipped_step",
     .unit = kAsCounted,
     .metric = "fuyou_chunks_rolled_back_total",
     .labels = "reason=\"skipped_step\"",
     .help = "Chunk updates rolled back because the training loop skipped the step."},
    {.ticker = kRedoNanoseconds,
     .proto_field = "redo_seconds",
     .unit = kNanoseconds,
     .metric = "fuyou_redo_seconds_total",
     .help = "Seconds spent on redone updates (reading the committed states again, the kernel, the write-back)."},
    {.ticker = kWeightsFetches,
     .proto_field = "weights_fetches",
     .unit = kAsCounted,
     .metric = "fuyou_weights_fetches_total",
     .help = "Working weights of a chunk fetched by a client (FetchWeights of a chunk with store_weights)."},
    {.ticker = kWeightsFetchCacheHits,
     .proto_field = "weights_fetch_cache_hits",
     .unit = kAsCounted,
     .metric = "fuyou_weights_fetch_cache_hits_total",
     .help = "Weights fetches answered from DRAM (a cached chunk, or a read-ahead done or in flight)."},
    {.ticker = kWeightsBytesRead,
     .proto_field = "weights_bytes_read",
     .unit = kAsCounted,
     .metric = "fuyou_weights_read_bytes_total",
     .help = "Bytes of working weights read from storage for fetches and their read-aheads (weights only)."},
    {.ticker = kJournalBytes,
     .proto_field = "journal_bytes_total",
     .unit = kAsCounted,
     .metric = "fuyou_journal_bytes_total",
     .help = "Bytes of gradients journaled for redos in the streamed mode (GradReady.journal KEEP, ADD, REPLAY)."},
    {.ticker = kJournalSpilledBytes,
     .proto_field = "journal_spilled_bytes_total",
     .unit = kAsCounted,
     .metric = "fuyou_journal_spilled_bytes_total",
     .help = "Bytes of journaled gradients spilled to the storage tier's scratch files (beyond the DRAM budget)."},
    {.ticker = kJournalReplays,
     .proto_field = "journal_replays_total",
     .unit = kAsCounted,
     .metric = "fuyou_journal_replays_total",
     .help = "Chunk updates made from a gradient journal (JOURNAL_USE_ADD and JOURNAL_USE_REPLAY)."},
    {.ticker = kJournalReplayNanoseconds,
     .proto_field = "journal_replay_seconds_total",
     .unit = kNanoseconds,
     .metric = "fuyou_journal_replay_seconds_total",
     .help = "Seconds spent on updates from a gradient journal (journal read, ops and add, kernel)."},
    {.ticker = kActivationSpilledBytes,
     .proto_field = "activation_spilled_bytes_total",
     .unit = kAsCounted,
     .metric = "fuyou_activation_spilled_bytes_total",
     .help = "Bytes of activations spilled to the storage tier's scratch files (SpillActivation)."},
    {.ticker = kActivationRecalledBytes,
     .proto_field = "activation_recalled_bytes_total",
     .unit = kAsCounted,
     .metric = "fuyou_activation_recalled_bytes_total",
     .help = "Bytes of spilled activations read back and checked (RecallActivation)."},
}};

constexpr bool InEnumOrder() {
  for (size_t i = 0; i < kTickers.size(); ++i) {
    if (static_cast<size_t>(kTickers[i].ticker) != i) return false;
  }
  return true;
}
static_assert(InEnumOrder(), "kTickers lists every ticker once, in enum order");

}  // namespace

std::span<const TickerInfo> AllTickers() { return kTickers; }

const TickerInfo& InfoOf(Ticker ticker) { return kTickers[static_cast<size_t>(ticker)]; }

const google::protobuf::FieldDescriptor* ProtoFieldOf(const TickerInfo& info) {
  return v1::GetStatsResponse::descriptor()->FindFieldByName(std::string(info.proto_field));
}

void FillTickers(const TickerCounts& counts, v1::StatsScope scope, v1::GetStatsResponse& response) {
  const google::protobuf::Reflection* reflection = response.GetReflection();
  for (const TickerInfo& info : kTickers) {
    if (scope == v1::STATS_SCOPE_DAEMON && info.daemon_from_storage_paths) continue;
    const google::protobuf::FieldDescriptor* field = ProtoFieldOf(info);
    if (field == nullptr) continue;  // never for the table (ticker_test)
    const uint64_t count = counts.Get(info.ticker);
    if (info.unit == TickerUnit::kNanoseconds) {
      reflection->SetDouble(&response, field, static_cast<double>(count) / 1e9);
    } else {
      reflection->SetUInt64(&response, field, count);
    }
  }
}

}  // namespace fuyou
