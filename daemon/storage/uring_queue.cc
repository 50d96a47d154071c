#include "storage/uring_queue.h"

#include <pthread.h>

#include <utility>

#include "fmt/format.h"

namespace fuyou::storage::internal {
namespace {

// user_data of the no-op that tells the reaper to exit; never a Request address.
constexpr uint64_t kStopTag = ~uint64_t{0};
// Completions in a row that move a request forward by less than one block
// before it fails instead of spinning.
constexpr unsigned kMaxStalls = 8;

const char* OpName(FaultInjector::Op op) {
  switch (op) {
    case FaultInjector::Op::kRead:
      return "read";
    case FaultInjector::Op::kWrite:
      return "write";
    case FaultInjector::Op::kReserve:
      return "reserve";
    case FaultInjector::Op::kSync:
      return "sync";
  }
  return "io";
}

std::string Describe(const Request& r) {
  const uint64_t offset = r.offset + r.done;
  const uint64_t length = r.length - r.done;
  std::string s = fmt::format("{} of {} at offset {} length {}", OpName(r.transfer->op()), r.target->path.string(),
                              offset, length);
  if (offset != r.transfer->offset() || length != r.transfer->length()) {
    s += fmt::format(" (part of a transfer at offset {} length {})", r.transfer->offset(), r.transfer->length());
  }
  return s;
}

// What a request costs in its owner's share: the bytes it still has to move.
uint64_t CostOf(const Request& r) {
  return r.kind == Request::Kind::kRead || r.kind == Request::Kind::kWrite ? r.length - r.done : 0;
}

FairKey KeyOf(const Request& r) { return FairKey{r.target->owner.user(), r.target->owner.id()}; }

bool IsBackground(const Request& r) { return r.target->owner.priority() == IoPriority::kBackground; }

}  // namespace

UringQueue::UringQueue(unsigned depth, uint64_t quantum, FaultInjector* fault_injector, std::string name,
                       std::unique_ptr<UringRing> ring)
    : depth_(depth), fault_injector_(fault_injector), name_(std::move(name)), ring_(std::move(ring)), backlog_(quantum) {}

absl::StatusOr<std::unique_ptr<UringQueue>> UringQueue::Create(unsigned depth, uint64_t quantum,
                                                               FaultInjector* fault_injector, std::string name) {
  absl::StatusOr<std::unique_ptr<UringRing>> ring = UringRing::Create(depth, name);
  if (!ring.ok()) return ring.status();
  std::unique_ptr<UringQueue> queue(
      new UringQueue(depth, quantum, fault_injector, std::move(name), *std::move(ring)));
  queue->reaper_ = std::thread([q = queue.get()] { q->ReapLoop(); });
  // Thread names are at most 15 characters.
  pthread_setname_np(queue->reaper_.native_handle(), fmt::format("fuyou-io-{}", queue->name_).substr(0, 15).c_str());
  return queue;
}

UringQueue::~UringQueue() { Shutdown(); }

void UringQueue::Submit(std::vector<std::unique_ptr<Request>> requests) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (!lifetime_.stopping) {
      lifetime_.live += requests.size();
      for (auto& r : requests) QueueLocked(std::move(r), /*front=*/false);
      FillRingLocked();
      return;
    }
  }
  for (auto& r : requests) {
    r->transfer->RequestDone(absl::FailedPreconditionError(
        fmt::format("{}: the I/O engine has been destroyed", Describe(*r))));
  }
}

void UringQueue::Shutdown() {
  {
    std::unique_lock<std::mutex> lock(mu_);
    if (lifetime_.joined || !reaper_.joinable()) return;
    idle_.wait(lock, [this] { return lifetime_.live == 0; });
    if (!lifetime_.stopping) {
      lifetime_.stopping = true;
      io_uring_sqe* sqe = ring_->NextEntry();  // the ring is empty, so there is room
      io_uring_prep_nop(sqe);
      io_uring_sqe_set_data64(sqe, kStopTag);
      ring_->Submit();
    }
  }
  reaper_.join();
  std::lock_guard<std::mutex> lock(mu_);
  lifetime_.joined = true;
}

void UringQueue::QueueLocked(std::unique_ptr<Request> r, bool front) {
  FairQueue<std::unique_ptr<Request>>& queue = IsBackground(*r) ? backlog_.background : backlog_.waiting;
  const FairKey key = KeyOf(*r);
  const uint64_t cost = CostOf(*r);
  if (front) {
    queue.PushFront(key, cost, std::move(r));
  } else {
    queue.PushBack(key, cost, std::move(r));
  }
}

void UringQueue::FillRingLocked() {
  bool added = false;
  while (backlog_.in_ring < depth_) {
    // A background request enters while fewer than kBackgroundInRing of its
    // kind are in the ring, when no foreground request waits or after
    // kForegroundPerBackground foreground ones entered while it waited.
    const bool background = !backlog_.background.empty() && backlog_.background_in_ring < kBackgroundInRing &&
                            (backlog_.waiting.empty() || backlog_.foreground_run >= kForegroundPerBackground);
    if (!background && backlog_.waiting.empty()) break;
    io_uring_sqe* sqe = ring_->NextEntry();
    if (sqe == nullptr) break;  // cannot happen: the SQ is flushed after every fill
    std::unique_ptr<Request> r = background ? backlog_.background.PopNext() : backlog_.waiting.PopNext();
    if (background) {
      ++backlog_.background_in_ring;
      backlog_.foreground_run = 0;
    } else if (!backlog_.background.empty()) {
      ++backlog_.foreground_run;
    }
    // Lengths fit: IoEngine::Create caps max_request_bytes far below 4 GiB.
    const auto length = static_cast<unsigned>(r->length - r->done);
    switch (r->kind) {
      case Request::Kind::kRead:
        io_uring_prep_read(sqe, r->target->fd, r->data + r->done, length, r->offset + r->done);
        break;
      case Request::Kind::kWrite:
        io_uring_prep_write(sqe, r->target->fd, r->data + r->done, length, r->offset + r->done);
        break;
      case Request::Kind::kSync:
        io_uring_prep_fsync(sqe, r->target->fd, IORING_FSYNC_DATASYNC);
        break;
      case Request::Kind::kNop:
        io_uring_prep_nop(sqe);
        break;
    }
    io_uring_sqe_set_data(sqe, r.release());
    ++backlog_.in_ring;
    added = true;
  }
  if (added) ring_->Submit();
}

bool UringQueue::Evaluate(Request& r, int64_t result, absl::Status* status) {
  if (r.kind == Request::Kind::kNop) {
    *status = r.nop_status;
    return false;
  }
  if (r.kind == Request::Kind::kSync) {
    if (fault_injector_ != nullptr) {
      result = fault_injector_->Adjust(FaultInjector::Op::kSync, r.target->path, 0, 0, result);
    }
    *status = result < 0 ? ErrnoToIoStatus(static_cast<int>(-result),
                                           fmt::format("sync (fdatasync) of {}", r.target->path.string()))
                         : absl::OkStatus();
    return false;
  }
  const uint64_t remaining = r.length - r.done;
  const auto op = r.kind == Request::Kind::kRead ? FaultInjector::Op::kRead : FaultInjector::Op::kWrite;
  if (fault_injector_ != nullptr) {
    result = fault_injector_->Adjust(op, r.target->path, r.offset + r.done, remaining, result);
  }
  if (result < 0) {
    *status = ErrnoToIoStatus(static_cast<int>(-result), Describe(r));
    return false;
  }
  if (result == 0) {
    if (op == FaultInjector::Op::kRead) {
      *status = absl::OutOfRangeError(fmt::format("{} failed: end of file", Describe(r)));
    } else {
      *status = absl::InternalError(fmt::format("{} failed: the kernel wrote 0 bytes", Describe(r)));
    }
    return false;
  }
  if (static_cast<uint64_t>(result) > remaining) {
    *status = absl::InternalError(
        fmt::format("{} failed: the kernel reported {} bytes transferred", Describe(r), result));
    return false;
  }
  uint64_t advance = static_cast<uint64_t>(result);
  if (advance < remaining && r.target->direct) {
    // O_DIRECT needs the remainder aligned; redo the partial block (idempotent).
    advance -= advance % kBlockSize;
  }
  r.done += advance;
  if (r.done == r.length) {
    *status = absl::OkStatus();
    return false;
  }
  r.stalls = advance == 0 ? r.stalls + 1 : 0;
  if (r.stalls > kMaxStalls) {
    *status = absl::DataLossError(fmt::format("{} failed: {} completions in a row transferred less than a block",
                                              Describe(r), r.stalls));
    return false;
  }
  return true;
}

void UringQueue::ReapLoop() {
  std::vector<UringRing::Completion> batch;
  std::vector<std::unique_ptr<Request>> again;
  std::vector<std::pair<std::shared_ptr<Transfer>, absl::Status>> finished;  // requests that ended
  for (;;) {
    ring_->WaitForCompletions(batch);

    bool stop = false;
    unsigned reaped = 0;
    unsigned reaped_background = 0;
    again.clear();
    for (const UringRing::Completion& c : batch) {
      if (c.user_data == kStopTag) {
        stop = true;
        continue;
      }
      ++reaped;
      std::unique_ptr<Request> r(reinterpret_cast<Request*>(c.user_data));
      if (IsBackground(*r)) ++reaped_background;
      absl::Status status;
      if (Evaluate(*r, c.res, &status)) {
        again.push_back(std::move(r));
        continue;
      }
      finished.push_back({std::move(r->transfer), std::move(status)});
      r.reset();
    }
    {
      std::lock_guard<std::mutex> lock(mu_);
      backlog_.in_ring -= reaped;
      backlog_.background_in_ring -= reaped_background;
      // Continuations go first (in their owner's FIFO, and an owner with nothing
      // else waiting takes the next turn): they hold up a transfer that is
      // already running.
      for (auto it = again.rbegin(); it != again.rend(); ++it) QueueLocked(std::move(*it), /*front=*/true);
      FillRingLocked();
    }
    // The ring is refilled before the callbacks run: a callback may take a
    // while (a checksum over a whole chunk), and the device keeps working
    // through the requests queued meanwhile.
    const uint64_t ended = finished.size();
    for (auto& [transfer, status] : finished) transfer->RequestDone(std::move(status));  // may run callbacks
    finished.clear();
    if (ended != 0) {
      std::lock_guard<std::mutex> lock(mu_);
      lifetime_.live -= ended;
      if (lifetime_.live == 0) idle_.notify_all();
    }
    if (stop) return;
  }
}

}  // namespace fuyou::storage::internal
