// StoreContext: what the parts of a ChunkStore (state/chunk_store.h) share.
//
// The job on storage, its view of the DRAM tier, the counters, the read-ahead
// window (ReadAheadBytes), and the acknowledged manifest: the job's manifest as of
// ChunkStore::committed_step() (the durable one, with the counts and step of
// the steps acknowledged since; see DurabilityPolicy). Each part reads it
// through Find; the parts that commit (the step, import, registration) replace
// it after every commit.
//
// Not thread-safe: the store's calls are serialised by its caller. The Job,
// the cache and the counters outlive it.
#pragma once

#include <cstdint>

#include "fuyou/v1/manifest.pb.h"
#include "jobs/job.h"
#include "state/job_cache.h"
#include "stats/ticker.h"

namespace fuyou {

// What the store counts into: the daemon's counts and the job owner's
// (StoreCounters::Bump adds to both).
using StoreCounters = StatsScopes;

// How often a step is made durable (DaemonConfig commit_every_steps/seconds).
struct DurabilityInterval {
  uint32_t every_steps = 1;   // 1: every step
  double every_seconds = 0;   // > 0: also once this long passed since the last durable step
};

// The default most chunks a read-ahead takes after the one in use: deeper
// than any DRAM budget holds in practice (4096 chunks of 16 MiB are 64 GiB),
// so that ReadAheadBytes, not a count, bounds it. Deep costs no residency:
// StateCache lets a prefetch evict only what is needed after it.
inline constexpr unsigned kDeepestPrefetchWindow = 4096;
// The daemon's default (SessionServices::prefetch_window): 2 chunks.
inline constexpr unsigned kDefaultPrefetchWindow = 2;

// The most chunks the weights read-ahead (WeightsReader) takes: its entries
// are not ranked by a learned order in the cache (StateCache::SetOrder ranks
// the states only), so a deeper one evicts weights needed again in the same
// step (weights_integration_test reads them more than twice a step).
inline constexpr unsigned kWeightsReadAheadWindow = 2;

struct StoreContext {
  StoreContext(Job& job, StateCache& cache, StoreCounters counters, unsigned prefetch_window)
      : job(job), cache(cache, job.key()), counters(counters), prefetch_window(prefetch_window),
        acknowledged(job.manifest()) {}

  // The record of `chunk_id` in the acknowledged manifest, or null.
  const v1::ChunkRecord* Find(uint32_t chunk_id) const {
    // acknowledged lists the chunks in the durable manifest's order (a copy of
    // it, with later counts and step).
    const int index = job.FindChunk(chunk_id);
    return index < 0 ? nullptr : &acknowledged.chunks(index);
  }
  // After a commit: the acknowledged manifest is the job's again.
  void Reload() { acknowledged = job.manifest(); }

  // How many bytes of predicted chunks a read-ahead may keep in DRAM ahead of
  // their use (the states prefetch and the weights read-ahead alike): the
  // budget, less every hold (pending states and undo copies, which stay
  // pinned) and less `writing_bytes`, the store's write-backs in flight (their
  // buffers stay pinned until they complete). A read-ahead walks the predicted
  // chunks in order and stops at the first beyond this window, at the first
  // that gets no budget without waiting, or after `prefetch_window` chunks; it
  // never waits for budget and evicts only entries needed after the chunk it
  // reads, never a pinned one, an unused one or the resident prefix
  // (StateCache::Create with wait=false, loading=true).
  uint64_t ReadAheadBytes(uint64_t writing_bytes) const {
    const StateCache& dram = cache.cache();
    const uint64_t taken = dram.held_bytes() + writing_bytes;  // each at most the budget: no overflow
    return taken >= dram.budget_bytes() ? 0 : dram.budget_bytes() - taken;
  }

  Job& job;
  const JobCache cache;
  const StoreCounters counters;
  // The weights read-ahead's cap: prefetch_window, at most kWeightsReadAheadWindow.
  unsigned weights_window() const { return prefetch_window < kWeightsReadAheadWindow ? prefetch_window : kWeightsReadAheadWindow; }
  const unsigned prefetch_window;  // most chunks read ahead after the one in use (ReadAheadBytes decides within it)
  v1::JobManifest acknowledged;
};

}  // namespace fuyou
