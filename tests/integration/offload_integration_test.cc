// Integration tests: a real fuyoud process on a temporary socket and data
// directory, driven through clientlib (and the raw protocol for malformed input).
#include <dirent.h>
#include <fcntl.h>
#include <fmt/format.h>
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/wait.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <fstream>
#include <random>
#include <thread>

#include "adamw_reference.h"
#include "daemon_process.h"
#include "test_values.h"
#include "fuyou/admin_client.h"
#include "fuyou/client.h"
#include "fuyou/v1/offload.grpc.pb.h"
#include "grpcpp/grpcpp.h"

namespace fuyou::testing {
namespace {
namespace fs = std::filesystem;
using std::chrono::milliseconds;

AdamWHyper HyperForStep(int64_t step) {
  AdamWHyper hyper;
  // A scheduler's decay. Adam moves a weight by about lr a step, so in 20 steps
  // no weight (all start at |w| >= 0.1) comes near zero: relative errors stay meaningful.
  hyper.lr = 1e-3f * (1.0f - static_cast<float>(step) / 40.0f);
  hyper.weight_decay = 0.01f;
  return hyper;
}

// One chunk as the test trains it: its spec, and the reference the daemon must match.
struct TrainedChunk {
  ChunkSpec spec;
  ReferenceChunk reference;
  std::vector<std::byte> weights;  // what the daemon returned last, in param_dtype

  TrainedChunk(ChunkSpec s, const std::vector<float>& initial)
      : spec(s),
        // The daemon starts from the weights as the wire carried them.
        reference(Decode(Encode(initial, s.param_dtype), s.param_dtype)),
        weights(Encode(initial, s.param_dtype)) {}

  std::vector<float> Gradients(int64_t step) const {
    // Decoded from the wire dtype, so the reference sees what the daemon sees.
    return Decode(Encode(Values(step * 1000 + spec.chunk_id, spec.num_elements, 0.1f), spec.grad_dtype),
                  spec.grad_dtype);
  }
};

// Max relative error of the returned weights against the reference; for 16-bit
// weights, against the reference rounded to that dtype, in units of its epsilon.
double MaxError(const TrainedChunk& chunk) {
  std::vector<float> got = Decode(chunk.weights, chunk.spec.param_dtype);
  double worst = 0;
  for (size_t i = 0; i < got.size(); ++i) {
    const float expected = chunk.reference.master[i];
    double error = std::abs(double{got[i]} - expected) / std::max(std::abs(double{expected}), 1e-3);
    worst = std::max(worst, error);
  }
  return worst;
}

double Tolerance(DType dtype) {
  switch (dtype) {
    case DType::kFloat32: return 1e-6;
    case DType::kBFloat16: return 1.0 / 128;  // one bf16 ulp (8 significant bits)
    default: return 1.0 / 1024;               // one fp16 ulp
  }
}

// Runs steps [first, last] of `chunks` on `session`, checking every step.
void TrainSteps(Session& session, std::vector<TrainedChunk>& chunks, int64_t first, int64_t last) {
  for (int64_t step = first; step <= last; ++step) {
    const AdamWHyper hyper = HyperForStep(step);
    // Backward order: every gradient handed over before any weight is waited for.
    for (auto it = chunks.rbegin(); it != chunks.rend(); ++it) {
      std::vector<std::byte> grads = Encode(it->Gradients(step), it->spec.grad_dtype);
      ASSERT_TRUE(session.PushGradients(it->spec.chunk_id, step, hyper, grads).ok());
      it->reference.Step(it->Gradients(step), hyper);
    }
    for (TrainedChunk& chunk : chunks) {
      absl::Status pulled = session.PullParams(chunk.spec.chunk_id, chunk.weights);
      ASSERT_TRUE(pulled.ok()) << Text(pulled);
      EXPECT_LE(MaxError(chunk), Tolerance(chunk.spec.param_dtype))
          << "step " << step << " chunk " << chunk.spec.chunk_id;
    }
    auto committed = session.EndStep(step);
    ASSERT_TRUE(committed.ok()) << Text(committed.status());
    EXPECT_EQ(committed->step, step);
    EXPECT_EQ(committed->chunks_updated, chunks.size());
  }
}

class OffloadIntegrationTest : public ::testing::Test {
 protected:
  void StartDaemon(std::vector<std::string> args = {"--dram-budget", "64MiB"}) {
    daemon_ = std::make_unique<DaemonProcess>(dir_.path(), std::move(args));
    absl::Status started = daemon_->Start();
    ASSERT_TRUE(started.ok()) << Text(started);
  }
  std::unique_ptr<Session> OpenSession(const std::string& job, uint64_t slot_bytes, uint32_t slots = 8) {
    auto session = Session::Open({.job = job, .num_slots = slots, .slot_bytes = slot_bytes}, daemon_->client_options());
    EXPECT_TRUE(session.ok()) << Text(session.status());
    return session.ok() ? std::move(*session) : nullptr;
  }
  v1::GetStatsResponse Stats() {
    auto admin = AdminClient::Connect(daemon_->client_options());
    EXPECT_TRUE(admin.ok());
    auto stats = (*admin)->GetStats();
    EXPECT_TRUE(stats.ok());
    return *stats;
  }

  TempDir dir_;
  std::unique_ptr<DaemonProcess> daemon_;
};

std::vector<TrainedChunk> MixedChunks() {
  std::vector<TrainedChunk> chunks;
  const std::vector<ChunkSpec> specs = {
      {.chunk_id = 0, .num_elements = 1},
      {.chunk_id = 1, .num_elements = 4097},
      {.chunk_id = 2, .num_elements = 300'001, .grad_dtype = DType::kBFloat16},
      {.chunk_id = 3, .num_elements = 100'003, .param_dtype = DType::kBFloat16, .grad_dtype = DType::kBFloat16},
      {.chunk_id = 4, .num_elements = 65'536, .param_dtype = DType::kFloat16, .grad_dtype = DType::kFloat16},
      {.chunk_id = 5, .num_elements = 2'500'000},
      {.chunk_id = 6, .num_elements = 2'500'000},
      {.chunk_id = 7, .num_elements = 1'500'000},
  };
  for (const ChunkSpec& spec : specs) chunks.emplace_back(spec, Values(spec.chunk_id, spec.num_elements));
  return chunks;
}

// Registers `chunks`; all must be new (or all resumed when `expect_resumed`).
void RegisterAll(Session& session, std::vector<TrainedChunk>& chunks, bool expect_resumed) {
  for (TrainedChunk& chunk : chunks) {
    auto result = session.RegisterChunk(chunk.spec, chunk.weights);
    ASSERT_TRUE(result.ok()) << Text(result.status());
    EXPECT_EQ(result->resumed, expect_resumed);
  }
}

TEST_F(OffloadIntegrationTest, TwentyStepsMatchAReferenceAdamW) {
  // 84 MB of states for a 64 MiB budget: the pipeline window plus a cache that
  // cannot hold everything, so states go through the SSD every step.
  StartDaemon();
  std::vector<TrainedChunk> chunks = MixedChunks();
  auto session = OpenSession("twenty-steps", 2'500'000 * 4);
  ASSERT_NE(session, nullptr);
  EXPECT_EQ(session->committed_step(), 0);
  RegisterAll(*session, chunks, false);
  TrainSteps(*session, chunks, 1, 20);
  double fp32_error = 0;
  uint64_t params = 0;
  for (const TrainedChunk& chunk : chunks) {
    params += chunk.spec.num_elements;
    if (chunk.spec.param_dtype == DType::kFloat32) fp32_error = std::max(fp32_error, MaxError(chunk));
  }
  ASSERT_TRUE(session->Close().ok());
  v1::GetStatsResponse stats = Stats();
  EXPECT_EQ(stats.chunk_updates(), 20 * chunks.size());
  EXPECT_EQ(stats.params_updated(), 20 * params);
  EXPECT_GT(stats.storage(0).bytes_written(), 20 * 12 * 4'000'000ull);
  EXPECT_GT(stats.storage(0).bytes_read(), 0u);
  EXPECT_GT(stats.cache_misses(), 0u);
  std::printf("[figures] 20 steps, %zu chunks, %llu params; max fp32 relative error %.3g; SSD read %.1f MiB, "
              "written %.1f MiB; cache hits %llu, misses %llu\n",
              chunks.size(), static_cast<unsigned long long>(params), fp32_error,
              stats.storage(0).bytes_read() / 1048576.0, stats.storage(0).bytes_written() / 1048576.0,
              static_cast<unsigned long long>(stats.cache_hits()), static_cast<unsigned long long>(stats.cache_misses()));
}

TEST_F(OffloadIntegrationTest, AJobResumesAfterADaemonRestart) {
  StartDaemon();
  std::vector<TrainedChunk> chunks = MixedChunks();
  chunks.erase(chunks.begin() + 4, chunks.end());
  {
    auto session = OpenSession("resume", 300'001 * 4);
    ASSERT_NE(session, nullptr);
    RegisterAll(*session, chunks, false);
    TrainSteps(*session, chunks, 1, 3);
    ASSERT_TRUE(session->Close().ok());
  }
  EXPECT_EQ(daemon_->Stop(), 0);  // SIGTERM: clean exit
  EXPECT_FALSE(fs::exists(daemon_->socket_path()));
  StartDaemon();
  auto session = OpenSession("resume", 300'001 * 4);
  ASSERT_NE(session, nullptr);
  EXPECT_EQ(session->committed_step(), 3);
  for (TrainedChunk& chunk : chunks) {
    std::fill(chunk.weights.begin(), chunk.weights.end(), std::byte{0});
  }
  RegisterAll(*session, chunks, true);  // current weights come back
  for (const TrainedChunk& chunk : chunks) EXPECT_LE(MaxError(chunk), Tolerance(chunk.spec.param_dtype));
  TrainSteps(*session, chunks, 4, 6);
}

TEST_F(OffloadIntegrationTest, StatesAreStripedOverEveryStoragePath) {
  // Two storage paths (two SSDs): every chunk's states are spread over both.
  const fs::path second_path = dir_.path() / "data2";
  StartDaemon({"--dram-budget", "64MiB", "--data-dir", second_path.string()});  // besides <dir>/data
  std::vector<TrainedChunk> chunks;
  chunks.emplace_back(ChunkSpec{.chunk_id = 0, .num_elements = 1'000'000}, Values(0, 1'000'000));
  auto session = OpenSession("striped", 1'000'000 * 4, 2);
  ASSERT_NE(session, nullptr);
  RegisterAll(*session, chunks, false);
  TrainSteps(*session, chunks, 1, 3);
  ASSERT_TRUE(session->Close().ok());
  v1::GetStatsResponse stats = Stats();
  ASSERT_EQ(stats.storage_size(), 2);
  const double first = stats.storage(0).bytes_written();
  const double second = stats.storage(1).bytes_written();
  std::printf("[figures] one 12 MB chunk, 4 writes: %.1f MiB to path 1, %.1f MiB to path 2\n", first / 1048576,
              second / 1048576);
  EXPECT_GT(second, 0.4 * (first + second));
  EXPECT_GT(first, 0.4 * (first + second));
}

// The raw protocol, for requests clientlib would never send.
class RawClient {
 public:
  explicit RawClient(const ClientOptions& options)
      : stub_(v1::Offload::NewStub(grpc::CreateChannel(options.address, grpc::InsecureChannelCredentials()))) {}
  grpc::Status Open(const std::string& job, v1::OpenSessionResponse* response) {
    grpc::ClientContext context;
    v1::OpenSessionRequest request;
    request.set_job(job);
    request.set_num_slots(2);
    request.set_slot_bytes(4096);
    grpc::Status status = stub_->OpenSession(&context, request, response);
    if (!status.ok()) return status;
    // As clientlib does: the session's segment before anything else.
    auto segment = HandOverNewSegment(*response);
    if (!segment.ok()) return grpc::Status(grpc::StatusCode::INTERNAL, std::string(segment.status().message()));
    segments_.push_back(std::move(*segment));
    return status;
  }
  grpc::Status Register(const std::string& session_id, uint32_t chunk_id, uint64_t n, int dtype) {
    grpc::ClientContext context;
    v1::RegisterChunksRequest request;
    request.set_session_id(session_id);
    v1::ChunkSpec* spec = request.add_chunks();
    spec->set_chunk_id(chunk_id);
    spec->set_num_elements(n);
    spec->set_param_dtype(static_cast<v1::DType>(dtype));
    spec->set_grad_dtype(v1::DTYPE_FLOAT32);
    v1::RegisterChunksResponse response;
    return stub_->RegisterChunks(&context, request, &response);
  }
  grpc::Status Close(const std::string& session_id) {
    grpc::ClientContext context;
    v1::CloseSessionRequest request;
    request.set_session_id(session_id);
    v1::CloseSessionResponse response;
    return stub_->CloseSession(&context, request, &response);
  }
  v1::Offload::Stub& stub() { return *stub_; }

 private:
  std::unique_ptr<v1::Offload::Stub> stub_;
  std::vector<std::unique_ptr<ClientSegment>> segments_;
};

void ExpectRefused(const absl::Status& status, absl::StatusCode code, const std::string& words) {
  EXPECT_EQ(status.code(), code) << Text(status);
  EXPECT_NE(Text(status).find(words), std::string::npos) << "message '" << Text(status) << "' lacks '" << words << "'";
}

void ExpectRefused(const grpc::Status& status, grpc::StatusCode code, const std::string& words) {
  EXPECT_EQ(status.error_code(), code) << status.error_message();
  EXPECT_NE(status.error_message().find(words), std::string::npos)
      << "message '" << status.error_message() << "' lacks '" << words << "'";
}

TEST_F(OffloadIntegrationTest, BadInputIsRefusedWhileAnotherSessionTrains) {
  StartDaemon();
  std::vector<TrainedChunk> good_chunks = MixedChunks();
  good_chunks.erase(good_chunks.begin() + 3, good_chunks.end());
  auto good = OpenSession("good", 300'001 * 4);
  ASSERT_NE(good, nullptr);
  RegisterAll(*good, good_chunks, false);
  TrainSteps(*good, good_chunks, 1, 2);

  auto bad = OpenSession("bad", 4096 * 4, 4);
  ASSERT_NE(bad, nullptr);
  std::vector<float> weights(1000, 0.5f);
  ASSERT_TRUE(bad->RegisterChunk({.chunk_id = 1, .num_elements = 1000}, std::as_writable_bytes(std::span(weights))).ok());
  AdamWHyper hyper;

  // Unknown chunk: sent raw through the zero-copy API, refused by the daemon.
  auto slot = bad->AcquireSlot(milliseconds(1000));
  ASSERT_TRUE(slot.ok());
  ASSERT_TRUE(bad->SendGradReady(999, *slot, 1, hyper).ok());
  ExpectRefused(bad->WaitParams(999, milliseconds(5000)).status(), absl::StatusCode::kInvalidArgument,
                "chunk 999 is not registered");
  // Step out of order.
  slot = bad->AcquireSlot(milliseconds(1000));
  ASSERT_TRUE(slot.ok());
  ASSERT_TRUE(bad->SendGradReady(1, *slot, 5, hyper).ok());
  ExpectRefused(bad->WaitParams(1, milliseconds(5000)).status(), absl::StatusCode::kFailedPrecondition,
                "step 5 is out of order");
  ExpectRefused(bad->EndStep(9).status(), absl::StatusCode::kFailedPrecondition, "out of order");
  // Hyper-parameters that make no sense.
  AdamWHyper nan_lr = hyper;
  nan_lr.lr = std::nanf("");
  slot = bad->AcquireSlot(milliseconds(1000));
  ASSERT_TRUE(slot.ok());
  ASSERT_TRUE(bad->SendGradReady(1, *slot, 1, nan_lr).ok());
  ExpectRefused(bad->WaitParams(1, milliseconds(5000)).status(), absl::StatusCode::kInvalidArgument, "lr");
  // A chunk sent twice in one step.
  std::vector<float> grads(1000, 0.1f);
  ASSERT_TRUE(bad->PushGradients(1, 1, hyper, std::as_bytes(std::span(grads))).ok());
  ASSERT_TRUE(bad->PullParams(1, std::as_writable_bytes(std::span(weights))).ok());
  slot = bad->AcquireSlot(milliseconds(1000));
  ASSERT_TRUE(slot.ok());
  ASSERT_TRUE(bad->SendGradReady(1, *slot, 1, hyper).ok());
  ExpectRefused(bad->WaitParams(1, milliseconds(5000)).status(), absl::StatusCode::kFailedPrecondition,
                "already updated in step 1");
  // A second session on a job that is open.
  auto second = Session::Open({.job = "good", .num_slots = 2, .slot_bytes = 4096}, daemon_->client_options());
  ExpectRefused(second.status(), absl::StatusCode::kFailedPrecondition, "already open");

  // Requests clientlib itself would refuse: through the raw protocol.
  RawClient raw(daemon_->client_options());
  v1::OpenSessionResponse opened;
  ASSERT_TRUE(raw.Open("raw", &opened).ok());
  ExpectRefused(raw.Register(opened.session_id(), 0, 100, 0), grpc::StatusCode::INVALID_ARGUMENT, "dtype");
  ExpectRefused(raw.Register(opened.session_id(), 0, 100, 42), grpc::StatusCode::INVALID_ARGUMENT, "dtype");
  ExpectRefused(raw.Register(opened.session_id(), 0, 4096, v1::DTYPE_FLOAT32), grpc::StatusCode::INVALID_ARGUMENT,
                "bytes per slot region");
  ASSERT_TRUE(raw.Register(opened.session_id(), 0, 100, v1::DTYPE_FLOAT32).ok());
  ASSERT_TRUE(raw.Close(opened.session_id()).ok());
  ASSERT_TRUE(raw.Open("raw", &opened).ok());
  EXPECT_EQ(opened.existing_chunks(), 1u);  // the chunk registered in the last session
  ExpectRefused(raw.Register(opened.session_id(), 0, 99, v1::DTYPE_FLOAT32), grpc::StatusCode::INVALID_ARGUMENT,
                "has 100 elements on the daemon");
  ExpectRefused(raw.Register("no-such-session", 0, 99, v1::DTYPE_FLOAT32), grpc::StatusCode::NOT_FOUND, "no-such-session");
  v1::OpenSessionResponse bad_name;
  ExpectRefused(raw.Open("../escape", &bad_name), grpc::StatusCode::INVALID_ARGUMENT, "job name");
  {
    // A malformed stream message: a ClientMessage with nothing set.
    grpc::ClientContext context;
    auto stream = raw.stub().Stream(&context);
    v1::ClientMessage attach;
    attach.mutable_attach()->set_session_id(opened.session_id());
    ASSERT_TRUE(stream->Write(attach));
    v1::DaemonMessage reply;
    ASSERT_TRUE(stream->Read(&reply));
    EXPECT_TRUE(reply.has_attached());
    ASSERT_TRUE(stream->Write(v1::ClientMessage()));
    ASSERT_TRUE(stream->Read(&reply));
    ASSERT_TRUE(reply.has_error());
    EXPECT_EQ(reply.error().code(), grpc::StatusCode::INVALID_ARGUMENT);
    EXPECT_NE(reply.error().message().find("malformed"), std::string::npos);
    stream->WritesDone();
    EXPECT_TRUE(stream->Finish().ok());
  }
  {
    // A stream that does not start with Attach.
    grpc::ClientContext context;
    auto stream = raw.stub().Stream(&context);
    v1::ClientMessage end;
    end.mutable_end_step()->set_step(1);
    stream->Write(end);
    stream->WritesDone();
    ExpectRefused(stream->Finish(), grpc::StatusCode::INVALID_ARGUMENT, "must be Attach");
  }

  // After all that, both sessions still work and "good" still matches the reference.
  ASSERT_TRUE(bad->EndStep(1).ok());
  TrainSteps(*good, good_chunks, 3, 5);
  EXPECT_TRUE(good->Close().ok());
  EXPECT_TRUE(bad->Close().ok());
}

// Mappings of client segments (memfds) in the daemon `pid`.
int CountDaemonShmMappings(pid_t pid) {
  std::ifstream maps(fmt::format("/proc/{}/maps", pid));
  std::string line;
  int count = 0;
  while (std::getline(maps, line)) count += line.find("/memfd:fuyou-segment") != std::string::npos;
  return count;
}

// File descriptors of client segments the daemon `pid` holds open.
int CountDaemonSegmentFds(pid_t pid) {
  int count = 0;
  for (const auto& entry : fs::directory_iterator(fmt::format("/proc/{}/fd", pid))) {
    std::error_code ec;
    count += fs::read_symlink(entry.path(), ec).string().find("memfd:fuyou-segment") != std::string::npos;
  }
  return count;
}

TEST_F(OffloadIntegrationTest, AClientKilledMidStepFreesItsSegmentAndTheDaemonServesOn) {
  StartDaemon();
  const fs::path ready = dir_.path() / "ready";
  pid_t client = Spawn(CRASH_CLIENT_PATH, {daemon_->socket_path().string(), "victim", ready.string()});
  ASSERT_GT(client, 0);
  for (int i = 0; i < 400 && !fs::exists(ready); ++i) std::this_thread::sleep_for(milliseconds(50));
  ASSERT_TRUE(fs::exists(ready)) << "crash_client never reached the middle of step 4";
  EXPECT_EQ(CountDaemonShmMappings(daemon_->pid()), 1);
  {
    // The daemon knows who is at the other end: the peer credentials of the socket.
    auto admin = AdminClient::Connect(daemon_->client_options());
    ASSERT_TRUE(admin.ok());
    auto sessions = (*admin)->ListSessions();
    ASSERT_TRUE(sessions.ok());
    ASSERT_EQ(sessions->sessions_size(), 1);
    EXPECT_EQ(sessions->sessions(0).pid(), client);
    EXPECT_EQ(sessions->sessions(0).uid(), ::getuid());
    EXPECT_EQ(sessions->sessions(0).job(), "victim");
  }
  EXPECT_EQ(CountDaemonSegmentFds(daemon_->pid()), 0) << "the daemon keeps the mapping, not the fd";
  ::kill(client, SIGKILL);
  ::waitpid(client, nullptr, 0);

  // The daemon notices the broken stream, closes the session and unmaps the segment.
  auto admin = AdminClient::Connect(daemon_->client_options());
  ASSERT_TRUE(admin.ok());
  bool gone = false;
  for (int i = 0; i < 200 && !gone; ++i) {
    auto sessions = (*admin)->ListSessions();
    ASSERT_TRUE(sessions.ok());
    gone = sessions->sessions_size() == 0;
    if (!gone) std::this_thread::sleep_for(milliseconds(50));
  }
  ASSERT_TRUE(gone) << "the killed client's session is still listed after 10 s";
  EXPECT_EQ(CountDaemonShmMappings(daemon_->pid()), 0);

  // The job resumes at its last committed step, with the weights of 3 steps.
  auto session = OpenSession("victim", 4 * 4096, 4);
  ASSERT_NE(session, nullptr);
  EXPECT_EQ(session->committed_step(), 3);
  ReferenceChunk reference(std::vector<float>(4096, 0.5f));
  for (int step = 0; step < 3; ++step) reference.Step(std::vector<float>(4096, 0.25f), AdamWHyper{});
  std::vector<float> weights(4096, 0.0f);
  for (uint32_t chunk = 0; chunk < 2; ++chunk) {
    auto result = session->RegisterChunk({.chunk_id = chunk, .num_elements = 4096}, std::as_writable_bytes(std::span(weights)));
    ASSERT_TRUE(result.ok()) << Text(result.status());
    EXPECT_TRUE(result->resumed);
    EXPECT_EQ(result->update_count, 3);
    EXPECT_NEAR(weights[17], reference.master[17], 1e-6);
  }
  EXPECT_TRUE(session->Close().ok());
}

// Runs fuyouctl with `args` as uid `uid`; returns its exit status, with its
// stdout and stderr in `output`.
int RunFuyouctlAs(uid_t uid, const std::vector<std::string>& args, const fs::path& output_file, std::string* output) {
  return RunAs(uid, FUYOUCTL_PATH, args, output_file, output);
}

TEST_F(OffloadIntegrationTest, AnotherUserCannotSeeOrDeleteAJob) {
  if (::geteuid() != 0) GTEST_SKIP() << "skipped: needs root to act as a second user";
  constexpr uid_t kNobody = 65534;
  ::chmod(dir_.path().c_str(), 0755);
  StartDaemon({"--dram-budget", "64MiB", "--socket-mode", "0666"});
  auto session = OpenSession("private", 4096 * 4, 2);
  ASSERT_NE(session, nullptr);
  std::vector<float> weights(1000, 0.5f);
  ASSERT_TRUE(session->RegisterChunk({.chunk_id = 0, .num_elements = 1000}, std::as_writable_bytes(std::span(weights))).ok());
  const std::string socket = daemon_->socket_path().string();
  const fs::path out = dir_.path() / "fuyouctl.out";
  std::string text;
  ASSERT_EQ(RunFuyouctlAs(0, {"--socket", socket, "sessions", "--json"}, out, &text), 0) << text;
  EXPECT_NE(text.find("private"), std::string::npos) << "root sees every session: " << text;
  ASSERT_EQ(RunFuyouctlAs(kNobody, {"--socket", socket, "sessions", "--json"}, out, &text), 0) << text;
  EXPECT_EQ(text.find("private"), std::string::npos) << "another user saw the session: " << text;
  ASSERT_EQ(RunFuyouctlAs(kNobody, {"--socket", socket, "jobs", "--json"}, out, &text), 0) << text;
  EXPECT_EQ(text.find("private"), std::string::npos) << "another user saw the job: " << text;
  ASSERT_TRUE(session->Close().ok());
  EXPECT_NE(RunFuyouctlAs(kNobody, {"--socket", socket, "delete-job", "private"}, out, &text), 0);
  // Jobs live in a namespace per uid: nobody has no job "private", and the
  // answer says nothing of root's (issue 8 item 9).
  EXPECT_NE(text.find("does not exist"), std::string::npos) << text;
  EXPECT_EQ(text.find("uid"), std::string::npos) << text;
  ASSERT_EQ(RunFuyouctlAs(0, {"--socket", socket, "jobs", "--json"}, out, &text), 0) << text;
  EXPECT_NE(text.find("private"), std::string::npos) << "the job must still exist: " << text;
}

TEST_F(OffloadIntegrationTest, DaemonRefusesASecondInstanceAndCleansAStaleSocket) {
  StartDaemon();
  // A second daemon on the same socket exits with an error; the first keeps serving.
  pid_t second = Spawn(FUYOUD_PATH, {"--socket", daemon_->socket_path().string(), "--data-dir",
                                     (dir_.path() / "other-data").string()});
  int status = 0;
  ASSERT_EQ(::waitpid(second, &status, 0), second);
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 1);
  EXPECT_EQ(Stats().live_sessions(), 0u);
  daemon_->Kill();                    // leaves stale sockets behind
  EXPECT_TRUE(fs::exists(daemon_->socket_path()));
  EXPECT_TRUE(fs::exists(daemon_->socket_path().string() + ".seg"));
  StartDaemon();                      // removes it and serves
  EXPECT_EQ(Stats().live_sessions(), 0u);
}

}  // namespace
}  // namespace fuyou::testing
