// A client that redo_integration_test runs as another user (fork, setuid, exec:
// gRPC does not survive a fork without exec), so that the user scope of
// GetStats shows its own speculation counters.
//
//   redo_client <socket> <job>
//       Registers one chunk of 256 elements; step 1: a speculative update, a
//       redo (gradients changed), a redo (clipped), EndStep; step 2: a
//       speculative update, then AbortStep(SKIPPED_STEP). Then prints its
//       GetStats as "key=value" lines. Exit 0 on success, 1 with a line saying
//       what failed.
#include <cstdio>
#include <string>
#include <vector>

#include "fuyou/admin_client.h"
#include "raw_session.h"

namespace {

using fuyou::testing::ChunkSpecOf;
using fuyou::testing::GradReadyOf;
using fuyou::testing::RawSession;
namespace v1 = fuyou::v1;

int Fail(const std::string& what) {
  std::printf("failed: %s\n", what.c_str());
  return 1;
}

int Run(const std::string& socket, const std::string& job) {
  fuyou::ClientOptions client;
  client.address = "unix:" + socket;
  auto session = RawSession::Open(client, job, 1, 4096);
  if (!session.ok()) return Fail("open: " + std::string(session.status().message()));
  RawSession& raw = **session;
  v1::RegisterChunksResponse registered;
  if (grpc::Status status = raw.Register({ChunkSpecOf(0, 256, 0)}, &registered); !status.ok()) {
    return Fail("register: " + status.error_message());
  }
  v1::AdamWHyper hyper;
  hyper.set_lr(1e-3f);
  hyper.set_beta1(0.9f);
  hyper.set_beta2(0.999f);
  hyper.set_eps(1e-8f);
  const std::vector<float> grads(256, 0.25f);
  v1::GradReady grad = GradReadyOf(1, 0, 0, hyper);
  grad.set_speculative(true);
  if (!raw.SendGrad(grad, grads).has_params_ready()) return Fail("speculative update");
  grad.set_speculative(false);
  grad.set_redo(v1::REDO_REASON_GRADIENTS_CHANGED);
  if (!raw.SendGrad(grad, grads).has_params_ready()) return Fail("redo (changed)");
  grad.set_redo(v1::REDO_REASON_CLIPPED);
  grad.mutable_hyper()->set_grad_scale(0.5f);
  if (!raw.SendGrad(grad, grads).has_params_ready()) return Fail("redo (clipped)");
  if (!raw.EndStep(1).has_step_committed()) return Fail("EndStep");
  grad = GradReadyOf(2, 0, 0, hyper);
  grad.set_speculative(true);
  if (!raw.SendGrad(grad, grads).has_params_ready()) return Fail("step 2");
  if (!raw.AbortStep(2, v1::ABORT_REASON_SKIPPED_STEP).has_step_aborted()) return Fail("AbortStep");

  auto admin = fuyou::AdminClient::Connect(client);
  if (!admin.ok()) return Fail("admin connect");
  auto stats = (*admin)->GetStats();
  if (!stats.ok()) return Fail("stats: " + std::string(stats.status().message()));
  std::printf("scope=%d\nchunks_speculative=%llu\nchunks_redone_changed=%llu\nchunks_redone_clipped=%llu\n"
              "chunks_rolled_back_skipped_step=%llu\nredo_positive=%d\n",
              static_cast<int>(stats->scope()), static_cast<unsigned long long>(stats->chunks_speculative()),
              static_cast<unsigned long long>(stats->chunks_redone_changed()),
              static_cast<unsigned long long>(stats->chunks_redone_clipped()),
              static_cast<unsigned long long>(stats->chunks_rolled_back_skipped_step()),
              stats->redo_seconds() > 0 ? 1 : 0);
  return raw.Close().ok() ? 0 : Fail("close");
}

}  // namespace

int main(int argc, char** argv) {
  if (argc == 3) return Run(argv[1], argv[2]);
  std::fprintf(stderr, "usage: redo_client <socket> <job>\n");
  return 2;
}
