// IoEngine: aligned, asynchronous file I/O for optimizer states (io_uring, O_DIRECT).
//
// One engine serves every storage path; each opened StateFile is driven by the
// ring of its storage path. Completions run on the engine's completion threads.
// Short transfers are continued until complete; a transfer that cannot complete
// (EOF, EIO, ENOSPC, ...) completes its Future (common/future.h) with an error
// Status naming the file, offset and errno text. Nothing is asserted, nothing is
// silent.
//
// Rings: one io_uring and one completion thread per filesystem, keyed by the
// st_dev of the opened file (so per storage path when, as intended, each storage
// path is its own SSD; two paths on one filesystem share a ring, and subfolders of
// a path never get rings of their own). Rings are made on first Open and live
// until the engine is destroyed.
//
// Requests: a transfer is split into requests of at most max_request_bytes; all of
// them are queued at once, at most queue_depth are in a ring, the rest wait and
// enter as earlier ones complete. Submission is thread-safe.
//
// Owners: every file is opened for an IoOwner (one session, or one job copy, of
// one uid), and its requests are that owner's. The requests waiting for a ring
// are shared by the bytes they move, between users (uids) first, then between
// each user's owners: a two-level deficit round robin (common/fair_queue.h) whose
// quantum is max_request_bytes, so each user with requests waiting gets about one
// request's bytes per round, however many sessions it has. So another user's
// read waits for at most about one request of each other user ahead of it in the
// turn (plus what is in the ring), not behind a flood of write-backs, and a
// user's share does not grow with its sessions. Within one owner the order is
// submission order (a request continuing a short transfer goes first), so one
// owner alone is served exactly as one FIFO, and so are all files opened for
// the same owner. A request enters the ring after every request its owner
// submitted before it; the ring may still run them in any order, so a caller
// that needs a write on the device before a read or a sync waits for the
// write's Future first (SyncAsync covers the writes whose callbacks ran,
// below). Reads do not overtake their own owner's write-backs: a session's
// write-backs give back the DRAM its reads need.
//
// Background owners (IoPriority::kBackground: a job copy) have a low-priority
// share: their requests wait apart, shared among themselves by bytes per user as
// above, and enter the ring while fewer than kBackgroundInRing of them are in
// it: when no foreground request waits, or after kForegroundPerBackground
// foreground requests entered while one waited (a copy is slowed, never
// starved). So a session's read waits behind at most kBackgroundInRing
// requests of copies in the device, and gets at least kForegroundPerBackground
// of every kForegroundPerBackground + 1 places.
//
// Status codes a transfer's Future (or Reserve/Sync) may hold:
//   INVALID_ARGUMENT    misaligned offset/length/address (checked before any I/O),
//                       or EINVAL from the kernel
//   RESOURCE_EXHAUSTED  ENOSPC, EDQUOT (the errno table is common/errno_code.h)
//   DATA_LOSS           EIO; or a request that keeps making no progress
//   OUT_OF_RANGE        a read that reached end of file (result 0)
//   INTERNAL            a write that transferred 0 bytes; other errnos
//   FAILED_PRECONDITION the engine was destroyed before the transfer started
// A failed transfer still waits for all of its requests before its Future is set,
// so `buffer` is no longer touched by the kernel once it is ready.
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
#include "common/future.h"
#include "storage/dir_fd.h"

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

// What an async transfer returns. Its result is set exactly once, on a
// completion thread (also for argument errors, which are never set on the
// caller's thread), except after the engine was destroyed, when it is set on
// the caller's thread. A continuation (Future::Then) runs where the result is
// set: it must not block long, and must not call the blocking Read/Write/Sync
// or destroy the engine. It may start new transfers, and may destroy the
// StateFile whose transfer it completes.
using IoFuture = Future<void>;

// How a file's transfers rank in its ring (see Owners above).
enum class IoPriority { kForeground, kBackground };

// Most requests of background owners in one ring at once.
inline constexpr unsigned kBackgroundInRing = 4;
// Foreground requests that enter a ring for each background one, while both wait.
inline constexpr unsigned kForegroundPerBackground = 4;

// Whom a file's transfers are for: the unit the ring's waiting requests are
// shared between, in turns (see Owners above), with the user (uid) whose share
// it draws on. The daemon makes one per session (its job hold,
// jobs/job_registry.h, and its scratch files) and one per job copy (background).
// IoOwner() is the daemon's own work (probes, tests): user 0, foreground, one
// owner like any other.
class IoOwner {
 public:
  constexpr IoOwner() = default;
  // An owner no other call returned before, in this process (never IoOwner()),
  // of `user`.
  static IoOwner Next(uint32_t user = 0, IoPriority priority = IoPriority::kForeground);

  constexpr uint64_t id() const { return id_; }
  constexpr uint32_t user() const { return user_; }
  constexpr IoPriority priority() const { return priority_; }
  friend constexpr bool operator==(IoOwner, IoOwner) = default;

 private:
  constexpr IoOwner(uint64_t id, uint32_t user, IoPriority priority) : id_(id), user_(user), priority_(priority) {}
  uint64_t id_ = 0;
  uint32_t user_ = 0;
  IoPriority priority_ = IoPriority::kForeground;
};

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
  // Consulted after the O_DIRECT open of `file`; `result` is 0 or -errno. Returning
  // -EINVAL makes the engine treat the filesystem as one that refuses O_DIRECT (as
  // tmpfs did before Linux 6.6). An injected success cannot hide a real failure.
  virtual int AdjustOpenDirect(const std::filesystem::path& /*file*/, int result) { return result; }
};

// An open state file. Destruction waits for its transfers in flight, then closes
// the fd. Counting: read_ops/write_ops and bytes_* count successful transfers (one
// per ReadAsync/WriteAsync call), errors counts failed transfers and failed
// Reserve/Sync calls.
class StateFile {
 public:
  virtual ~StateFile() = default;

  // Async transfers. Preconditions (checked; a violation completes the Future
  // with INVALID_ARGUMENT): offset, buffer.size() and buffer.data() are
  // multiples of kBlockSize. `buffer` must stay alive until the Future is ready.
  [[nodiscard]] virtual IoFuture ReadAsync(uint64_t offset, std::span<std::byte> buffer) = 0;
  [[nodiscard]] virtual IoFuture WriteAsync(uint64_t offset, std::span<const std::byte> buffer) = 0;

  // Blocking forms of the above. Not to be called on a completion thread.
  absl::Status Read(uint64_t offset, std::span<std::byte> buffer);
  absl::Status Write(uint64_t offset, std::span<const std::byte> buffer);

  // Makes sure the file has `bytes` allocated (fallocate), so that a later write
  // cannot fail with ENOSPC. RESOURCE_EXHAUSTED when the device is full.
  // A Reserve that fails gives back what it allocated: the file keeps its size
  // and allocation from before the call.
  virtual absl::Status Reserve(uint64_t bytes) = 0;
  // Gives space back: the file becomes `bytes` long and nothing past that stays
  // allocated (ftruncate, then a punched hole over the rest). For undoing
  // reservations that were never committed.
  virtual absl::Status Truncate(uint64_t bytes) = 0;
  // fdatasync. Covers the writes whose callbacks have run, not ones in flight.
  virtual absl::Status Sync() = 0;
  // fdatasync through the ring (IORING_OP_FSYNC with IORING_FSYNC_DATASYNC),
  // asynchronous: covers the writes whose callbacks ran before the call. O_DIRECT
  // writes still need it for the device's write cache and the metadata of the
  // extents they filled. Its Future holds the Status a Sync would return
  // (errors counted as Sync's are); the FaultInjector sees it as Op::kSync.
  [[nodiscard]] virtual IoFuture SyncAsync() = 0;

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
  // INVALID_ARGUMENT unless 0 < queue_depth <= 4096 and max_request_bytes is a
  // multiple of kBlockSize in (0, 1 GiB]; UNAVAILABLE when io_uring is unusable.
  static absl::StatusOr<std::unique_ptr<IoEngine>> Create(const IoEngineOptions& options);
  // Waits for every transfer in flight (and its callback), then joins the
  // completion threads. StateFiles may outlive the engine; their later transfers
  // fail with FAILED_PRECONDITION.
  virtual ~IoEngine() = default;

  // Opens (creating when `create`, mode 0600) a state file with O_DIRECT|O_CLOEXEC.
  // `counters` (may be null, not owned, must outlive the file) receive its
  // traffic. A filesystem that refuses O_DIRECT gives a buffered file and a warning
  // on stderr, or FAILED_PRECONDITION (and no file created) when
  // allow_buffered_fallback is false.
  // The last component of `path` is never followed (O_NOFOLLOW). Tests use this
  // form; the daemon opens its state files with OpenAt.
  // Every transfer of the file is `owner`'s (see Owners above).
  virtual absl::StatusOr<std::unique_ptr<StateFile>> Open(const std::filesystem::path& path, bool create,
                                                          IoCounters* counters, IoOwner owner) = 0;
  // As Open, for the file `name` (one component) in `dir`: openat relative to the
  // directory's fd with O_NOFOLLOW (storage/dir_fd.h), so a symlink planted in
  // place of the file fails with FAILED_PRECONDITION and touches nothing.
  virtual absl::StatusOr<std::unique_ptr<StateFile>> OpenAt(const DirFd& dir, const std::string& name, bool create,
                                                            IoCounters* counters, IoOwner owner) = 0;
};

}  // namespace fuyou::storage
