// Durability of the storage tier against a real fuyoud: a full disk and I/O
// errors injected through the storage seam (FUYOU_TEST_FAULTS, test-only, see
// daemon/storage/fault_spec.h), a flipped bit in a committed extent, the capacity
// check and per-job quota at registration, WaitDurable while a step's durable
// commit is held, and no leaks across jobs.
#include <fcntl.h>
#include <fmt/format.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <chrono>
#include <cstring>
#include <fstream>
#include <future>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "adamw_reference.h"
#include "daemon_process.h"
#include "test_values.h"
#include "fuyou/admin_client.h"
#include "fuyou/client.h"
#include "fuyou/v1/manifest.pb.h"
#include "fuyou/v1/offload.grpc.pb.h"
#include "grpcpp/grpcpp.h"

namespace fuyou::testing {
namespace {
namespace fs = std::filesystem;

// An fp32 chunk trained against ReferenceChunk.
struct Chunk {
  ChunkSpec spec;
  ReferenceChunk reference;
  std::vector<float> weights;
  Chunk(uint32_t id, uint64_t n)
      : spec{.chunk_id = id, .num_elements = n}, reference(Values(id + 1, n)), weights(Values(id + 1, n)) {}
  std::vector<float> Gradients(int64_t step) const { return Values(step * 1000 + spec.chunk_id, spec.num_elements, 0.1f); }
  std::span<std::byte> bytes() { return std::as_writable_bytes(std::span(weights)); }
  double MaxError() const {
    double worst = 0;
    for (size_t i = 0; i < weights.size(); ++i) {
      worst = std::max(worst, std::abs(double{weights[i]} - reference.master[i]) / std::abs(double{reference.master[i]}));
    }
    return worst;
  }
};

absl::Status RegisterAll(Session& session, std::vector<Chunk>& chunks, bool expect_resumed) {
  for (Chunk& chunk : chunks) {
    auto result = session.RegisterChunk(chunk.spec, chunk.bytes());
    if (!result.ok()) return result.status();
    EXPECT_EQ(result->resumed, expect_resumed) << "chunk " << chunk.spec.chunk_id;
  }
  return absl::OkStatus();
}

// One step of every chunk; the reference advances only when the step commits.
// `durable_step`, when given, gets the durable step EndStep's answer reports.
absl::Status TrainStep(Session& session, std::vector<Chunk>& chunks, int64_t step, int64_t* durable_step = nullptr) {
  AdamWHyper hyper;
  absl::Status first_error;
  for (auto it = chunks.rbegin(); it != chunks.rend(); ++it) {
    std::vector<float> grads = it->Gradients(step);
    absl::Status pushed = session.PushGradients(it->spec.chunk_id, step, hyper, std::as_bytes(std::span(grads)));
    if (!pushed.ok()) return pushed;
  }
  std::vector<std::vector<float>> pulled;
  for (Chunk& chunk : chunks) {
    std::vector<float> weights(chunk.weights.size());
    absl::Status status = session.PullParams(chunk.spec.chunk_id, std::as_writable_bytes(std::span(weights)));
    if (!status.ok() && first_error.ok()) first_error = status;
    pulled.push_back(std::move(weights));
  }
  auto ended = session.EndStep(step);
  if (!ended.ok()) return ended.status();
  if (!first_error.ok()) return first_error;
  if (durable_step != nullptr) *durable_step = ended->durable_step;
  for (size_t i = 0; i < chunks.size(); ++i) {
    chunks[i].weights = std::move(pulled[i]);
    chunks[i].reference.Step(chunks[i].Gradients(step), hyper);
  }
  return absl::OkStatus();
}

class DurabilityTest : public ::testing::Test {
 protected:
  void StartDaemon(std::vector<std::string> args = {}, std::vector<std::string> env = {}) {
    args.insert(args.begin(), {"--dram-budget", "64MiB"});
    daemon_ = std::make_unique<DaemonProcess>(dir_.path(), std::move(args), std::move(env));
    absl::Status started = daemon_->Start();
    ASSERT_TRUE(started.ok()) << Text(started);
  }
  std::unique_ptr<Session> Open(const std::string& job) {
    auto session = Session::Open({.job = job, .num_slots = 4, .slot_bytes = 100'000 * 4}, daemon_->client_options());
    EXPECT_TRUE(session.ok()) << Text(session.status());
    return session.ok() ? std::move(*session) : nullptr;
  }
  AdminClient& Admin() {
    if (!admin_) {
      auto admin = AdminClient::Connect(daemon_->client_options());
      EXPECT_TRUE(admin.ok());
      admin_ = std::move(*admin);
    }
    return *admin_;
  }
  v1::GetStatsResponse Stats() {
    auto stats = Admin().GetStats();
    EXPECT_TRUE(stats.ok());
    return stats.ok() ? *stats : v1::GetStatsResponse();
  }
  v1::JobInfo Job(const std::string& name) {
    auto jobs = Admin().ListJobs();
    EXPECT_TRUE(jobs.ok());
    for (const v1::JobInfo& job : jobs->jobs()) {
      if (job.name() == name) return job;
    }
    ADD_FAILURE() << "job '" << name << "' is not listed";
    return v1::JobInfo();
  }
  // The directory of the test's (the caller's uid) job `name`.
  fs::path JobDir(const std::string& name) const {
    return daemon_->data_dir() / "users" / std::to_string(::getuid()) / "jobs" / name;
  }
  void Restart(std::vector<std::string> args = {}) {
    admin_.reset();
    EXPECT_EQ(daemon_->Stop(), 0);
    StartDaemon(std::move(args));
  }

  TempDir dir_;
  std::unique_ptr<DaemonProcess> daemon_;
  std::unique_ptr<AdminClient> admin_;
};

void ExpectError(const absl::Status& status, absl::StatusCode code, const std::vector<std::string>& words) {
  EXPECT_EQ(status.code(), code) << Text(status);
  for (const std::string& word : words) {
    EXPECT_NE(Text(status).find(word), std::string::npos) << "'" << Text(status) << "' lacks '" << word << "'";
  }
}

TEST_F(DurabilityTest, ADiskFullAtRegistrationIsRefusedAndNothingIsCommitted) {
  StartDaemon({}, {"FUYOU_TEST_FAULTS=reserve:ENOSPC:after=1:job=full;write:ENOSPC:job=nowrite"});
  std::vector<Chunk> chunks = {Chunk(0, 1000), Chunk(1, 20'000)};
  {
    // The second chunk's extents cannot be reserved.
    auto session = Open("full");
    ASSERT_NE(session, nullptr);
    ASSERT_TRUE(session->RegisterChunk(chunks[0].spec, chunks[0].bytes()).ok());
    ExpectError(session->RegisterChunk(chunks[1].spec, chunks[1].bytes()).status(),
                absl::StatusCode::kResourceExhausted, {"job 'full'", "chunk 1", "No space left on device"});
    EXPECT_TRUE(session->Close().ok());
  }
  EXPECT_EQ(Job("full").chunks(), 1u);  // chunk 0 committed, chunk 1 not
  {
    // The initial states cannot be written.
    auto session = Open("nowrite");
    ASSERT_NE(session, nullptr);
    ExpectError(session->RegisterChunk(chunks[0].spec, chunks[0].bytes()).status(),
                absl::StatusCode::kResourceExhausted,
                {"job 'nowrite'", "initial states of chunk 0", "nothing of this registration was committed"});
    EXPECT_TRUE(session->Close().ok());
  }
  // The session made "nowrite" and never committed a chunk: closing it removed
  // the empty job (issue 8 item 10), instead of leaving a half-registered one.
  auto listed = Admin().ListJobs();
  ASSERT_TRUE(listed.ok());
  for (const v1::JobInfo& job : listed->jobs()) EXPECT_NE(job.name(), "nowrite");
  EXPECT_FALSE(fs::exists(JobDir("nowrite")));
  // Without the faults both jobs open and register; only what was committed resumes.
  Restart();
  auto full = Open("full");
  ASSERT_NE(full, nullptr);
  auto resumed = full->RegisterChunk(chunks[0].spec, chunks[0].bytes());
  ASSERT_TRUE(resumed.ok()) << Text(resumed.status());
  EXPECT_TRUE(resumed->resumed);
  auto fresh = full->RegisterChunk(chunks[1].spec, chunks[1].bytes());
  ASSERT_TRUE(fresh.ok()) << Text(fresh.status());
  EXPECT_FALSE(fresh->resumed);
  ASSERT_TRUE(TrainStep(*full, chunks, 1).ok());
  auto nowrite = Open("nowrite");
  ASSERT_NE(nowrite, nullptr);
  std::vector<Chunk> other = {Chunk(0, 1000)};
  ASSERT_TRUE(RegisterAll(*nowrite, other, false).ok());
  ASSERT_TRUE(TrainStep(*nowrite, other, 1).ok());
}

TEST_F(DurabilityTest, AJobThatCannotFitIsRefusedBeforeAnythingIsWritten) {
  // The third chunk of one request cannot be reserved: nothing of the request may
  // have been written (all extents are reserved before any state is written).
  StartDaemon({}, {"FUYOU_TEST_FAULTS=reserve:ENOSPC:after=2:job=batch"});
  auto raw = v1::Offload::NewStub(grpc::CreateChannel(daemon_->client_options().address,
                                                      grpc::InsecureChannelCredentials()));
  v1::OpenSessionResponse opened;
  {
    grpc::ClientContext context;
    v1::OpenSessionRequest request;
    request.set_job("batch");
    request.set_num_slots(4);
    request.set_slot_bytes(10'000 * 4);
    ASSERT_TRUE(raw->OpenSession(&context, request, &opened).ok());
  }
  auto segment = HandOverNewSegment(opened);
  ASSERT_TRUE(segment.ok()) << segment.status();
  const uint64_t written_before = Stats().storage(0).bytes_written();
  grpc::ClientContext context;
  v1::RegisterChunksRequest request;
  request.set_session_id(opened.session_id());
  for (uint32_t id = 0; id < 3; ++id) {
    v1::ChunkSpec* spec = request.add_chunks();
    spec->set_chunk_id(id);
    spec->set_num_elements(10'000);
    spec->set_slot(id);
    spec->set_param_dtype(v1::DTYPE_FLOAT32);
    spec->set_grad_dtype(v1::DTYPE_FLOAT32);
  }
  v1::RegisterChunksResponse response;
  grpc::Status status = raw->RegisterChunks(&context, request, &response);
  EXPECT_EQ(status.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED) << status.error_message();
  EXPECT_NE(status.error_message().find("chunk 2"), std::string::npos) << status.error_message();
  EXPECT_EQ(Stats().storage(0).bytes_written(), written_before) << "states were written before the refusal";
  EXPECT_EQ(Job("batch").chunks(), 0u);
  EXPECT_EQ(Job("batch").bytes_on_storage(), 0u);
  grpc::ClientContext close_context;
  v1::CloseSessionRequest close;
  close.set_session_id(opened.session_id());
  v1::CloseSessionResponse closed;
  EXPECT_TRUE(raw->CloseSession(&close_context, close, &closed).ok());
}

TEST_F(DurabilityTest, APerJobQuotaRefusesRegistrationOverIt) {
  StartDaemon({"--job-quota", "1MiB"});
  auto session = Open("q");
  ASSERT_NE(session, nullptr);
  // Two extents per chunk, each 12 bytes a parameter rounded up to 4 KiB.
  std::vector<Chunk> fits = {Chunk(0, 10'000), Chunk(1, 30'000)};  // 2*122880 + 2*360448 = 966656 bytes
  ASSERT_TRUE(RegisterAll(*session, fits, false).ok());
  Chunk over(2, 10'000);  // + 245760 = 1212416 > 1048576
  ExpectError(session->RegisterChunk(over.spec, over.bytes()).status(), absl::StatusCode::kResourceExhausted,
              {"job 'q' needs 1212416 bytes on storage, over the per-job quota of 1048576"});
  EXPECT_EQ(Job("q").bytes_on_storage(), 966656u);
  EXPECT_EQ(fs::file_size(JobDir("q") / "states.bin"), 966656u);
  ASSERT_TRUE(TrainStep(*session, fits, 1).ok());  // the job trains on within its quota
  ASSERT_TRUE(session->Close().ok());
  // Another job is measured on its own.
  auto other = Open("q2");
  ASSERT_NE(other, nullptr);
  std::vector<Chunk> small = {Chunk(0, 30'000)};
  EXPECT_TRUE(RegisterAll(*other, small, false).ok());
}

TEST_F(DurabilityTest, ADiskFullInAStepRollsItBackWhileAnotherJobTrainsOn) {
  // Registration writes 2 extents and each step 2 (every write one request): the
  // write-backs of step 3 fail.
  StartDaemon({}, {"FUYOU_TEST_FAULTS=write:ENOSPC:after=6:job=sick"});
  std::vector<Chunk> sick_chunks = {Chunk(0, 1000), Chunk(1, 3000)};
  std::vector<Chunk> healthy_chunks = {Chunk(10, 5000), Chunk(11, 20'000)};
  auto sick = Open("sick");
  auto healthy = Open("healthy");
  ASSERT_NE(sick, nullptr);
  ASSERT_NE(healthy, nullptr);
  ASSERT_TRUE(RegisterAll(*sick, sick_chunks, false).ok());
  ASSERT_TRUE(RegisterAll(*healthy, healthy_chunks, false).ok());
  for (int64_t step = 1; step <= 2; ++step) {
    ASSERT_TRUE(TrainStep(*sick, sick_chunks, step).ok());
    ASSERT_TRUE(TrainStep(*healthy, healthy_chunks, step).ok());
  }
  std::vector<std::vector<float>> at_step_2;
  for (const Chunk& chunk : sick_chunks) at_step_2.push_back(chunk.weights);
  ExpectError(TrainStep(*sick, sick_chunks, 3), absl::StatusCode::kResourceExhausted,
              {"step 3 was rolled back to step 2", "job 'sick'", "No space left on device"});
  EXPECT_EQ(sick->committed_step(), 2);
  EXPECT_FALSE(TrainStep(*sick, sick_chunks, 3).ok());  // the disk is still full: refused again
  for (int64_t step = 3; step <= 5; ++step) ASSERT_TRUE(TrainStep(*healthy, healthy_chunks, step).ok());
  for (const Chunk& chunk : healthy_chunks) EXPECT_LE(chunk.MaxError(), 1e-6) << "chunk " << chunk.spec.chunk_id;
  EXPECT_TRUE(sick->Close().ok());
  EXPECT_TRUE(healthy->Close().ok());
  EXPECT_EQ(Job("sick").committed_step(), 2);
  EXPECT_EQ(Job("healthy").committed_step(), 5);

  // Restarted without faults (cold cache): the sick job resumes at step 2 with its
  // step-2 weights, bit for bit, and trains on.
  Restart();
  sick = Open("sick");
  ASSERT_NE(sick, nullptr);
  EXPECT_EQ(sick->committed_step(), 2);
  for (Chunk& chunk : sick_chunks) std::fill(chunk.weights.begin(), chunk.weights.end(), 0.0f);
  ASSERT_TRUE(RegisterAll(*sick, sick_chunks, true).ok());
  for (size_t i = 0; i < sick_chunks.size(); ++i) EXPECT_EQ(sick_chunks[i].weights, at_step_2[i]);
  for (int64_t step = 3; step <= 4; ++step) ASSERT_TRUE(TrainStep(*sick, sick_chunks, step).ok());
  for (const Chunk& chunk : sick_chunks) EXPECT_LE(chunk.MaxError(), 1e-6) << "chunk " << chunk.spec.chunk_id;
}

TEST_F(DurabilityTest, AFailedBackgroundCommitFailsTheNextRequestAndTheJobResumesAtItsDurableStep) {
  // EndStep answers once a step is applied; its data syncs and manifest commit
  // run on in the background. From the SYNCS_BEFORE_FAULT-th data sync of job
  // "syncfail" on, every sync fails (the registration's syncs pass).
  constexpr int kSyncsBeforeFault = 12;
  StartDaemon({}, {fmt::format("FUYOU_TEST_FAULTS=sync:EIO:after={}:job=syncfail", kSyncsBeforeFault)});
  std::vector<Chunk> chunks = {Chunk(0, 5000), Chunk(1, 7000)};
  // The reference masters after each step (index: step).
  std::vector<std::vector<std::vector<float>>> masters(1);
  for (const Chunk& chunk : chunks) masters[0].push_back(chunk.reference.master);
  int64_t durable = 0;
  int64_t failed_at = 0;
  absl::Status failed;
  {
    auto session = Open("syncfail");
    ASSERT_NE(session, nullptr);
    ASSERT_TRUE(RegisterAll(*session, chunks, false).ok());
    for (int64_t step = 1; step <= 20 && failed.ok(); ++step) {
      int64_t reported = 0;
      failed = TrainStep(*session, chunks, step, &reported);
      if (!failed.ok()) {
        failed_at = step;
        break;
      }
      EXPECT_TRUE(reported == step - 1 || reported == step) << "step " << step << " reported " << reported;
      EXPECT_GE(reported, durable);
      durable = reported;
      masters.emplace_back();
      for (const Chunk& chunk : chunks) masters.back().push_back(chunk.reference.master);
    }
    ASSERT_FALSE(failed.ok()) << "no sync failed in 20 steps: raise the steps or lower kSyncsBeforeFault";
    ASSERT_GT(failed_at, 1) << "the fault hit the first step: " << Text(failed);
    EXPECT_NE(Text(failed).find("Input/output error"), std::string::npos) << Text(failed);
    // The session stays broken: a step after it fails too (the reference does
    // not advance: TrainStep moves it only for a step that EndStep answered).
    const absl::Status again = TrainStep(*session, chunks, failed_at + 1);
    EXPECT_FALSE(again.ok());
    session->Close().IgnoreError();
  }
  // Without the fault the job reopens at the last step reported durable (the
  // failed commit's step, or later ones, are gone), with that step's states.
  Restart();
  auto session = Open("syncfail");
  ASSERT_NE(session, nullptr);
  ASSERT_TRUE(RegisterAll(*session, chunks, true).ok());
  const int64_t resumed = session->committed_step();
  EXPECT_EQ(resumed, durable) << "failed at step " << failed_at << ": " << Text(failed);
  ASSERT_LT(resumed, static_cast<int64_t>(masters.size()));
  for (size_t c = 0; c < chunks.size(); ++c) {
    double worst = 0;
    for (size_t i = 0; i < chunks[c].weights.size(); ++i) {
      const double want = masters[resumed][c][i];
      worst = std::max(worst, std::abs(chunks[c].weights[i] - want) / std::abs(want));
    }
    EXPECT_LE(worst, 1e-6) << "chunk " << c << " against the reference at step " << resumed;
  }
}

// WaitDurable (issue 24) while step 2's durable commit is held (its data syncs
// wait for a file, FUYOU_TEST_FAULTS sync:HOLD): not answered, while the same
// stream's later messages, another WaitDurable among them, and the admin API
// (which reads the session) are; answered with the step once the commit ends.
TEST_F(DurabilityTest, WaitDurableIsAnsweredWhenTheHeldCommitEndsAndNothingElseWaits) {
  const fs::path release = dir_.path() / "release-syncs";
  std::ofstream(release).put('x');
  StartDaemon({}, {fmt::format("FUYOU_TEST_FAULTS=sync:HOLD:until={}:job=held", release.string())});
  std::unique_ptr<Session> session = Open("held");
  ASSERT_NE(session, nullptr);
  std::vector<Chunk> chunks;
  chunks.emplace_back(0, 1000);
  ASSERT_TRUE(RegisterAll(*session, chunks, false).ok());
  ASSERT_TRUE(TrainStep(*session, chunks, 1).ok());
  EXPECT_EQ(session->WaitDurable(1).value_or(-1), 1);
  ExpectError(session->WaitDurable(2).status(), absl::StatusCode::kFailedPrecondition,
              {"WaitDurable for step 2", "committed step 1"});
  ExpectError(session->WaitDurable(-1).status(), absl::StatusCode::kInvalidArgument, {"step -1"});

  // One chunk: its write-back completes before a sync is held (the held sync
  // holds the engine's completion thread), so EndStep answers.
  fs::remove(release);
  int64_t durable_at_end = -1;
  ASSERT_TRUE(TrainStep(*session, chunks, 2, &durable_at_end).ok());
  EXPECT_EQ(durable_at_end, 1);
  std::future<absl::StatusOr<int64_t>> waiting =
      std::async(std::launch::async, [&] { return session->WaitDurable(2); });
  EXPECT_EQ(waiting.wait_for(std::chrono::milliseconds(500)), std::future_status::timeout)
      << "answered while step 2's commit is held";
  EXPECT_EQ(session->WaitDurable(1).value_or(-1), 1) << "a later message waited for the held commit";
  auto sessions = Admin().ListSessions();
  ASSERT_TRUE(sessions.ok()) << Text(sessions.status());
  ASSERT_EQ(sessions->sessions_size(), 1);
  EXPECT_EQ(sessions->sessions(0).committed_step(), 2);
  EXPECT_EQ(Job("held").committed_step(), 1) << "durable before its commit ended";
  // At most 16 wait at once (Session::kMaxDurableWaits): the 17th is refused,
  // so a client cannot pile up answers while a commit is held.
  std::vector<std::future<absl::StatusOr<int64_t>>> more;
  for (int i = 1; i < 16; ++i) more.push_back(std::async(std::launch::async, [&] { return session->WaitDurable(2); }));
  std::this_thread::sleep_for(std::chrono::seconds(3));  // the 15 are read by the daemon first
  ExpectError(session->WaitDurable(2).status(), absl::StatusCode::kResourceExhausted,
              {"WaitDurable for step 2", "16 WaitDurable requests"});
  std::ofstream(release).put('x');
  absl::StatusOr<int64_t> durable = waiting.get();
  ASSERT_TRUE(durable.ok()) << Text(durable.status());
  EXPECT_EQ(*durable, 2);
  for (auto& f : more) EXPECT_EQ(f.get().value_or(-1), 2);
  EXPECT_EQ(session->WaitDurable(2).value_or(-1), 2) << "the waits were not given back";
  ASSERT_TRUE(session->Close().ok());
  EXPECT_EQ(Job("held").committed_step(), 2);
}

// The admin API reads a session without its lock (SessionProgress): while the
// session's EndStep waits for a write-back held by FUYOU_TEST_FAULTS (write:HOLD),
// ListSessions answers with the session as of its last finished request.
TEST_F(DurabilityTest, TheAdminAPIAnswersWhileASessionsRequestWaitsForItsWrites) {
  const fs::path release = dir_.path() / "release-writes";
  std::ofstream(release).put('x');
  StartDaemon({}, {fmt::format("FUYOU_TEST_FAULTS=write:HOLD:until={}:job=busy", release.string())});
  std::unique_ptr<Session> session = Open("busy");
  ASSERT_NE(session, nullptr);
  std::vector<Chunk> chunks;
  chunks.emplace_back(0, 1000);
  ASSERT_TRUE(RegisterAll(*session, chunks, false).ok());
  ASSERT_TRUE(TrainStep(*session, chunks, 1).ok());
  ASSERT_EQ(session->WaitDurable(1).value_or(-1), 1);  // step 1's commit wrote all it writes
  AdminClient& admin = Admin();
  fs::remove(release);
  std::future<absl::Status> step = std::async(std::launch::async, [&] { return TrainStep(*session, chunks, 2); });
  const bool step_waited = step.wait_for(std::chrono::milliseconds(500)) == std::future_status::timeout;
  std::future<absl::StatusOr<v1::ListSessionsResponse>> listed =
      std::async(std::launch::async, [&] { return admin.ListSessions(); });
  const bool answered = listed.wait_for(std::chrono::seconds(30)) == std::future_status::ready;
  std::ofstream(release).put('x');  // before any assertion: nothing is left waiting
  EXPECT_TRUE(step_waited) << "step 2's EndStep did not wait for its held write-back";
  ASSERT_TRUE(answered) << "ListSessions waited for the session's EndStep";
  absl::StatusOr<v1::ListSessionsResponse> sessions = listed.get();
  ASSERT_TRUE(sessions.ok()) << Text(sessions.status());
  ASSERT_EQ(sessions->sessions_size(), 1);
  EXPECT_EQ(sessions->sessions(0).committed_step(), 1);
  EXPECT_EQ(sessions->sessions(0).chunks(), 1u);
  EXPECT_EQ(sessions->sessions(0).chunk_updates(), 2u) << "step 2's update finished before its EndStep";
  ASSERT_TRUE(step.get().ok());
  sessions = admin.ListSessions();
  ASSERT_TRUE(sessions.ok()) << Text(sessions.status());
  EXPECT_EQ(sessions->sessions(0).committed_step(), 2);
  ASSERT_TRUE(session->Close().ok());
}

TEST_F(DurabilityTest, AReadErrorFailsTheStepNotTheDaemon) {
  // The cold read of a resumed job fails with EIO: registration says so, and a
  // healthy job on the same daemon is unaffected.
  StartDaemon();
  std::vector<Chunk> chunks = {Chunk(0, 1000)};
  {
    auto session = Open("eio");
    ASSERT_NE(session, nullptr);
    ASSERT_TRUE(RegisterAll(*session, chunks, false).ok());
    ASSERT_TRUE(TrainStep(*session, chunks, 1).ok());
  }
  admin_.reset();
  EXPECT_EQ(daemon_->Stop(), 0);
  StartDaemon({}, {"FUYOU_TEST_FAULTS=read:EIO:job=eio"});
  auto session = Open("eio");
  ASSERT_NE(session, nullptr);
  std::vector<float> untouched(1000, 7.0f);
  ExpectError(session->RegisterChunk(chunks[0].spec, std::as_writable_bytes(std::span(untouched))).status(),
              absl::StatusCode::kDataLoss, {"job 'eio' chunk 0", "cannot read", "states.bin"});
  EXPECT_EQ(untouched, std::vector<float>(1000, 7.0f));
  auto healthy = Open("fine");
  ASSERT_NE(healthy, nullptr);
  std::vector<Chunk> other = {Chunk(5, 2000)};
  ASSERT_TRUE(RegisterAll(*healthy, other, false).ok());
  ASSERT_TRUE(TrainStep(*healthy, other, 1).ok());
}

TEST_F(DurabilityTest, AFlippedBitInACommittedExtentIsDataLossNamingJobAndChunk) {
  StartDaemon();
  std::vector<Chunk> chunks = {Chunk(0, 1000), Chunk(1, 5000)};
  {
    auto session = Open("flip");
    ASSERT_NE(session, nullptr);
    ASSERT_TRUE(RegisterAll(*session, chunks, false).ok());
    for (int64_t step = 1; step <= 2; ++step) ASSERT_TRUE(TrainStep(*session, chunks, step).ok());
    ASSERT_TRUE(session->Close().ok());
  }
  admin_.reset();
  EXPECT_EQ(daemon_->Stop(), 0);

  // Find chunk 1's committed extent in the manifest (8-byte checksum, then the proto).
  const fs::path job_dir = JobDir("flip");
  std::ifstream in(job_dir / "manifest.pb", std::ios::binary);
  std::string bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  v1::JobManifest manifest;
  ASSERT_GT(bytes.size(), 8u);
  ASSERT_TRUE(manifest.ParseFromArray(bytes.data() + 8, static_cast<int>(bytes.size() - 8)));
  ASSERT_EQ(manifest.committed_step(), 2);
  ASSERT_EQ(manifest.chunks(1).chunk_id(), 1u);
  const v1::ChunkRecord& record = manifest.chunks(1);
  const v1::StateExtent& extent = record.extents(static_cast<int>(record.committed_version()));
  // One bit of Adam's v (the third of fp32 master | m | v).
  const uint64_t at = extent.offset() + 8 * record.num_elements() + 4 * 123 + 1;
  int fd = ::open((job_dir / "states.bin").c_str(), O_RDWR);
  ASSERT_GE(fd, 0);
  unsigned char byte = 0;
  ASSERT_EQ(::pread(fd, &byte, 1, static_cast<off_t>(at)), 1);
  byte ^= 0x10;
  ASSERT_EQ(::pwrite(fd, &byte, 1, static_cast<off_t>(at)), 1);
  ::fsync(fd);
  ::close(fd);

  StartDaemon();  // cold cache: states come from the disk
  auto session = Open("flip");
  ASSERT_NE(session, nullptr);
  EXPECT_EQ(session->committed_step(), 2);
  auto good = session->RegisterChunk(chunks[0].spec, chunks[0].bytes());
  ASSERT_TRUE(good.ok()) << Text(good.status());
  EXPECT_TRUE(good->resumed);
  std::vector<float> untouched(5000, 3.0f);
  ExpectError(session->RegisterChunk(chunks[1].spec, std::as_writable_bytes(std::span(untouched))).status(),
              absl::StatusCode::kDataLoss, {"job 'flip'", "chunk 1", "checksum", "nothing was returned"});
  EXPECT_EQ(untouched, std::vector<float>(5000, 3.0f)) << "weights came back from a corrupt extent";
}

// --- leaks -------------------------------------------------------------------

int CountEntries(const fs::path& dir) {
  int count = 0;
  for ([[maybe_unused]] const auto& entry : fs::directory_iterator(dir)) ++count;
  return count;
}

int CountShmMappings(pid_t pid) {
  std::ifstream maps(fmt::format("/proc/{}/maps", pid));
  std::string line;
  int count = 0;
  while (std::getline(maps, line)) count += line.find("/memfd:fuyou-segment") != std::string::npos;
  return count;
}

uint64_t RssBytes(pid_t pid) {
  std::ifstream status(fmt::format("/proc/{}/status", pid));
  std::string line;
  while (std::getline(status, line)) {
    if (line.rfind("VmRSS:", 0) == 0) return std::stoull(line.substr(6)) * 1024;
  }
  return 0;
}

// Bytes allocated on disk under `dir` (st_blocks, so fallocate'd space counts).
uint64_t DiskBytes(const fs::path& dir) {
  uint64_t total = 0;
  for (const auto& entry : fs::recursive_directory_iterator(dir)) {
    struct stat st {};
    if (entry.is_regular_file() && ::stat(entry.path().c_str(), &st) == 0) total += uint64_t(st.st_blocks) * 512;
  }
  return total;
}

TEST_F(DurabilityTest, JobsComeAndGoWithoutLeaks) {
  StartDaemon();
  const pid_t pid = daemon_->pid();
  const fs::path fd_dir = fmt::format("/proc/{}/fd", pid);
  Stats();  // the admin connection is part of the baseline
  const uint64_t disk_before = DiskBytes(daemon_->data_dir());
  struct Sample {
    int fds, maps;
    uint64_t rss, disk, dram, disk_with_jobs;
  };
  std::vector<Sample> samples;
  for (int cycle = 0; cycle < 3; ++cycle) {
    uint64_t dram_with_jobs = 0;
    for (const char* name : {"leak-a", "leak-b"}) {
      std::vector<Chunk> chunks = {Chunk(0, 100'000), Chunk(1, 60'000), Chunk(2, 1000)};
      auto session = Open(name);
      ASSERT_NE(session, nullptr);
      ASSERT_TRUE(RegisterAll(*session, chunks, false).ok());
      for (int64_t step = 1; step <= 3; ++step) ASSERT_TRUE(TrainStep(*session, chunks, step).ok());
      ASSERT_TRUE(session->Close().ok());
    }
    dram_with_jobs = Stats().dram_bytes_in_use();
    const uint64_t disk_with_jobs = DiskBytes(daemon_->data_dir());
    EXPECT_GT(disk_with_jobs, disk_before);
    EXPECT_GT(dram_with_jobs, 0u);
    auto deleted = Admin().DeleteJob("leak-a");
    ASSERT_TRUE(deleted.ok()) << Text(deleted.status());
    EXPECT_GT(deleted->bytes_freed(), 0u);
    const uint64_t dram_one_job = Stats().dram_bytes_in_use();
    EXPECT_LT(dram_one_job, dram_with_jobs) << "deleting a job left its states in the DRAM cache";
    ASSERT_TRUE(Admin().DeleteJob("leak-b").ok());
    const v1::GetStatsResponse stats = Stats();
    EXPECT_EQ(stats.dram_bytes_in_use(), 0u);
    EXPECT_EQ(stats.live_sessions(), 0u);
    samples.push_back({CountEntries(fd_dir), CountShmMappings(pid), RssBytes(pid), DiskBytes(daemon_->data_dir()),
                       stats.dram_bytes_in_use(), disk_with_jobs});
    EXPECT_EQ(samples.back().maps, 0);
    EXPECT_EQ(samples.back().disk, disk_before) << "cycle " << cycle << ": the data dir did not shrink back";
    EXPECT_FALSE(fs::exists(JobDir("leak-a")));
  }
  // The first cycle makes the I/O rings and gRPC's threads; later cycles add nothing.
  EXPECT_EQ(samples[2].fds, samples[1].fds);
  EXPECT_LE(samples[2].fds, samples[0].fds);
  EXPECT_LE(samples[2].rss, samples[1].rss + (4u << 20)) << "RSS grew by more than 4 MiB in the third cycle";
  for (size_t i = 0; i < samples.size(); ++i) {
    std::printf("[figures] leak cycle %zu, after deleting both jobs: %d fds, %d shm mappings, RSS %.1f MiB, DRAM "
                "cache %llu B, data dir %llu B allocated (%llu B with the two jobs, %llu B before any job)\n",
                i + 1, samples[i].fds, samples[i].maps, samples[i].rss / 1048576.0,
                static_cast<unsigned long long>(samples[i].dram), static_cast<unsigned long long>(samples[i].disk),
                static_cast<unsigned long long>(samples[i].disk_with_jobs),
                static_cast<unsigned long long>(disk_before));
  }
}

}  // namespace
}  // namespace fuyou::testing
