#include "storage/uring_queue.h"

#include <pthread.h>

#include <cerrno>
#include <chrono>
#include <cstring>
#include <utility>

#include "common/errno_code.h"
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

}  // namespace

absl::Status ErrnoToIoStatus(int err, const std::string& what) {
  // One errno table for the daemon: common/errno_code.h.
  return absl::Status(ErrnoCode(err), fmt::format("{} failed: {} (errno {})", what, std::strerror(err), err));
}

UringQueue::UringQueue(unsigned depth, FaultInjector* fault_injector, std::string name)
    : depth_(depth), fault_injector_(fault_injector), name_(std::move(name)) {}

absl::StatusOr<std::unique_ptr<UringQueue>> UringQueue::Create(unsigned depth, FaultInjector* fault_injector,
                                                               std::string name) {
  std::unique_ptr<UringQueue> queue(new UringQueue(depth, fault_injector, std::move(name)));
  io_uring_params params{};
  // SUBMIT_ALL: one bad SQE does not leave the ones after it unsubmitted (5.18+).
  params.flags = IORING_SETUP_SUBMIT_ALL;
  int ret = io_uring_queue_init_params(depth, &queue->ring_, &params);
  if (ret == -EINVAL) {
    params = io_uring_params{};
    ret = io_uring_queue_init_params(depth, &queue->ring_, &params);
  }
  if (ret < 0) {
    return ErrnoToIoStatus(-ret, fmt::format("io_uring_queue_init({}) for {} (is io_uring disabled by "
                                             "kernel.io_uring_disabled or a seccomp profile?)",
                                             depth, queue->name_));
  }
  queue->ring_ready_ = true;
  queue->reaper_ = std::thread([q = queue.get()] { q->ReapLoop(); });
  // Thread names are at most 15 characters.
  pthread_setname_np(queue->reaper_.native_handle(), fmt::format("fuyou-io-{}", queue->name_).substr(0, 15).c_str());
  return queue;
}

UringQueue::~UringQueue() {
  Shutdown();
  if (ring_ready_) io_uring_queue_exit(&ring_);
}

void UringQueue::Submit(std::vector<std::unique_ptr<Request>> requests) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (!stopping_) {
      live_ += requests.size();
      for (auto& r : requests) waiting_.push_back(std::move(r));
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
    if (joined_ || !reaper_.joinable()) return;
    idle_.wait(lock, [this] { return live_ == 0; });
    if (!stopping_) {
      stopping_ = true;
      io_uring_sqe* sqe = io_uring_get_sqe(&ring_);  // the ring is empty, so there is room
      io_uring_prep_nop(sqe);
      io_uring_sqe_set_data64(sqe, kStopTag);
      SubmitRingLocked();
    }
  }
  reaper_.join();
  std::lock_guard<std::mutex> lock(mu_);
  joined_ = true;
}

void UringQueue::FillRingLocked() {
  bool added = false;
  while (!waiting_.empty() && in_ring_ < depth_) {
    io_uring_sqe* sqe = io_uring_get_sqe(&ring_);
    if (sqe == nullptr) break;  // cannot happen: the SQ is flushed after every fill
    std::unique_ptr<Request> r = std::move(waiting_.front());
    waiting_.pop_front();
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
    ++in_ring_;
    added = true;
  }
  if (added) SubmitRingLocked();
}

void UringQueue::SubmitRingLocked() {
  for (int attempt = 0;; ++attempt) {
    const int ret = io_uring_submit(&ring_);
    if (ret >= 0) return;
    if (ret == -EINTR) continue;
    if ((ret == -EAGAIN || ret == -EBUSY) && attempt < 1000) {
      // The kernel is short of memory or completions; the reaper frees them.
      std::this_thread::sleep_for(std::chrono::microseconds(100));
      continue;
    }
    // The SQEs stay in the SQ and go with the next submit.
    fmt::print(stderr, "fuyou storage [{}]: io_uring_submit failed: {} (errno {}); will retry\n", name_,
               std::strerror(-ret), -ret);
    return;
  }
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
  struct Completion {
    uint64_t user_data;
    int32_t res;
  };
  std::vector<Completion> batch;
  std::vector<std::unique_ptr<Request>> again;
  std::vector<std::pair<std::shared_ptr<Transfer>, absl::Status>> finished;  // requests that ended
  for (;;) {
    io_uring_cqe* cqe = nullptr;
    const int ret = io_uring_wait_cqe(&ring_, &cqe);
    if (ret < 0) {
      if (ret != -EINTR) {
        fmt::print(stderr, "fuyou storage [{}]: io_uring_wait_cqe failed: {}\n", name_, std::strerror(-ret));
        std::this_thread::sleep_for(std::chrono::milliseconds(1));
      }
      continue;
    }
    batch.clear();
    unsigned head = 0;
    io_uring_for_each_cqe(&ring_, head, cqe) { batch.push_back({cqe->user_data, cqe->res}); }
    io_uring_cq_advance(&ring_, static_cast<unsigned>(batch.size()));

    bool stop = false;
    unsigned reaped = 0;
    again.clear();
    for (const Completion& c : batch) {
      if (c.user_data == kStopTag) {
        stop = true;
        continue;
      }
      ++reaped;
      std::unique_ptr<Request> r(reinterpret_cast<Request*>(c.user_data));
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
      in_ring_ -= reaped;
      // Continuations go first: they hold up a transfer that is already running.
      for (auto it = again.rbegin(); it != again.rend(); ++it) waiting_.push_front(std::move(*it));
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
      live_ -= ended;
      if (live_ == 0) idle_.notify_all();
    }
    if (stop) return;
  }
}

}  // namespace fuyou::storage::internal
