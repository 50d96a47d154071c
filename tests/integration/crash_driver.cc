#include "crash_driver.h"

#include <algorithm>
#include <cstring>
#include <memory>

#include "adamw_reference.h"
#include "fmt/format.h"

namespace fuyou::testing {
namespace {

// Deterministic values in +-[0.1, 1) * scale from a counter hash (splitmix64).
std::vector<float> HashValues(uint64_t seed, size_t n, float scale) {
  std::vector<float> values(n);
  for (size_t i = 0; i < n; ++i) {
    uint64_t z = seed * 0x9e3779b97f4a7c15ull + i + 1;
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    z ^= z >> 31;
    const float magnitude = 0.1f + 0.9f * static_cast<float>(z >> 40) / static_cast<float>(1 << 24);
    values[i] = ((z & 1) ? 1.0f : -1.0f) * magnitude * scale;
  }
  return values;
}

std::vector<std::byte> InitialWeights(const ChunkSpec& spec) {
  return Encode(HashValues(spec.chunk_id + 1, spec.num_elements, 1.0f), spec.param_dtype);
}

std::vector<std::byte> Gradients(const ChunkSpec& spec, uint64_t seed) {
  return Encode(HashValues(seed * 1000 + spec.chunk_id + 7, spec.num_elements, 0.1f), spec.grad_dtype);
}

AdamWHyper HyperFor(int64_t step) {
  AdamWHyper hyper;
  hyper.lr = 1e-3f * (1.0f - static_cast<float>(step) / 32.0f);
  hyper.weight_decay = 0.01f;
  return hyper;
}

std::string Describe(const absl::Status& status) {
  return fmt::format("{} ({})", std::string(status.message()), static_cast<int>(status.code()));
}

}  // namespace

const std::vector<ChunkSpec>& DriverChunks() {
  static const std::vector<ChunkSpec> chunks = {
      {.chunk_id = 0, .num_elements = 1000},
      // 8-bit moments (issue 36): every crash point, resume and redo covers them
      // too, bit for bit against the uncrashed run (16 blocks and one of 1).
      {.chunk_id = 1, .num_elements = 4097, .grad_dtype = DType::kBFloat16, .moments_dtype = DType::kBlock8},
      {.chunk_id = 2, .num_elements = 50'000, .param_dtype = DType::kBFloat16, .grad_dtype = DType::kBFloat16},
      {.chunk_id = 3, .num_elements = 200'000, .param_dtype = DType::kFloat16, .grad_dtype = DType::kFloat16},
  };
  return chunks;
}

uint64_t DriverSlotBytes() { return 100 * 4096; }

absl::Status DriveJob(const ClientOptions& options, const std::string& job, const WeightHistory* expected,
                      DriverProgress& progress, WeightHistory* record, const DriverHook& hook) {
  const std::vector<ChunkSpec>& chunks = DriverChunks();
  auto fail = [&](const std::string& call, const absl::Status& status) {
    progress.failed_call = fmt::format("{}: {}", call, Describe(status));
    return status;
  };
  auto check = [&](const std::string& what, const std::vector<std::byte>& got, const std::vector<std::byte>& want) {
    if (got != want) progress.mismatches.push_back(what);
  };
  if (record != nullptr) record->assign(kDriverSteps + 1, std::vector<std::vector<std::byte>>(chunks.size()));
  progress.weights.resize(chunks.size());
  progress.opened_at = -1;
  progress.chunks_registered = 0;
  progress.chunks_resumed = 0;
  progress.registration_in_flight = false;
  progress.commit_in_flight = false;

  auto opened = Session::Open({.job = job, .num_slots = 8, .slot_bytes = DriverSlotBytes()}, options);
  if (!opened.ok()) return fail("OpenSession", opened.status());
  std::unique_ptr<Session> session = std::move(*opened);
  const int64_t committed = session->committed_step();
  progress.opened_at = committed;
  progress.acked_step = committed;
  progress.durable_step = committed;

  for (size_t i = 0; i < chunks.size(); ++i) {
    std::vector<std::byte> weights = InitialWeights(chunks[i]);
    progress.registration_in_flight = true;
    auto result = session->RegisterChunk(chunks[i], weights);
    if (!result.ok()) return fail(fmt::format("RegisterChunk({})", chunks[i].chunk_id), result.status());
    progress.registration_in_flight = false;
    ++progress.chunks_registered;
    if (result->resumed) {
      ++progress.chunks_resumed;
      if (result->update_count != committed) {
        progress.mismatches.push_back(fmt::format("chunk {} resumed with update_count {} at committed step {}",
                                                  chunks[i].chunk_id, result->update_count, committed));
      }
      if (progress.chunks_resumed != progress.chunks_registered) {
        progress.mismatches.push_back(fmt::format("chunk {} resumed after a chunk that was new", chunks[i].chunk_id));
      }
    } else if (committed != 0) {
      progress.mismatches.push_back(
          fmt::format("chunk {} is new in a job at committed step {}", chunks[i].chunk_id, committed));
    }
    if (expected != nullptr) {
      check(fmt::format("resumed weights of chunk {} at step {}", chunks[i].chunk_id, committed), weights,
            (*expected)[committed][i]);
    }
    if (record != nullptr) (*record)[committed][i] = weights;
    progress.weights[i] = std::move(weights);
  }

  for (int64_t step = committed + 1; step <= kDriverSteps; ++step) {
    if (step == kDriverAbortedStep) {
      // Two chunks updated with other gradients, then abandoned.
      for (size_t i = chunks.size() - 2; i < chunks.size(); ++i) {
        absl::Status pushed = session->PushGradients(chunks[i].chunk_id, step, HyperFor(step),
                                                     Gradients(chunks[i], 100 + step));
        if (!pushed.ok()) return fail(fmt::format("PushGradients({}, {}) to abort", chunks[i].chunk_id, step), pushed);
        std::vector<std::byte> scratch(chunks[i].param_bytes());
        absl::Status pulled = session->PullParams(chunks[i].chunk_id, scratch);
        if (!pulled.ok()) return fail(fmt::format("PullParams({}, {}) to abort", chunks[i].chunk_id, step), pulled);
      }
      absl::Status aborted = session->AbortStep(step);
      if (!aborted.ok()) return fail(fmt::format("AbortStep({})", step), aborted);
    }
    int k = 0;
    for (size_t i = chunks.size(); i-- > 0;) {  // backward order
      absl::Status pushed =
          session->PushGradients(chunks[i].chunk_id, step, HyperFor(step), Gradients(chunks[i], step));
      if (!pushed.ok()) return fail(fmt::format("PushGradients({}, {})", chunks[i].chunk_id, step), pushed);
      if (hook) hook("pushed", step, ++k);
    }
    k = 0;
    for (size_t i = chunks.size(); i-- > 0;) {
      absl::Status pulled = session->PullParams(chunks[i].chunk_id, progress.weights[i]);
      if (!pulled.ok()) return fail(fmt::format("PullParams({}, {})", chunks[i].chunk_id, step), pulled);
      if (expected != nullptr) {
        check(fmt::format("weights of chunk {} after step {}", chunks[i].chunk_id, step), progress.weights[i],
              (*expected)[step][i]);
      }
      if (record != nullptr) (*record)[step][i] = progress.weights[i];
      if (hook) hook("pulled", step, ++k);
    }
    progress.commit_in_flight = true;
    auto ended = session->EndStep(step);
    if (!ended.ok()) return fail(fmt::format("EndStep({})", step), ended.status());
    progress.commit_in_flight = false;
    progress.acked_step = step;
    progress.durable_step = ended->durable_step;
    if (ended->step != step || ended->chunks_updated != chunks.size()) {
      progress.mismatches.push_back(
          fmt::format("EndStep({}) answered step {} with {} chunks", step, ended->step, ended->chunks_updated));
    }
    if (hook) hook("committed", step, 0);
  }
  absl::Status closed = session->Close();
  if (!closed.ok()) return fail("CloseSession", closed);
  return absl::OkStatus();
}

}  // namespace fuyou::testing
