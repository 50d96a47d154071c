// A client that limits_test runs as another user (fork, setuid, exec: gRPC does
// not survive a fork without exec).
//
//   limits_client <socket> open <job> <slot-bytes>
//       Opens a session with a raw OpenSession (left unattached) and prints
//       "<status code> <message>". Exit 0 when it opened, 1 when refused.
//   limits_client <socket> train <job> <steps>
//       Trains one chunk of 4096 elements for <steps> committed steps through
//       clientlib, then, with the session still open, prints its GetStats as
//       "key=value" lines. Exit 0 on success.
#include <cstdio>
#include <string>
#include <vector>

#include "fuyou/admin_client.h"
#include "fuyou/client.h"
#include "fuyou/v1/offload.grpc.pb.h"
#include "grpcpp/grpcpp.h"

namespace {

int Open(const std::string& socket, const std::string& job, uint64_t slot_bytes) {
  auto channel = grpc::CreateChannel("unix:" + socket, grpc::InsecureChannelCredentials());
  auto stub = fuyou::v1::Offload::NewStub(channel);
  fuyou::v1::OpenSessionRequest request;
  request.set_job(job);
  request.set_num_slots(1);
  request.set_slot_bytes(slot_bytes);
  fuyou::v1::OpenSessionResponse response;
  grpc::ClientContext context;
  context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(20));
  const grpc::Status status = stub->OpenSession(&context, request, &response);
  std::printf("%d %s\n", static_cast<int>(status.error_code()), status.error_message().c_str());
  return status.ok() ? 0 : 1;
}

int Train(const std::string& socket, const std::string& job, int64_t steps) {
  fuyou::ClientOptions client;
  client.address = "unix:" + socket;
  auto session = fuyou::Session::Open({.job = job, .num_slots = 2, .slot_bytes = 4 * 4096}, client);
  if (!session.ok()) {
    std::printf("open: %s\n", std::string(session.status().message()).c_str());
    return 1;
  }
  std::vector<float> weights(4096, 0.5f);
  std::vector<float> grads(4096, 0.25f);
  auto bytes = [](std::vector<float>& v) { return std::as_writable_bytes(std::span(v)); };
  if (!(*session)->RegisterChunk({.chunk_id = 0, .num_elements = 4096}, bytes(weights)).ok()) return 1;
  for (int64_t step = 1; step <= steps; ++step) {
    if (!(*session)->PushGradients(0, step, {}, std::as_bytes(std::span(grads))).ok()) return 1;
    if (!(*session)->PullParams(0, bytes(weights)).ok()) return 1;
    if (!(*session)->EndStep(step).ok()) return 1;
  }
  auto admin = fuyou::AdminClient::Connect(client);
  if (!admin.ok()) return 1;
  auto stats = (*admin)->GetStats();
  if (!stats.ok()) {
    std::printf("stats: %s\n", std::string(stats.status().message()).c_str());
    return 1;
  }
  std::printf("scope=%d\nuid=%u\nstorage=%d\nbytes_read=%llu\nbytes_written=%llu\nchunk_updates=%llu\n"
              "params_updated=%llu\nsteps_committed=%llu\nlive_sessions=%u\ndram_budget_bytes=%llu\n"
              "cache_hits=%llu\ncache_misses=%llu\n",
              static_cast<int>(stats->scope()), stats->uid(), stats->storage_size(),
              static_cast<unsigned long long>(stats->bytes_read()),
              static_cast<unsigned long long>(stats->bytes_written()),
              static_cast<unsigned long long>(stats->chunk_updates()),
              static_cast<unsigned long long>(stats->params_updated()),
              static_cast<unsigned long long>(stats->steps_committed()), stats->live_sessions(),
              static_cast<unsigned long long>(stats->dram_budget_bytes()),
              static_cast<unsigned long long>(stats->cache_hits()),
              static_cast<unsigned long long>(stats->cache_misses()));
  return (*session)->Close().ok() ? 0 : 1;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc == 5 && std::string(argv[2]) == "open") return Open(argv[1], argv[3], std::stoull(argv[4]));
  if (argc == 5 && std::string(argv[2]) == "train") return Train(argv[1], argv[3], std::stoll(argv[4]));
  std::fprintf(stderr, "usage: limits_client <socket> open <job> <slot-bytes> | train <job> <steps>\n");
  return 2;
}
