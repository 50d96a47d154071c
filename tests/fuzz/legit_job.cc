// The legitimate job that runs beside the RPC fuzzer (rpc_fuzz.py): trains a
// small model through the real clientlib and checks every returned weight
// against a plain AdamW (adamw_reference.h), then reopens the job and checks that
// it resumes at the right step with the same weights, and deletes it.
//
// Usage: legit_job <socket> <job> <steps>
// Exits 0 when every check passed, 1 with a message on stderr otherwise.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <string>
#include <vector>

#include "adamw_reference.h"
#include "fmt/format.h"
#include "fuyou/admin_client.h"
#include "fuyou/client.h"
#include "test_values.h"

namespace {

using fuyou::AdamWHyper;
using fuyou::ChunkSpec;
using fuyou::DType;
using fuyou::testing::Decode;
using fuyou::testing::Encode;
using fuyou::testing::ReferenceChunk;
using fuyou::testing::Text;
using fuyou::testing::Values;

struct TrainedChunk {
  ChunkSpec spec;
  ReferenceChunk reference;
  std::vector<std::byte> weights;  // in param_dtype, as the daemon returned them last

  TrainedChunk(ChunkSpec s, const std::vector<float>& initial)
      : spec(s), reference(Decode(Encode(initial, s.param_dtype), s.param_dtype)), weights(Encode(initial, s.param_dtype)) {}

  std::vector<float> Gradients(int64_t step) const {
    return Decode(Encode(Values(step * 1000 + spec.chunk_id, spec.num_elements, 0.1f), spec.grad_dtype),
                  spec.grad_dtype);
  }
};

// Largest relative error of the returned weights against the reference, and the
// tolerance for the chunk's dtype (one ulp of a 16-bit dtype; fp32 ~ a few ulps).
bool Matches(const TrainedChunk& chunk, std::string* why) {
  const double tolerance = chunk.spec.param_dtype == DType::kFloat32    ? 1e-6
                           : chunk.spec.param_dtype == DType::kBFloat16 ? 1.0 / 128
                                                                        : 1.0 / 1024;
  const std::vector<float> got = Decode(chunk.weights, chunk.spec.param_dtype);
  for (size_t i = 0; i < got.size(); ++i) {
    const double expected = chunk.reference.master[i];
    const double error = std::abs(double{got[i]} - expected) / std::max(std::abs(expected), 1e-3);
    if (!(error <= tolerance)) {
      *why = fmt::format("chunk {} element {}: got {}, reference {} (relative error {} > {})", chunk.spec.chunk_id, i,
                         got[i], expected, error, tolerance);
      return false;
    }
  }
  return true;
}

int Fail(const std::string& job, const std::string& what) {
  std::fprintf(stderr, "legit_job %s: %s\n", job.c_str(), what.c_str());
  return 1;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 4) {
    std::fprintf(stderr, "usage: legit_job <socket> <job> <steps>\n");
    return 2;
  }
  const std::string job = argv[2];
  const int64_t steps = std::stoll(argv[3]);
  fuyou::ClientOptions client;
  client.address = std::string("unix:") + argv[1];
  // The daemon runs under ASan beside a fuzzer: generous deadlines, never a hang.
  client.rpc_timeout = std::chrono::milliseconds(120000);

  std::vector<TrainedChunk> chunks;
  chunks.emplace_back(ChunkSpec{.chunk_id = 0, .num_elements = 3000}, Values(1, 3000));
  chunks.emplace_back(ChunkSpec{.chunk_id = 1, .num_elements = 1537, .param_dtype = DType::kBFloat16,
                                .grad_dtype = DType::kBFloat16},
                      Values(2, 1537));
  chunks.emplace_back(ChunkSpec{.chunk_id = 2, .num_elements = 777, .param_dtype = DType::kFloat16,
                                .grad_dtype = DType::kFloat32},
                      Values(3, 777));
  const uint64_t slot_bytes = 3000 * 4;

  {
    auto session = fuyou::Session::Open({.job = job, .num_slots = 4, .slot_bytes = slot_bytes,
                                         .client_info = "legit_job beside the fuzzer"},
                                        client);
    if (!session.ok()) return Fail(job, "open: " + Text(session.status()));
    if ((*session)->committed_step() != 0) {
      return Fail(job, fmt::format("a new job starts at step {}, not 0", (*session)->committed_step()));
    }
    for (TrainedChunk& chunk : chunks) {
      auto registered = (*session)->RegisterChunk(chunk.spec, chunk.weights);
      if (!registered.ok()) return Fail(job, "register: " + Text(registered.status()));
      if (registered->resumed) return Fail(job, fmt::format("chunk {} of a new job was resumed", chunk.spec.chunk_id));
    }
    for (int64_t step = 1; step <= steps; ++step) {
      AdamWHyper hyper;
      hyper.lr = 1e-3f * (1.0f - static_cast<float>(step) / 40.0f);
      for (auto it = chunks.rbegin(); it != chunks.rend(); ++it) {
        const std::vector<float> grads = it->Gradients(step);
        absl::Status pushed =
            (*session)->PushGradients(it->spec.chunk_id, step, hyper, Encode(grads, it->spec.grad_dtype));
        if (!pushed.ok()) return Fail(job, fmt::format("push step {}: {}", step, Text(pushed)));
        it->reference.Step(grads, hyper);
      }
      for (TrainedChunk& chunk : chunks) {
        absl::Status pulled = (*session)->PullParams(chunk.spec.chunk_id, chunk.weights);
        if (!pulled.ok()) return Fail(job, fmt::format("pull step {}: {}", step, Text(pulled)));
        std::string why;
        if (!Matches(chunk, &why)) return Fail(job, fmt::format("step {}: {}", step, why));
      }
      auto committed = (*session)->EndStep(step);
      if (!committed.ok()) return Fail(job, fmt::format("end step {}: {}", step, Text(committed.status())));
    }
    if (absl::Status closed = (*session)->Close(); !closed.ok()) {
      return Fail(job, "close: " + Text(closed));
    }
  }

  // Resume: the job is at its last step, with the weights it returned last.
  {
    auto session = fuyou::Session::Open(
        {.job = job, .num_slots = 4, .slot_bytes = slot_bytes, .client_info = "legit_job, resumed"}, client);
    if (!session.ok()) return Fail(job, "reopen: " + Text(session.status()));
    if ((*session)->committed_step() != steps) {
      return Fail(job, fmt::format("resumed at step {}, not {}", (*session)->committed_step(), steps));
    }
    for (TrainedChunk& chunk : chunks) {
      std::vector<std::byte> resumed(chunk.weights.size());
      auto registered = (*session)->RegisterChunk(chunk.spec, resumed);
      if (!registered.ok()) return Fail(job, "register on resume: " + Text(registered.status()));
      if (!registered->resumed || registered->update_count != steps) {
        return Fail(job, fmt::format("chunk {}: resumed={} update_count={}, expected a resume at {}",
                                     chunk.spec.chunk_id, registered->resumed, registered->update_count, steps));
      }
      if (resumed != chunk.weights) {
        return Fail(job, fmt::format("chunk {}: resumed weights differ from the last ones returned", chunk.spec.chunk_id));
      }
    }
    if (absl::Status closed = (*session)->Close(); !closed.ok()) {
      return Fail(job, "close after resume: " + Text(closed));
    }
  }

  auto admin = fuyou::AdminClient::Connect(client);
  if (!admin.ok()) return Fail(job, "admin: " + Text(admin.status()));
  if (auto deleted = (*admin)->DeleteJob(job); !deleted.ok()) {
    return Fail(job, "delete: " + Text(deleted.status()));
  }
  return 0;
}
