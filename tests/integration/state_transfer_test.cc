// Export and import of optimizer states (ReadState, WriteState, SetUpdateCount,
// CommitImport) against a real fuyoud, through clientlib.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <random>

#include "adamw_reference.h"
#include "daemon_process.h"
#include "test_values.h"
#include "fuyou/client.h"

namespace fuyou::testing {
namespace {

std::vector<float> Abs(std::vector<float> values) {
  for (float& x : values) x = std::abs(x);
  return values;
}

class StateTransferTest : public ::testing::Test {
 protected:
  void SetUp() override {
    daemon_ = std::make_unique<DaemonProcess>(dir_.path(), std::vector<std::string>{"--dram-budget", "64MiB"});
    absl::Status started = daemon_->Start();
    ASSERT_TRUE(started.ok()) << Text(started);
  }
  std::unique_ptr<Session> Open(const std::string& job, uint64_t slot_bytes) {
    auto session = Session::Open({.job = job, .num_slots = 2, .slot_bytes = slot_bytes}, daemon_->client_options());
    EXPECT_TRUE(session.ok()) << Text(session.status());
    return session.ok() ? std::move(*session) : nullptr;
  }
  std::vector<float> Read(Session& session, uint32_t chunk_id, StateKind which, size_t n, int64_t* t = nullptr) {
    std::vector<float> out(n);
    auto count = session.ReadState(chunk_id, which, 0, out);
    EXPECT_TRUE(count.ok()) << Text(count.status());
    if (t != nullptr && count.ok()) *t = *count;
    return out;
  }

  TempDir dir_;
  std::unique_ptr<DaemonProcess> daemon_;
};

// A bf16 chunk: slots hold n * 2 bytes, so its fp32 states move in two pieces.
constexpr size_t kN = 10'001;
const ChunkSpec kSpec{.chunk_id = 7, .num_elements = kN, .param_dtype = DType::kBFloat16,
                      .grad_dtype = DType::kBFloat16};

TEST_F(StateTransferTest, WrittenStatesReadBackAfterCommitAndResume) {
  const std::vector<float> master = Values(1, kN), m = Values(2, kN, 0.01f), v = Abs(Values(3, kN, 1e-4f));
  {
    auto session = Open("import", kSpec.param_bytes());
    ASSERT_NE(session, nullptr);
    std::vector<std::byte> weights = Encode(Values(9, kN), kSpec.param_dtype);
    ASSERT_TRUE(session->RegisterChunk(kSpec, weights).ok());
    ASSERT_TRUE(session->WriteState(7, StateKind::kMaster, 0, master).ok());
    ASSERT_TRUE(session->WriteState(7, StateKind::kExpAvg, 0, m).ok());
    // In two calls, the second at an offset.
    ASSERT_TRUE(session->WriteState(7, StateKind::kExpAvgSq, 0, std::span(v).first(100)).ok());
    ASSERT_TRUE(session->WriteState(7, StateKind::kExpAvgSq, 100, std::span(v).subspan(100)).ok());
    ASSERT_TRUE(session->SetUpdateCount(7, 12).ok());
    // Not committed yet: the committed states are not readable as imported ones.
    std::vector<float> one(1);
    EXPECT_TRUE(absl::IsFailedPrecondition(session->ReadState(7, StateKind::kMaster, 0, one).status()));
    // Nor can a step start.
    AdamWHyper hyper;
    auto refused = session->PushGradients(7, 1, hyper, Encode(Values(4, kN), kSpec.grad_dtype));
    if (refused.ok()) {
      std::vector<std::byte> out(kSpec.param_bytes());
      EXPECT_TRUE(absl::IsFailedPrecondition(session->PullParams(7, out)));
    }
    auto committed = session->CommitImport();
    ASSERT_TRUE(committed.ok()) << Text(committed.status());
    EXPECT_EQ(*committed, 1u);
    EXPECT_EQ(session->committed_step(), 0);
    int64_t t = 0;
    EXPECT_EQ(Read(*session, 7, StateKind::kMaster, kN, &t), master);
    EXPECT_EQ(t, 12);
    EXPECT_EQ(Read(*session, 7, StateKind::kExpAvg, kN), m);
    EXPECT_EQ(Read(*session, 7, StateKind::kExpAvgSq, kN), v);
    ASSERT_TRUE(session->Close().ok());
  }
  // Durable: a new session on the job (a restart of the daemon would read the same manifest).
  auto session = Open("import", kSpec.param_bytes());
  ASSERT_NE(session, nullptr);
  std::vector<std::byte> weights(kSpec.param_bytes());
  auto registered = session->RegisterChunk(kSpec, weights);
  ASSERT_TRUE(registered.ok());
  EXPECT_TRUE(registered->resumed);
  EXPECT_EQ(registered->update_count, 12);
  EXPECT_EQ(Decode(weights, kSpec.param_dtype), Decode(Encode(master, kSpec.param_dtype), kSpec.param_dtype));
  int64_t t = 0;
  EXPECT_EQ(Read(*session, 7, StateKind::kExpAvgSq, kN, &t), v);
  EXPECT_EQ(t, 12);

  // An import the session ends without committing is dropped.
  ASSERT_TRUE(session->WriteState(7, StateKind::kExpAvg, 0, v).ok());
  ASSERT_TRUE(session->SetUpdateCount(7, 99).ok());
  ASSERT_TRUE(session->Close().ok());
  session = Open("import", kSpec.param_bytes());
  ASSERT_NE(session, nullptr);
  registered = session->RegisterChunk(kSpec, weights);
  ASSERT_TRUE(registered.ok());
  EXPECT_EQ(registered->update_count, 12);
  EXPECT_EQ(Read(*session, 7, StateKind::kExpAvg, kN), m);
}

// A job rebuilt from other jobs' states (a data-parallel reshard) goes on from
// their step: CommitImport's resume_step sets a new job's committed step, with
// or without states pending, durably; a job that committed a step refuses it.
TEST_F(StateTransferTest, ResumeStepSetsANewJobsStepAndIsRefusedOnceItTrained) {
  const std::vector<float> master = Values(1, kN);
  std::vector<std::byte> weights = Encode(Values(9, kN), kSpec.param_dtype);
  {
    auto session = Open("rebuilt", kSpec.param_bytes());
    ASSERT_NE(session, nullptr);
    ASSERT_TRUE(session->RegisterChunk(kSpec, weights).ok());
    ASSERT_TRUE(session->WriteState(7, StateKind::kMaster, 0, master).ok());
    auto hostile = session->CommitImport(-1);
    EXPECT_TRUE(absl::IsInvalidArgument(hostile.status())) << hostile.status();
    EXPECT_NE(Text(hostile.status()).find("resume_step -1"), std::string::npos) << hostile.status();
    hostile = session->CommitImport(int64_t{1} << 60);
    EXPECT_TRUE(absl::IsInvalidArgument(hostile.status())) << hostile.status();
    auto committed = session->CommitImport(7);  // the refusals left the import pending
    ASSERT_TRUE(committed.ok()) << Text(committed.status());
    EXPECT_EQ(*committed, 1u);
    EXPECT_EQ(session->committed_step(), 7);
    EXPECT_EQ(Read(*session, 7, StateKind::kMaster, kN), master);
    // Set once: now the job has a step, and a second one is refused.
    auto again = session->CommitImport(9);
    EXPECT_TRUE(absl::IsFailedPrecondition(again.status())) << again.status();
    EXPECT_NE(Text(again.status()).find("committed step 7"), std::string::npos) << again.status();
    // The next step is 8.
    AdamWHyper hyper;
    ASSERT_TRUE(session->PushGradients(7, 8, hyper, Encode(Values(4, kN), kSpec.grad_dtype)).ok());
    ASSERT_TRUE(session->PullParams(7, weights).ok());
    auto ended = session->EndStep(8);
    ASSERT_TRUE(ended.ok()) << Text(ended.status());
    ASSERT_TRUE(session->Close().ok());
  }
  auto resumed = Open("rebuilt", kSpec.param_bytes());
  ASSERT_NE(resumed, nullptr);
  EXPECT_EQ(resumed->committed_step(), 8);
  // With nothing else pending, on a job that has chunks but no step yet.
  auto empty = Open("empty", kSpec.param_bytes());
  ASSERT_NE(empty, nullptr);
  ASSERT_TRUE(empty->RegisterChunk(kSpec, weights).ok());
  auto set = empty->CommitImport(3);
  ASSERT_TRUE(set.ok()) << Text(set.status());
  EXPECT_EQ(*set, 0u);
  EXPECT_EQ(empty->committed_step(), 3);
  ASSERT_TRUE(empty->Close().ok());
  empty = Open("empty", kSpec.param_bytes());
  ASSERT_NE(empty, nullptr);
  EXPECT_EQ(empty->committed_step(), 3);
}

TEST_F(StateTransferTest, AdamStatesMatchReferenceAndTrainingContinuesFromImport) {
  const ChunkSpec spec{.chunk_id = 3, .num_elements = 4099};
  const size_t n = spec.num_elements;
  ReferenceChunk reference(Values(5, n));
  auto session = Open("export", spec.param_bytes());
  ASSERT_NE(session, nullptr);
  std::vector<std::byte> weights = Encode(reference.master, DType::kFloat32);
  ASSERT_TRUE(session->RegisterChunk(spec, weights).ok());
  AdamWHyper hyper;
  hyper.lr = 1e-3f;
  hyper.weight_decay = 0.01f;
  auto train = [&](Session& s, ReferenceChunk& ref, int64_t first, int64_t last) {
    for (int64_t step = first; step <= last; ++step) {
      const std::vector<float> grad = Values(100 + step, n, 0.1f);
      ASSERT_TRUE(s.PushGradients(spec.chunk_id, step, hyper, Encode(grad, DType::kFloat32)).ok());
      ASSERT_TRUE(s.PullParams(spec.chunk_id, weights).ok());
      ref.Step(grad, hyper);
      auto ended = s.EndStep(step);
      ASSERT_TRUE(ended.ok()) << Text(ended.status());
    }
  };
  // The kernel may fuse or reorder (m is a sum with cancellation): errors are
  // measured against the size of the state's values, not each element's.
  auto expect_close = [](const std::vector<float>& got, const std::vector<float>& want, const char* what) {
    ASSERT_EQ(got.size(), want.size());
    double scale = 0;
    for (float x : want) scale = std::max(scale, double{std::abs(x)});
    for (size_t i = 0; i < got.size(); ++i) {
      ASSERT_NEAR(got[i], want[i], 1e-6 * scale) << what << " element " << i;
    }
  };
  train(*session, reference, 1, 5);
  int64_t t = 0;
  expect_close(Read(*session, 3, StateKind::kExpAvg, n, &t), reference.m, "exp_avg");
  expect_close(Read(*session, 3, StateKind::kExpAvgSq, n), reference.v, "exp_avg_sq");
  expect_close(Read(*session, 3, StateKind::kMaster, n), reference.master, "master");
  EXPECT_EQ(t, 5);

  // Between EndStep-less updates the states are not readable or writable.
  const std::vector<float> grad = Values(999, n, 0.1f);
  ASSERT_TRUE(session->PushGradients(3, 6, hyper, Encode(grad, DType::kFloat32)).ok());
  ASSERT_TRUE(session->PullParams(3, weights).ok());
  std::vector<float> some(10);
  auto during = session->ReadState(3, StateKind::kExpAvg, 0, some);
  EXPECT_TRUE(absl::IsFailedPrecondition(during.status())) << during.status();
  EXPECT_TRUE(absl::IsFailedPrecondition(session->WriteState(3, StateKind::kExpAvg, 0, some)));
  ASSERT_TRUE(session->AbortStep(6).ok());
  // Bad ranges name the chunk and the range.
  auto outside = session->ReadState(3, StateKind::kMaster, n - 5, some);
  EXPECT_TRUE(absl::IsInvalidArgument(outside.status()));
  EXPECT_NE(Text(outside.status()).find("chunk 3"), std::string::npos) << outside.status();
  EXPECT_TRUE(absl::IsInvalidArgument(session->ReadState(8, StateKind::kMaster, 0, some).status()));
  ASSERT_TRUE(session->Close().ok());

  // A new job imported from the reference's states continues exactly as the reference.
  auto imported = Open("imported", spec.param_bytes());
  ASSERT_NE(imported, nullptr);
  weights = Encode(reference.master, DType::kFloat32);
  ASSERT_TRUE(imported->RegisterChunk(spec, weights).ok());
  ASSERT_TRUE(imported->WriteState(3, StateKind::kExpAvg, 0, reference.m).ok());
  ASSERT_TRUE(imported->WriteState(3, StateKind::kExpAvgSq, 0, reference.v).ok());
  ASSERT_TRUE(imported->SetUpdateCount(3, reference.t).ok());
  ASSERT_TRUE(imported->CommitImport().ok());
  train(*imported, reference, 1, 3);
  expect_close(Decode(weights, DType::kFloat32), reference.master, "weights after import");
}

}  // namespace
}  // namespace fuyou::testing
