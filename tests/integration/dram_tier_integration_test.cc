// The DRAM tier against a real fuyoud: a model whose optimizer states fit in the
// daemon's budget is read from storage at most once (the first step after the
// daemon starts) and then trains from DRAM; one that does not fit keeps reading.
// Measured through the admin API's bytes_read and cache hit/miss counters.
#include <gtest/gtest.h>

#include <cstdio>

#include <cstring>
#include <vector>

#include "daemon_process.h"
#include "fuyou/admin_client.h"
#include "fuyou/client.h"

namespace fuyou::testing {
namespace {

struct Counters {
  uint64_t bytes_read = 0;
  uint64_t hits = 0;
  uint64_t misses = 0;
};

Counters Read(const DaemonProcess& daemon) {
  auto admin = AdminClient::Connect(daemon.client_options());
  EXPECT_TRUE(admin.ok()) << admin.status();
  auto stats = (*admin)->GetStats();
  EXPECT_TRUE(stats.ok()) << stats.status();
  Counters c;
  for (const auto& path : stats->storage()) c.bytes_read += path.bytes_read();
  c.hits = stats->cache_hits();
  c.misses = stats->cache_misses();
  return c;
}

// Opens job "tier" with `chunks` chunks of `n` fp32 parameters (registering or resuming).
std::unique_ptr<Session> OpenJob(const DaemonProcess& daemon, uint32_t chunks, uint64_t n) {
  auto session = Session::Open({.job = "tier", .num_slots = 2, .slot_bytes = 4 * n}, daemon.client_options());
  EXPECT_TRUE(session.ok()) << session.status();
  if (!session.ok()) return nullptr;
  std::vector<float> weights(n, 0.5f);
  for (uint32_t id = 0; id < chunks; ++id) {
    auto registered = (*session)->RegisterChunk(
        {.chunk_id = id, .num_elements = n},
        std::span<std::byte>(reinterpret_cast<std::byte*>(weights.data()), 4 * n));
    EXPECT_TRUE(registered.ok()) << registered.status();
  }
  return std::move(*session);
}

// One step: every chunk in backward order, weights collected, committed.
void Step(Session& session, uint32_t chunks, uint64_t n) {
  const int64_t step = session.committed_step() + 1;
  std::vector<float> grads(n, 1e-3f), weights(n);
  auto grad_bytes = std::span<const std::byte>(reinterpret_cast<const std::byte*>(grads.data()), 4 * n);
  auto weight_bytes = std::span<std::byte>(reinterpret_cast<std::byte*>(weights.data()), 4 * n);
  for (uint32_t i = 0; i < chunks; ++i) {
    const uint32_t id = chunks - 1 - i;
    ASSERT_TRUE(session.PushGradients(id, step, {}, grad_bytes).ok());
    ASSERT_TRUE(session.PullParams(id, weight_bytes).ok());
  }
  auto committed = session.EndStep(step);
  ASSERT_TRUE(committed.ok()) << committed.status();
  EXPECT_EQ(committed->chunks_updated, chunks);
}

TEST(DramTierTest, StatesThatFitInTheBudgetAreReadOnlyInTheFirstStepAfterAStart) {
  TempDir dir;
  constexpr uint32_t kChunks = 6;
  constexpr uint64_t kN = uint64_t{1} << 20;  // 12 MiB of states a chunk, 72 MiB in all
  const uint64_t states = 12 * kN * kChunks;
  {
    DaemonProcess daemon(dir.path(), {"--dram-budget", "256MiB"});
    ASSERT_TRUE(daemon.Start().ok());
    auto session = OpenJob(daemon, kChunks, kN);
    ASSERT_NE(session, nullptr);
    // Registration left every chunk resident: no step reads storage.
    for (int s = 0; s < 3; ++s) Step(*session, kChunks, kN);
    const Counters c = Read(daemon);
    EXPECT_EQ(c.bytes_read, 0u);
    EXPECT_EQ(c.misses, 0u);
    EXPECT_EQ(c.hits, 3u * kChunks);
    ASSERT_TRUE(session->Close().ok());
  }
  // A restarted daemon has a cold cache: the first step reads each chunk once,
  // later steps nothing.
  DaemonProcess daemon(dir.path(), {"--dram-budget", "256MiB"});
  ASSERT_TRUE(daemon.Start().ok());
  auto session = OpenJob(daemon, kChunks, kN);  // resuming reads the weights once
  ASSERT_NE(session, nullptr);
  Step(*session, kChunks, kN);
  const Counters first = Read(daemon);
  EXPECT_GE(first.bytes_read, states);
  EXPECT_LT(first.bytes_read, 2 * states);
  for (int s = 0; s < 4; ++s) Step(*session, kChunks, kN);
  const Counters later = Read(daemon);
  EXPECT_EQ(later.bytes_read, first.bytes_read) << "a model that fits in DRAM read storage after its first step";
  EXPECT_EQ(later.misses, first.misses);
  EXPECT_EQ(later.hits - first.hits, 4u * kChunks);
  ASSERT_TRUE(session->Close().ok());
}

TEST(DramTierTest, StatesLargerThanTheBudgetAreReadEveryStep) {
  TempDir dir;
  constexpr uint32_t kChunks = 8;
  constexpr uint64_t kN = uint64_t{1} << 20;  // 96 MiB of states against 64 MiB
  DaemonProcess daemon(dir.path(), {"--dram-budget", "64MiB"});
  ASSERT_TRUE(daemon.Start().ok());
  auto session = OpenJob(daemon, kChunks, kN);
  ASSERT_NE(session, nullptr);
  Step(*session, kChunks, kN);
  const Counters first = Read(daemon);
  Step(*session, kChunks, kN);
  const Counters second = Read(daemon);
  EXPECT_GT(second.bytes_read, first.bytes_read);
  EXPECT_GT(second.misses + second.hits, first.misses + first.hits);
  // Never more than one read of every chunk a step.
  EXPECT_LE(second.bytes_read - first.bytes_read, 12 * kN * kChunks + kChunks * 4096);
  ASSERT_TRUE(session->Close().ok());
}

TEST(DramTierTest, WhatFitsBeyondThePipelineWindowStaysResidentWhenTheModelDoesNot) {
  TempDir dir;
  constexpr uint32_t kChunks = 32;
  constexpr uint64_t kN = uint64_t{1} << 18;  // 32 x 3 MiB = 96 MiB of states against 64 MiB
  constexpr uint64_t kMiB = uint64_t{1} << 20;
  DaemonProcess daemon(dir.path(), {"--dram-budget", "64MiB"});
  ASSERT_TRUE(daemon.Start().ok());
  auto session = OpenJob(daemon, kChunks, kN);
  ASSERT_NE(session, nullptr);
  Step(*session, kChunks, kN);
  const Counters first = Read(daemon);
  constexpr int kSteps = 3;
  for (int s = 0; s < kSteps; ++s) Step(*session, kChunks, kN);
  const Counters later = Read(daemon);
  const uint64_t per_step = (later.bytes_read - first.bytes_read) / kSteps;
  // Reads a step are states - budget (32 MiB) plus what the step could not keep
  // resident because write-backs in flight pinned it: a use that finds every
  // other entry pinned evicts one of the resident prefix (state_cache.h), and
  // how many write-backs are in flight follows the disk's flush speed (41-51 MiB
  // on a shared virtual disk). A least-recently-used cache reads all 96 MiB in
  // this cyclic scan; the bound is two thirds of that.
  std::printf("[figures] 96 MiB of states, 64 MiB budget: %.1f MiB read a step\n", per_step / double(kMiB));
  EXPECT_LE(per_step, 64 * kMiB);
  EXPECT_GT(per_step, 0u);
  ASSERT_TRUE(session->Close().ok());
}

}  // namespace
}  // namespace fuyou::testing
