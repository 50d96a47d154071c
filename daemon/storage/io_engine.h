// IoEngine: aligned, asynchronous file I/O for optimizer states (io_uring, O_DIRECT).
//
// One engine serves every storage path; each opened StateFile is driven by the
// ring of its storage path. Completions run on the engine's completion threads.
// Short transfers are continued until complete; a transfer that cannot complete
// (EOF, EIO, ENOSPC, ...) completes its callback with an error Status naming the
// file, offset and errno text. Nothing is asserted, nothing is silent.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <functional>
#include <memory>
#include <span>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace fuyou::storage {

// Offsets, lengths and buffer addresses of every transfer are multiples of this.
inline constexpr uint64_t kBlockSize = 4096;

// Traffic counters of one storage path; read by the admin stats.
struct IoCounters {
  std::atomic<uint64_t> bytes_read{0};
  std::atomic<uint64_t> bytes_written{0};
  std::atomic<uint64_t> read_ops{0};
  std::atomic<uint64_t> write_ops{0};
  std::atomic<uint64_t> errors{0};
};

// Called exactly once per transfer, on a completion thread; must not block long.
using IoCallback = std::function<void(absl::Status)>;

// A test seam: consulted on every completion before the engine acts on it.
// Returning a value replaces the kernel's result (bytes transferred, or -errno),
// e.g. -ENOSPC, -EIO, or a short count.
class FaultInjector {
 public:
  enum class Op { kRead, kWrite, kReserve, kSync };
  virtual ~FaultInjector() = default;
  // `result` is what the kernel returned for a transfer of `length` bytes.
  virtual int64_t Adjust(Op op, const std::filesystem::path& file, uint64_t offset, uint64_t length,
                         int64_t result) = 0;
};

class StateFile {
 public:
  virtual ~StateFile() = default;

  // Async transfers. Preconditions (checked; a violation completes `done` with
  // INVALID_ARGUMENT): offset, buffer.size() and buffer.data() are multiples of
  // kBlockSize. `buffer` must stay alive until `done` runs.
  virtual void ReadAsync(uint64_t offset, std::span<std::byte> buffer, IoCallback done) = 0;
  virtual void WriteAsync(uint64_t offset, std::span<const std::byte> buffer, IoCallback done) = 0;

  // Blocking forms of the above.
  absl::Status Read(uint64_t offset, std::span<std::byte> buffer);
  absl::Status Write(uint64_t offset, std::span<const std::byte> buffer);

  // Makes sure the file has `bytes` allocated (fallocate), so that a later write
  // cannot fail with ENOSPC. RESOURCE_EXHAUSTED when the device is full.
  virtual absl::Status Reserve(uint64_t bytes) = 0;
  // fdatasync.
  virtual absl::Status Sync() = 0;

  virtual uint64_t size() const = 0;
  // False when the filesystem refused O_DIRECT and the file is buffered.
  virtual bool direct_io() const = 0;
  virtual const std::filesystem::path& path() const = 0;
};

struct IoEngineOptions {
  // Submission queue depth of each ring.
  unsigned queue_depth = 64;
  // Largest single request; bigger transfers are split into requests of this size,
  // all in flight at once.
  uint64_t max_request_bytes = 1 << 20;
  // When a filesystem refuses O_DIRECT (tmpfs): true opens it buffered with a
  // logged warning; false refuses the path with FAILED_PRECONDITION.
  bool allow_buffered_fallback = true;
  // Optional test seam; not owned, must outlive the engine.
  FaultInjector* fault_injector = nullptr;
};

class IoEngine {
 public:
  static absl::StatusOr<std::unique_ptr<IoEngine>> Create(const IoEngineOptions& options);
  virtual ~IoEngine() = default;

  // Opens (creating when `create`) a state file. `counters` (may be null, not
  // owned, must outlive the file) receive its traffic.
  virtual absl::StatusOr<std::unique_ptr<StateFile>> Open(const std::filesystem::path& path, bool create,
                                                          IoCounters* counters) = 0;
};

}  // namespace fuyou::storage
