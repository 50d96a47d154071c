// UringRing: one io_uring, owned: set up by Create, torn down (io_uring_queue_exit)
// by the destructor. Private to the storage module; UringQueue drives it.
//
// The ring knows nothing of requests: it hands out submission entries, submits
// them (retrying while the kernel is short of memory) and gives back the
// completions in batches. Not thread-safe: one thread submits at a time (the
// caller's lock), and one thread reaps (WaitForCompletions), which io_uring
// allows to run alongside the submitter.
#pragma once

#include <liburing.h>

#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace fuyou::storage::internal {

// Maps an errno to the Status code the engine reports (see io_engine.h).
absl::Status ErrnoToIoStatus(int err, const std::string& what);

class UringRing {
 public:
  // One completion as reaped: the user_data of its submission and the result
  // (bytes transferred, or -errno).
  struct Completion {
    uint64_t user_data;
    int32_t res;
  };

  // A ring of `depth` entries (IORING_SETUP_SUBMIT_ALL where the kernel has
  // it). The error names `name` and the io_uring sysctl that may forbid rings.
  static absl::StatusOr<std::unique_ptr<UringRing>> Create(unsigned depth, std::string_view name);
  ~UringRing();
  UringRing(const UringRing&) = delete;
  UringRing& operator=(const UringRing&) = delete;

  // The next free submission entry, or null when the submission queue is full
  // (never after Submit with fewer than `depth` entries outstanding).
  io_uring_sqe* NextEntry();
  // Submits the entries prepared since the last call. On a failure that
  // retrying does not cure, logs it and leaves the entries for the next Submit.
  void Submit();
  // Waits for at least one completion, then replaces `batch` with every
  // completion ready now (and marks them seen). Retries interrupted waits.
  void WaitForCompletions(std::vector<Completion>& batch);

 private:
  explicit UringRing(std::string_view name) : name_(name) {}

  const std::string name_;  // labels log lines
  io_uring ring_{};
  bool set_up_ = false;  // ring_ needs io_uring_queue_exit
};

}  // namespace fuyou::storage::internal
