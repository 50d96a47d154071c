// UringQueue: one io_uring plus the thread that reaps its completions. Private to
// the storage module; IoEngine keeps one per filesystem (see io_engine.h).
//
// Requests go to the ring while fewer than `depth` are in it; the rest wait, one
// FIFO per owner (their target's), and enter as earlier ones complete, shared by
// bytes between users, then owners (FairQueue), background owners' apart with
// their low-priority share (the contract is io_engine.h's "Owners"). Short
// transfers are resubmitted for the remainder, ahead of what their owner has
// waiting. Each request ends in one Status handed to its Transfer, whose
// done() future is set once every request of the transfer has ended.
#pragma once

#include <condition_variable>
#include <cstdint>
#include <filesystem>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "common/fair_queue.h"
#include "common/future.h"
#include "storage/io_engine.h"
#include "storage/uring_ring.h"

namespace fuyou::storage::internal {

// What a request needs to know about its file. Owned by the StateFile, which
// outlives every request on it.
struct IoTarget {
  int fd = -1;
  bool direct = false;
  std::filesystem::path path;
  IoOwner owner;  // whose turn its requests wait for
};

// One caller-visible transfer (a ReadAsync or WriteAsync call), split into
// `requests` requests. done() is ready once every request has ended, with the
// first error seen (or OK); it is set on the thread that ends the last request.
class Transfer {
 public:
  Transfer(FaultInjector::Op op, uint64_t offset, uint64_t length, uint32_t requests)
      : op_(op), offset_(offset), length_(length), requests_(requests) {}

  FaultInjector::Op op() const { return op_; }
  uint64_t offset() const { return offset_; }
  uint64_t length() const { return length_; }

  // Records the end of one request: exactly `requests` calls in all.
  void RequestDone(absl::Status status) { requests_.Arrive(std::move(status)); }
  Future<void> done() const { return requests_.future(); }

 private:
  const FaultInjector::Op op_;
  const uint64_t offset_;
  const uint64_t length_;
  Countdown requests_;
};

// One read, write, data sync (fdatasync of the whole file) or no-op in the ring. A no-op carries a Status decided at
// submission (a rejected argument) so that every callback runs on the completion
// thread.
struct Request {
  enum class Kind { kRead, kWrite, kSync, kNop };
  Kind kind = Kind::kNop;
  const IoTarget* target = nullptr;
  std::byte* data = nullptr;
  uint64_t offset = 0;
  uint64_t length = 0;
  uint64_t done = 0;    // bytes already transferred
  unsigned stalls = 0;  // consecutive completions that made no usable progress
  absl::Status nop_status;
  std::shared_ptr<Transfer> transfer;
};

class UringQueue {
 public:
  // `depth`: most requests in the ring at once; `quantum`: the bytes a user (an
  // owner) is credited at each of its turns (the engine's max_request_bytes).
  // `name` labels the reaper thread and log lines.
  static absl::StatusOr<std::unique_ptr<UringQueue>> Create(unsigned depth, uint64_t quantum,
                                                            FaultInjector* fault_injector, std::string name);
  ~UringQueue();
  UringQueue(const UringQueue&) = delete;
  UringQueue& operator=(const UringQueue&) = delete;

  // Thread-safe, never blocks on I/O. After Shutdown the requests end at once, on
  // the calling thread, with FAILED_PRECONDITION.
  void Submit(std::vector<std::unique_ptr<Request>> requests);

  // Waits until no request is queued, in the ring or in its callback, then stops
  // and joins the reaper thread. Idempotent. Must not run on the reaper thread.
  void Shutdown();

 private:
  UringQueue(unsigned depth, uint64_t quantum, FaultInjector* fault_injector, std::string name,
             std::unique_ptr<UringRing> ring);

  void ReapLoop();
  // Applies one completion to its request. Returns true when the remainder must
  // be submitted again; otherwise sets `status` to the request's final Status.
  bool Evaluate(Request& request, int64_t result, absl::Status* status);
  void FillRingLocked();
  // Queues `r` (its remainder) for the ring: behind (`front` false) or ahead of
  // what its owner has waiting.
  void QueueLocked(std::unique_ptr<Request> r, bool front);

  // Requests on their way into the ring; guarded by mu_.
  struct Backlog {
    explicit Backlog(uint64_t quantum) : waiting(quantum), background(quantum) {}
    // Not yet in the ring, by target->owner (user, then owner): foreground owners'
    // and background owners'.
    FairQueue<std::unique_ptr<Request>> waiting;
    FairQueue<std::unique_ptr<Request>> background;
    unsigned in_ring = 0;             // SQEs submitted, CQE not yet reaped
    unsigned background_in_ring = 0;  // of which background owners'
    unsigned foreground_run = 0;      // foreground requests entered since a background one, while one waited
  };
  // Whether the queue still takes requests, and how many have not yet ended
  // (Shutdown waits for none); guarded by mu_.
  struct Lifetime {
    uint64_t live = 0;  // requests not yet ended (incl. callback)
    bool stopping = false;
    bool joined = false;
  };

  const unsigned depth_;
  FaultInjector* const fault_injector_;
  const std::string name_;
  const std::unique_ptr<UringRing> ring_;

  std::mutex mu_;
  std::condition_variable idle_;  // lifetime_.live fell to 0
  Backlog backlog_;
  Lifetime lifetime_;
  std::thread reaper_;
};

}  // namespace fuyou::storage::internal
