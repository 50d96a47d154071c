// A client run as another user by jobs_security_test (fork, setuid, exec).
// Usage: job_owner_client <socket> <job> <initial-weight>
// Opens <job>, registers chunk 0 (1024 fp32 elements, all <initial-weight>),
// trains one step, closes, and prints "resumed=<0|1> weight=<w>",
// where w is element 0 as the daemon gave it at registration (a resumed job's
// weight, else the initial one).
#include <cstdio>
#include <string>
#include <vector>

#include "fuyou/client.h"

int main(int argc, char** argv) {
  if (argc != 4) {
    std::fprintf(stderr, "usage: job_owner_client <socket> <job> <initial-weight>\n");
    return 2;
  }
  fuyou::ClientOptions client;
  client.address = std::string("unix:") + argv[1];
  auto session = fuyou::Session::Open({.job = argv[2], .num_slots = 2, .slot_bytes = 4096}, client);
  if (!session.ok()) {
    std::fprintf(stderr, "open: %s\n", std::string(session.status().message()).c_str());
    return 1;
  }
  std::vector<float> weights(1024, std::stof(argv[3]));
  auto bytes = [](std::vector<float>& v) { return std::as_writable_bytes(std::span(v)); };
  auto registered = (*session)->RegisterChunk({.chunk_id = 0, .num_elements = 1024}, bytes(weights));
  if (!registered.ok()) {
    std::fprintf(stderr, "register: %s\n", std::string(registered.status().message()).c_str());
    return 1;
  }
  const float seen = weights[0];
  std::vector<float> grads(1024, 0.25f);
  const int64_t step = (*session)->committed_step() + 1;
  if (!(*session)->PushGradients(0, step, fuyou::AdamWHyper{}, std::as_bytes(std::span(grads))).ok()) return 1;
  if (!(*session)->PullParams(0, bytes(weights)).ok()) return 1;
  if (!(*session)->EndStep(step).ok()) return 1;
  if (!(*session)->Close().ok()) return 1;
  std::printf("resumed=%d weight=%g\n", registered->resumed ? 1 : 0, seen);
  return 0;
}
