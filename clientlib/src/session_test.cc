// Session against a fake in-process Offload service: the fake serves on a Unix
// socket in a temporary directory, takes the client's memfd segment on a segment
// socket beside it (fuyou/segment_handover.h), maps it and writes its header,
// and answers the stream the way fuyoud does, with a few chunk ids that misbehave:
//   chunk 999: every GradReady is refused with FAILED_PRECONDITION;
//   chunk 777: GradReady is never answered (to test waits and shutdown);
//   EndStep 113: refused with an Error that names the step, not a chunk.
// "Updated" weights are deterministic: new[i] = grad[i] * 2 + step (float32).
#include <fcntl.h>
#include <poll.h>
#include <stdlib.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <cstring>
#include <filesystem>
#include <map>
#include <mutex>
#include <set>
#include <thread>
#include <vector>

#include "fmt/format.h"
#include "fuyou/client.h"
#include "fuyou/segment_handover.h"
#include "fuyou/segment_layout.h"
#include "fuyou/v1/offload.grpc.pb.h"
#include "grpcpp/server.h"
#include "grpcpp/server_builder.h"
#include "test_support/temp_dir.h"

namespace fuyou {
namespace {

using std::chrono::milliseconds;
using Clock = std::chrono::steady_clock;

constexpr uint32_t kRefusedChunk = 999;
constexpr uint32_t kSilentChunk = 777;
constexpr int64_t kRefusedStep = 113;

class FakeOffload final : public v1::Offload::Service {
 public:
  enum class HeaderFault { kNone, kBadMagic, kWrongSlots };

  ~FakeOffload() override { Unmap(); }

  std::atomic<HeaderFault> header_fault{HeaderFault::kNone};
  // Set: every handover is answered with this error instead of taken.
  absl::Status refuse_segment;
  std::string segment_socket;  // what OpenSession names
  std::atomic<int> segments_received{0};
  std::atomic<int> last_segment_seals{0};
  std::atomic<int> close_calls{0};
  std::atomic<int> grad_ready_seen{0};
  std::atomic<int> fetches_seen{0};
  std::atomic<bool> silent_chunk_arrived{false};

  // Chunks the "job" already has: resumed by RegisterChunks.
  void AddExistingChunk(uint32_t chunk_id, std::vector<float> weights, int64_t updates,
                        std::vector<int64_t> segment_updates = {}) {
    std::lock_guard lock(mu_);
    store_[chunk_id] = StoredChunk{std::move(weights), updates, std::move(segment_updates)};
  }
  // What the client sent last, as the daemon received it.
  v1::ChunkSpec LastSpec() {
    std::lock_guard lock(mu_);
    return last_spec_;
  }
  v1::GradReady LastGradReady() {
    std::lock_guard lock(mu_);
    return last_grad_ready_;
  }
  v1::AbortStep LastAbortStep() {
    std::lock_guard lock(mu_);
    return last_abort_;
  }
  std::vector<float> StoredWeights(uint32_t chunk_id) {
    std::lock_guard lock(mu_);
    return store_[chunk_id].weights;
  }

  grpc::Status OpenSession(grpc::ServerContext*, const v1::OpenSessionRequest* request,
                           v1::OpenSessionResponse* response) override {
    std::lock_guard lock(mu_);
    Unmap();
    layout_ = *SegmentLayout::Checked(request->num_slots(), request->slot_bytes(), UINT64_MAX);
    size_ = layout_.TotalBytes();
    registered_.clear();
    session_id_ = fmt::format("fake-{}", ++sessions_);
    response->set_session_id(session_id_);
    response->set_segment_socket(segment_socket);
    response->set_segment_bytes(size_);
    response->set_num_slots(layout_.num_slots);
    response->set_slot_bytes(layout_.slot_bytes);
    response->set_committed_step(committed_);
    response->set_existing_chunks(static_cast<uint32_t>(store_.size()));
    return grpc::Status::OK;
  }

  grpc::Status RegisterChunks(grpc::ServerContext*, const v1::RegisterChunksRequest* request,
                              v1::RegisterChunksResponse* response) override {
    std::lock_guard lock(mu_);
    for (const v1::ChunkSpec& spec : request->chunks()) {
      if (spec.slot() >= layout_.num_slots) {
        return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT, fmt::format("slot {} out of range", spec.slot()));
      }
      last_spec_ = spec;
      float* region = Param(spec.slot());
      v1::RegisteredChunk* result = response->add_chunks();
      result->set_chunk_id(spec.chunk_id());
      auto it = store_.find(spec.chunk_id());
      if (it != store_.end()) {
        std::memcpy(region, it->second.weights.data(), it->second.weights.size() * sizeof(float));
        result->set_resumed(true);
        result->set_update_count(it->second.updates);
        for (int64_t count : it->second.segment_updates) result->add_segment_update_counts(count);
      } else {
        store_[spec.chunk_id()] = StoredChunk{std::vector<float>(region, region + spec.num_elements()), 0, {}};
      }
      registered_[spec.chunk_id()] = spec.num_elements();
      if (spec.store_weights()) stores_weights_.insert(spec.chunk_id());
    }
    return grpc::Status::OK;
  }

  grpc::Status Stream(grpc::ServerContext*,
                      grpc::ServerReaderWriter<v1::DaemonMessage, v1::ClientMessage>* stream) override {
    v1::ClientMessage in;
    if (!stream->Read(&in) || !in.has_attach()) {
      return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT, "first message must be Attach");
    }
    {
      std::lock_guard lock(mu_);
      if (base_ == nullptr) return grpc::Status(grpc::StatusCode::FAILED_PRECONDITION, "send the segment first");
    }
    v1::DaemonMessage out;
    out.mutable_attached()->set_session_id(in.attach().session_id());
    stream->Write(out);
    std::map<int64_t, uint32_t> updated_in_step;
    while (stream->Read(&in)) {
      out.Clear();
      if (in.has_grad_ready()) {
        ++grad_ready_seen;
        const v1::GradReady& ready = in.grad_ready();
        if (ready.chunk_id() == kSilentChunk) {
          silent_chunk_arrived = true;
          continue;
        }
        std::lock_guard lock(mu_);
        last_grad_ready_ = ready;
        auto known = registered_.find(ready.chunk_id());
        if (ready.chunk_id() == kRefusedChunk || known == registered_.end()) {
          v1::Error* error = out.mutable_error();
          if (known == registered_.end()) {
            error->set_code(static_cast<int>(grpc::StatusCode::INVALID_ARGUMENT));
            error->set_message(fmt::format("chunk {} is not registered (fake)", ready.chunk_id()));
          } else {
            error->set_code(static_cast<int>(grpc::StatusCode::FAILED_PRECONDITION));
            error->set_message(fmt::format("chunk {} in slot {} refused by the fake daemon", ready.chunk_id(),
                                           ready.slot()));
          }
          error->set_chunk_id(ready.chunk_id());
          error->set_step(ready.step());
        } else {
          const float* grad = Grad(ready.slot());
          float* param = Param(ready.slot());
          for (uint64_t i = 0; i < known->second; ++i) {
            param[i] = grad[i] * 2 + static_cast<float>(ready.step());
          }
          ++updated_in_step[ready.step()];
          out.mutable_params_ready()->set_step(ready.step());
          out.mutable_params_ready()->set_chunk_id(ready.chunk_id());
          out.mutable_params_ready()->set_slot(ready.slot());
          if (ready.journal() != v1::JOURNAL_USE_UNSPECIFIED) {  // stats the test can recognise
            out.mutable_params_ready()->add_segment_sum_squares(ready.step() + 0.5);
            out.mutable_params_ready()->add_segment_max_abs(static_cast<float>(ready.grad_ops_size()));
          }
        }
      } else if (in.has_fetch_weights()) {
        // As fuyoud: the chunk's stored weights into the slot's parameter
        // region; a refusal names the chunk and no step.
        const v1::FetchWeights& fetch = in.fetch_weights();
        std::lock_guard lock(mu_);
        ++fetches_seen;
        if (fetch.chunk_id() == kSilentChunk) continue;  // never answered
        if (fetch.chunk_id() == kRefusedChunk || stores_weights_.count(fetch.chunk_id()) == 0) {
          out.mutable_error()->set_code(static_cast<int>(grpc::StatusCode::FAILED_PRECONDITION));
          out.mutable_error()->set_message(
              fmt::format("fetch of chunk {} into slot {} refused by the fake daemon", fetch.chunk_id(), fetch.slot()));
          out.mutable_error()->set_chunk_id(fetch.chunk_id());
        } else {
          const std::vector<float>& weights = store_[fetch.chunk_id()].weights;
          std::memcpy(Param(fetch.slot()), weights.data(), weights.size() * sizeof(float));
          out.mutable_weights_fetched()->set_chunk_id(fetch.chunk_id());
          out.mutable_weights_fetched()->set_slot(fetch.slot());
          out.mutable_weights_fetched()->set_step(committed_);
        }
      } else if (in.has_end_step()) {
        const int64_t step = in.end_step().step();
        if (step == kRefusedStep) {
          out.mutable_error()->set_code(static_cast<int>(grpc::StatusCode::FAILED_PRECONDITION));
          out.mutable_error()->set_message(fmt::format("step {} is not the next step (fake)", step));
          out.mutable_error()->set_step(step);
        } else {
          committed_ = step;
          out.mutable_step_committed()->set_step(step);
          out.mutable_step_committed()->set_chunks_updated(updated_in_step[step]);
        }
      } else if (in.has_abort_step()) {
        {
          std::lock_guard lock(mu_);
          last_abort_ = in.abort_step();
        }
        out.mutable_step_aborted()->set_step(in.abort_step().step());
      } else {
        continue;
      }
      stream->Write(out);
    }
    return grpc::Status::OK;
  }

  // A handover on the segment socket: maps the memfd and writes the header, as
  // fuyoud does (with the header faults asked for).
  absl::Status ReceiveSegment(const std::string& id, int fd) {
    std::lock_guard lock(mu_);
    if (!refuse_segment.ok()) return refuse_segment;
    if (id != session_id_) return absl::NotFoundError(fmt::format("no open session has id '{}'", id));
    last_segment_seals = ::fcntl(fd, F_GET_SEALS);
    base_ = static_cast<std::byte*>(::mmap(nullptr, size_, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0));
    if (base_ == MAP_FAILED) {
      base_ = nullptr;
      return absl::InternalError("mmap failed");
    }
    SegmentHeader header{kSegmentMagic, layout_.num_slots, 0, layout_.slot_bytes, size_};
    if (header_fault == HeaderFault::kBadMagic) header.magic = 0x1234;
    if (header_fault == HeaderFault::kWrongSlots) header.num_slots += 1;
    std::memcpy(base_, &header, sizeof(header));
    ++segments_received;
    return absl::OkStatus();
  }

  grpc::Status CloseSession(grpc::ServerContext*, const v1::CloseSessionRequest*,
                            v1::CloseSessionResponse* response) override {
    ++close_calls;
    response->set_committed_step(committed_);
    return grpc::Status::OK;
  }

 private:
  struct StoredChunk {
    std::vector<float> weights;
    int64_t updates = 0;
    std::vector<int64_t> segment_updates;
  };

  float* Grad(uint32_t slot) { return reinterpret_cast<float*>(base_ + layout_.GradOffset(slot)); }
  float* Param(uint32_t slot) { return reinterpret_cast<float*>(base_ + layout_.ParamOffset(slot)); }
  void Unmap() {
    if (base_ != nullptr) ::munmap(base_, size_);
    base_ = nullptr;
  }

  std::mutex mu_;
  SegmentLayout layout_;
  std::string session_id_;
  std::byte* base_ = nullptr;
  uint64_t size_ = 0;
  int sessions_ = 0;
  std::atomic<int64_t> committed_{0};
  std::map<uint32_t, StoredChunk> store_;
  std::map<uint32_t, uint64_t> registered_;  // chunk -> elements, this session
  std::set<uint32_t> stores_weights_;        // chunks registered with store_weights
  v1::ChunkSpec last_spec_;
  v1::GradReady last_grad_ready_;
  v1::AbortStep last_abort_;
};

// The segment socket of the fake: one handover at a time, on its own thread.
class FakeSegmentSocket {
 public:
  FakeSegmentSocket(const std::string& path, FakeOffload& fake) : fake_(fake) {
    listen_fd_ = ::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
    sockaddr_un address{};
    address.sun_family = AF_UNIX;
    std::strncpy(address.sun_path, path.c_str(), sizeof(address.sun_path) - 1);
    EXPECT_EQ(::bind(listen_fd_, reinterpret_cast<sockaddr*>(&address), sizeof address), 0);
    EXPECT_EQ(::listen(listen_fd_, 16), 0);
    EXPECT_EQ(::pipe2(stop_, O_CLOEXEC), 0);
    thread_ = std::thread([this] { Serve(); });
  }
  ~FakeSegmentSocket() {
    (void)::write(stop_[1], "x", 1);
    thread_.join();
    ::close(listen_fd_);
    ::close(stop_[0]);
    ::close(stop_[1]);
  }

 private:
  void Serve() {
    for (;;) {
      pollfd fds[2] = {{listen_fd_, POLLIN, 0}, {stop_[0], POLLIN, 0}};
      if (::poll(fds, 2, -1) < 0 || fds[1].revents != 0) return;
      const int connection = ::accept4(listen_fd_, nullptr, nullptr, SOCK_CLOEXEC);
      if (connection < 0) continue;
      char buffer[kMaxHandoverMessageBytes];
      alignas(cmsghdr) char control[CMSG_SPACE(sizeof(int))];
      iovec data{buffer, sizeof buffer};
      msghdr message{};
      message.msg_iov = &data;
      message.msg_iovlen = 1;
      message.msg_control = control;
      message.msg_controllen = sizeof control;
      const ssize_t got = ::recvmsg(connection, &message, MSG_CMSG_CLOEXEC);
      int fd = -1;
      cmsghdr* header = got > 0 ? CMSG_FIRSTHDR(&message) : nullptr;
      if (header != nullptr && header->cmsg_type == SCM_RIGHTS) std::memcpy(&fd, CMSG_DATA(header), sizeof fd);
      const std::string text(buffer, got > 0 ? static_cast<size_t>(got) : 0);
      absl::Status status = absl::InvalidArgumentError("malformed handover");
      if (fd >= 0 && !text.empty() && text.back() == '\n') {
        status = fake_.ReceiveSegment(text.substr(0, text.size() - 1), fd);
      }
      if (fd >= 0) ::close(fd);
      const std::string reply = FormatHandoverReply(status);
      (void)::send(connection, reply.data(), reply.size(), MSG_NOSIGNAL);
      ::close(connection);
    }
  }

  FakeOffload& fake_;
  int listen_fd_ = -1;
  int stop_[2] = {-1, -1};
  std::thread thread_;
};

std::span<std::byte> Bytes(std::vector<float>& v) { return std::as_writable_bytes(std::span(v)); }
std::span<const std::byte> ConstBytes(const std::vector<float>& v) { return std::as_bytes(std::span(v)); }

ChunkSpec Float32Chunk(uint32_t id, uint64_t elements) {
  return ChunkSpec{.chunk_id = id, .num_elements = elements};
}

bool Contains(const absl::Status& status, std::string_view text) {
  return std::string(status.message()).find(text) != std::string::npos;
}

class SessionTest : public ::testing::Test {
 protected:
  void SetUp() override {
    address_ = "unix:" + dir_ + "/fuyoud.sock";
    fake_.segment_socket = dir_ + "/fuyoud.sock" + std::string(kSegmentSocketSuffix);
    segment_socket_ = std::make_unique<FakeSegmentSocket>(fake_.segment_socket, fake_);
    grpc::ServerBuilder builder;
    builder.AddListeningPort(address_, grpc::InsecureServerCredentials());
    builder.RegisterService(&fake_);
    server_ = builder.BuildAndStart();
    ASSERT_NE(server_, nullptr);
  }
  void TearDown() override {
    ShutdownServer();
    segment_socket_.reset();
  }
  void ShutdownServer() {
    if (server_ != nullptr) {
      server_->Shutdown(std::chrono::system_clock::now() + milliseconds(200));
      server_->Wait();
      server_.reset();
    }
  }

  ClientOptions Client() const {
    ClientOptions client;
    client.address = address_;
    client.rpc_timeout = milliseconds(10000);
    client.connect_timeout = milliseconds(2000);
    return client;
  }
  absl::StatusOr<std::unique_ptr<Session>> Open(uint32_t slots = 2, uint64_t slot_bytes = 4000) {
    return Session::Open({.job = "test-job", .num_slots = slots, .slot_bytes = slot_bytes}, Client());
  }

  const TempDir temp_dir_{"fuyou-session-test"};
  const std::string dir_ = temp_dir_.path().string();
  std::string address_;
  FakeOffload fake_;
  std::unique_ptr<FakeSegmentSocket> segment_socket_;
  std::unique_ptr<grpc::Server> server_;
};

TEST(SessionOpenTest, NothingListeningIsUnavailableWithinTheConnectTimeout) {
  const TempDir dir("fuyou-session-test");
  const std::string path = dir.path().string() + "/fuyoud.sock";
  ClientOptions client;
  client.address = "unix:" + path;
  client.connect_timeout = milliseconds(1000);
  const auto start = Clock::now();
  absl::StatusOr<std::unique_ptr<Session>> session =
      Session::Open({.job = "j", .num_slots = 1, .slot_bytes = 4096}, client);
  EXPECT_LT(Clock::now() - start, std::chrono::seconds(10));
  EXPECT_EQ(session.status().code(), absl::StatusCode::kUnavailable);
  EXPECT_TRUE(Contains(session.status(), path)) << session.status();
  EXPECT_TRUE(Contains(session.status(), "is the daemon running?")) << session.status();
}

TEST(SessionOpenTest, BadOptionsAreRefusedLocally) {
  ClientOptions client;
  client.address = "unix:/nonexistent/fuyoud.sock";
  EXPECT_EQ(Session::Open({.job = "", .slot_bytes = 4096}, client).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(Session::Open({.job = "j", .num_slots = 65, .slot_bytes = 4096}, client).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(Session::Open({.job = "j", .slot_bytes = 0}, client).status().code(),
            absl::StatusCode::kInvalidArgument);
}

TEST(DefaultAddressTest, FollowsFuyouSocket) {
  ::setenv("FUYOU_SOCKET", "/tmp/x/fuyoud.sock", 1);
  EXPECT_EQ(DefaultAddress(), "unix:/tmp/x/fuyoud.sock");
  ::unsetenv("FUYOU_SOCKET");
}

TEST_F(SessionTest, RegisterPushPullEndStepClose) {
  absl::StatusOr<std::unique_ptr<Session>> session = Open(2, 4000);
  ASSERT_TRUE(session.ok()) << session.status();
  Session& s = **session;
  EXPECT_EQ(s.session_id(), "fake-1");
  EXPECT_EQ(s.num_slots(), 2u);
  EXPECT_EQ(s.slot_bytes(), 4096u);  // rounded up by the daemon
  EXPECT_EQ(s.committed_step(), 0);

  std::vector<float> weights(1000);
  for (size_t i = 0; i < weights.size(); ++i) weights[i] = static_cast<float>(i) * 0.5f;
  absl::StatusOr<RegisterResult> registered = s.RegisterChunk(Float32Chunk(1, 1000), Bytes(weights));
  ASSERT_TRUE(registered.ok()) << registered.status();
  EXPECT_FALSE(registered->resumed);
  EXPECT_EQ(fake_.StoredWeights(1), weights);  // initial weights went through the slot

  std::vector<float> grads(1000);
  for (size_t i = 0; i < grads.size(); ++i) grads[i] = static_cast<float>(i);
  ASSERT_TRUE(s.PushGradients(1, 1, AdamWHyper{}, ConstBytes(grads)).ok());
  ASSERT_TRUE(s.PullParams(1, Bytes(weights)).ok());
  for (size_t i = 0; i < weights.size(); ++i) ASSERT_EQ(weights[i], grads[i] * 2 + 1) << i;

  absl::StatusOr<StepResult> committed = s.EndStep(1);
  ASSERT_TRUE(committed.ok()) << committed.status();
  EXPECT_EQ(committed->step, 1);
  EXPECT_EQ(committed->chunks_updated, 1u);
  EXPECT_EQ(s.committed_step(), 1);
  EXPECT_TRUE(s.AbortStep(2).ok());

  EXPECT_TRUE(s.Close().ok());
  EXPECT_EQ(fake_.close_calls, 1);
  EXPECT_TRUE(s.Close().ok());  // idempotent
  EXPECT_EQ(fake_.close_calls, 1);
  absl::Status after = s.PushGradients(1, 2, AdamWHyper{}, ConstBytes(grads));
  EXPECT_EQ(after.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_TRUE(Contains(after, "closed")) << after;
}

TEST_F(SessionTest, TheSegmentIsASealedMemfdHandedOverOnTheSegmentSocket) {
  std::set<std::string> shm_before;
  for (const auto& entry : std::filesystem::directory_iterator("/dev/shm")) shm_before.insert(entry.path().string());
  absl::StatusOr<std::unique_ptr<Session>> session = Open();
  ASSERT_TRUE(session.ok()) << session.status();
  EXPECT_EQ(fake_.segments_received, 1);
  const int seals = fake_.last_segment_seals;
  EXPECT_EQ(seals & (F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL), F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL);
  // Nothing is named in /dev/shm, and the client keeps no fd of its segment.
  for (const auto& entry : std::filesystem::directory_iterator("/dev/shm")) {
    EXPECT_EQ(shm_before.count(entry.path().string()), 1u) << entry.path();
  }
  for (const auto& entry : std::filesystem::directory_iterator("/proc/self/fd")) {
    std::error_code ec;
    EXPECT_EQ(std::filesystem::read_symlink(entry.path(), ec).string().find("memfd:fuyou-segment"), std::string::npos);
  }
}

TEST_F(SessionTest, ASegmentTheDaemonRefusesFailsOpenWithItsStatus) {
  fake_.refuse_segment =
      absl::FailedPreconditionError("the segment must be a memfd sealed with F_SEAL_SHRINK|F_SEAL_GROW");
  absl::StatusOr<std::unique_ptr<Session>> session = Open();
  EXPECT_EQ(session.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_TRUE(Contains(session.status(), "handing the segment of job 'test-job' (session fake-1) to fuyoud failed"))
      << session.status();
  EXPECT_TRUE(Contains(session.status(), "F_SEAL_SHRINK|F_SEAL_GROW")) << session.status();
  EXPECT_EQ(fake_.close_calls, 1);  // the daemon is told to free the session
}

TEST_F(SessionTest, ADaemonThatNamesNoSegmentSocketIsRefused) {
  fake_.segment_socket = "";
  absl::StatusOr<std::unique_ptr<Session>> session = Open();
  EXPECT_EQ(session.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_TRUE(Contains(session.status(), "named no segment socket")) << session.status();
}

TEST_F(SessionTest, ExistingChunkIsResumedIntoTheWeights) {
  fake_.AddExistingChunk(5, std::vector<float>(10, 42.0f), 7);
  absl::StatusOr<std::unique_ptr<Session>> session = Open();
  ASSERT_TRUE(session.ok()) << session.status();
  std::vector<float> weights(10, 0.0f);
  absl::StatusOr<RegisterResult> registered = (*session)->RegisterChunk(Float32Chunk(5, 10), Bytes(weights));
  ASSERT_TRUE(registered.ok()) << registered.status();
  EXPECT_TRUE(registered->resumed);
  EXPECT_EQ(registered->update_count, 7);
  EXPECT_EQ(weights, std::vector<float>(10, 42.0f));
  EXPECT_EQ((*session)->RegisterChunk(Float32Chunk(5, 10), Bytes(weights)).status().code(),
            absl::StatusCode::kAlreadyExists);
}

TEST_F(SessionTest, ChunkErrorComesBackFromPullParamsAndFreesTheSlot) {
  absl::StatusOr<std::unique_ptr<Session>> session = Open(/*slots=*/1);
  ASSERT_TRUE(session.ok()) << session.status();
  Session& s = **session;
  std::vector<float> weights(100, 1.0f), grads(100, 1.0f);
  ASSERT_TRUE(s.RegisterChunk(Float32Chunk(kRefusedChunk, 100), Bytes(weights)).ok());
  ASSERT_TRUE(s.RegisterChunk(Float32Chunk(1, 100), Bytes(weights)).ok());

  ASSERT_TRUE(s.PushGradients(kRefusedChunk, 1, AdamWHyper{}, ConstBytes(grads)).ok());
  absl::Status pulled = s.PullParams(kRefusedChunk, Bytes(weights));
  EXPECT_EQ(pulled.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(pulled.message(), "chunk 999 in slot 0 refused by the fake daemon");
  EXPECT_EQ(weights, std::vector<float>(100, 1.0f));  // untouched

  // The only slot was freed: another chunk goes through, and the session is usable.
  ASSERT_TRUE(s.PushGradients(1, 1, AdamWHyper{}, ConstBytes(grads)).ok());
  ASSERT_TRUE(s.PullParams(1, Bytes(weights)).ok());
  EXPECT_EQ(weights, std::vector<float>(100, 3.0f));
  EXPECT_TRUE(s.EndStep(1).ok());
}

TEST_F(SessionTest, DaemonValidatesWhatSendGradReadySends) {
  absl::StatusOr<std::unique_ptr<Session>> session = Open();
  ASSERT_TRUE(session.ok()) << session.status();
  Session& s = **session;
  absl::StatusOr<uint32_t> slot = s.AcquireSlot(milliseconds(1000));
  ASSERT_TRUE(slot.ok()) << slot.status();
  ASSERT_TRUE(s.SendGradReady(/*chunk_id=*/42, *slot, 1, AdamWHyper{}).ok());
  absl::StatusOr<uint32_t> ready = s.WaitParams(42, milliseconds(5000));
  EXPECT_EQ(ready.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(Contains(ready.status(), "chunk 42 is not registered")) << ready.status();
}

TEST_F(SessionTest, ZeroCopyApi) {
  absl::StatusOr<std::unique_ptr<Session>> session = Open();
  ASSERT_TRUE(session.ok()) << session.status();
  Session& s = **session;
  std::vector<float> weights(16, 0.0f);
  ASSERT_TRUE(s.RegisterChunk(Float32Chunk(3, 16), Bytes(weights)).ok());
  absl::StatusOr<uint32_t> slot = s.AcquireSlot(milliseconds(1000));
  ASSERT_TRUE(slot.ok()) << slot.status();
  ASSERT_EQ(s.GradRegion(*slot).size(), s.slot_bytes());
  EXPECT_TRUE(s.GradRegion(s.num_slots()).empty());
  auto* grad = reinterpret_cast<float*>(s.GradRegion(*slot).data());
  for (int i = 0; i < 16; ++i) grad[i] = static_cast<float>(i);
  ASSERT_TRUE(s.SendGradReady(3, *slot, 1, AdamWHyper{}).ok());
  // Sending the chunk again before taking its parameters is refused.
  EXPECT_EQ(s.SendGradReady(3, *slot, 1, AdamWHyper{}).code(), absl::StatusCode::kFailedPrecondition);
  absl::StatusOr<uint32_t> ready = s.WaitParams(3, milliseconds(5000));
  ASSERT_TRUE(ready.ok()) << ready.status();
  EXPECT_EQ(*ready, *slot);
  const auto* param = reinterpret_cast<const float*>(s.ParamRegion(*ready).data());
  for (int i = 0; i < 16; ++i) EXPECT_EQ(param[i], static_cast<float>(i) * 2 + 1);
  s.ReleaseSlot(*ready);
  EXPECT_EQ(s.WaitParams(3, milliseconds(10)).status().code(), absl::StatusCode::kFailedPrecondition);
}

TEST_F(SessionTest, BadArgumentsAreRefusedLocally) {
  absl::StatusOr<std::unique_ptr<Session>> session = Open(2, 4096);
  ASSERT_TRUE(session.ok()) << session.status();
  Session& s = **session;
  std::vector<float> weights(1024), grads(1024);

  absl::Status unknown = s.PushGradients(3, 1, AdamWHyper{}, ConstBytes(grads));
  EXPECT_EQ(unknown.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(Contains(unknown, "chunk 3 is not registered")) << unknown;

  absl::Status too_big = s.RegisterChunk(Float32Chunk(1, 1025), Bytes(weights)).status();
  EXPECT_EQ(too_big.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(Contains(too_big, "slot_bytes")) << too_big;

  ChunkSpec no_dtype = Float32Chunk(1, 1024);
  no_dtype.grad_dtype = DType::kUnspecified;
  EXPECT_EQ(s.RegisterChunk(no_dtype, Bytes(weights)).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(s.RegisterChunk(Float32Chunk(1, 0), {}).status().code(), absl::StatusCode::kInvalidArgument);
  absl::Status wrong_size = s.RegisterChunk(Float32Chunk(1, 512), Bytes(weights)).status();
  EXPECT_EQ(wrong_size.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(Contains(wrong_size, "weights are 4096 bytes, expected 2048")) << wrong_size;

  ASSERT_TRUE(s.RegisterChunk(Float32Chunk(1, 1024), Bytes(weights)).ok());
  std::vector<float> short_grads(10);
  EXPECT_EQ(s.PushGradients(1, 1, AdamWHyper{}, ConstBytes(short_grads)).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(s.PullParams(1, Bytes(short_grads)).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(s.SendGradReady(1, /*slot=*/0, 1, AdamWHyper{}).code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(s.SendGradReady(1, /*slot=*/9, 1, AdamWHyper{}).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(fake_.grad_ready_seen, 0);
}

TEST_F(SessionTest, SegmentsSpeculationRedoAndAbortReasonReachTheDaemon) {
  absl::StatusOr<std::unique_ptr<Session>> session = Open();
  ASSERT_TRUE(session.ok()) << session.status();
  Session& s = **session;
  std::vector<float> weights(16, 0.0f);
  ChunkSpec spec = Float32Chunk(3, 16);
  spec.segment_elements = {10, 6};
  ASSERT_TRUE(s.RegisterChunk(spec, Bytes(weights)).ok());
  const v1::ChunkSpec received = fake_.LastSpec();
  EXPECT_EQ(std::vector<uint64_t>(received.segment_elements().begin(), received.segment_elements().end()),
            (std::vector<uint64_t>{10, 6}));

  absl::StatusOr<uint32_t> slot = s.AcquireSlot(milliseconds(1000));
  ASSERT_TRUE(slot.ok()) << slot.status();
  ASSERT_TRUE(s.SendGradReady(3, *slot, 1, AdamWHyper{},
                              {.segments_without_grad = {1}, .speculative = true})
                  .ok());
  ASSERT_TRUE(s.WaitParams(3, milliseconds(5000)).ok());
  v1::GradReady sent = fake_.LastGradReady();
  EXPECT_EQ(sent.segments_without_grad_size(), 1);
  EXPECT_EQ(sent.segments_without_grad(0), 1u);
  EXPECT_TRUE(sent.speculative());
  EXPECT_EQ(sent.redo(), v1::REDO_REASON_UNSPECIFIED);

  // The redo of the same chunk in the same step, after its parameters were taken.
  ASSERT_TRUE(s.SendGradReady(3, *slot, 1, AdamWHyper{}, {.redo = RedoReason::kClipped}).ok());
  ASSERT_TRUE(s.WaitParams(3, milliseconds(5000)).ok());
  sent = fake_.LastGradReady();
  EXPECT_EQ(sent.segments_without_grad_size(), 0);
  EXPECT_FALSE(sent.speculative());
  EXPECT_EQ(sent.redo(), v1::REDO_REASON_CLIPPED);

  // Segment indices out of order, repeated or past the chunk's segments: nothing sent.
  const int seen = fake_.grad_ready_seen;
  for (const std::vector<uint32_t>& bad : {std::vector<uint32_t>{1, 0}, std::vector<uint32_t>{0, 0},
                                           std::vector<uint32_t>{2}}) {
    absl::Status refused = s.SendGradReady(3, *slot, 1, AdamWHyper{}, {.segments_without_grad = bad});
    EXPECT_EQ(refused.code(), absl::StatusCode::kInvalidArgument) << refused;
    EXPECT_TRUE(Contains(refused, "segments without gradients")) << refused;
  }
  EXPECT_EQ(fake_.grad_ready_seen, seen);
  s.ReleaseSlot(*slot);

  ASSERT_TRUE(s.AbortStep(1, AbortReason::kSkippedStep).ok());
  EXPECT_EQ(fake_.LastAbortStep().step(), 1);
  EXPECT_EQ(fake_.LastAbortStep().reason(), v1::ABORT_REASON_SKIPPED_STEP);
  ASSERT_TRUE(s.AbortStep(1).ok());
  EXPECT_EQ(fake_.LastAbortStep().reason(), v1::ABORT_REASON_UNSPECIFIED);
}

TEST_F(SessionTest, JournalUseAndGradOpsReachTheDaemonAndItsStatsAreKept) {
  absl::StatusOr<std::unique_ptr<Session>> session = Open();
  ASSERT_TRUE(session.ok()) << session.status();
  Session& s = **session;
  std::vector<float> weights(16, 0.0f);
  ASSERT_TRUE(s.RegisterChunk(Float32Chunk(4, 16), Bytes(weights)).ok());
  absl::StatusOr<uint32_t> slot = s.AcquireSlot(milliseconds(1000));
  ASSERT_TRUE(slot.ok()) << slot.status();
  EXPECT_FALSE(s.GetJournalStats(4).has_value());
  ASSERT_TRUE(s.SendGradReady(4, *slot, 1, AdamWHyper{}, {.journal = JournalUse::kKeep}).ok());
  ASSERT_TRUE(s.WaitParams(4, milliseconds(5000)).ok());
  EXPECT_EQ(fake_.LastGradReady().journal(), v1::JOURNAL_USE_KEEP);
  EXPECT_EQ(fake_.LastGradReady().grad_ops_size(), 0);
  std::optional<JournalStats> stats = s.GetJournalStats(4);
  ASSERT_TRUE(stats.has_value());
  EXPECT_EQ(stats->sum_squares, (std::vector<double>{1.5}));
  EXPECT_EQ(stats->max_abs, (std::vector<float>{0.0f}));

  GradReadyOptions replay{.redo = RedoReason::kGradientsChanged, .journal = JournalUse::kReplay};
  replay.grad_ops = {{GradOp::Kind::kMul, 0.25f}, {GradOp::Kind::kDiv, 1024.0f}};
  ASSERT_TRUE(s.SendGradReady(4, *slot, 1, AdamWHyper{}, replay).ok());
  ASSERT_TRUE(s.WaitParams(4, milliseconds(5000)).ok());
  const v1::GradReady sent = fake_.LastGradReady();
  EXPECT_EQ(sent.journal(), v1::JOURNAL_USE_REPLAY);
  ASSERT_EQ(sent.grad_ops_size(), 2);
  EXPECT_EQ(sent.grad_ops(0).kind(), v1::GradOp::KIND_MUL);
  EXPECT_EQ(sent.grad_ops(0).operand(), 0.25f);
  EXPECT_EQ(sent.grad_ops(1).kind(), v1::GradOp::KIND_DIV);
  EXPECT_EQ(sent.grad_ops(1).operand(), 1024.0f);
  stats = s.GetJournalStats(4);
  ASSERT_TRUE(stats.has_value());
  EXPECT_EQ(stats->max_abs, (std::vector<float>{2.0f}));

  // An update without a journal: no stats for it.
  ASSERT_TRUE(s.SendGradReady(4, *slot, 1, AdamWHyper{}, {.redo = RedoReason::kClipped}).ok());
  ASSERT_TRUE(s.WaitParams(4, milliseconds(5000)).ok());
  EXPECT_FALSE(s.GetJournalStats(4).has_value());
  s.ReleaseSlot(*slot);
}

TEST_F(SessionTest, SegmentsThatDoNotAddUpAreRefusedLocally) {
  absl::StatusOr<std::unique_ptr<Session>> session = Open();
  ASSERT_TRUE(session.ok()) << session.status();
  Session& s = **session;
  std::vector<float> weights(16, 0.0f);
  for (const std::vector<uint64_t>& bad :
       {std::vector<uint64_t>{10, 5}, std::vector<uint64_t>{10, 7}, std::vector<uint64_t>{16, 0},
        std::vector<uint64_t>(4097, 1)}) {
    ChunkSpec spec = Float32Chunk(3, 16);
    spec.segment_elements = bad;
    absl::Status refused = s.RegisterChunk(spec, Bytes(weights)).status();
    EXPECT_EQ(refused.code(), absl::StatusCode::kInvalidArgument) << refused;
  }
}

TEST_F(SessionTest, ResumedChunkReturnsItsSegmentUpdateCounts) {
  fake_.AddExistingChunk(5, std::vector<float>(16, 1.0f), 7, {7, 4});
  absl::StatusOr<std::unique_ptr<Session>> session = Open();
  ASSERT_TRUE(session.ok()) << session.status();
  std::vector<float> weights(16, 0.0f);
  ChunkSpec spec = Float32Chunk(5, 16);
  spec.segment_elements = {8, 8};
  absl::StatusOr<RegisterResult> registered = (*session)->RegisterChunk(spec, Bytes(weights));
  ASSERT_TRUE(registered.ok()) << registered.status();
  EXPECT_TRUE(registered->resumed);
  EXPECT_EQ(registered->update_count, 7);
  EXPECT_EQ(registered->segment_update_counts, (std::vector<int64_t>{7, 4}));
}

ChunkSpec StoredWeightsChunk(uint32_t id, uint64_t elements) {
  return ChunkSpec{.chunk_id = id, .num_elements = elements, .store_weights = true};
}

std::vector<float> SlotFloats(Session& s, uint32_t slot, size_t n) {
  const auto* p = reinterpret_cast<const float*>(s.ParamRegion(slot).data());
  return std::vector<float>(p, p + n);
}

TEST_F(SessionTest, FetchWeightsCopiesTheStoredWeightsIntoTheSlot) {
  absl::StatusOr<std::unique_ptr<Session>> session = Open(/*slots=*/3);
  ASSERT_TRUE(session.ok()) << session.status();
  Session& s = **session;
  std::vector<float> weights(100);
  for (size_t i = 0; i < weights.size(); ++i) weights[i] = static_cast<float>(i) * 0.5f;
  const std::vector<float> initial = weights;
  ASSERT_TRUE(s.RegisterChunk(StoredWeightsChunk(4, 100), Bytes(weights)).ok());
  EXPECT_TRUE(fake_.LastSpec().store_weights());  // store_weights reaches the daemon
  std::vector<float> other(10);
  ASSERT_TRUE(s.RegisterChunk(Float32Chunk(5, 10), Bytes(other)).ok());
  EXPECT_FALSE(fake_.LastSpec().store_weights());

  // Two fetches of one chunk in flight at once, in two slots: answered in order.
  absl::StatusOr<uint32_t> a = s.AcquireSlot(milliseconds(1000));
  absl::StatusOr<uint32_t> b = s.AcquireSlot(milliseconds(1000));
  ASSERT_TRUE(a.ok() && b.ok());
  ASSERT_TRUE(s.SendFetchWeights(4, *a).ok());
  ASSERT_TRUE(s.SendFetchWeights(4, *b).ok());
  absl::StatusOr<uint32_t> first = s.WaitWeights(4, milliseconds(5000));
  ASSERT_TRUE(first.ok()) << first.status();
  EXPECT_EQ(*first, *a);
  EXPECT_EQ(SlotFloats(s, *first, 100), initial);
  s.ReleaseSlot(*first);
  absl::StatusOr<uint32_t> second = s.WaitWeights(4, milliseconds(5000));
  ASSERT_TRUE(second.ok()) << second.status();
  EXPECT_EQ(*second, *b);
  EXPECT_EQ(SlotFloats(s, *second, 100), initial);
  s.ReleaseSlot(*second);
  EXPECT_EQ(fake_.fetches_seen.load(), 2);
  EXPECT_EQ(s.WaitWeights(4, milliseconds(10)).status().code(), absl::StatusCode::kFailedPrecondition);

  // A fetch the daemon never answers: its slot stays in flight (not sent
  // again, not released), states are not read meanwhile, and the wait times
  // out without losing it.
  std::vector<float> silent(8);
  ASSERT_TRUE(s.RegisterChunk(StoredWeightsChunk(kSilentChunk, 8), Bytes(silent)).ok());
  absl::StatusOr<uint32_t> c = s.AcquireSlot(milliseconds(1000));
  ASSERT_TRUE(c.ok());
  ASSERT_TRUE(s.SendFetchWeights(kSilentChunk, *c).ok());
  absl::Status again = s.SendFetchWeights(4, *c);
  EXPECT_EQ(again.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_TRUE(Contains(again, "already in flight")) << again;
  std::vector<float> out(100);
  absl::StatusOr<int64_t> read = s.ReadState(4, StateKind::kMaster, 0, out);
  EXPECT_EQ(read.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_TRUE(Contains(read.status(), "weights fetches of 1 chunks are in flight")) << read.status();
  for (int i = 0; i < 2; ++i) {
    absl::StatusOr<uint32_t> waited = s.WaitWeights(kSilentChunk, milliseconds(100));
    EXPECT_EQ(waited.status().code(), absl::StatusCode::kDeadlineExceeded);
    EXPECT_TRUE(Contains(waited.status(), "no WeightsFetched for chunk 777")) << waited.status();
  }
  EXPECT_EQ(fake_.fetches_seen.load(), 3);  // the refused one was not sent
  s.ReleaseSlot(*c);                         // ignored: the daemon owns it
  // The two other slots are free again; the third stays in flight.
  EXPECT_TRUE(s.AcquireSlot(milliseconds(100)).ok());
  EXPECT_TRUE(s.AcquireSlot(milliseconds(100)).ok());
  EXPECT_EQ(s.AcquireSlot(milliseconds(10)).status().code(), absl::StatusCode::kDeadlineExceeded);
}

// A fetch beside the chunk's own GradReady: each answer goes to its waiter, and
// so does each refusal (a refused fetch names no step, a refused GradReady does).
TEST_F(SessionTest, FetchesAndUpdatesOfOneChunkInFlightGetTheirOwnAnswers) {
  absl::StatusOr<std::unique_ptr<Session>> session = Open(/*slots=*/4);
  ASSERT_TRUE(session.ok()) << session.status();
  Session& s = **session;
  std::vector<float> weights(50, 3.0f), refused(50, 1.0f);
  ASSERT_TRUE(s.RegisterChunk(StoredWeightsChunk(2, 50), Bytes(weights)).ok());
  ASSERT_TRUE(s.RegisterChunk(StoredWeightsChunk(kRefusedChunk, 50), Bytes(refused)).ok());

  absl::StatusOr<uint32_t> grad_slot = s.AcquireSlot(milliseconds(1000));
  absl::StatusOr<uint32_t> fetch_slot = s.AcquireSlot(milliseconds(1000));
  ASSERT_TRUE(grad_slot.ok() && fetch_slot.ok());
  auto* grad = reinterpret_cast<float*>(s.GradRegion(*grad_slot).data());
  for (int i = 0; i < 50; ++i) grad[i] = 1.0f;
  ASSERT_TRUE(s.SendGradReady(2, *grad_slot, 1, AdamWHyper{}).ok());
  ASSERT_TRUE(s.SendFetchWeights(2, *fetch_slot).ok());
  absl::StatusOr<uint32_t> fetched = s.WaitWeights(2, milliseconds(5000));
  ASSERT_TRUE(fetched.ok()) << fetched.status();
  EXPECT_EQ(*fetched, *fetch_slot);
  EXPECT_EQ(SlotFloats(s, *fetched, 50), std::vector<float>(50, 3.0f));  // the stored weights
  absl::StatusOr<uint32_t> ready = s.WaitParams(2, milliseconds(5000));
  ASSERT_TRUE(ready.ok()) << ready.status();
  EXPECT_EQ(*ready, *grad_slot);
  EXPECT_EQ(SlotFloats(s, *ready, 50), std::vector<float>(50, 3.0f));  // the fake's update: 2 * 1 + step 1
  s.ReleaseSlot(*fetched);
  s.ReleaseSlot(*ready);

  // Both refused, the fetch first in the stream: the GradReady's error (with a
  // step) does not end the fetch's wait, nor the fetch's the GradReady's.
  grad_slot = s.AcquireSlot(milliseconds(1000));
  fetch_slot = s.AcquireSlot(milliseconds(1000));
  ASSERT_TRUE(grad_slot.ok() && fetch_slot.ok());
  ASSERT_TRUE(s.SendFetchWeights(kRefusedChunk, *fetch_slot).ok());
  ASSERT_TRUE(s.SendGradReady(kRefusedChunk, *grad_slot, 1, AdamWHyper{}).ok());
  absl::StatusOr<uint32_t> refused_params = s.WaitParams(kRefusedChunk, milliseconds(5000));
  EXPECT_EQ(refused_params.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_TRUE(Contains(refused_params.status(), "chunk 999 in slot")) << refused_params.status();
  absl::StatusOr<uint32_t> refused_fetch = s.WaitWeights(kRefusedChunk, milliseconds(5000));
  EXPECT_EQ(refused_fetch.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(refused_fetch.status().message(),
            fmt::format("fetch of chunk 999 into slot {} refused by the fake daemon", *fetch_slot));
  // Both slots were freed by the refusals, the session is still usable.
  for (int i = 0; i < 4; ++i) EXPECT_TRUE(s.AcquireSlot(milliseconds(100)).ok()) << i;
  EXPECT_TRUE(s.EndStep(1).ok());
}

TEST_F(SessionTest, BadFetchesAreRefusedLocally) {
  absl::StatusOr<std::unique_ptr<Session>> session = Open(/*slots=*/2);
  ASSERT_TRUE(session.ok()) << session.status();
  Session& s = **session;
  std::vector<float> weights(10);
  ASSERT_TRUE(s.RegisterChunk(StoredWeightsChunk(1, 10), Bytes(weights)).ok());
  ASSERT_TRUE(s.RegisterChunk(Float32Chunk(2, 10), Bytes(weights)).ok());
  absl::StatusOr<uint32_t> slot = s.AcquireSlot(milliseconds(1000));
  ASSERT_TRUE(slot.ok());

  absl::Status unknown = s.SendFetchWeights(3, *slot);
  EXPECT_EQ(unknown.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(Contains(unknown, "chunk 3 is not registered")) << unknown;
  absl::Status without = s.SendFetchWeights(2, *slot);
  EXPECT_EQ(without.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_TRUE(Contains(without, "chunk 2 of job 'test-job'")) << without;
  EXPECT_TRUE(Contains(without, "without store_weights")) << without;
  absl::Status no_such_slot = s.SendFetchWeights(1, 2);
  EXPECT_EQ(no_such_slot.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(Contains(no_such_slot, "slot 2 does not exist")) << no_such_slot;
  const uint32_t free_slot = 1 - *slot;
  absl::Status not_held = s.SendFetchWeights(1, free_slot);
  EXPECT_EQ(not_held.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_TRUE(Contains(not_held, "is free")) << not_held;
  EXPECT_EQ(fake_.fetches_seen.load(), 0);  // nothing was sent
  absl::StatusOr<uint32_t> nothing = s.WaitWeights(1, milliseconds(10));
  EXPECT_EQ(nothing.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_TRUE(Contains(nothing.status(), "no weights fetch in flight")) << nothing.status();
}

TEST_F(SessionTest, SlotsRunOutAndComeBack) {
  absl::StatusOr<std::unique_ptr<Session>> session = Open(/*slots=*/1);
  ASSERT_TRUE(session.ok()) << session.status();
  Session& s = **session;
  absl::StatusOr<uint32_t> slot = s.AcquireSlot(milliseconds(100));
  ASSERT_TRUE(slot.ok());
  const auto start = Clock::now();
  absl::StatusOr<uint32_t> none = s.AcquireSlot(milliseconds(200));
  EXPECT_GE(Clock::now() - start, milliseconds(150));
  EXPECT_EQ(none.status().code(), absl::StatusCode::kDeadlineExceeded);
  EXPECT_TRUE(Contains(none.status(), "no free slot within 200 ms")) << none.status();
  s.ReleaseSlot(*slot);
  EXPECT_TRUE(s.AcquireSlot(milliseconds(100)).ok());
}

TEST_F(SessionTest, StepErrorComesBackFromEndStep) {
  absl::StatusOr<std::unique_ptr<Session>> session = Open();
  ASSERT_TRUE(session.ok()) << session.status();
  absl::StatusOr<StepResult> result = (*session)->EndStep(kRefusedStep);
  EXPECT_EQ(result.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(result.status().message(), "step 113 is not the next step (fake)");
  EXPECT_EQ((*session)->committed_step(), 0);
  EXPECT_TRUE((*session)->EndStep(1).ok());  // still usable
}

TEST_F(SessionTest, WaitWithoutAnswerTimesOut) {
  absl::StatusOr<std::unique_ptr<Session>> session = Open();
  ASSERT_TRUE(session.ok()) << session.status();
  std::vector<float> weights(8), grads(8);
  ASSERT_TRUE((*session)->RegisterChunk(Float32Chunk(kSilentChunk, 8), Bytes(weights)).ok());
  ASSERT_TRUE((*session)->PushGradients(kSilentChunk, 1, AdamWHyper{}, ConstBytes(grads)).ok());
  absl::StatusOr<uint32_t> ready = (*session)->WaitParams(kSilentChunk, milliseconds(200));
  EXPECT_EQ(ready.status().code(), absl::StatusCode::kDeadlineExceeded);
  EXPECT_TRUE(Contains(ready.status(), "chunk 777")) << ready.status();
}

TEST_F(SessionTest, ServerShutdownMidWaitIsUnavailableNotAHang) {
  absl::StatusOr<std::unique_ptr<Session>> session = Open();
  ASSERT_TRUE(session.ok()) << session.status();
  Session& s = **session;
  std::vector<float> weights(8), grads(8);
  ASSERT_TRUE(s.RegisterChunk(Float32Chunk(kSilentChunk, 8), Bytes(weights)).ok());
  ASSERT_TRUE(s.PushGradients(kSilentChunk, 1, AdamWHyper{}, ConstBytes(grads)).ok());
  while (!fake_.silent_chunk_arrived) std::this_thread::sleep_for(milliseconds(5));

  std::thread killer([&] {
    std::this_thread::sleep_for(milliseconds(200));
    ShutdownServer();
  });
  const auto start = Clock::now();
  absl::Status pulled = s.PullParams(kSilentChunk, Bytes(weights));  // rpc_timeout is 10 s
  EXPECT_LT(Clock::now() - start, std::chrono::seconds(5));
  killer.join();
  EXPECT_EQ(pulled.code(), absl::StatusCode::kUnavailable) << pulled;
  EXPECT_TRUE(Contains(pulled, "connection to fuyoud lost")) << pulled;

  // Every later call fails the same way, quickly.
  EXPECT_EQ(s.EndStep(1).status().code(), absl::StatusCode::kUnavailable);
  EXPECT_EQ(s.AcquireSlot(milliseconds(5000)).status().code(), absl::StatusCode::kUnavailable);
  EXPECT_EQ(s.Close().code(), absl::StatusCode::kUnavailable);
  EXPECT_LT(Clock::now() - start, std::chrono::seconds(5));
}

TEST_F(SessionTest, WrongMagicIsDataLoss) {
  fake_.header_fault = FakeOffload::HeaderFault::kBadMagic;
  absl::StatusOr<std::unique_ptr<Session>> session = Open();
  EXPECT_EQ(session.status().code(), absl::StatusCode::kDataLoss);
  EXPECT_TRUE(Contains(session.status(), "magic")) << session.status();
  EXPECT_EQ(fake_.close_calls, 1);  // the daemon is told to free the session
}

TEST_F(SessionTest, HeaderThatDisagreesIsRefused) {
  fake_.header_fault = FakeOffload::HeaderFault::kWrongSlots;
  absl::StatusOr<std::unique_ptr<Session>> session = Open();
  EXPECT_EQ(session.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_TRUE(Contains(session.status(), "header of 3 slots")) << session.status();
  EXPECT_EQ(fake_.close_calls, 1);
}

TEST_F(SessionTest, DestructorClosesTheSession) {
  {
    absl::StatusOr<std::unique_ptr<Session>> session = Open();
    ASSERT_TRUE(session.ok()) << session.status();
  }
  EXPECT_EQ(fake_.close_calls, 1);
}

TEST_F(SessionTest, ManyThreadsPushAndPull) {
  constexpr int kThreads = 4, kChunksPerThread = 4, kSteps = 20;
  absl::StatusOr<std::unique_ptr<Session>> session = Open(/*slots=*/3, 1024 * sizeof(float));
  ASSERT_TRUE(session.ok()) << session.status();
  Session& s = **session;
  for (uint32_t c = 0; c < kThreads * kChunksPerThread; ++c) {
    std::vector<float> weights(1024, 0.0f);
    ASSERT_TRUE(s.RegisterChunk(Float32Chunk(c, 1024), Bytes(weights)).ok());
  }
  for (int64_t step = 1; step <= kSteps; ++step) {
    std::vector<std::thread> threads;
    std::atomic<int> failures{0};
    for (int t = 0; t < kThreads; ++t) {
      threads.emplace_back([&, t] {
        for (int k = 0; k < kChunksPerThread; ++k) {
          const uint32_t chunk = t * kChunksPerThread + k;
          std::vector<float> grads(1024, static_cast<float>(chunk)), weights(1024);
          if (!s.PushGradients(chunk, step, AdamWHyper{}, ConstBytes(grads)).ok()) ++failures;
          if (!s.PullParams(chunk, Bytes(weights)).ok()) ++failures;
          if (weights[1023] != static_cast<float>(chunk) * 2 + static_cast<float>(step)) ++failures;
        }
      });
    }
    for (std::thread& thread : threads) thread.join();
    ASSERT_EQ(failures, 0) << "step " << step;
    absl::StatusOr<StepResult> committed = s.EndStep(step);
    ASSERT_TRUE(committed.ok()) << committed.status();
    EXPECT_EQ(committed->chunks_updated, static_cast<uint32_t>(kThreads * kChunksPerThread));
  }
  EXPECT_EQ(s.committed_step(), kSteps);
}

}  // namespace
}  // namespace fuyou
