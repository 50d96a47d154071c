#include "storage/uring_ring.h"

#include <cerrno>
#include <chrono>
#include <cstring>
#include <thread>

#include "common/errno_code.h"
#include "fmt/format.h"

namespace fuyou::storage::internal {

absl::Status ErrnoToIoStatus(int err, const std::string& what) {
  // One errno table for the daemon: common/errno_code.h.
  return absl::Status(ErrnoCode(err), fmt::format("{} failed: {} (errno {})", what, std::strerror(err), err));
}

absl::StatusOr<std::unique_ptr<UringRing>> UringRing::Create(unsigned depth, std::string_view name) {
  std::unique_ptr<UringRing> ring(new UringRing(name));
  io_uring_params params{};
  // SUBMIT_ALL: one bad SQE does not leave the ones after it unsubmitted (5.18+).
  params.flags = IORING_SETUP_SUBMIT_ALL;
  int ret = io_uring_queue_init_params(depth, &ring->ring_, &params);
  if (ret == -EINVAL) {
    params = io_uring_params{};
    ret = io_uring_queue_init_params(depth, &ring->ring_, &params);
  }
  if (ret < 0) {
    return ErrnoToIoStatus(-ret, fmt::format("io_uring_queue_init({}) for {} (is io_uring disabled by "
                                             "kernel.io_uring_disabled or a seccomp profile?)",
                                             depth, name));
  }
  ring->set_up_ = true;
  return ring;
}

UringRing::~UringRing() {
  if (set_up_) io_uring_queue_exit(&ring_);
}

io_uring_sqe* UringRing::NextEntry() { return io_uring_get_sqe(&ring_); }

void UringRing::Submit() {
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

void UringRing::WaitForCompletions(std::vector<Completion>& batch) {
  io_uring_cqe* cqe = nullptr;
  for (;;) {
    const int ret = io_uring_wait_cqe(&ring_, &cqe);
    if (ret >= 0) break;
    if (ret != -EINTR) {
      fmt::print(stderr, "fuyou storage [{}]: io_uring_wait_cqe failed: {}\n", name_, std::strerror(-ret));
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
  }
  batch.clear();
  unsigned head = 0;
  io_uring_for_each_cqe(&ring_, head, cqe) { batch.push_back({cqe->user_data, cqe->res}); }
  io_uring_cq_advance(&ring_, static_cast<unsigned>(batch.size()));
}

}  // namespace fuyou::storage::internal
