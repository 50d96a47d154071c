// A training client that a test kills with SIGKILL in the middle of a step.
// Usage: crash_client <socket> <job> <ready-file>
// Registers two chunks, commits 3 steps, sends the gradients of step 4, writes
// <ready-file>, then waits forever.
#include <unistd.h>

#include <cstdio>
#include <fstream>
#include <vector>

#include "fuyou/client.h"

int main(int argc, char** argv) {
  if (argc != 4) {
    std::fprintf(stderr, "usage: crash_client <socket> <job> <ready-file>\n");
    return 2;
  }
  fuyou::ClientOptions client;
  client.address = std::string("unix:") + argv[1];
  auto session = fuyou::Session::Open({.job = argv[2], .num_slots = 4, .slot_bytes = 4 * 4096}, client);
  if (!session.ok()) {
    std::fprintf(stderr, "open: %s\n", std::string(session.status().message()).c_str());
    return 1;
  }
  std::vector<float> weights(4096, 0.5f);
  std::vector<float> grads(4096, 0.25f);
  auto bytes = [](std::vector<float>& v) { return std::as_writable_bytes(std::span(v)); };
  for (uint32_t chunk = 0; chunk < 2; ++chunk) {
    if (!(*session)->RegisterChunk({.chunk_id = chunk, .num_elements = 4096}, bytes(weights)).ok()) return 1;
  }
  fuyou::AdamWHyper hyper;
  for (int64_t step = 1; step <= 4; ++step) {
    for (uint32_t chunk = 0; chunk < 2; ++chunk) {
      if (!(*session)->PushGradients(chunk, step, hyper, std::as_bytes(std::span(grads))).ok()) return 1;
      if (!(*session)->PullParams(chunk, bytes(weights)).ok()) return 1;
      if (step == 4) break;  // one chunk of step 4 updated, never committed
    }
    if (step == 4) break;
    if (!(*session)->EndStep(step).ok()) return 1;
  }
  std::ofstream(argv[3]) << "ready\n";
  for (;;) ::pause();
}
