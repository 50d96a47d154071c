// A client for privilege_test, run as another uid (the test forks, changes uid
// and execs it). Two modes:
//   privilege_client train <socket> <job> <steps>
//     trains <steps> steps of two float32 chunks through clientlib and checks
//     the weights against the AdamW reference after each; exits 0 when all match.
//   privilege_client handover <segment-socket> <session-id> <bytes>
//     creates a sealed memfd segment of <bytes> and hands it over for
//     <session-id>; prints "<CODE_NAME> <message>" of the reply, exits 0.
#include <cmath>
#include <cstdio>
#include <string>
#include <vector>

#include "adamw_reference.h"
#include "fuyou/client.h"
#include "fuyou/client_segment.h"
#include "test_values.h"

namespace {

using fuyou::testing::ReferenceChunk;
using fuyou::testing::Text;
using fuyou::testing::Values;

int Train(const std::string& socket, const std::string& job, int64_t steps) {
  fuyou::ClientOptions client;
  client.address = "unix:" + socket;
  client.rpc_timeout = std::chrono::milliseconds(20000);
  auto session = fuyou::Session::Open({.job = job, .num_slots = 2, .slot_bytes = 4 * 1000}, client);
  if (!session.ok()) {
    std::fprintf(stderr, "open: %s\n", Text(session.status()).c_str());
    return 1;
  }
  constexpr size_t kElements = 1000;
  std::vector<std::vector<float>> weights;
  std::vector<ReferenceChunk> references;
  for (uint32_t chunk = 0; chunk < 2; ++chunk) {
    weights.push_back(Values(chunk + 1, kElements));
    references.emplace_back(weights.back());
    auto registered = (*session)->RegisterChunk({.chunk_id = chunk, .num_elements = kElements},
                                                std::as_writable_bytes(std::span(weights.back())));
    if (!registered.ok() || registered->resumed) {
      std::fprintf(stderr, "register chunk %u: %s\n", chunk, Text(registered.status()).c_str());
      return 1;
    }
  }
  fuyou::AdamWHyper hyper;
  hyper.lr = 1e-3f;
  hyper.weight_decay = 0.01f;
  for (int64_t step = 1; step <= steps; ++step) {
    for (uint32_t chunk = 2; chunk-- > 0;) {
      const std::vector<float> grads = Values(step * 100 + chunk, kElements, 0.1f);
      absl::Status pushed = (*session)->PushGradients(chunk, step, hyper, std::as_bytes(std::span(grads)));
      if (!pushed.ok()) {
        std::fprintf(stderr, "step %ld chunk %u: %s\n", static_cast<long>(step), chunk, Text(pushed).c_str());
        return 1;
      }
      references[chunk].Step(grads, hyper);
    }
    for (uint32_t chunk = 0; chunk < 2; ++chunk) {
      absl::Status pulled = (*session)->PullParams(chunk, std::as_writable_bytes(std::span(weights[chunk])));
      if (!pulled.ok()) {
        std::fprintf(stderr, "pull step %ld chunk %u: %s\n", static_cast<long>(step), chunk, Text(pulled).c_str());
        return 1;
      }
      for (size_t i = 0; i < kElements; ++i) {
        const float expected = references[chunk].master[i];
        if (std::abs(weights[chunk][i] - expected) > 1e-6f * std::max(std::abs(expected), 1e-3f)) {
          std::fprintf(stderr, "step %ld chunk %u element %zu: %g, expected %g\n", static_cast<long>(step), chunk, i,
                       weights[chunk][i], expected);
          return 1;
        }
      }
    }
    auto committed = (*session)->EndStep(step);
    if (!committed.ok()) {
      std::fprintf(stderr, "end step %ld: %s\n", static_cast<long>(step), Text(committed.status()).c_str());
      return 1;
    }
  }
  if (absl::Status closed = (*session)->Close(); !closed.ok()) {
    std::fprintf(stderr, "close: %s\n", Text(closed).c_str());
    return 1;
  }
  std::printf("trained %ld steps\n", static_cast<long>(steps));
  return 0;
}

int HandOver(const std::string& segment_socket, const std::string& session_id, uint64_t bytes) {
  auto segment = fuyou::ClientSegment::Create(bytes);
  if (!segment.ok()) {
    std::fprintf(stderr, "create: %s\n", Text(segment.status()).c_str());
    return 1;
  }
  absl::Status status = (*segment)->HandOver(segment_socket, session_id, std::chrono::milliseconds(20000));
  std::printf("%s %s\n", absl::StatusCodeToString(status.code()).c_str(), Text(status).c_str());
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  const std::string mode = argc > 1 ? argv[1] : "";
  if (mode == "train" && argc == 5) return Train(argv[2], argv[3], std::stol(argv[4]));
  if (mode == "handover" && argc == 5) return HandOver(argv[2], argv[3], std::stoull(argv[4]));
  std::fprintf(stderr,
               "usage: privilege_client train <socket> <job> <steps>\n"
               "       privilege_client handover <segment-socket> <session-id> <bytes>\n");
  return 2;
}
