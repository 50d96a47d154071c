// Working weights kept by the daemon and fetched by chunk id (issue 12), the
// protocol end to end against a real fuyoud over raw gRPC (raw_session.h):
//   - chunks registered with store_weights (bf16, fp16, fp32): a fetch gives
//     the registered weights, then after each commit the weights ParamsReady
//     returned in that step, bit for bit; WeightsFetched names the committed
//     step;
//   - a fetch during a step, also after the chunk's own update (staged, not
//     committed), gives the committed weights; so does one after AbortStep;
//   - hostile fetches (unknown chunk, slot out of range, a chunk without
//     weights, a resume with the other store_weights) are refused with their
//     code, naming chunk and slot, and change nothing, while another session
//     keeps training and fetching;
//   - the daemon killed (after commits, and in the middle of a step) and
//     restarted: the resume and a fetch give the last committed weights;
//   - with states larger than the DRAM budget, GetStats shows at most two
//     reads of the weights a step (forward and backward) and never the fp32
//     master; fuyouctl stats prints the counters on its "weights" line, and
//     each user sees their own (weights_client run as nobody).
#include <gtest/gtest.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstdint>
#include <cstring>
#include <map>
#include <random>
#include <string>
#include <vector>

#include "daemon_process.h"
#include "fuyou/admin_client.h"
#include "fmt/format.h"
#include "fuyou/dtype.h"
#include "raw_session.h"
#include "test_values.h"

namespace fuyou::testing {
namespace {

const std::vector<std::string> kDaemonArgs = {"--dram-budget", "64MiB", "--threads", "2"};
constexpr uint64_t kSlotBytes = 4096 * 2;  // up to 2048 fp32 elements a chunk
constexpr uint32_t kSlots = 3;

using Bytes = std::vector<std::byte>;

v1::AdamWHyper Hyper() {
  v1::AdamWHyper hyper;
  hyper.set_lr(1e-2f);
  hyper.set_beta1(0.9f);
  hyper.set_beta2(0.999f);
  hyper.set_eps(1e-8f);
  hyper.set_weight_decay(0.1f);
  return hyper;
}

v1::ChunkSpec WeightsChunk(uint32_t id, uint64_t n, uint32_t slot, v1::DType param_dtype, bool store_weights = true) {
  v1::ChunkSpec spec = ChunkSpecOf(id, n, slot);
  spec.set_param_dtype(param_dtype);
  spec.set_store_weights(store_weights);
  return spec;
}

size_t SizeOf(v1::DType dtype) { return DTypeSize(static_cast<DType>(dtype)); }

// n finite weights in `dtype`, as bytes: fp32 from Values, bf16 their upper
// halves, fp16 normal numbers of magnitude 2^-2..2^1.
Bytes InitialWeights(uint64_t seed, size_t n, v1::DType dtype) {
  const std::vector<float> values = Values(seed, n);
  Bytes bytes(n * SizeOf(dtype));
  std::mt19937_64 rng(seed);
  for (size_t i = 0; i < n; ++i) {
    uint32_t bits;
    std::memcpy(&bits, &values[i], 4);
    if (dtype == v1::DTYPE_FLOAT32) {
      std::memcpy(&bytes[i * 4], &bits, 4);
    } else {
      uint16_t half = dtype == v1::DTYPE_BFLOAT16
                          ? static_cast<uint16_t>(bits >> 16)
                          : static_cast<uint16_t>((rng() & 1) << 15 | (13 + rng() % 4) << 10 | (rng() & 0x3ff));
      std::memcpy(&bytes[i * 2], &half, 2);
    }
  }
  return bytes;
}

// The index of the first differing byte, as text (for messages).
std::string FirstDifference(const Bytes& a, const Bytes& b) {
  if (a.size() != b.size()) return "sizes " + std::to_string(a.size()) + " and " + std::to_string(b.size());
  for (size_t i = 0; i < a.size(); ++i) {
    if (a[i] != b[i]) return "byte " + std::to_string(i);
  }
  return "none";
}
#define EXPECT_SAME_BYTES(a, b) EXPECT_TRUE((a) == (b)) << "first difference: " << FirstDifference(a, b)

std::string Describe(const v1::DaemonMessage& reply) { return reply.ShortDebugString(); }

v1::ClientMessage FetchOf(uint32_t chunk_id, uint32_t slot) {
  v1::ClientMessage message;
  message.mutable_fetch_weights()->set_chunk_id(chunk_id);
  message.mutable_fetch_weights()->set_slot(slot);
  return message;
}

// One raw session and what the test knows of its chunks.
struct Chunk {
  uint64_t n = 0;
  v1::DType dtype = v1::DTYPE_BFLOAT16;
  size_t bytes() const { return n * SizeOf(dtype); }
};

class Client {
 public:
  Client(std::unique_ptr<RawSession> session, std::map<uint32_t, Chunk> chunks)
      : session_(std::move(session)), chunks_(std::move(chunks)) {}
  RawSession& raw() { return *session_; }

  // Registers every chunk with `initial` weights in slots 0, 1, ... (at most
  // kSlots per call); returns the response.
  v1::RegisterChunksResponse Register(const std::map<uint32_t, Bytes>& initial, bool store_weights = true,
                                      grpc::Status* status_out = nullptr) {
    std::vector<v1::ChunkSpec> specs;
    uint32_t slot = 0;
    for (const auto& [id, weights] : initial) {
      specs.push_back(WeightsChunk(id, chunks_.at(id).n, slot, chunks_.at(id).dtype, store_weights));
      std::memcpy(session_->ParamRegion(slot).data(), weights.data(), weights.size());
      ++slot;
    }
    v1::RegisterChunksResponse response;
    grpc::Status status = session_->Register(specs, &response);
    if (status_out != nullptr) {
      *status_out = status;
    } else {
      EXPECT_TRUE(status.ok()) << status.error_message();
    }
    return response;
  }

  // The weights a registration left in slot `slot` for chunk `id`.
  Bytes SlotBytes(uint32_t id, uint32_t slot) {
    const std::byte* p = session_->ParamRegion(slot).data();
    return Bytes(p, p + chunks_.at(id).bytes());
  }

  // FetchWeights of chunk `id` into `slot`: the weights, and the reply's step in
  // `*step`; the reply when it is not WeightsFetched in `*refused`.
  Bytes Fetch(uint32_t id, uint32_t slot, int64_t* step = nullptr) {
    std::memset(session_->ParamRegion(slot).data(), 0xA5, chunks_.at(id).bytes());  // nothing left from before
    const v1::DaemonMessage reply = session_->Exchange(FetchOf(id, slot));
    EXPECT_TRUE(reply.has_weights_fetched()) << Describe(reply);
    if (!reply.has_weights_fetched()) return {};
    EXPECT_EQ(reply.weights_fetched().chunk_id(), id);
    EXPECT_EQ(reply.weights_fetched().slot(), slot);
    if (step != nullptr) *step = reply.weights_fetched().step();
    return SlotBytes(id, slot);
  }

  // GradReady of chunk `id` for `step` with gradients from `seed`; returns the
  // new weights ParamsReady put in the slot.
  Bytes Update(int64_t step, uint32_t id, uint32_t slot, uint64_t seed) {
    const v1::DaemonMessage reply =
        session_->SendGrad(GradReadyOf(step, id, slot, Hyper()), Values(seed, chunks_.at(id).n, 0.1f));
    EXPECT_TRUE(reply.has_params_ready()) << Describe(reply);
    return SlotBytes(id, slot);
  }

 private:
  std::unique_ptr<RawSession> session_;
  std::map<uint32_t, Chunk> chunks_;
};

class WeightsTest : public ::testing::Test {
 protected:
  void SetUp() override { StartDaemon(); }

  void StartDaemon(std::vector<std::string> args = kDaemonArgs) {
    daemon_ = std::make_unique<DaemonProcess>(dir_.path(), std::move(args));
    absl::Status started = daemon_->Start();
    ASSERT_TRUE(started.ok()) << Text(started);
  }

  std::unique_ptr<Client> Open(const std::string& job, std::map<uint32_t, Chunk> chunks, uint32_t slots = kSlots,
                               uint64_t slot_bytes = kSlotBytes) {
    auto session = RawSession::Open(daemon_->client_options(), job, slots, slot_bytes);
    EXPECT_TRUE(session.ok()) << Text(session.status());
    if (!session.ok()) return nullptr;
    return std::make_unique<Client>(std::move(*session), std::move(chunks));
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

const std::map<uint32_t, Chunk> kThreeDtypes = {
    {0, {1000, v1::DTYPE_BFLOAT16}}, {1, {700, v1::DTYPE_FLOAT16}}, {2, {513, v1::DTYPE_FLOAT32}}};

std::map<uint32_t, Bytes> InitialOf(const std::map<uint32_t, Chunk>& chunks, uint64_t seed = 1) {
  std::map<uint32_t, Bytes> initial;
  for (const auto& [id, chunk] : chunks) initial[id] = InitialWeights(seed + id, chunk.n, chunk.dtype);
  return initial;
}

// Items 1 and 2 of the proto's FetchWeights: the committed weights, bit for bit,
// between steps and during one; the chunk's own staged update is not returned.
TEST_F(WeightsTest, AFetchGivesTheCommittedWeightsBetweenAndDuringSteps) {
  auto client = Open("fetch", kThreeDtypes);
  ASSERT_NE(client, nullptr);
  std::map<uint32_t, Bytes> committed = InitialOf(kThreeDtypes);
  const v1::RegisterChunksResponse registered = client->Register(committed);
  for (const v1::RegisteredChunk& chunk : registered.chunks()) EXPECT_FALSE(chunk.resumed());

  int64_t step_of_fetch = -1;
  for (const auto& [id, weights] : committed) {
    EXPECT_SAME_BYTES(client->Fetch(id, (id + 1) % kSlots, &step_of_fetch), weights);
    EXPECT_EQ(step_of_fetch, 0);
  }
  for (int64_t step = 1; step <= 3; ++step) {
    SCOPED_TRACE("step " + std::to_string(step));
    std::map<uint32_t, Bytes> updated;
    for (const auto& [id, chunk] : kThreeDtypes) {
      // Forward's fetch, backward's fetch, the update, and a fetch after it.
      EXPECT_SAME_BYTES(client->Fetch(id, 0), committed[id]);
      EXPECT_SAME_BYTES(client->Fetch(id, 1, &step_of_fetch), committed[id]);
      EXPECT_EQ(step_of_fetch, step - 1);
      updated[id] = client->Update(step, id, 2, 100 * step + id);
      EXPECT_NE(updated[id], committed[id]) << "chunk " << id << " must change in an update";
      EXPECT_SAME_BYTES(client->Fetch(id, 0), committed[id]);  // its own update is staged only
      // The slot of that update, answered, is the client's again: a fetch may use it.
      EXPECT_SAME_BYTES(client->Fetch(id, 2), committed[id]);
    }
    ASSERT_TRUE(client->raw().EndStep(step).has_step_committed());
    for (const auto& [id, chunk] : kThreeDtypes) {
      EXPECT_SAME_BYTES(client->Fetch(id, id % kSlots, &step_of_fetch), updated[id]);
      EXPECT_EQ(step_of_fetch, step);
    }
    committed = updated;
  }

  // An aborted step leaves the committed weights; a redo's update is not returned either.
  client->Update(4, 0, 2, 7);
  v1::GradReady redo = GradReadyOf(4, 0, 2, Hyper());
  redo.set_redo(v1::REDO_REASON_GRADIENTS_CHANGED);
  ASSERT_TRUE(client->raw().SendGrad(redo, Values(8, 1000, 0.1f)).has_params_ready());
  EXPECT_SAME_BYTES(client->Fetch(0, 1), committed[0]);
  ASSERT_TRUE(client->raw().AbortStep(4, v1::ABORT_REASON_SKIPPED_STEP).has_step_aborted());
  for (const auto& [id, chunk] : kThreeDtypes) EXPECT_SAME_BYTES(client->Fetch(id, 0), committed[id]);

  const v1::GetStatsResponse stats = Stats();
  EXPECT_EQ(stats.weights_fetches(), 3u + 3u * (3u * 4u + 3u) + 1u + 3u);
  EXPECT_LE(stats.weights_fetch_cache_hits(), stats.weights_fetches());
  EXPECT_TRUE(client->raw().Close().ok());
}

// Hostile fetches are refused with their code, naming chunk and slot, and
// change nothing; the session goes on, and so does another session training
// beside it.
TEST_F(WeightsTest, HostileFetchesAreRefusedWhileAnotherSessionTrains) {
  const std::map<uint32_t, Chunk> chunks = {{0, {1000, v1::DTYPE_BFLOAT16}}, {1, {1000, v1::DTYPE_BFLOAT16}}};
  auto trainer = Open("trainer", chunks);
  auto hostile = Open("hostile", chunks);
  ASSERT_TRUE(trainer != nullptr && hostile != nullptr);
  std::map<uint32_t, Bytes> trained = InitialOf(chunks, 10);
  trainer->Register(trained);
  // The hostile job: chunk 0 stores its weights, chunk 1 does not.
  const std::map<uint32_t, Bytes> mine = InitialOf(chunks, 20);
  {
    v1::RegisterChunksResponse response;
    std::vector<v1::ChunkSpec> specs = {WeightsChunk(0, 1000, 0, v1::DTYPE_BFLOAT16, true),
                                        WeightsChunk(1, 1000, 1, v1::DTYPE_BFLOAT16, false)};
    std::memcpy(hostile->raw().ParamRegion(0).data(), mine.at(0).data(), mine.at(0).size());
    std::memcpy(hostile->raw().ParamRegion(1).data(), mine.at(1).data(), mine.at(1).size());
    ASSERT_TRUE(hostile->raw().Register(specs, &response).ok());
  }

  int64_t step = 0;
  auto train_one_step = [&] {
    ++step;
    std::map<uint32_t, Bytes> updated;
    for (const auto& [id, chunk] : chunks) {
      EXPECT_SAME_BYTES(trainer->Fetch(id, 0), trained[id]);
      updated[id] = trainer->Update(step, id, 1, step * 10 + id);
    }
    ASSERT_TRUE(trainer->raw().EndStep(step).has_step_committed());
    trained = updated;
  };

  struct Case {
    std::string what;
    uint32_t chunk_id;
    uint32_t slot;
    absl::StatusCode code;
    std::string names;  // text the message must contain
  };
  const std::vector<Case> cases = {
      {"an unknown chunk", 7, 0, absl::StatusCode::kInvalidArgument, "chunk 7 (into slot 0) is not registered"},
      {"a chunk id past every chunk", 0xFFFFFFFFu, 1, absl::StatusCode::kInvalidArgument, "chunk 4294967295"},
      {"a slot out of range", 0, kSlots, absl::StatusCode::kInvalidArgument, "slot 3 does not exist"},
      {"the largest slot", 0, 0xFFFFFFFFu, absl::StatusCode::kInvalidArgument, "slot 4294967295 does not exist"},
      {"a chunk without weights", 1, 0, absl::StatusCode::kFailedPrecondition, "without store_weights"},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.what);
    std::memset(hostile->raw().ParamRegion(0).data(), 0x5A, kSlotBytes);
    const v1::DaemonMessage reply = hostile->raw().Exchange(FetchOf(c.chunk_id, c.slot));
    ASSERT_TRUE(reply.has_error()) << Describe(reply);
    EXPECT_EQ(reply.error().code(), static_cast<int>(c.code)) << Describe(reply);
    EXPECT_NE(reply.error().message().find(c.names), std::string::npos) << reply.error().message();
    EXPECT_NE(reply.error().message().find("FetchWeights"), std::string::npos) << reply.error().message();
    ASSERT_TRUE(reply.error().has_chunk_id());
    EXPECT_EQ(reply.error().chunk_id(), c.chunk_id);
    EXPECT_FALSE(reply.error().has_step()) << "a refused fetch names no step";
    EXPECT_EQ(hostile->SlotBytes(0, 0), Bytes(2000, std::byte{0x5A})) << "a refused fetch writes nothing";
    train_one_step();
  }
  // An empty FetchWeights is a fetch of chunk 0 into slot 0: served.
  {
    v1::ClientMessage empty;
    empty.mutable_fetch_weights();
    EXPECT_TRUE(hostile->raw().Exchange(empty).has_weights_fetched());
  }
  // The hostile session is still usable; its job is untouched.
  EXPECT_SAME_BYTES(hostile->Fetch(0, 2), mine.at(0));
  train_one_step();
  EXPECT_TRUE(hostile->raw().Close().ok());

  // A resume with the other store_weights is refused, both ways, and changes nothing.
  for (bool store : {false, true}) {
    SCOPED_TRACE(store ? "store_weights on a chunk created without" : "no store_weights on a chunk created with");
    auto again = Open("hostile", chunks);
    ASSERT_NE(again, nullptr);
    v1::RegisterChunksResponse response;
    const uint32_t id = store ? 1 : 0;
    grpc::Status status = again->raw().Register({WeightsChunk(id, 1000, 0, v1::DTYPE_BFLOAT16, store)}, &response);
    EXPECT_EQ(status.error_code(), grpc::StatusCode::FAILED_PRECONDITION) << status.error_message();
    EXPECT_NE(status.error_message().find("store_weights"), std::string::npos) << status.error_message();
    EXPECT_NE(status.error_message().find("chunk " + std::to_string(id)), std::string::npos)
        << status.error_message();
    // Registered as created, it resumes with its weights.
    ASSERT_TRUE(again->raw().Register({WeightsChunk(0, 1000, 0, v1::DTYPE_BFLOAT16, true)}, &response).ok());
    EXPECT_TRUE(response.chunks(0).resumed());
    EXPECT_SAME_BYTES(again->SlotBytes(0, 0), mine.at(0));
    EXPECT_SAME_BYTES(again->Fetch(0, 1), mine.at(0));
    EXPECT_TRUE(again->raw().Close().ok());
    train_one_step();
  }
  EXPECT_TRUE(trainer->raw().Close().ok());
}

// Killed after commits, and in the middle of a step: the resume and a fetch
// give the last committed weights; a SIGTERM restart too.
TEST_F(WeightsTest, ARestartedDaemonGivesTheCommittedWeights) {
  std::map<uint32_t, Bytes> committed = InitialOf(kThreeDtypes, 30);
  {
    auto client = Open("restart", kThreeDtypes);
    ASSERT_NE(client, nullptr);
    client->Register(committed);
    for (int64_t step = 1; step <= 2; ++step) {
      std::map<uint32_t, Bytes> updated;
      for (const auto& [id, chunk] : kThreeDtypes) updated[id] = client->Update(step, id, id, step * 7 + id);
      ASSERT_TRUE(client->raw().EndStep(step).has_step_committed());
      committed = updated;
    }
    // Step 3 in flight: chunk 0 updated, not committed.
    client->Update(3, 0, 0, 99);
    daemon_->Kill();
  }
  for (const char* how : {"killed", "stopped"}) {
    SCOPED_TRACE(how);
    StartDaemon();
    auto client = Open("restart", kThreeDtypes);
    ASSERT_NE(client, nullptr);
    EXPECT_EQ(client->raw().committed_step(), 2);
    const v1::RegisterChunksResponse registered = client->Register(InitialOf(kThreeDtypes, 999));
    uint32_t slot = 0;
    for (const auto& [id, chunk] : kThreeDtypes) {  // the resume left the committed weights in the slots
      SCOPED_TRACE("chunk " + std::to_string(id));
      EXPECT_TRUE(registered.chunks(static_cast<int>(slot)).resumed());
      EXPECT_SAME_BYTES(client->SlotBytes(id, slot), committed[id]);
      ++slot;
    }
    for (const auto& [id, chunk] : kThreeDtypes) {
      SCOPED_TRACE("chunk " + std::to_string(id));
      int64_t step = -1;
      EXPECT_SAME_BYTES(client->Fetch(id, (id + 1) % kSlots, &step), committed[id]);
      EXPECT_EQ(step, 2);
    }
    EXPECT_TRUE(client->raw().Close().ok());
    EXPECT_EQ(daemon_->Stop(), 0);
  }
}

// Item 1 of issue 12: with states larger than the DRAM budget, a step that
// fetches every chunk forward, then backward in reverse before its update,
// reads at most two copies of the working weights from storage, and only the
// weights (2 bytes a parameter in bf16, never the fp32 master's 4).
TEST_F(WeightsTest, BeyondTheBudgetAStepReadsTheWeightsAtMostTwiceAndNeverTheMaster) {
  constexpr uint32_t kChunks = 16;
  constexpr uint64_t kN = 512 * 1024;  // 6 MiB of states and 1 MiB of bf16 weights a chunk: 112 MiB in all
  constexpr uint32_t kBigSlots = 4;
  constexpr uint64_t kBigSlotBytes = kN * 4;
  std::map<uint32_t, Chunk> chunks;
  for (uint32_t id = 0; id < kChunks; ++id) chunks[id] = {kN, v1::DTYPE_BFLOAT16};
  auto client = Open("big", chunks, kBigSlots, kBigSlotBytes);
  ASSERT_NE(client, nullptr);
  // Registered kBigSlots at a time (one slot per chunk in a request).
  std::map<uint32_t, Bytes> committed;
  for (uint32_t first = 0; first < kChunks; first += kBigSlots) {
    std::map<uint32_t, Bytes> batch;
    for (uint32_t id = first; id < first + kBigSlots; ++id) batch[id] = InitialWeights(id, kN, v1::DTYPE_BFLOAT16);
    client->Register(batch);
    committed.insert(batch.begin(), batch.end());
  }
  const uint64_t weights_bytes = kChunks * kN * 2;  // one copy of every chunk's weights
  const uint64_t master_bytes = kChunks * kN * 4;   // one copy of every chunk's fp32 master
  const uint64_t extent_bytes = kChunks * kN * 14;  // every chunk's extent: master, m, v and weights

  for (int64_t step = 1; step <= 4; ++step) {
    SCOPED_TRACE("step " + std::to_string(step));
    const v1::GetStatsResponse before = Stats();
    for (uint32_t id = 0; id < kChunks; ++id) {  // forward
      EXPECT_SAME_BYTES(client->Fetch(id, id % 2), committed[id]);
    }
    std::map<uint32_t, Bytes> updated;
    for (uint32_t id = kChunks; id-- > 0;) {  // backward
      EXPECT_SAME_BYTES(client->Fetch(id, id % 2), committed[id]);
      updated[id] = client->Update(step, id, 2 + id % 2, step * 100 + id);
    }
    ASSERT_TRUE(client->raw().EndStep(step).has_step_committed());
    committed = updated;
    const v1::GetStatsResponse after = Stats();
    const uint64_t fetches = after.weights_fetches() - before.weights_fetches();
    const uint64_t hits = after.weights_fetch_cache_hits() - before.weights_fetch_cache_hits();
    const uint64_t read = after.weights_bytes_read() - before.weights_bytes_read();
    const uint64_t storage_read = after.bytes_read() - before.bytes_read();
    EXPECT_EQ(fetches, 2u * kChunks);
    EXPECT_LE(hits, fetches);
    EXPECT_LE(read, 2 * weights_bytes) << "more than one read of the weights for forward and one for backward";
    EXPECT_EQ(read % 4096, 0u) << "weights are read in whole blocks of their own region";
    // Never the master: everything the step read from storage is the updates'
    // states (each chunk's extent at most once) plus the weights counted.
    EXPECT_LE(storage_read, extent_bytes + read) << "storage reads beyond the updates' states and the weights";
    std::printf("[figures] step %lld: %llu fetches, %llu from DRAM, %.2f MiB of weights read (a copy: %.2f MiB; "
                "the master: %.2f MiB), %.2f MiB read in all\n",
                static_cast<long long>(step), static_cast<unsigned long long>(fetches),
                static_cast<unsigned long long>(hits), read / 1048576.0, weights_bytes / 1048576.0,
                master_bytes / 1048576.0, storage_read / 1048576.0);
  }
  EXPECT_TRUE(client->raw().Close().ok());
}

// GetStats fields 24-26 in both scopes, and fuyouctl stats' "weights" line:
// another user (weights_client, run as nobody) sees its own fetches only;
// root sees the whole daemon's.
TEST(WeightsStatsTest, EachUserSeesTheirOwnFetchesAndFuyouctlPrintsThem) {
  if (::geteuid() != 0) GTEST_SKIP() << "skipped: needs root to act as a second user";
  constexpr uid_t kNobody = 65534;
  TempDir dir;
  ::chmod(dir.path().c_str(), 01777);  // nobody must reach the socket and write its output (sticky, as fuyoud requires)
  DaemonProcess daemon(dir.path(), {"--dram-budget", "64MiB", "--socket-mode", "0666", "--drain-seconds", "0"});
  absl::Status started = daemon.Start();
  ASSERT_TRUE(started.ok()) << Text(started);
  {
    // Root: five fetches of one chunk.
    auto session = RawSession::Open(daemon.client_options(), "roots-job", 2, 4096);
    ASSERT_TRUE(session.ok()) << Text(session.status());
    v1::RegisterChunksResponse registered;
    ASSERT_TRUE((*session)->Register({WeightsChunk(0, 1000, 0, v1::DTYPE_BFLOAT16)}, &registered).ok());
    for (int i = 0; i < 5; ++i) ASSERT_TRUE((*session)->Exchange(FetchOf(0, 1)).has_weights_fetched());
    EXPECT_TRUE((*session)->Close().ok());
  }
  std::string output;
  ASSERT_EQ(RunAs(kNobody, WEIGHTS_CLIENT_PATH, {daemon.socket_path().string(), "nobodys-job", "3"},
                  dir.path() / "client.out", &output),
            0)
      << output;
  auto mine = KeyValues(output);
  EXPECT_EQ(mine["scope"], std::to_string(v1::STATS_SCOPE_USER)) << output;
  EXPECT_EQ(mine["weights_fetches"], "3") << "root's fetches must not show";
  EXPECT_LE(std::stoull(mine["weights_fetch_cache_hits"]), 3u);

  auto admin = AdminClient::Connect(daemon.client_options());
  ASSERT_TRUE(admin.ok());
  auto all = (*admin)->GetStats();
  ASSERT_TRUE(all.ok()) << Text(all.status());
  EXPECT_EQ(all->scope(), v1::STATS_SCOPE_DAEMON);
  EXPECT_EQ(all->weights_fetches(), 8u);
  EXPECT_LE(all->weights_fetch_cache_hits(), 8u);
  EXPECT_GE(all->weights_bytes_read(), std::stoull(mine["weights_bytes_read"]));

  // fuyouctl stats prints them on its "weights" line, in each scope.
  ASSERT_EQ(RunAs(0, FUYOUCTL_PATH, {"--socket", daemon.socket_path().string(), "stats"}, dir.path() / "ctl.out",
                  &output),
            0)
      << output;
  EXPECT_NE(output.find(fmt::format("weights      fetches 8, {} from DRAM", all->weights_fetch_cache_hits())),
            std::string::npos)
      << output;
  ASSERT_EQ(RunAs(kNobody, FUYOUCTL_PATH, {"--socket", daemon.socket_path().string(), "stats"},
                  dir.path() / "ctl-nobody.out", &output),
            0)
      << output;
  EXPECT_NE(output.find("fetches 3, " + mine["weights_fetch_cache_hits"] + " from DRAM"), std::string::npos)
      << output;
}

}  // namespace
}  // namespace fuyou::testing
