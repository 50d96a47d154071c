// A client that weights_integration_test runs as another user (fork, setuid,
// exec: gRPC does not survive a fork without exec), so that the user scope of
// GetStats shows its own weights counters.
//
//   weights_client <socket> <job> <fetches>
//       Registers one chunk of 256 bf16 elements with store_weights, fetches
//       its weights <fetches> times, then prints its GetStats as "key=value"
//       lines. Exit 0 on success, 1 with a line saying what failed.
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "fuyou/admin_client.h"
#include "raw_session.h"

namespace {

using fuyou::testing::ChunkSpecOf;
using fuyou::testing::RawSession;
namespace v1 = fuyou::v1;

int Fail(const std::string& what) {
  std::printf("failed: %s\n", what.c_str());
  return 1;
}

int Run(const std::string& socket, const std::string& job, int fetches) {
  fuyou::ClientOptions client;
  client.address = "unix:" + socket;
  auto session = RawSession::Open(client, job, 2, 4096);
  if (!session.ok()) return Fail("open: " + std::string(session.status().message()));
  RawSession& raw = **session;
  v1::ChunkSpec spec = ChunkSpecOf(0, 256, 0);
  spec.set_param_dtype(v1::DTYPE_BFLOAT16);
  spec.set_store_weights(true);
  v1::RegisterChunksResponse registered;
  if (grpc::Status status = raw.Register({spec}, &registered); !status.ok()) {
    return Fail("register: " + status.error_message());
  }
  for (int i = 0; i < fetches; ++i) {
    v1::ClientMessage fetch;
    fetch.mutable_fetch_weights()->set_chunk_id(0);
    fetch.mutable_fetch_weights()->set_slot(1);
    const v1::DaemonMessage reply = raw.Exchange(fetch);
    if (!reply.has_weights_fetched()) return Fail("fetch: " + reply.ShortDebugString());
  }
  if (!raw.Close().ok()) return Fail("close");
  auto admin = fuyou::AdminClient::Connect(client);
  if (!admin.ok()) return Fail("admin: " + std::string(admin.status().message()));
  auto stats = (*admin)->GetStats();
  if (!stats.ok()) return Fail("GetStats: " + std::string(stats.status().message()));
  std::printf("scope=%d\n", static_cast<int>(stats->scope()));
  std::printf("weights_fetches=%llu\n", static_cast<unsigned long long>(stats->weights_fetches()));
  std::printf("weights_fetch_cache_hits=%llu\n", static_cast<unsigned long long>(stats->weights_fetch_cache_hits()));
  std::printf("weights_bytes_read=%llu\n", static_cast<unsigned long long>(stats->weights_bytes_read()));
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 4) return Fail("usage: weights_client <socket> <job> <fetches>");
  return Run(argv[1], argv[2], std::atoi(argv[3]));
}
