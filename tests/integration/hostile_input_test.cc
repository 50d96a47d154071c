// Hostile input against a real fuyoud (issue 8, items 1, 2, 7, 9 and 11): the
// exact requests an attacker sent with raw gRPC, each refused with a clear status,
// after which the daemon is alive, serves a normal session, and the job's
// committed state is intact.
//
// Sessions that need a mapped segment are opened through clientlib
// (Session::Open) and the hostile request then goes through a raw stub with the
// session's id; requests that need no segment go through the raw stub alone.
#include <gtest/gtest.h>

#include <cstdint>
#include <limits>
#include <string>
#include <vector>

#include "daemon_process.h"
#include "fuyou/client.h"
#include "fuyou/v1/offload.grpc.pb.h"
#include "grpcpp/grpcpp.h"
#include "test_values.h"

namespace fuyou::testing {
namespace {

constexpr uint64_t kMax = std::numeric_limits<uint64_t>::max();

class HostileInputTest : public ::testing::Test {
 protected:
  void SetUp() override {
    daemon_ = std::make_unique<DaemonProcess>(dir_.path(), std::vector<std::string>{"--dram-budget", "64MiB"});
    absl::Status started = daemon_->Start();
    ASSERT_TRUE(started.ok()) << Text(started);
    stub_ = v1::Offload::NewStub(
        grpc::CreateChannel(daemon_->client_options().address, grpc::InsecureChannelCredentials()));
  }

  std::unique_ptr<Session> Open(const std::string& job, uint64_t slot_bytes = 4096 * 4, uint32_t slots = 2) {
    auto session = Session::Open({.job = job, .num_slots = slots, .slot_bytes = slot_bytes}, daemon_->client_options());
    EXPECT_TRUE(session.ok()) << Text(session.status());
    return session.ok() ? std::move(*session) : nullptr;
  }

  grpc::Status RawOpen(const std::string& job, uint32_t num_slots, uint64_t slot_bytes,
                       v1::OpenSessionResponse* response) {
    grpc::ClientContext context;
    v1::OpenSessionRequest request;
    request.set_job(job);
    request.set_num_slots(num_slots);
    request.set_slot_bytes(slot_bytes);
    return stub_->OpenSession(&context, request, response);
  }

  grpc::Status RawRegister(const std::string& session_id, uint32_t chunk_id, uint64_t num_elements,
                           v1::DType param_dtype = v1::DTYPE_FLOAT32, uint32_t slot = 0) {
    grpc::ClientContext context;
    v1::RegisterChunksRequest request;
    request.set_session_id(session_id);
    v1::ChunkSpec* spec = request.add_chunks();
    spec->set_chunk_id(chunk_id);
    spec->set_num_elements(num_elements);
    spec->set_param_dtype(param_dtype);
    spec->set_grad_dtype(v1::DTYPE_FLOAT32);
    spec->set_slot(slot);
    v1::RegisterChunksResponse response;
    return stub_->RegisterChunks(&context, request, &response);
  }

  // Trains one chunk of `n` elements for one step on a fresh job: the daemon is
  // alive and does its work correctly for a well-behaved client.
  void ExpectDaemonServes(const std::string& job) {
    SCOPED_TRACE("a normal session after the hostile requests");
    auto session = Open(job, 1000 * 4);
    ASSERT_NE(session, nullptr);
    std::vector<float> weights(1000, 0.5f);
    auto registered = session->RegisterChunk({.chunk_id = 1, .num_elements = 1000},
                                             std::as_writable_bytes(std::span(weights)));
    ASSERT_TRUE(registered.ok()) << Text(registered.status());
    std::vector<float> grads(1000, 1.0f);
    AdamWHyper hyper;
    hyper.weight_decay = 0;
    const int64_t step = session->committed_step() + 1;
    ASSERT_TRUE(session->PushGradients(1, step, hyper, std::as_bytes(std::span(grads))).ok());
    absl::Status pulled = session->PullParams(1, std::as_writable_bytes(std::span(weights)));
    ASSERT_TRUE(pulled.ok()) << Text(pulled);
    auto committed = session->EndStep(step);
    ASSERT_TRUE(committed.ok()) << Text(committed.status());
    // Adam's first step moves each weight by lr against the gradient's sign.
    EXPECT_NEAR(weights[0], 0.5f - hyper.lr, 1e-6);
    EXPECT_TRUE(session->Close().ok());
  }

  TempDir dir_;
  std::unique_ptr<DaemonProcess> daemon_;
  std::unique_ptr<v1::Offload::Stub> stub_;
};

void ExpectRefused(const grpc::Status& status, grpc::StatusCode code, const std::string& words) {
  EXPECT_EQ(status.error_code(), code) << status.error_message();
  EXPECT_NE(status.error_message().find(words), std::string::npos)
      << "message '" << status.error_message() << "' lacks '" << words << "'";
}

void ExpectRefused(const absl::Status& status, absl::StatusCode code, const std::string& words) {
  EXPECT_EQ(status.code(), code) << Text(status);
  EXPECT_NE(Text(status).find(words), std::string::npos) << "message '" << Text(status) << "' lacks '" << words << "'";
}

// Item 1: slot sizes whose segment size wrapped to 4 KiB were accepted, and the
// next RegisterChunks crashed the daemon.
TEST_F(HostileInputTest, SegmentSizesThatWrapAreRefused) {
  struct Request {
    uint32_t num_slots;
    uint64_t slot_bytes;
  };
  for (const Request& r : {Request{1, uint64_t{1} << 63}, Request{4, uint64_t{1} << 62},
                           Request{64, uint64_t{1} << 57}, Request{1, kMax - 4094}, Request{1, kMax},
                           Request{2, kMax / 2}}) {
    SCOPED_TRACE(::testing::Message() << r.num_slots << " slots of " << r.slot_bytes << " bytes");
    v1::OpenSessionResponse response;
    grpc::Status opened = RawOpen("wrap", r.num_slots, r.slot_bytes, &response);
    ExpectRefused(opened, grpc::StatusCode::INVALID_ARGUMENT, "max_segment_bytes");
    EXPECT_NE(opened.error_message().find(std::to_string(r.slot_bytes)), std::string::npos) << opened.error_message();
    if (opened.ok()) {
      // What the old daemon did next: a chunk registered on the 4 KiB segment.
      (void)RawRegister(response.session_id(), 1, 1000);
      grpc::ClientContext context;
      v1::CloseSessionRequest close;
      close.set_session_id(response.session_id());
      v1::CloseSessionResponse closed;
      (void)stub_->CloseSession(&context, close, &closed);
    }
  }
  ExpectDaemonServes("after-wrap");
}

// Item 2: element counts whose byte sizes wrapped were accepted and written to
// the manifest; the first GradReady then wrote past a 4 KiB buffer.
TEST_F(HostileInputTest, ChunkSizesThatWrapAreRefusedAndNothingIsWritten) {
  auto session = Open("victim");
  ASSERT_NE(session, nullptr);
  std::vector<float> weights(100, 0.25f);
  ASSERT_TRUE(session->RegisterChunk({.chunk_id = 1, .num_elements = 100}, std::as_writable_bytes(std::span(weights)))
                  .ok());
  const std::string id = session->session_id();
  struct Bad {
    uint64_t num_elements;
    v1::DType dtype;
  };
  for (const Bad& bad : {Bad{(uint64_t{1} << 62) + 1, v1::DTYPE_FLOAT32}, Bad{uint64_t{1} << 63, v1::DTYPE_BFLOAT16},
                         Bad{kMax, v1::DTYPE_FLOAT32}, Bad{(uint64_t{1} << 62) + 1, v1::DTYPE_FLOAT16},
                         Bad{4096 * 4 / 4 + 1, v1::DTYPE_FLOAT32}}) {
    SCOPED_TRACE(::testing::Message() << bad.num_elements << " elements of dtype " << bad.dtype);
    ExpectRefused(RawRegister(id, 2, bad.num_elements, bad.dtype, 1), grpc::StatusCode::INVALID_ARGUMENT,
                  "bytes per slot region");
  }
  // The session goes on: its chunk trains.
  std::vector<float> grads(100, 1.0f);
  AdamWHyper hyper;
  ASSERT_TRUE(session->PushGradients(1, 1, hyper, std::as_bytes(std::span(grads))).ok());
  ASSERT_TRUE(session->PullParams(1, std::as_writable_bytes(std::span(weights))).ok());
  ASSERT_TRUE(session->EndStep(1).ok());
  const std::vector<float> trained = weights;
  ASSERT_TRUE(session->Close().ok());

  // Nothing of the refused chunks reached the manifest: the job reopens with its
  // one chunk at step 1, and its weights are those of step 1.
  auto again = Open("victim");
  ASSERT_NE(again, nullptr);
  EXPECT_EQ(again->committed_step(), 1);
  std::vector<float> resumed(100, 0.0f);
  auto result = again->RegisterChunk({.chunk_id = 1, .num_elements = 100}, std::as_writable_bytes(std::span(resumed)));
  ASSERT_TRUE(result.ok()) << Text(result.status());
  EXPECT_TRUE(result->resumed);
  EXPECT_EQ(resumed, trained);
  ExpectRefused(RawRegister(again->session_id(), 2, (uint64_t{1} << 62) + 1, v1::DTYPE_FLOAT32, 1),
                grpc::StatusCode::INVALID_ARGUMENT, "bytes per slot region");
  ASSERT_TRUE(again->Close().ok());
  ExpectDaemonServes("after-chunks");
}

// Item 7: a model with the same element count per chunk but another layout
// (Linear(8,8) then Linear(6,12, bias=False)) is refused; the original resumes.
TEST_F(HostileInputTest, ResumeWithAnotherLayoutFingerprintIsRefused) {
  constexpr uint64_t kLinear8x8 = 0x1111222233334444;
  constexpr uint64_t kLinear6x12 = 0x5555666677778888;
  std::vector<float> weights(72, 0.5f);
  auto bytes = [](std::vector<float>& w) { return std::as_writable_bytes(std::span(w)); };
  {
    auto session = Open("layout");
    ASSERT_NE(session, nullptr);
    ASSERT_TRUE(
        session->RegisterChunk({.chunk_id = 0, .num_elements = 72, .layout_fingerprint = kLinear8x8}, bytes(weights))
            .ok());
    ASSERT_TRUE(session->Close().ok());
  }
  {
    auto session = Open("layout");
    ASSERT_NE(session, nullptr);
    std::vector<float> other(72, 9.0f);
    auto refused =
        session->RegisterChunk({.chunk_id = 0, .num_elements = 72, .layout_fingerprint = kLinear6x12}, bytes(other));
    ExpectRefused(refused.status(), absl::StatusCode::kFailedPrecondition,
                  "use a new job name or the model the job was created with");
    EXPECT_NE(Text(refused.status()).find("0x1111222233334444"), std::string::npos) << Text(refused.status());
    EXPECT_EQ(other, std::vector<float>(72, 9.0f));  // no weights were handed out
    // A client that sends no fingerprint cannot resume a chunk that has one.
    ExpectRefused(session->RegisterChunk({.chunk_id = 0, .num_elements = 72}, bytes(other)).status(),
                  absl::StatusCode::kFailedPrecondition, "sends no layout fingerprint");
    ASSERT_TRUE(session->Close().ok());
  }
  {
    auto session = Open("layout");
    ASSERT_NE(session, nullptr);
    std::vector<float> resumed(72, 0.0f);
    auto result =
        session->RegisterChunk({.chunk_id = 0, .num_elements = 72, .layout_fingerprint = kLinear8x8}, bytes(resumed));
    ASSERT_TRUE(result.ok()) << Text(result.status());
    EXPECT_TRUE(result->resumed);
    EXPECT_EQ(resumed, weights);
    ASSERT_TRUE(session->Close().ok());
  }
}

// A chunk created without a fingerprint (before this change) adopts the first
// one a resume sends, and is held to it from then on.
TEST_F(HostileInputTest, ChunkWithoutFingerprintAdoptsTheFirstOneSent) {
  std::vector<float> weights(64, 0.5f);
  auto bytes = [](std::vector<float>& w) { return std::as_writable_bytes(std::span(w)); };
  for (uint64_t fingerprint : {uint64_t{0}, uint64_t{0}, uint64_t{7}, uint64_t{7}}) {
    auto session = Open("legacy");
    ASSERT_NE(session, nullptr);
    auto result =
        session->RegisterChunk({.chunk_id = 3, .num_elements = 64, .layout_fingerprint = fingerprint}, bytes(weights));
    ASSERT_TRUE(result.ok()) << fingerprint << ": " << Text(result.status());
    ASSERT_TRUE(session->Close().ok());
  }
  auto session = Open("legacy");
  ASSERT_NE(session, nullptr);
  ExpectRefused(
      session->RegisterChunk({.chunk_id = 3, .num_elements = 64, .layout_fingerprint = 8}, bytes(weights)).status(),
      absl::StatusCode::kFailedPrecondition, "fingerprint");
}

// Item 11: SetUpdateCount(INT64_MAX) was accepted and the next step overflowed t.
TEST_F(HostileInputTest, UpdateCountsAreBounded) {
  constexpr int64_t kMaxCount = int64_t{1} << 53;
  auto session = Open("counts");
  ASSERT_NE(session, nullptr);
  std::vector<float> weights(100, 0.5f);
  ASSERT_TRUE(session->RegisterChunk({.chunk_id = 1, .num_elements = 100}, std::as_writable_bytes(std::span(weights)))
                  .ok());
  for (int64_t count : {std::numeric_limits<int64_t>::max(), kMaxCount + 1, int64_t{-1}}) {
    ExpectRefused(session->SetUpdateCount(1, count), absl::StatusCode::kInvalidArgument, "outside 0..");
  }
  // The maximum itself is accepted; a chunk at it takes no further update, and
  // the refusal leaves it where it was.
  ASSERT_TRUE(session->SetUpdateCount(1, kMaxCount).ok());
  ASSERT_TRUE(session->CommitImport().ok());
  std::vector<float> grads(100, 1.0f);
  AdamWHyper hyper;
  ASSERT_TRUE(session->PushGradients(1, 1, hyper, std::as_bytes(std::span(grads))).ok());
  ExpectRefused(session->PullParams(1, std::as_writable_bytes(std::span(weights))),
                absl::StatusCode::kFailedPrecondition, "no further update");
  ASSERT_TRUE(session->AbortStep(1).ok());
  std::vector<float> master(100);
  auto count = session->ReadState(1, StateKind::kMaster, 0, master);
  ASSERT_TRUE(count.ok()) << Text(count.status());
  EXPECT_EQ(*count, kMaxCount);
  EXPECT_EQ(master, std::vector<float>(100, 0.5f));
  ASSERT_TRUE(session->Close().ok());
  ExpectDaemonServes("after-counts");
}

// Item 9: a 10 kB job name or session id does not come back whole in the error,
// and bytes that would drive a terminal come back escaped.
TEST_F(HostileInputTest, ErrorTextsDoNotEchoUnboundedInput) {
  const std::string long_name = std::string(10000, 'j') + "\x1b[2J";
  v1::OpenSessionResponse response;
  grpc::Status opened = RawOpen(long_name, 2, 4096, &response);
  ExpectRefused(opened, grpc::StatusCode::INVALID_ARGUMENT, "(10004 bytes)");
  EXPECT_LT(opened.error_message().size(), 400u) << opened.error_message();
  opened = RawOpen("evil\x1b]0;owned\x07", 2, 4096, &response);
  ExpectRefused(opened, grpc::StatusCode::INVALID_ARGUMENT, "evil\\x1b]0;owned\\x07");
  EXPECT_EQ(opened.error_message().find('\x1b'), std::string::npos);

  const std::string long_id = "s-" + std::string(10000, 'i');
  grpc::Status registered = RawRegister(long_id, 1, 10);
  ExpectRefused(registered, grpc::StatusCode::NOT_FOUND, "(10002 bytes)");
  EXPECT_LT(registered.error_message().size(), 400u);
  {
    grpc::ClientContext context;
    v1::CloseSessionRequest request;
    request.set_session_id(long_id + "\x1b");
    v1::CloseSessionResponse closed;
    grpc::Status status = stub_->CloseSession(&context, request, &closed);
    ExpectRefused(status, grpc::StatusCode::NOT_FOUND, "(10003 bytes)");
    EXPECT_LT(status.error_message().size(), 400u);
  }
  ExpectDaemonServes("after-names");
}

// Issue 22: ChunkSpec.moments_dtype other than fp32 or bf16 is refused; a chunk
// with bf16 moments trains (Adam's first step moves each weight by lr, as with
// fp32 moments); a resume asking for other moments is refused, naming the
// job's; the same dtype resumes.
TEST_F(HostileInputTest, MomentsDTypeIsCheckedAndFixedAtCreation) {
  auto raw = Open("moments");
  ASSERT_NE(raw, nullptr);
  for (int bad : {static_cast<int>(v1::DTYPE_FLOAT16), 9, -1}) {
    SCOPED_TRACE(bad);
    grpc::ClientContext context;
    v1::RegisterChunksRequest request;
    request.set_session_id(raw->session_id());
    v1::ChunkSpec* spec = request.add_chunks();
    spec->set_chunk_id(1);
    spec->set_num_elements(100);
    spec->set_param_dtype(v1::DTYPE_FLOAT32);
    spec->set_grad_dtype(v1::DTYPE_FLOAT32);
    spec->set_moments_dtype(static_cast<v1::DType>(bad));
    v1::RegisterChunksResponse response;
    ExpectRefused(stub_->RegisterChunks(&context, request, &response), grpc::StatusCode::INVALID_ARGUMENT,
                  "moments_dtype");
  }
  ASSERT_TRUE(raw->Close().ok());

  auto session = Open("bf16-job", 1000 * 4);
  ASSERT_NE(session, nullptr);
  std::vector<float> weights(1000, 0.5f);
  const ChunkSpec bf16{.chunk_id = 1, .num_elements = 1000, .moments_dtype = DType::kBFloat16};
  ASSERT_TRUE(session->RegisterChunk(bf16, std::as_writable_bytes(std::span(weights))).ok());
  std::vector<float> grads(1000, 1.0f);
  AdamWHyper hyper;
  hyper.weight_decay = 0;
  ASSERT_TRUE(session->PushGradients(1, 1, hyper, std::as_bytes(std::span(grads))).ok());
  ASSERT_TRUE(session->PullParams(1, std::as_writable_bytes(std::span(weights))).ok());
  ASSERT_TRUE(session->EndStep(1).ok());
  EXPECT_NEAR(weights[0], 0.5f - hyper.lr, 1e-6);
  ASSERT_TRUE(session->Close().ok());

  auto fp32 = Open("bf16-job", 1000 * 4);
  ASSERT_NE(fp32, nullptr);
  auto refused = fp32->RegisterChunk({.chunk_id = 1, .num_elements = 1000}, std::as_writable_bytes(std::span(weights)));
  ExpectRefused(refused.status(), absl::StatusCode::kFailedPrecondition,
                "keeps its Adam moments (m, v) as bfloat16, but this registration asks for float32");
  ASSERT_TRUE(fp32->Close().ok());
  auto again = Open("bf16-job", 1000 * 4);
  ASSERT_NE(again, nullptr);
  std::vector<float> resumed(1000, 0.0f);
  auto result = again->RegisterChunk(bf16, std::as_writable_bytes(std::span(resumed)));
  ASSERT_TRUE(result.ok()) << Text(result.status());
  EXPECT_TRUE(result->resumed);
  EXPECT_EQ(resumed, weights);
  ASSERT_TRUE(again->Close().ok());
}

}  // namespace
}  // namespace fuyou::testing
