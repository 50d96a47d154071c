// The fake in-process Offload service the Session tests run against
// (session_*_test.cc, one binary): the fake serves on a Unix socket in a
// temporary directory, takes the client's memfd segment on a segment socket
// beside it (fuyou/segment_handover.h), maps it and writes its header, and
// answers the stream the way fuyoud does (each answer carries the request's id
// back), with a few chunk ids that misbehave:
//   chunk 999: every GradReady, FetchWeights and ReadState is refused with
//              FAILED_PRECONDITION;
//   chunk 777: GradReady and FetchWeights are never answered (to test waits
//              and shutdown);
//   chunk 555: GradReady is answered with a StepCommitted (the wrong kind);
//   EndStep 113: refused with an Error that names the step, not a chunk;
//   EndStep 114: answered only once the test calls ReleaseLateStep() (the
//                stream's later messages wait behind it, as in fuyoud);
//   WaitDurable: a step after the last EndStep is refused with
//                FAILED_PRECONDITION; others are durable at the last EndStep's
//                step, but step 116, answered as durable at step 0 (a lie).
// And knobs that break the protocol on purpose: answers without ids (an older
// daemon), ids that were never sent, Errors that name no chunk and no step.
// "Updated" weights are deterministic: new[i] = grad[i] * 2 + step (float32).
// The tests use it through session_test_fixture.h (its segment socket and the
// SessionTest fixture).
#pragma once

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
#include <condition_variable>
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

namespace fuyou::session_test {

using std::chrono::milliseconds;
using Clock = std::chrono::steady_clock;

constexpr uint32_t kRefusedChunk = 999;
constexpr uint32_t kSilentChunk = 777;
constexpr uint32_t kWrongKindChunk = 555;
constexpr int64_t kRefusedStep = 113;
constexpr int64_t kLyingDurableStep = 116;  // WaitDurable answered with a durable step below it
constexpr int64_t kLateStep = 114;  // EndStep answered only after ReleaseLateStep()

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
  // False: answers carry no request id, as from a daemon older than request ids.
  std::atomic<bool> echo_request_ids{true};
  // Added to the id of every answer from now on: ids the client never sent.
  std::atomic<uint64_t> answer_id_offset{0};
  // True: Errors name no chunk and no step (only the request id says whose they are).
  std::atomic<bool> bare_errors{false};

  // Chunks the "job" already has: resumed by RegisterChunks.
  void AddExistingChunk(uint32_t chunk_id, std::vector<float> weights, int64_t updates,
                        std::vector<int64_t> segment_updates = {}) {
    std::lock_guard lock(mu_);
    store_[chunk_id] = StoredChunk{std::move(weights), updates, std::move(segment_updates)};
  }
  // Activations the fake holds (SpillActivation pieces, by daemon key).
  size_t ActivationsHeld() {
    std::lock_guard lock(mu_);
    return activations_.size();
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
  // Lets the fake answer EndStep of kLateStep.
  void ReleaseLateStep() {
    std::lock_guard lock(late_mu_);
    late_released_ = true;
    late_cv_.notify_all();
  }
  // The request id of every stream message received, in order (Attach first).
  std::vector<uint64_t> RequestIds() {
    std::lock_guard lock(mu_);
    return request_ids_;
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
    Answer(in, out, stream);
    std::map<int64_t, uint32_t> updated_in_step;
    while (stream->Read(&in)) {
      out.Clear();
      if (in.has_grad_ready()) {
        ++grad_ready_seen;
        const v1::GradReady& ready = in.grad_ready();
        if (ready.chunk_id() == kSilentChunk) {
          std::lock_guard lock(mu_);
          request_ids_.push_back(in.request_id());
          silent_chunk_arrived = true;
          continue;
        }
        if (ready.chunk_id() == kWrongKindChunk) {
          out.mutable_step_committed()->set_step(ready.step());
          Answer(in, out, stream);
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
        if (fetch.chunk_id() == kSilentChunk) {  // never answered
          request_ids_.push_back(in.request_id());
          continue;
        }
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
        if (step == kLateStep) {  // bounded, so that a failed test does not hang the server's shutdown
          std::unique_lock lock(late_mu_);
          late_cv_.wait_for(lock, std::chrono::seconds(30), [&] { return late_released_; });
        }
        if (step == kRefusedStep) {
          out.mutable_error()->set_code(static_cast<int>(grpc::StatusCode::FAILED_PRECONDITION));
          out.mutable_error()->set_message(fmt::format("step {} is not the next step (fake)", step));
          out.mutable_error()->set_step(step);
        } else {
          committed_ = step;
          out.mutable_step_committed()->set_step(step);
          out.mutable_step_committed()->set_chunks_updated(updated_in_step[step]);
        }
      } else if (in.has_wait_durable()) {
        const int64_t step = in.wait_durable().step();
        if (step > committed_) {
          out.mutable_error()->set_code(static_cast<int>(grpc::StatusCode::FAILED_PRECONDITION));
          out.mutable_error()->set_message(fmt::format("WaitDurable for step {}: not committed (fake)", step));
          out.mutable_error()->set_step(step);
        } else {
          out.mutable_step_durable()->set_step(step);
          out.mutable_step_durable()->set_durable_step(step == kLyingDurableStep ? int64_t{0} : committed_.load());
        }
      } else if (in.has_abort_step()) {
        {
          std::lock_guard lock(mu_);
          last_abort_ = in.abort_step();
        }
        out.mutable_step_aborted()->set_step(in.abort_step().step());
      } else if (in.has_read_state()) {
        // As fuyoud: the stored weights stand for every state.
        const v1::ReadState& read = in.read_state();
        std::lock_guard lock(mu_);
        auto stored = store_.find(read.chunk_id());
        if (read.chunk_id() == kRefusedChunk || stored == store_.end() ||
            read.first_element() + read.num_elements() > stored->second.weights.size()) {
          out.mutable_error()->set_code(static_cast<int>(grpc::StatusCode::FAILED_PRECONDITION));
          out.mutable_error()->set_message(fmt::format("ReadState of chunk {} refused by the fake", read.chunk_id()));
          out.mutable_error()->set_chunk_id(read.chunk_id());
        } else {
          std::memcpy(Param(read.slot()), stored->second.weights.data() + read.first_element(),
                      read.num_elements() * sizeof(float));
          v1::StateRead* answer = out.mutable_state_read();
          answer->set_chunk_id(read.chunk_id());
          answer->set_which(read.which());
          answer->set_slot(read.slot());
          answer->set_first_element(read.first_element());
          answer->set_num_elements(read.num_elements());
          answer->set_update_count(stored->second.updates);
        }
      } else if (in.has_spill_activation()) {
        // As fuyoud: the slot's gradient region's first `bytes` under the key.
        const v1::SpillActivation& spill = in.spill_activation();
        std::lock_guard lock(mu_);
        const auto* from = reinterpret_cast<const char*>(Grad(spill.slot()));
        if (!activations_.emplace(spill.key(), std::string(from, spill.bytes())).second) {
          out.mutable_error()->set_code(static_cast<int>(grpc::StatusCode::INVALID_ARGUMENT));
          out.mutable_error()->set_message(fmt::format("activation {} is already spilled (fake)", spill.key()));
        } else {
          out.mutable_activation_spilled()->set_key(spill.key());
          out.mutable_activation_spilled()->set_bytes(spill.bytes());
        }
      } else if (in.has_recall_activation()) {
        const v1::RecallActivation& recall = in.recall_activation();
        std::lock_guard lock(mu_);
        auto found = activations_.find(recall.key());
        if (found == activations_.end()) {
          out.mutable_error()->set_code(static_cast<int>(grpc::StatusCode::NOT_FOUND));
          out.mutable_error()->set_message(fmt::format("activation {} is not spilled (fake)", recall.key()));
        } else {
          std::memcpy(Grad(recall.slot()), found->second.data(), found->second.size());
          out.mutable_activation_recalled()->set_key(recall.key());
          out.mutable_activation_recalled()->set_slot(recall.slot());
          out.mutable_activation_recalled()->set_bytes(found->second.size());
          activations_.erase(found);
        }
      } else if (in.has_drop_activations()) {
        std::lock_guard lock(mu_);
        out.mutable_activations_dropped()->set_activations(static_cast<uint32_t>(activations_.size()));
        activations_.clear();
      } else {
        continue;
      }
      Answer(in, out, stream);
    }
    return grpc::Status::OK;
  }

  // Sends `out` as the answer to `in`: with its request id as the knobs say.
  void Answer(const v1::ClientMessage& in, v1::DaemonMessage& out,
              grpc::ServerReaderWriter<v1::DaemonMessage, v1::ClientMessage>* stream) {
    {
      std::lock_guard lock(mu_);
      request_ids_.push_back(in.request_id());
    }
    if (echo_request_ids) out.set_request_id(in.request_id() + answer_id_offset);
    if (bare_errors && out.has_error()) {
      out.mutable_error()->clear_chunk_id();
      out.mutable_error()->clear_step();
    }
    stream->Write(out);
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
  std::map<uint64_t, std::string> activations_;  // SpillActivation's bytes by daemon key
  v1::ChunkSpec last_spec_;
  v1::GradReady last_grad_ready_;
  v1::AbortStep last_abort_;
  std::vector<uint64_t> request_ids_;
  std::mutex late_mu_;
  std::condition_variable late_cv_;
  bool late_released_ = false;
};

}  // namespace fuyou::session_test
