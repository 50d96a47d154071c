// The gradient journal (issue 19, streamed mode), daemon side, against a real
// fuyoud over the raw protocol (raw_session.h):
//   - KEEP, then REPLAY with [MUL c] (the slot's gradients overwritten with junk,
//     so they cannot be what is read) is bit for bit the update from c * g;
//   - KEEP, then ADD with a second pass in bf16 is the update from the bf16 sum
//     of the two (fp32 add, rounded to nearest even);
//   - ParamsReady carries the journal's per-segment sum of squares and max |x|;
//   - a journal ends with its step: after EndStep and after AbortStep a REPLAY
//     is refused (FAILED_PRECONDITION), the session goes on serving;
//   - hostile journal fields are refused with errors naming chunk and step;
//   - with a tiny DRAM budget the journals spill to <data>/journal, replay from
//     there exactly, a corrupted spill is DATA_LOSS, leftovers of an earlier
//     daemon are removed at start;
//   - GetStats counts journal bytes, spilled bytes, replays and their time.
// Expected states come from the daemon's own AdamW kernel on the expected
// gradients (see redo_integration_test.cc for why that is the right oracle).
#include <gtest/gtest.h>

#include <sys/stat.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "daemon_process.h"
#include "fmt/format.h"
#include "fuyou/admin_client.h"
#include "optimizer/adamw_kernel.h"
#include "raw_session.h"
#include "test_values.h"

namespace fuyou::testing {
namespace {
namespace fs = std::filesystem;

constexpr uint32_t kSlots = 3;

v1::AdamWHyper Hyper(float grad_scale = 1.0f) {
  v1::AdamWHyper hyper;
  hyper.set_lr(1e-2f);
  hyper.set_beta1(0.9f);
  hyper.set_beta2(0.999f);
  hyper.set_eps(1e-8f);
  hyper.set_weight_decay(0.1f);
  hyper.set_grad_scale(grad_scale);
  return hyper;
}

// The master weights after one AdamW update (t = 1) of `initial` from fp32 `grads`.
std::vector<float> UpdatedMaster(std::vector<float> master, const std::vector<float>& grads,
                                 const v1::AdamWHyper& hyper) {
  std::vector<float> m(master.size(), 0.0f), v(master.size(), 0.0f);
  optimizer::AdamWBuffers buffers;
  buffers.master = master.data();
  buffers.exp_avg = m.data();
  buffers.exp_avg_sq = v.data();
  buffers.grad = grads.data();
  buffers.grad_dtype = DType::kFloat32;
  buffers.n = master.size();
  optimizer::AdamWStepParams params;
  params.lr = hyper.lr();
  params.beta1 = hyper.beta1();
  params.beta2 = hyper.beta2();
  params.eps = hyper.eps();
  params.weight_decay = hyper.weight_decay();
  params.grad_scale = hyper.grad_scale() == 0 ? 1.0f : hyper.grad_scale();
  params.step = 1;
  optimizer::AdamWUpdateRange(optimizer::DetectIsa(), params, buffers, 0, master.size());
  return master;
}

bool BitEqual(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
}

// bf16 of an fp32, round to nearest even (finite values).
uint16_t ToBf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return static_cast<uint16_t>((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}
float FromBf16(uint16_t h) {
  const uint32_t u = uint32_t{h} << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

v1::GradReady WithJournal(v1::GradReady grad, v1::JournalUse use, std::vector<std::pair<v1::GradOp::Kind, float>> ops = {},
                          v1::RedoReason redo = v1::REDO_REASON_UNSPECIFIED) {
  grad.set_journal(use);
  grad.set_redo(redo);
  for (const auto& [kind, operand] : ops) {
    v1::GradOp* op = grad.add_grad_ops();
    op->set_kind(kind);
    op->set_operand(operand);
  }
  return grad;
}

std::string Describe(const v1::DaemonMessage& reply) { return reply.ShortDebugString(); }

class JournalTest : public ::testing::Test {
 protected:
  void StartDaemon(uint64_t slot_bytes, std::vector<std::string> extra = {}) {
    slot_bytes_ = slot_bytes;
    extra.insert(extra.end(), {"--dram-budget", "64MiB", "--threads", "2"});
    daemon_ = std::make_unique<DaemonProcess>(dir_.path(), extra);
    absl::Status started = daemon_->Start();
    ASSERT_TRUE(started.ok()) << Text(started);
  }

  std::unique_ptr<RawSession> Open(const std::string& job) {
    auto session = RawSession::Open(daemon_->client_options(), job, kSlots, slot_bytes_);
    EXPECT_TRUE(session.ok()) << Text(session.status());
    return session.ok() ? std::move(*session) : nullptr;
  }

  void Register(RawSession& session, const std::vector<v1::ChunkSpec>& specs,
                const std::vector<std::vector<float>>& weights) {
    for (size_t i = 0; i < specs.size(); ++i) {
      std::memcpy(session.ParamRegion(specs[i].slot()).data(), weights[i].data(), weights[i].size() * 4);
    }
    v1::RegisterChunksResponse response;
    grpc::Status status = session.Register(specs, &response);
    ASSERT_TRUE(status.ok()) << status.error_message();
  }

  v1::GetStatsResponse Stats() {
    auto admin = AdminClient::Connect(daemon_->client_options());
    EXPECT_TRUE(admin.ok());
    auto stats = (*admin)->GetStats();
    EXPECT_TRUE(stats.ok()) << Text(stats.status());
    return stats.ok() ? *stats : v1::GetStatsResponse{};
  }

  static void Junk(RawSession& session, uint32_t slot) {
    std::span<std::byte> region = session.GradRegion(slot);
    std::fill(region.begin(), region.end(), std::byte{0x7f});  // NaN-ish garbage if ever read
  }

  TempDir dir_;
  uint64_t slot_bytes_ = 0;
  std::unique_ptr<DaemonProcess> daemon_;
};

TEST_F(JournalTest, KeepThenReplayWithMulIsTheUpdateFromTheScaledGradients) {
  StartDaemon(4096 * 4);
  constexpr size_t kN = 3000;
  auto session = Open("replay");
  ASSERT_NE(session, nullptr);
  const std::vector<float> w = Values(1, kN);
  Register(*session, {ChunkSpecOf(0, kN, 0, {1000, 2000})}, {w});
  const std::vector<float> g = Values(2, kN, 0.1f);

  v1::DaemonMessage reply = session->SendGrad(WithJournal(GradReadyOf(1, 0, 0, Hyper()), v1::JOURNAL_USE_KEEP), g);
  ASSERT_TRUE(reply.has_params_ready()) << Describe(reply);
  EXPECT_TRUE(BitEqual(session->Weights(0, kN), UpdatedMaster(w, g, Hyper())));
  ASSERT_EQ(reply.params_ready().segment_sum_squares_size(), 2);

  // The loop clipped .grad in place (mul_ by c) and unscaled it (div_ by 4).
  const float c = 0.37f;
  Junk(*session, 0);
  v1::ClientMessage message;
  *message.mutable_grad_ready() =
      WithJournal(GradReadyOf(1, 0, 0, Hyper(0.5f)), v1::JOURNAL_USE_REPLAY,
                  {{v1::GradOp::KIND_MUL, c}, {v1::GradOp::KIND_DIV, 4.0f}}, v1::REDO_REASON_GRADIENTS_CHANGED);
  reply = session->Exchange(message);
  ASSERT_TRUE(reply.has_params_ready()) << Describe(reply);
  std::vector<float> scaled(kN);
  for (size_t i = 0; i < kN; ++i) scaled[i] = g[i] * c / 4.0f;
  EXPECT_TRUE(BitEqual(session->Weights(0, kN), UpdatedMaster(w, scaled, Hyper(0.5f))))
      << "a replay is the update from the committed states with ops(journal), grad_scale on top";
  // Stats of the journal after the ops, before grad_scale, per segment.
  const v1::ParamsReady& ready = reply.params_ready();
  ASSERT_EQ(ready.segment_sum_squares_size(), 2);
  ASSERT_EQ(ready.segment_max_abs_size(), 2);
  for (int s = 0; s < 2; ++s) {
    double sum = 0;
    float max_abs = 0;
    for (size_t i = s == 0 ? 0 : 1000; i < (s == 0 ? 1000u : kN); ++i) {
      sum += double{scaled[i]} * double{scaled[i]};
      max_abs = std::max(max_abs, std::fabs(scaled[i]));
    }
    EXPECT_DOUBLE_EQ(ready.segment_sum_squares(s), sum) << s;
    EXPECT_EQ(ready.segment_max_abs(s), max_abs) << s;
  }
  // The ops persist: a second replay without ops is the same update again.
  Junk(*session, 0);
  *message.mutable_grad_ready() = WithJournal(GradReadyOf(1, 0, 0, Hyper(0.5f)), v1::JOURNAL_USE_REPLAY, {},
                                              v1::REDO_REASON_CLIPPED);
  reply = session->Exchange(message);
  ASSERT_TRUE(reply.has_params_ready()) << Describe(reply);
  EXPECT_TRUE(BitEqual(session->Weights(0, kN), UpdatedMaster(w, scaled, Hyper(0.5f))));
  ASSERT_TRUE(session->EndStep(1).has_step_committed());

  const v1::GetStatsResponse stats = Stats();
  EXPECT_EQ(stats.journal_replays_total(), 2u);
  EXPECT_EQ(stats.journal_bytes_total(), 2u * kN * 4) << "KEEP and the replay with ops wrote it";
  EXPECT_GT(stats.journal_replay_seconds_total(), 0.0);
  EXPECT_EQ(stats.journal_spilled_bytes_total(), 0u);
}

TEST_F(JournalTest, KeepThenAddIsTheUpdateFromTheBf16SumOfBothPasses) {
  StartDaemon(4096 * 4);
  constexpr size_t kN = 2048;
  auto session = Open("add");
  ASSERT_NE(session, nullptr);
  const std::vector<float> w = Values(3, kN);
  v1::ChunkSpec spec = ChunkSpecOf(0, kN, 0);
  spec.set_grad_dtype(v1::DTYPE_BFLOAT16);
  Register(*session, {spec}, {w});
  std::vector<uint16_t> g1(kN), g2(kN);
  const std::vector<float> a = Values(4, kN, 1.0f), b = Values(5, kN, 0.01f);
  for (size_t i = 0; i < kN; ++i) {
    g1[i] = ToBf16(a[i]);
    g2[i] = ToBf16(b[i]);
  }
  auto send = [&](const std::vector<uint16_t>& grads, const v1::GradReady& grad) {
    std::memcpy(session->GradRegion(0).data(), grads.data(), kN * 2);
    v1::ClientMessage message;
    *message.mutable_grad_ready() = grad;
    return session->Exchange(message);
  };
  v1::DaemonMessage reply = send(g1, WithJournal(GradReadyOf(1, 0, 0, Hyper()), v1::JOURNAL_USE_KEEP));
  ASSERT_TRUE(reply.has_params_ready()) << Describe(reply);
  // A second backward pass accumulates; the loop also unscaled by 2 first.
  reply = send(g2, WithJournal(GradReadyOf(1, 0, 0, Hyper()), v1::JOURNAL_USE_ADD, {{v1::GradOp::KIND_DIV, 2.0f}},
                               v1::REDO_REASON_GRADIENTS_CHANGED));
  ASSERT_TRUE(reply.has_params_ready()) << Describe(reply);
  std::vector<float> sum(kN);
  size_t rounded = 0;
  for (size_t i = 0; i < kN; ++i) {
    const float halved = FromBf16(ToBf16(FromBf16(g1[i]) / 2.0f));
    const float exact = halved + FromBf16(g2[i]);
    sum[i] = FromBf16(ToBf16(exact));
    rounded += sum[i] != exact;
  }
  ASSERT_GT(rounded, kN / 4) << "the test's values must exercise bf16 rounding of the add";
  EXPECT_TRUE(BitEqual(session->Weights(0, kN), UpdatedMaster(w, sum, Hyper())));
  double squares = 0;
  for (float x : sum) squares += double{x} * double{x};
  ASSERT_EQ(reply.params_ready().segment_sum_squares_size(), 1);
  EXPECT_DOUBLE_EQ(reply.params_ready().segment_sum_squares(0), squares);
  ASSERT_TRUE(session->EndStep(1).has_step_committed());
}

TEST_F(JournalTest, AJournalEndsWithItsStepAndHostileFieldsAreRefused) {
  StartDaemon(4096 * 4);
  constexpr size_t kN = 1000;
  auto session = Open("lifetime");
  ASSERT_NE(session, nullptr);
  Register(*session, {ChunkSpecOf(0, kN, 0)}, {Values(6, kN)});
  const std::vector<float> g = Values(7, kN, 0.1f);
  auto expect_error = [&](const v1::GradReady& grad, absl::StatusCode code, const std::string& words) {
    v1::DaemonMessage reply = session->SendGrad(grad, g);
    ASSERT_TRUE(reply.has_error()) << Describe(reply);
    EXPECT_EQ(reply.error().code(), static_cast<int>(code)) << reply.error().message();
    EXPECT_NE(reply.error().message().find(words), std::string::npos) << reply.error().message();
    EXPECT_EQ(reply.error().chunk_id(), grad.chunk_id());
    EXPECT_EQ(reply.error().step(), grad.step());
  };
  const v1::RedoReason changed = v1::REDO_REASON_GRADIENTS_CHANGED;
  // Hostile fields, before anything was sent in the step.
  expect_error(WithJournal(GradReadyOf(1, 0, 0, Hyper()), static_cast<v1::JournalUse>(7)),
               absl::StatusCode::kInvalidArgument, "is not a JournalUse");
  expect_error(WithJournal(GradReadyOf(1, 0, 0, Hyper()), v1::JOURNAL_USE_KEEP, {{v1::GradOp::KIND_MUL, 2.0f}}),
               absl::StatusCode::kInvalidArgument, "allowed only with");
  ASSERT_TRUE(session->SendGrad(WithJournal(GradReadyOf(1, 0, 0, Hyper()), v1::JOURNAL_USE_KEEP), g).has_params_ready());
  expect_error(WithJournal(GradReadyOf(1, 0, 0, Hyper()), v1::JOURNAL_USE_REPLAY), absl::StatusCode::kInvalidArgument,
               "must be sent as a redo");
  std::vector<std::pair<v1::GradOp::Kind, float>> many(65, {v1::GradOp::KIND_MUL, 1.0f});
  expect_error(WithJournal(GradReadyOf(1, 0, 0, Hyper()), v1::JOURNAL_USE_REPLAY, many, changed),
               absl::StatusCode::kInvalidArgument, "65 grad_ops");
  expect_error(WithJournal(GradReadyOf(1, 0, 0, Hyper()), v1::JOURNAL_USE_ADD,
                           {{static_cast<v1::GradOp::Kind>(9), 1.0f}}, changed),
               absl::StatusCode::kInvalidArgument, "not KIND_MUL or KIND_DIV");
  // 64 ops are allowed.
  std::vector<std::pair<v1::GradOp::Kind, float>> most(64, {v1::GradOp::KIND_MUL, 1.0f});
  ASSERT_TRUE(session->SendGrad(WithJournal(GradReadyOf(1, 0, 0, Hyper()), v1::JOURNAL_USE_REPLAY, most, changed), g)
                  .has_params_ready());
  ASSERT_TRUE(session->EndStep(1).has_step_committed());

  // Step 2: the journal of step 1 is gone.
  ASSERT_TRUE(session->SendGrad(GradReadyOf(2, 0, 0, Hyper()), g).has_params_ready());
  expect_error(WithJournal(GradReadyOf(2, 0, 0, Hyper()), v1::JOURNAL_USE_REPLAY, {}, changed),
               absl::StatusCode::kFailedPrecondition, "has no gradient journal in step 2");
  // KEEP, then AbortStep: gone too.
  ASSERT_TRUE(session->SendGrad(WithJournal(GradReadyOf(2, 0, 0, Hyper()), v1::JOURNAL_USE_KEEP, {}, changed), g)
                  .has_params_ready());
  ASSERT_TRUE(session->AbortStep(2, v1::ABORT_REASON_SKIPPED_STEP).has_step_aborted());
  ASSERT_TRUE(session->SendGrad(GradReadyOf(2, 0, 0, Hyper()), g).has_params_ready());
  expect_error(WithJournal(GradReadyOf(2, 0, 0, Hyper()), v1::JOURNAL_USE_ADD, {}, changed),
               absl::StatusCode::kFailedPrecondition, "has no gradient journal");
  // A journal of a step that is not the session's: out of order.
  expect_error(WithJournal(GradReadyOf(5, 0, 0, Hyper()), v1::JOURNAL_USE_REPLAY, {}, changed),
               absl::StatusCode::kFailedPrecondition, "out of order");
  // The session still serves.
  ASSERT_TRUE(session->EndStep(2).has_step_committed());
}

TEST_F(JournalTest, BeyondTheDramBudgetJournalsSpillChecksummedAndReplayExactly) {
  // 64 MiB of DRAM: journals may hold at most 32 MiB; seven chunks of 6 MB of
  // fp32 gradients cannot all stay.
  constexpr size_t kN = 1536 * 1024;
  constexpr uint32_t kChunks = 7;
  StartDaemon(kN * 4);
  auto session = Open("spill");
  ASSERT_NE(session, nullptr);
  std::vector<std::vector<float>> w, g;
  for (uint32_t c = 0; c < kChunks; ++c) {
    w.push_back(Values(100 + c, kN));
    g.push_back(Values(200 + c, kN, 0.1f));
    Register(*session, {ChunkSpecOf(c, kN, c % kSlots)}, {w.back()});
  }
  for (uint32_t c = 0; c < kChunks; ++c) {
    v1::DaemonMessage reply =
        session->SendGrad(WithJournal(GradReadyOf(1, c, c % kSlots, Hyper()), v1::JOURNAL_USE_KEEP), g[c]);
    ASSERT_TRUE(reply.has_params_ready()) << Describe(reply);
  }
  v1::GetStatsResponse stats = Stats();
  EXPECT_GT(stats.journal_spilled_bytes_total(), 0u) << "nothing spilled: the test does not exercise the spill";
  EXPECT_EQ(stats.journal_bytes_total(), uint64_t{kChunks} * kN * 4);
  std::vector<fs::path> spills;
  for (const auto& entry : fs::recursive_directory_iterator(daemon_->data_dir())) {
    if (entry.path().extension() == ".spill") spills.push_back(entry.path());
  }
  ASSERT_EQ(spills.size(), 1u);
  EXPECT_EQ(spills[0].parent_path().filename(), "journal");
  // Replays, every chunk with [MUL 0.5], from DRAM or from the scratch file alike.
  for (uint32_t c = 0; c < kChunks; ++c) {
    Junk(*session, c % kSlots);
    v1::ClientMessage message;
    *message.mutable_grad_ready() = WithJournal(GradReadyOf(1, c, c % kSlots, Hyper()), v1::JOURNAL_USE_REPLAY,
                                                {{v1::GradOp::KIND_MUL, 0.5f}}, v1::REDO_REASON_CLIPPED);
    v1::DaemonMessage reply = session->Exchange(message);
    ASSERT_TRUE(reply.has_params_ready()) << c << ": " << Describe(reply);
    std::vector<float> half(kN);
    for (size_t i = 0; i < kN; ++i) half[i] = g[c][i] * 0.5f;
    EXPECT_TRUE(BitEqual(session->Weights(c % kSlots, kN), UpdatedMaster(w[c], half, Hyper()))) << "chunk " << c;
  }
  // A corrupted scratch file: the journal at its start no longer verifies.
  {
    std::fstream file(spills[0], std::ios::in | std::ios::out | std::ios::binary);
    ASSERT_TRUE(file.good());
    file.seekp(40);
    const char junk[4] = {'b', 'a', 'd', '!'};
    file.write(junk, 4);
  }
  int data_loss = 0;
  for (uint32_t c = 0; c < kChunks; ++c) {
    v1::ClientMessage message;
    *message.mutable_grad_ready() = WithJournal(GradReadyOf(1, c, c % kSlots, Hyper()), v1::JOURNAL_USE_REPLAY, {},
                                                v1::REDO_REASON_CLIPPED);
    v1::DaemonMessage reply = session->Exchange(message);
    if (reply.has_error()) {
      EXPECT_EQ(reply.error().code(), static_cast<int>(absl::StatusCode::kDataLoss)) << reply.error().message();
      EXPECT_NE(reply.error().message().find("checksum"), std::string::npos) << reply.error().message();
      EXPECT_EQ(reply.error().chunk_id(), c);
      ++data_loss;
    } else {
      ASSERT_TRUE(reply.has_params_ready()) << Describe(reply);
    }
  }
  EXPECT_EQ(data_loss, 1);
  stats = Stats();
  EXPECT_EQ(stats.journal_replays_total(), uint64_t{2} * kChunks - 1);
  // The step still commits (the refused replay changed nothing), and the
  // scratch space is given back at its end.
  ASSERT_TRUE(session->EndStep(1).has_step_committed());
  EXPECT_EQ(fs::file_size(spills[0]), 0u);
  ASSERT_TRUE(session->Close().ok());
  EXPECT_FALSE(fs::exists(spills[0])) << "a session's scratch file goes with it";

  // A restart removes what a dead daemon left.
  const fs::path leftover = spills[0].parent_path() / "s-dead.spill";
  { std::ofstream(leftover) << "left by a daemon that died mid-step"; }
  daemon_.reset();
  StartDaemon(kN * 4);
  EXPECT_FALSE(fs::exists(leftover));
}

// Bytes the jobs' states.bin files take on disk (what StorageBudget counts).
uint64_t StatesOnDisk(const fs::path& data_dir) {
  uint64_t bytes = 0;
  for (const auto& entry : fs::recursive_directory_iterator(data_dir)) {
    if (entry.path().filename() != "states.bin") continue;
    struct stat info {};
    if (::stat(entry.path().c_str(), &info) == 0) bytes += static_cast<uint64_t>(info.st_blocks) * 512;
  }
  return bytes;
}

TEST_F(JournalTest, ASpilledJournalIsAdmittedByThePerUserStorageLimit) {
  // As BeyondTheDramBudget...: seven chunks of 6 MiB of gradients, so some
  // journals must spill; the per-user storage limit leaves room for the jobs'
  // states and 4 MiB more, less than one spilled journal.
  constexpr size_t kN = 1536 * 1024;
  constexpr uint32_t kChunks = 7;
  auto register_all = [&](RawSession& session, std::vector<std::vector<float>>& w) {
    for (uint32_t c = 0; c < kChunks; ++c) {
      w.push_back(Values(100 + c, kN));
      Register(session, {ChunkSpecOf(c, kN, c % kSlots)}, {w.back()});
    }
  };
  uint64_t states = 0;
  {
    StartDaemon(kN * 4);  // no limit: what the states take
    auto session = Open("limited");
    ASSERT_NE(session, nullptr);
    std::vector<std::vector<float>> w;
    register_all(*session, w);
    ASSERT_TRUE(session->Close().ok());
    states = StatesOnDisk(daemon_->data_dir());
    ASSERT_GT(states, 0u);
    daemon_.reset();
  }
  const uint64_t limit = states + (4 << 20);
  StartDaemon(kN * 4, {"--max-storage-per-user", std::to_string(limit)});
  auto session = Open("limited");
  ASSERT_NE(session, nullptr);
  std::vector<std::vector<float>> w;
  register_all(*session, w);  // resumed: nothing more reserved
  int updated = 0;
  int refused = 0;
  std::vector<bool> was_updated(kChunks, false);
  for (uint32_t c = 0; c < kChunks; ++c) {
    v1::DaemonMessage reply = session->SendGrad(
        WithJournal(GradReadyOf(1, c, c % kSlots, Hyper()), v1::JOURNAL_USE_KEEP), Values(200 + c, kN, 0.1f));
    if (reply.has_params_ready()) {
      ++updated;
      was_updated[c] = true;
      continue;
    }
    ASSERT_TRUE(reply.has_error()) << Describe(reply);
    ++refused;
    EXPECT_EQ(reply.error().code(), static_cast<int>(absl::StatusCode::kResourceExhausted)) << Describe(reply);
    EXPECT_EQ(reply.error().chunk_id(), c);
    const std::vector<std::string> words = {"the gradient journal scratch of uid", "max_storage_bytes_per_user",
                                            fmt::format("({} bytes", limit), "--max-storage-per-user",
                                            "nothing of the step changed"};
    for (const std::string& word : words) {
      EXPECT_NE(reply.error().message().find(word), std::string::npos) << word << " in " << Describe(reply);
    }
  }
  EXPECT_GT(refused, 0) << "every journal was admitted: the limit does not bound the journal scratch";
  EXPECT_GT(updated, 0);
  v1::GetStatsResponse stats = Stats();
  EXPECT_EQ(stats.journal_spilled_bytes_total(), 0u);  // nothing of a refused journal was kept
  for (const auto& entry : fs::recursive_directory_iterator(daemon_->data_dir())) {
    if (entry.path().extension() == ".spill") EXPECT_EQ(fs::file_size(entry.path()), 0u) << entry.path();
  }
  // The session goes on: the step commits the updates it has, the refused
  // chunks keep their committed states.
  v1::DaemonMessage committed = session->EndStep(1);
  ASSERT_TRUE(committed.has_step_committed()) << Describe(committed);
  EXPECT_EQ(committed.step_committed().chunks_updated(), static_cast<uint32_t>(updated));
  for (uint32_t c = 0; c < kChunks; ++c) {
    auto master = session->ReadState(c, v1::STATE_MASTER, c % kSlots, kN);
    ASSERT_TRUE(master.ok()) << Text(master.status());
    EXPECT_EQ(BitEqual(*master, w[c]), !was_updated[c]) << "chunk " << c;
  }
  ASSERT_TRUE(session->Close().ok());
}

}  // namespace
}  // namespace fuyou::testing
