// Speculate, validate, redo (issue 10), daemon side, against a real fuyoud over
// the raw protocol (raw_session.h):
//   - a redo (GradReady.redo) replaces the chunk's update of the step with the
//     update from its committed states, the gradients now in the slot and the
//     new hyper-parameters, exactly;
//   - a redo of a chunk not updated in the step is refused, and a second
//     GradReady without redo still is;
//   - segments without gradient keep their weights, moments and update count,
//     and later updates use each segment's own t; a resume returns the
//     per-segment counts;
//   - hostile segment lists are refused and the daemon goes on serving;
//   - GetStats and fuyouctl stats count speculative updates, redos by reason,
//     steps rolled back as skipped, and the redos' time;
//   - the daemon killed at each redo crash point resumes at the last commit
//     with the committed states intact.
// The expected states are computed in the test with the daemon's own AdamW
// kernel (bit for bit what a correct daemon computes from the same inputs, see
// daemon/optimizer/adamw_kernel.h), and for the redo also with a plain AdamW
// written for the tests (adamw_reference.h).
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <limits>
#include <map>
#include <sstream>
#include <string>
#include <vector>

#include "adamw_reference.h"
#include "daemon_process.h"
#include "fuyou/admin_client.h"
#include "optimizer/adamw_kernel.h"
#include "raw_session.h"
#include "test_values.h"

namespace fuyou::testing {
namespace {
using std::chrono::milliseconds;

const std::vector<std::string> kDaemonArgs = {"--dram-budget", "64MiB", "--threads", "2"};
constexpr uint64_t kSlotBytes = 4096 * 2;  // up to 2048 fp32 elements a chunk
constexpr uint32_t kSlots = 3;

v1::AdamWHyper Hyper(float grad_scale = 1.0f, float lr = 1e-2f) {
  v1::AdamWHyper hyper;
  hyper.set_lr(lr);
  hyper.set_beta1(0.9f);
  hyper.set_beta2(0.999f);
  hyper.set_eps(1e-8f);
  hyper.set_weight_decay(0.1f);
  hyper.set_grad_scale(grad_scale);
  return hyper;
}

// A chunk's states as a correct daemon keeps them, updated with the daemon's
// kernel: each segment with its own t; segments without gradient untouched.
struct ExpectedChunk {
  std::vector<uint64_t> segments;  // element counts (one entry: the whole chunk)
  std::vector<float> master, m, v;
  std::vector<int64_t> counts;  // per segment

  ExpectedChunk(std::vector<float> initial, std::vector<uint64_t> segment_elements)
      : segments(std::move(segment_elements)),
        master(std::move(initial)),
        m(master.size(), 0.0f),
        v(master.size(), 0.0f) {
    if (segments.empty()) segments = {master.size()};
    counts.assign(segments.size(), 0);
  }

  void Update(const std::vector<float>& grads, const v1::AdamWHyper& hyper, const std::vector<uint32_t>& without = {}) {
    optimizer::AdamWBuffers buffers;
    buffers.master = master.data();
    buffers.exp_avg = m.data();
    buffers.exp_avg_sq = v.data();
    buffers.grad = grads.data();
    buffers.grad_dtype = DType::kFloat32;
    buffers.n = master.size();
    size_t begin = 0;
    for (size_t s = 0; s < segments.size(); ++s) {
      const size_t end = begin + segments[s];
      if (std::find(without.begin(), without.end(), s) == without.end()) {
        optimizer::AdamWStepParams params;
        params.lr = hyper.lr();
        params.beta1 = hyper.beta1();
        params.beta2 = hyper.beta2();
        params.eps = hyper.eps();
        params.weight_decay = hyper.weight_decay();
        params.grad_scale = hyper.grad_scale() == 0 ? 1.0f : hyper.grad_scale();
        params.step = ++counts[s];
        optimizer::AdamWUpdateRange(optimizer::DetectIsa(), params, buffers, begin, end);
      }
      begin = end;
    }
  }
  int64_t max_count() const { return *std::max_element(counts.begin(), counts.end()); }
};

bool BitEqual(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
}

// The index of the first element where a and b differ, as text (for messages).
std::string FirstDifference(const std::vector<float>& a, const std::vector<float>& b) {
  if (a.size() != b.size()) return "sizes " + std::to_string(a.size()) + " and " + std::to_string(b.size());
  for (size_t i = 0; i < a.size(); ++i) {
    if (std::memcmp(&a[i], &b[i], 4) != 0) {
      return "element " + std::to_string(i) + ": " + std::to_string(a[i]) + " vs " + std::to_string(b[i]);
    }
  }
  return "none";
}

#define EXPECT_BITS(a, b) EXPECT_TRUE(BitEqual(a, b)) << "first difference: " << FirstDifference(a, b)

bool IsParamsReady(const v1::DaemonMessage& reply) { return reply.has_params_ready(); }

std::string Describe(const v1::DaemonMessage& reply) { return reply.ShortDebugString(); }

class RedoTest : public ::testing::Test {
 protected:
  void SetUp() override { StartDaemon(); }

  void StartDaemon(std::vector<std::string> env = {}) {
    daemon_ = std::make_unique<DaemonProcess>(dir_.path(), kDaemonArgs, std::move(env));
    absl::Status started = daemon_->Start();
    ASSERT_TRUE(started.ok()) << Text(started);
  }

  std::unique_ptr<RawSession> Open(const std::string& job) {
    auto session = RawSession::Open(daemon_->client_options(), job, kSlots, kSlotBytes);
    EXPECT_TRUE(session.ok()) << Text(session.status());
    return session.ok() ? std::move(*session) : nullptr;
  }

  // Registers `specs` with initial weights `weights[i]` in their slots.
  v1::RegisterChunksResponse Register(RawSession& session, const std::vector<v1::ChunkSpec>& specs,
                                      const std::vector<std::vector<float>>& weights) {
    for (size_t i = 0; i < specs.size() && i < weights.size(); ++i) {
      std::memcpy(session.ParamRegion(specs[i].slot()).data(), weights[i].data(), weights[i].size() * 4);
    }
    v1::RegisterChunksResponse response;
    grpc::Status status = session.Register(specs, &response);
    EXPECT_TRUE(status.ok()) << status.error_message();
    return response;
  }

  // The committed master, m and v of a chunk must be `expected`'s, bit for bit.
  void ExpectCommittedStates(RawSession& session, uint32_t chunk_id, uint32_t slot, const ExpectedChunk& expected) {
    const size_t n = expected.master.size();
    int64_t t = -1;
    auto master = session.ReadState(chunk_id, v1::STATE_MASTER, slot, n, &t);
    auto m = session.ReadState(chunk_id, v1::STATE_EXP_AVG, slot, n);
    auto v = session.ReadState(chunk_id, v1::STATE_EXP_AVG_SQ, slot, n);
    ASSERT_TRUE(master.ok() && m.ok() && v.ok()) << Text(master.status()) << Text(m.status()) << Text(v.status());
    EXPECT_BITS(*master, expected.master);
    EXPECT_BITS(*m, expected.m);
    EXPECT_BITS(*v, expected.v);
    EXPECT_EQ(t, expected.max_count());
  }

  v1::GetStatsResponse Stats() {
    auto admin = AdminClient::Connect(daemon_->client_options());
    EXPECT_TRUE(admin.ok());
    auto stats = (*admin)->GetStats();
    EXPECT_TRUE(stats.ok()) << Text(stats.status());
    return stats.ok() ? *stats : v1::GetStatsResponse{};
  }

  TempDir dir_;
  std::unique_ptr<DaemonProcess> daemon_;
};

// Item 1 and 2 of issue 10: the speculative update is dropped and the chunk is
// updated again from its committed states with the gradients as they are now
// and the new grad_scale (a clip coefficient); the other chunk's update of the
// step stays; a redo of a redo works; the step commits the redone states with
// one update counted.
TEST_F(RedoTest, ARedoIsTheUpdateFromTheCommittedStatesWithTheNewGradients) {
  constexpr size_t kN0 = 1000, kN1 = 700;
  auto session = Open("redo");
  ASSERT_NE(session, nullptr);
  const std::vector<float> w0 = Values(1, kN0), w1 = Values(2, kN1);
  Register(*session, {ChunkSpecOf(0, kN0, 0), ChunkSpecOf(1, kN1, 1)}, {w0, w1});
  ExpectedChunk expected0(w0, {}), expected1(w1, {});
  ReferenceChunk plain0(w0);  // independent of the kernel

  // Step 1: a plain step.
  const std::vector<float> g0 = Values(10, kN0, 0.1f), g1 = Values(11, kN1, 0.1f);
  ASSERT_TRUE(IsParamsReady(session->SendGrad(GradReadyOf(1, 0, 0, Hyper()), g0)));
  ASSERT_TRUE(IsParamsReady(session->SendGrad(GradReadyOf(1, 1, 1, Hyper()), g1)));
  ASSERT_TRUE(session->EndStep(1).has_step_committed());
  expected0.Update(g0, Hyper());
  expected1.Update(g1, Hyper());
  AdamWHyper plain_hyper{.lr = 1e-2f, .beta1 = 0.9f, .beta2 = 0.999f, .eps = 1e-8f, .weight_decay = 0.1f,
                         .grad_scale = 1.0f};
  plain0.Step(g0, plain_hyper);

  // Step 2: both chunks speculatively.
  const std::vector<float> s0 = Values(20, kN0, 0.1f), s1 = Values(21, kN1, 0.1f);
  v1::GradReady speculative0 = GradReadyOf(2, 0, 0, Hyper());
  speculative0.set_speculative(true);
  v1::DaemonMessage reply = session->SendGrad(speculative0, s0);
  ASSERT_TRUE(IsParamsReady(reply)) << Describe(reply);
  {
    ExpectedChunk speculated = expected0;
    speculated.Update(s0, Hyper());
    EXPECT_BITS(session->Weights(0, kN0), speculated.master);
  }
  v1::GradReady speculative1 = GradReadyOf(2, 1, 1, Hyper());
  speculative1.set_speculative(true);
  ASSERT_TRUE(IsParamsReady(session->SendGrad(speculative1, s1)));
  ExpectedChunk expected1_step2 = expected1;
  expected1_step2.Update(s1, Hyper());

  // The gradients of chunk 0 changed (an external clip_grad_norm_): redo.
  const std::vector<float> changed = Values(30, kN0, 0.1f);
  v1::GradReady redo = GradReadyOf(2, 0, 0, Hyper(0.25f));
  redo.set_redo(v1::REDO_REASON_GRADIENTS_CHANGED);
  reply = session->SendGrad(redo, changed);
  ASSERT_TRUE(IsParamsReady(reply)) << Describe(reply);
  {
    ExpectedChunk redone = expected0;
    redone.Update(changed, Hyper(0.25f));
    EXPECT_BITS(session->Weights(0, kN0), redone.master) << "the redo must start from the committed states";
  }
  // And once more, clipped (a redo of a redo).
  redo.set_redo(v1::REDO_REASON_CLIPPED);
  *redo.mutable_hyper() = Hyper(0.5f);
  reply = session->SendGrad(redo, changed);
  ASSERT_TRUE(IsParamsReady(reply)) << Describe(reply);
  expected0.Update(changed, Hyper(0.5f));
  EXPECT_BITS(session->Weights(0, kN0), expected0.master);
  plain_hyper.grad_scale = 0.5f;
  plain0.Step(changed, plain_hyper);
  const std::vector<float> weights = session->Weights(0, kN0);
  for (size_t i = 0; i < kN0; ++i) {
    ASSERT_NEAR(weights[i], plain0.master[i], 1e-6 + 1e-5 * std::fabs(plain0.master[i])) << "i=" << i;
  }

  reply = session->EndStep(2);
  ASSERT_TRUE(reply.has_step_committed()) << Describe(reply);
  EXPECT_EQ(reply.step_committed().chunks_updated(), 2u);
  ExpectCommittedStates(*session, 0, 0, expected0);
  ExpectCommittedStates(*session, 1, 1, expected1_step2);
  EXPECT_EQ(expected0.max_count(), 2) << "a redo is not one more update";

  // Step 3 continues from the redone states with t = 3.
  const std::vector<float> g3 = Values(40, kN0, 0.1f);
  ASSERT_TRUE(IsParamsReady(session->SendGrad(GradReadyOf(3, 0, 0, Hyper()), g3)));
  ASSERT_TRUE(session->EndStep(3).has_step_committed());
  expected0.Update(g3, Hyper());
  ExpectCommittedStates(*session, 0, 0, expected0);
  EXPECT_TRUE(session->Close().ok());

  const v1::GetStatsResponse stats = Stats();
  EXPECT_EQ(stats.chunks_speculative(), 2u);
  EXPECT_EQ(stats.chunks_redone_changed(), 1u);
  EXPECT_EQ(stats.chunks_redone_clipped(), 1u);
  EXPECT_GT(stats.redo_seconds(), 0.0);
  EXPECT_EQ(stats.chunk_updates(), 7u) << "2 + 2 + 2 redos + 1";
}

TEST_F(RedoTest, ARedoOfAChunkNotUpdatedInTheStepIsRefused) {
  constexpr size_t kN = 500;
  auto session = Open("refused");
  ASSERT_NE(session, nullptr);
  const std::vector<float> w = Values(1, kN);
  Register(*session, {ChunkSpecOf(0, kN, 0), ChunkSpecOf(1, kN, 1)}, {w, w});
  ExpectedChunk expected(w, {});
  const std::vector<float> g = Values(2, kN, 0.1f);

  v1::GradReady redo = GradReadyOf(1, 0, 0, Hyper());
  redo.set_redo(v1::REDO_REASON_GRADIENTS_CHANGED);
  v1::DaemonMessage reply = session->SendGrad(redo, g);
  ASSERT_TRUE(reply.has_error()) << Describe(reply);
  EXPECT_EQ(reply.error().code(), static_cast<int>(absl::StatusCode::kFailedPrecondition));
  EXPECT_NE(reply.error().message().find("chunk 0"), std::string::npos) << reply.error().message();
  EXPECT_NE(reply.error().message().find("redo"), std::string::npos) << reply.error().message();

  // A redo reason the daemon does not know.
  v1::GradReady unknown = GradReadyOf(1, 0, 0, Hyper());
  unknown.set_redo(static_cast<v1::RedoReason>(9));
  reply = session->SendGrad(unknown, g);
  ASSERT_TRUE(reply.has_error()) << Describe(reply);
  EXPECT_EQ(reply.error().code(), static_cast<int>(absl::StatusCode::kInvalidArgument));

  // The chunk is still sendable once, and a second GradReady without redo is refused.
  ASSERT_TRUE(IsParamsReady(session->SendGrad(GradReadyOf(1, 0, 0, Hyper()), g)));
  expected.Update(g, Hyper());
  reply = session->SendGrad(GradReadyOf(1, 0, 0, Hyper()), Values(3, kN, 0.1f));
  ASSERT_TRUE(reply.has_error()) << Describe(reply);
  EXPECT_EQ(reply.error().code(), static_cast<int>(absl::StatusCode::kFailedPrecondition));
  EXPECT_NE(reply.error().message().find("already updated"), std::string::npos) << reply.error().message();
  // A redo of chunk 1, never sent in this step, is refused too.
  v1::GradReady redo1 = GradReadyOf(1, 1, 1, Hyper());
  redo1.set_redo(v1::REDO_REASON_CLIPPED);
  reply = session->SendGrad(redo1, g);
  ASSERT_TRUE(reply.has_error()) << Describe(reply);
  EXPECT_EQ(reply.error().code(), static_cast<int>(absl::StatusCode::kFailedPrecondition));

  reply = session->EndStep(1);
  ASSERT_TRUE(reply.has_step_committed()) << Describe(reply);
  EXPECT_EQ(reply.step_committed().chunks_updated(), 1u);
  ExpectCommittedStates(*session, 0, 0, expected);
  // Updated in step 1 is not updated in step 2: a redo in step 2 is refused.
  redo.set_step(2);
  reply = session->SendGrad(redo, g);
  ASSERT_TRUE(reply.has_error()) << Describe(reply);
  EXPECT_EQ(reply.error().code(), static_cast<int>(absl::StatusCode::kFailedPrecondition));
  EXPECT_TRUE(session->Close().ok());
  const v1::GetStatsResponse stats = Stats();
  EXPECT_EQ(stats.chunks_redone_changed() + stats.chunks_redone_clipped(), 0u) << "refused redos are not counted";
}

// A redo that fails after it dropped the chunk's update (here: the committed
// states cannot be read again) leaves the step without that update: the step
// is refused and rolled back at EndStep, never committed without the chunk.
TEST_F(RedoTest, ARedoThatFailsMakesTheStepRollBack) {
  constexpr size_t kN = 400;
  daemon_->Stop();
  StartDaemon({"FUYOU_TEST_FAULTS=read:EIO:job=redo-fails"});  // the DRAM tier serves every other read
  auto session = Open("redo-fails");
  ASSERT_NE(session, nullptr);
  const std::vector<float> w = Values(1, kN);
  Register(*session, {ChunkSpecOf(0, kN, 0), ChunkSpecOf(1, kN, 1)}, {w, w});
  const std::vector<float> g = Values(2, kN, 0.1f);
  ASSERT_TRUE(IsParamsReady(session->SendGrad(GradReadyOf(1, 0, 0, Hyper()), g)));
  ASSERT_TRUE(IsParamsReady(session->SendGrad(GradReadyOf(1, 1, 1, Hyper()), g)));
  ASSERT_TRUE(session->EndStep(1).has_step_committed());
  ASSERT_TRUE(IsParamsReady(session->SendGrad(GradReadyOf(2, 0, 0, Hyper()), g)));
  ASSERT_TRUE(IsParamsReady(session->SendGrad(GradReadyOf(2, 1, 1, Hyper()), g)));
  v1::GradReady redo = GradReadyOf(2, 0, 0, Hyper(0.5f));
  redo.set_redo(v1::REDO_REASON_CLIPPED);
  v1::DaemonMessage reply = session->SendGrad(redo, g);
  ASSERT_TRUE(reply.has_error()) << Describe(reply);
  EXPECT_NE(reply.error().message().find("redo of chunk 0 failed"), std::string::npos) << reply.error().message();
  // Nothing can mend the step now, and it does not commit.
  reply = session->SendGrad(GradReadyOf(2, 0, 0, Hyper()), g);
  ASSERT_TRUE(reply.has_error()) << Describe(reply);
  EXPECT_NE(reply.error().message().find("already failed"), std::string::npos) << reply.error().message();
  reply = session->EndStep(2);
  ASSERT_TRUE(reply.has_error()) << Describe(reply);
  EXPECT_NE(reply.error().message().find("rolled back to step 1"), std::string::npos) << reply.error().message();
  EXPECT_TRUE(session->Close().ok());
  session = Open("redo-fails");
  ASSERT_NE(session, nullptr);
  EXPECT_EQ(session->committed_step(), 1);
  EXPECT_TRUE(session->Close().ok());
}

// Item 5: `grad is None` inside a chunk. Segments 1 of {100, 300, 600} has no
// gradient in step 2 (its gradient bytes are NaN, to show they are not read):
// its weights, m, v and count stay; step 3 updates it with its own t (2, the
// others 3); a resume returns the per-segment counts.
TEST_F(RedoTest, SegmentsWithoutGradientKeepTheirStatesAndTheirCount) {
  constexpr size_t kN = 1000;
  const std::vector<uint64_t> segments = {100, 300, 600};
  const std::vector<float> w = Values(1, kN);
  ExpectedChunk expected(w, segments);
  {
    auto session = Open("segments");
    ASSERT_NE(session, nullptr);
    v1::RegisterChunksResponse registered = Register(*session, {ChunkSpecOf(0, kN, 0, segments)}, {w});
    ASSERT_EQ(registered.chunks_size(), 1);
    EXPECT_TRUE(registered.chunks(0).segment_update_counts().empty());

    const std::vector<float> g1 = Values(2, kN, 0.1f);
    ASSERT_TRUE(IsParamsReady(session->SendGrad(GradReadyOf(1, 0, 0, Hyper()), g1)));
    ASSERT_TRUE(session->EndStep(1).has_step_committed());
    expected.Update(g1, Hyper());
    const ExpectedChunk after_step1 = expected;

    std::vector<float> g2 = Values(3, kN, 0.1f);
    for (size_t i = 100; i < 400; ++i) g2[i] = std::numeric_limits<float>::quiet_NaN();
    v1::GradReady grad = GradReadyOf(2, 0, 0, Hyper());
    grad.add_segments_without_grad(1);
    v1::DaemonMessage reply = session->SendGrad(grad, g2);
    ASSERT_TRUE(IsParamsReady(reply)) << Describe(reply);
    expected.Update(g2, Hyper(), {1});
    EXPECT_BITS(session->Weights(0, kN), expected.master);
    const std::vector<float> weights = session->Weights(0, kN);
    for (size_t i = 100; i < 400; ++i) ASSERT_EQ(weights[i], after_step1.master[i]) << "i=" << i;
    ASSERT_TRUE(session->EndStep(2).has_step_committed());
    ExpectCommittedStates(*session, 0, 0, expected);
    EXPECT_EQ(expected.counts, (std::vector<int64_t>{2, 1, 2}));

    // Step 3: every segment has a gradient; segment 1 is at its own t = 2.
    const std::vector<float> g3 = Values(4, kN, 0.1f);
    ASSERT_TRUE(IsParamsReady(session->SendGrad(GradReadyOf(3, 0, 0, Hyper()), g3)));
    expected.Update(g3, Hyper());
    EXPECT_BITS(session->Weights(0, kN), expected.master);
    ASSERT_TRUE(session->EndStep(3).has_step_committed());
    ExpectCommittedStates(*session, 0, 0, expected);

    // Step 4: no segment has a gradient: nothing changes, the weights come back.
    grad = GradReadyOf(4, 0, 0, Hyper());
    for (uint32_t s : {0u, 1u, 2u}) grad.add_segments_without_grad(s);
    reply = session->SendGrad(grad, std::vector<float>(kN, std::numeric_limits<float>::quiet_NaN()));
    ASSERT_TRUE(IsParamsReady(reply)) << Describe(reply);
    EXPECT_BITS(session->Weights(0, kN), expected.master);
    reply = session->EndStep(4);
    ASSERT_TRUE(reply.has_step_committed()) << Describe(reply);
    EXPECT_EQ(reply.step_committed().chunks_updated(), 1u) << "the request counts as the chunk's update";
    ExpectCommittedStates(*session, 0, 0, expected);
    EXPECT_TRUE(session->Close().ok());
  }
  EXPECT_EQ(expected.counts, (std::vector<int64_t>{3, 2, 3}));
  {
    // A resume returns the per-segment counts (and refuses other segments).
    auto session = Open("segments");
    ASSERT_NE(session, nullptr);
    v1::RegisterChunksResponse refused;
    grpc::Status status = session->Register({ChunkSpecOf(0, kN, 0, {400, 600})}, &refused);
    EXPECT_EQ(status.error_code(), grpc::StatusCode::FAILED_PRECONDITION) << status.error_message();
    EXPECT_NE(status.error_message().find("segments"), std::string::npos) << status.error_message();
    v1::RegisterChunksResponse registered = Register(*session, {ChunkSpecOf(0, kN, 0, segments)}, {});
    ASSERT_EQ(registered.chunks_size(), 1);
    EXPECT_TRUE(registered.chunks(0).resumed());
    EXPECT_EQ(registered.chunks(0).update_count(), 3);
    EXPECT_EQ(std::vector<int64_t>(registered.chunks(0).segment_update_counts().begin(),
                                   registered.chunks(0).segment_update_counts().end()),
              (std::vector<int64_t>{3, 2, 3}));
    EXPECT_BITS(session->Weights(0, kN), expected.master);
    // And the next update goes on with each segment's t.
    const std::vector<float> g5 = Values(5, kN, 0.1f);
    ASSERT_TRUE(IsParamsReady(session->SendGrad(GradReadyOf(5, 0, 0, Hyper()), g5)));
    expected.Update(g5, Hyper());
    EXPECT_BITS(session->Weights(0, kN), expected.master);
    ASSERT_TRUE(session->EndStep(5).has_step_committed());
    ExpectCommittedStates(*session, 0, 0, expected);
    EXPECT_TRUE(session->Close().ok());
  }
}

// A chunk created without segments adopts the segments of the first resume that
// sends them, as a missing layout fingerprint is adopted.
TEST_F(RedoTest, AChunkCreatedWithoutSegmentsAdoptsThemOnResume) {
  constexpr size_t kN = 300;
  const std::vector<float> w = Values(1, kN);
  ExpectedChunk expected(w, {});
  {
    auto session = Open("adopt");
    ASSERT_NE(session, nullptr);
    Register(*session, {ChunkSpecOf(0, kN, 0)}, {w});
    const std::vector<float> g = Values(2, kN, 0.1f);
    ASSERT_TRUE(IsParamsReady(session->SendGrad(GradReadyOf(1, 0, 0, Hyper()), g)));
    ASSERT_TRUE(session->EndStep(1).has_step_committed());
    expected.Update(g, Hyper());
    EXPECT_TRUE(session->Close().ok());
  }
  expected.segments = {100, 200};
  expected.counts = {1, 1};
  {
    auto session = Open("adopt");
    ASSERT_NE(session, nullptr);
    v1::RegisterChunksResponse registered = Register(*session, {ChunkSpecOf(0, kN, 0, {100, 200})}, {});
    ASSERT_EQ(registered.chunks_size(), 1);
    EXPECT_EQ(registered.chunks(0).update_count(), 1);
    const std::vector<float> g = Values(3, kN, 0.1f);
    v1::GradReady grad = GradReadyOf(2, 0, 0, Hyper());
    grad.add_segments_without_grad(0);
    ASSERT_TRUE(IsParamsReady(session->SendGrad(grad, g)));
    expected.Update(g, Hyper(), {0});
    ASSERT_TRUE(session->EndStep(2).has_step_committed());
    ExpectCommittedStates(*session, 0, 0, expected);
    EXPECT_TRUE(session->Close().ok());
  }
  {
    // Adopted for good: another packing is now refused.
    auto session = Open("adopt");
    ASSERT_NE(session, nullptr);
    v1::RegisterChunksResponse response;
    EXPECT_EQ(session->Register({ChunkSpecOf(0, kN, 0, {})}, &response).error_code(),
              grpc::StatusCode::FAILED_PRECONDITION);
    v1::RegisterChunksResponse registered = Register(*session, {ChunkSpecOf(0, kN, 0, {100, 200})}, {});
    ASSERT_EQ(registered.chunks_size(), 1);
    EXPECT_EQ(std::vector<int64_t>(registered.chunks(0).segment_update_counts().begin(),
                                   registered.chunks(0).segment_update_counts().end()),
              (std::vector<int64_t>{1, 2}));
  }
}

// Issue 12: a chunk registered with store_weights keeps each update's working
// weights itself, with the states, in the same commit: after a redo, a step
// with a segment without gradient and a daemon restart, a resume gets exactly
// the weights of the last committed update (here fp32: the master itself), and
// resuming it without store_weights is refused.
TEST_F(RedoTest, AChunkThatStoresItsWeightsResumesWithTheLastCommittedUpdatesWeights) {
  constexpr size_t kN = 300;
  const std::vector<float> w = Values(1, kN);
  ExpectedChunk expected(w, {100, 200});
  v1::ChunkSpec spec = ChunkSpecOf(0, kN, 0, {100, 200});
  spec.set_store_weights(true);
  {
    auto session = Open("stored-weights");
    ASSERT_NE(session, nullptr);
    Register(*session, {spec}, {w});
    const std::vector<float> speculative = Values(2, kN, 0.1f);
    ASSERT_TRUE(IsParamsReady(session->SendGrad(GradReadyOf(1, 0, 0, Hyper()), speculative)));
    const std::vector<float> g = Values(3, kN, 0.1f);
    v1::GradReady redo = GradReadyOf(1, 0, 0, Hyper(0.5f));
    redo.set_redo(v1::REDO_REASON_CLIPPED);
    ASSERT_TRUE(IsParamsReady(session->SendGrad(redo, g)));
    expected.Update(g, Hyper(0.5f));
    EXPECT_BITS(session->Weights(0, kN), expected.master);
    ASSERT_TRUE(session->EndStep(1).has_step_committed());
    const std::vector<float> g2 = Values(4, kN, 0.1f);
    v1::GradReady grad = GradReadyOf(2, 0, 0, Hyper());
    grad.add_segments_without_grad(0);
    ASSERT_TRUE(IsParamsReady(session->SendGrad(grad, g2)));
    expected.Update(g2, Hyper(), {0});
    EXPECT_BITS(session->Weights(0, kN), expected.master);
    ASSERT_TRUE(session->EndStep(2).has_step_committed());
    // A step that does not commit leaves them.
    ASSERT_TRUE(IsParamsReady(session->SendGrad(GradReadyOf(3, 0, 0, Hyper()), g)));
    ASSERT_TRUE(session->AbortStep(3, v1::ABORT_REASON_SKIPPED_STEP).has_step_aborted());
    EXPECT_TRUE(session->Close().ok());
  }
  daemon_.reset();
  StartDaemon();
  auto session = Open("stored-weights");
  ASSERT_NE(session, nullptr);
  v1::ChunkSpec without = spec;
  without.set_store_weights(false);
  v1::RegisterChunksResponse response;
  grpc::Status refused = session->Register({without}, &response);
  EXPECT_EQ(refused.error_code(), grpc::StatusCode::FAILED_PRECONDITION) << refused.error_message();
  EXPECT_NE(refused.error_message().find("store_weights"), std::string::npos) << refused.error_message();
  std::memset(session->ParamRegion(0).data(), 0, kN * 4);
  v1::RegisterChunksResponse registered = Register(*session, {spec}, {});
  ASSERT_EQ(registered.chunks_size(), 1);
  EXPECT_TRUE(registered.chunks(0).resumed());
  EXPECT_BITS(session->Weights(0, kN), expected.master);
  ExpectCommittedStates(*session, 0, 1, expected);
}

TEST_F(RedoTest, HostileSegmentListsAreRefusedAndTheDaemonServes) {
  constexpr size_t kN = 1000;
  auto session = Open("hostile");
  ASSERT_NE(session, nullptr);
  struct Case {
    const char* what;
    std::vector<uint64_t> segments;
    const char* words;
  };
  const std::vector<Case> cases = {
      {"sum too small", {100, 200}, "add up to 300 elements, but the chunk has 1000"},
      {"a zero segment", {500, 0, 500}, "segment_elements[1] is 0"},
      {"sum wraps to n", {std::numeric_limits<uint64_t>::max(), 1001}, "more than 2^64"},
      {"too many", std::vector<uint64_t>(4097, 1), "more than the 4096 segments"},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.what);
    std::vector<uint64_t> segments = c.segments;
    const uint64_t n = c.segments.size() == 4097 ? 4097 : kN;
    v1::RegisterChunksResponse response;
    grpc::Status status = session->Register({ChunkSpecOf(0, n, 0, segments)}, &response);
    EXPECT_EQ(status.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << status.error_message();
    EXPECT_NE(status.error_message().find("chunk 0"), std::string::npos) << status.error_message();
    EXPECT_NE(status.error_message().find(c.words), std::string::npos) << status.error_message();
  }
  // Nothing was registered: the chunk registers now as new.
  const std::vector<float> w = Values(1, kN);
  v1::RegisterChunksResponse registered = Register(*session, {ChunkSpecOf(0, kN, 0, {400, 600})}, {w});
  ASSERT_EQ(registered.chunks_size(), 1);
  EXPECT_FALSE(registered.chunks(0).resumed());

  // Hostile segments_without_grad: refused, nothing updated, the step goes on.
  const std::vector<float> g = Values(2, kN, 0.1f);
  for (const std::vector<uint32_t>& without :
       {std::vector<uint32_t>{2}, std::vector<uint32_t>{1, 0}, std::vector<uint32_t>{0, 0},
        std::vector<uint32_t>{std::numeric_limits<uint32_t>::max()}}) {
    v1::GradReady grad = GradReadyOf(1, 0, 0, Hyper());
    for (uint32_t s : without) grad.add_segments_without_grad(s);
    v1::DaemonMessage reply = session->SendGrad(grad, g);
    ASSERT_TRUE(reply.has_error()) << Describe(reply);
    EXPECT_EQ(reply.error().code(), static_cast<int>(absl::StatusCode::kInvalidArgument));
    EXPECT_NE(reply.error().message().find("segments_without_grad"), std::string::npos) << reply.error().message();
  }
  ExpectedChunk expected(w, {400, 600});
  ASSERT_TRUE(IsParamsReady(session->SendGrad(GradReadyOf(1, 0, 0, Hyper()), g)));
  expected.Update(g, Hyper());
  ASSERT_TRUE(session->EndStep(1).has_step_committed());
  ExpectCommittedStates(*session, 0, 0, expected);
  EXPECT_TRUE(session->Close().ok());
  auto admin = AdminClient::Connect(daemon_->client_options());
  ASSERT_TRUE(admin.ok());
  EXPECT_TRUE((*admin)->Health().ok());
}

// Item 4 and 6: a step the loop skipped is rolled back and counted; an abort
// for another reason is not counted as skipped.
TEST_F(RedoTest, SkippedStepsAreRolledBackAndCounted) {
  constexpr size_t kN = 200;
  auto session = Open("skipped");
  ASSERT_NE(session, nullptr);
  const std::vector<float> w = Values(1, kN);
  Register(*session, {ChunkSpecOf(0, kN, 0), ChunkSpecOf(1, kN, 1)}, {w, w});
  ExpectedChunk expected(w, {});
  const std::vector<float> g = Values(2, kN, 0.1f);
  for (v1::AbortReason reason : {v1::ABORT_REASON_SKIPPED_STEP, v1::ABORT_REASON_OVERFLOW, v1::ABORT_REASON_UNSPECIFIED}) {
    v1::GradReady grad = GradReadyOf(1, 0, 0, Hyper());
    grad.set_speculative(true);
    ASSERT_TRUE(IsParamsReady(session->SendGrad(grad, g)));
    grad = GradReadyOf(1, 1, 1, Hyper());
    grad.set_speculative(true);
    ASSERT_TRUE(IsParamsReady(session->SendGrad(grad, g)));
    v1::DaemonMessage reply = session->AbortStep(1, reason);
    ASSERT_TRUE(reply.has_step_aborted()) << Describe(reply);
  }
  ExpectCommittedStates(*session, 0, 0, expected);
  ASSERT_TRUE(IsParamsReady(session->SendGrad(GradReadyOf(1, 0, 0, Hyper()), g)));
  ASSERT_TRUE(session->EndStep(1).has_step_committed());
  expected.Update(g, Hyper());
  ExpectCommittedStates(*session, 0, 0, expected);
  EXPECT_TRUE(session->Close().ok());

  const v1::GetStatsResponse stats = Stats();
  EXPECT_EQ(stats.chunks_rolled_back_skipped_step(), 4u) << "2 chunks skipped, 2 overflowed; not the unspecified";
  EXPECT_EQ(stats.chunks_speculative(), 6u);

  // fuyouctl stats prints them.
  if (::geteuid() != 0) GTEST_SKIP() << "fuyouctl is run through RunAs, which needs root";
  std::string output;
  ASSERT_EQ(RunAs(0, FUYOUCTL_PATH, {"--socket", daemon_->socket_path().string(), "stats"}, dir_.path() / "ctl.out",
                  &output),
            0)
      << output;
  EXPECT_NE(output.find("speculative updates 6, redone 0 (changed 0, clipped 0), rolled back (skipped steps) 4"),
            std::string::npos)
      << output;
}

// The daemon killed at each redo crash point: the job resumes at its last
// commit with its committed states intact, and redoing the step then gives
// exactly the update from those states.
TEST_F(RedoTest, ACrashDuringARedoResumesAtTheLastCommit) {
  constexpr size_t kN = 800;
  for (const char* point : {"redo_received:1", "redo_after_kernel:1", "redo_writeback_submitted:1"}) {
    SCOPED_TRACE(point);
    daemon_->Stop();
    const std::string job = std::string("crash-") + std::string(point).substr(0, std::string(point).find(':'));
    StartDaemon({std::string("FUYOU_CRASH_AT=") + point});
    const std::vector<float> w0 = Values(1, kN), w1 = Values(2, kN);
    ExpectedChunk expected0(w0, {}), expected1(w1, {});
    {
      auto session = Open(job);
      ASSERT_NE(session, nullptr);
      Register(*session, {ChunkSpecOf(0, kN, 0), ChunkSpecOf(1, kN, 1)}, {w0, w1});
      const std::vector<float> g = Values(3, kN, 0.1f);
      ASSERT_TRUE(IsParamsReady(session->SendGrad(GradReadyOf(1, 0, 0, Hyper()), g)));
      ASSERT_TRUE(IsParamsReady(session->SendGrad(GradReadyOf(1, 1, 1, Hyper()), g)));
      ASSERT_TRUE(session->EndStep(1).has_step_committed());
      expected0.Update(g, Hyper());
      expected1.Update(g, Hyper());
      // Step 2: both speculatively, then a redo of chunk 0 kills the daemon.
      ASSERT_TRUE(IsParamsReady(session->SendGrad(GradReadyOf(2, 0, 0, Hyper()), Values(4, kN, 0.1f))));
      ASSERT_TRUE(IsParamsReady(session->SendGrad(GradReadyOf(2, 1, 1, Hyper()), Values(5, kN, 0.1f))));
      v1::GradReady redo = GradReadyOf(2, 0, 0, Hyper(0.5f));
      redo.set_redo(v1::REDO_REASON_CLIPPED);
      v1::DaemonMessage reply = session->SendGrad(redo, Values(6, kN, 0.1f));
      EXPECT_FALSE(IsParamsReady(reply)) << "the daemon should have died at " << point;
    }
    const int exit = daemon_->WaitForExit(milliseconds(20000));
    ASSERT_TRUE(exit != -1 && WIFSIGNALED(exit) && WTERMSIG(exit) == SIGKILL) << "fuyoud did not die at " << point;
    daemon_->set_env({});
    absl::Status started = daemon_->Start();
    ASSERT_TRUE(started.ok()) << Text(started);
    auto session = Open(job);
    ASSERT_NE(session, nullptr);
    EXPECT_EQ(session->committed_step(), 1);
    v1::RegisterChunksResponse registered = Register(*session, {ChunkSpecOf(0, kN, 0), ChunkSpecOf(1, kN, 1)}, {});
    ASSERT_EQ(registered.chunks_size(), 2);
    EXPECT_EQ(registered.chunks(0).update_count(), 1);
    EXPECT_BITS(session->Weights(0, kN), expected0.master);
    EXPECT_BITS(session->Weights(1, kN), expected1.master);
    ExpectCommittedStates(*session, 0, 0, expected0);
    ExpectCommittedStates(*session, 1, 1, expected1);
    // Step 2 again, with a redo that now completes.
    ASSERT_TRUE(IsParamsReady(session->SendGrad(GradReadyOf(2, 0, 0, Hyper()), Values(4, kN, 0.1f))));
    v1::GradReady redo = GradReadyOf(2, 0, 0, Hyper(0.5f));
    redo.set_redo(v1::REDO_REASON_CLIPPED);
    ASSERT_TRUE(IsParamsReady(session->SendGrad(redo, Values(6, kN, 0.1f))));
    ASSERT_TRUE(session->EndStep(2).has_step_committed());
    expected0.Update(Values(6, kN, 0.1f), Hyper(0.5f));
    ExpectCommittedStates(*session, 0, 0, expected0);
    ExpectCommittedStates(*session, 1, 1, expected1);
    EXPECT_TRUE(session->Close().ok());
  }
}

// What a redo costs, printed (never asserted: the machine is noisy): steps of
// 4 chunks of 512 Ki fp32 elements (6 MiB of states each, all in the DRAM
// tier), plain, and with every chunk updated speculatively and then redone (a
// clip coefficient < 1 on every step, the worst case). A redo reads the
// committed states again from storage: the speculative update changed the
// cached copy in place.
TEST_F(RedoTest, TheCostOfRedoingEveryChunkIsPrinted) {
  constexpr size_t kN = 512 * 1024;
  constexpr uint32_t kChunks = 4;
  constexpr int kSteps = 4;
  auto opened = RawSession::Open(daemon_->client_options(), "cost", kChunks, kN * 4);
  ASSERT_TRUE(opened.ok()) << Text(opened.status());
  RawSession& session = **opened;
  std::vector<v1::ChunkSpec> specs;
  std::vector<std::vector<float>> weights;
  for (uint32_t c = 0; c < kChunks; ++c) {
    specs.push_back(ChunkSpecOf(c, kN, c));
    weights.push_back(Values(c, kN));
  }
  Register(session, specs, weights);
  const std::vector<float> g = Values(99, kN, 0.1f);
  int64_t step = 1;
  auto run = [&](bool redo) {
    const auto start = std::chrono::steady_clock::now();
    for (int i = 0; i < kSteps; ++i, ++step) {
      for (uint32_t c = 0; c < kChunks; ++c) {
        v1::GradReady grad = GradReadyOf(step, c, c, Hyper());
        grad.set_speculative(redo);
        EXPECT_TRUE(IsParamsReady(session.SendGrad(grad, g)));
      }
      for (uint32_t c = 0; redo && c < kChunks; ++c) {
        v1::GradReady grad = GradReadyOf(step, c, c, Hyper(0.5f));
        grad.set_redo(v1::REDO_REASON_CLIPPED);
        EXPECT_TRUE(IsParamsReady(session.SendGrad(grad, g)));
      }
      EXPECT_TRUE(session.EndStep(step).has_step_committed());
    }
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count() / kSteps;
  };
  run(false);  // warm-up: first reads, page faults
  const double plain = run(false);
  const double redone = run(true);
  const double plain_again = run(false);
  const v1::GetStatsResponse stats = Stats();
  EXPECT_EQ(stats.chunks_redone_clipped(), uint64_t{kChunks} * kSteps);
  std::printf("[redo cost] %u chunks of %zu fp32 elements: plain step %.1f / %.1f ms, every chunk redone %.1f ms "
              "(x%.2f); %.2f ms a redo (GetStats redo_seconds / redos)\n",
              kChunks, kN, plain * 1e3, plain_again * 1e3, redone * 1e3, redone / ((plain + plain_again) / 2),
              stats.redo_seconds() * 1e3 / static_cast<double>(stats.chunks_redone_clipped()));
  EXPECT_TRUE(session.Close().ok());
}

// GetStats fields 19-23 in both scopes: another user (redo_client, run as
// nobody) sees its own speculation counters only; root sees the whole daemon's.
TEST(RedoStatsTest, EachUserSeesTheirOwnCountersAndRootSeesTheDaemons) {
  if (::geteuid() != 0) GTEST_SKIP() << "skipped: needs root to act as a second user";
  constexpr uid_t kNobody = 65534;
  TempDir dir;
  ::chmod(dir.path().c_str(), 01777);  // nobody must reach the socket and write its output (sticky, as fuyoud requires)
  DaemonProcess daemon(dir.path(), {"--dram-budget", "64MiB", "--socket-mode", "0666", "--drain-seconds", "0"});
  absl::Status started = daemon.Start();
  ASSERT_TRUE(started.ok()) << Text(started);
  {
    // Root: one speculative update, redone once (changed).
    auto session = RawSession::Open(daemon.client_options(), "roots-job", 1, 4096);
    ASSERT_TRUE(session.ok()) << Text(session.status());
    v1::RegisterChunksResponse registered;
    ASSERT_TRUE((*session)->Register({ChunkSpecOf(0, 100, 0)}, &registered).ok());
    v1::GradReady grad = GradReadyOf(1, 0, 0, Hyper());
    grad.set_speculative(true);
    ASSERT_TRUE(IsParamsReady((*session)->SendGrad(grad, Values(1, 100, 0.1f))));
    grad.set_speculative(false);
    grad.set_redo(v1::REDO_REASON_GRADIENTS_CHANGED);
    ASSERT_TRUE(IsParamsReady((*session)->SendGrad(grad, Values(2, 100, 0.1f))));
    ASSERT_TRUE((*session)->EndStep(1).has_step_committed());
    EXPECT_TRUE((*session)->Close().ok());
  }
  std::string output;
  ASSERT_EQ(RunAs(kNobody, REDO_CLIENT_PATH, {daemon.socket_path().string(), "nobodys-job"},
                  dir.path() / "client.out", &output),
            0)
      << output;
  auto mine = KeyValues(output);
  EXPECT_EQ(mine["scope"], std::to_string(v1::STATS_SCOPE_USER)) << output;
  EXPECT_EQ(mine["chunks_speculative"], "2") << "root's speculative update must not show";
  EXPECT_EQ(mine["chunks_redone_changed"], "1");
  EXPECT_EQ(mine["chunks_redone_clipped"], "1");
  EXPECT_EQ(mine["chunks_rolled_back_skipped_step"], "1");
  EXPECT_EQ(mine["redo_positive"], "1");

  auto admin = AdminClient::Connect(daemon.client_options());
  ASSERT_TRUE(admin.ok());
  auto all = (*admin)->GetStats();
  ASSERT_TRUE(all.ok()) << Text(all.status());
  EXPECT_EQ(all->scope(), v1::STATS_SCOPE_DAEMON);
  EXPECT_EQ(all->chunks_speculative(), 3u);
  EXPECT_EQ(all->chunks_redone_changed(), 2u);
  EXPECT_EQ(all->chunks_redone_clipped(), 1u);
  EXPECT_EQ(all->chunks_rolled_back_skipped_step(), 1u);
  EXPECT_GT(all->redo_seconds(), 0.0);
}

}  // namespace
}  // namespace fuyou::testing
