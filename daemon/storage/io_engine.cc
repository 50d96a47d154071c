#include "storage/io_engine.h"

#include <fcntl.h>
#include <liburing.h>
#include <sys/stat.h>
#include <sys/sysmacros.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <condition_variable>
#include <cstring>
#include <limits>
#include <map>
#include <mutex>
#include <utility>
#include <vector>

#include "fmt/format.h"
#include "storage/uring_queue.h"

namespace fuyou::storage {
namespace {

using internal::ErrnoToIoStatus;
using internal::IoTarget;
using internal::Request;
using internal::Transfer;
using internal::UringQueue;

constexpr uint64_t kMaxRequestBytesLimit = uint64_t{1} << 30;
constexpr unsigned kMaxQueueDepth = 4096;

using FileDescriptor = UniqueFd;

class UringStateFile final : public StateFile {
 public:
  UringStateFile(FileDescriptor fd, bool direct, std::filesystem::path path, IoOwner owner, uint64_t size,
                 std::shared_ptr<UringQueue> queue, const IoEngineOptions& options, IoCounters* counters)
      : fd_(std::move(fd)),
        queue_(std::move(queue)),
        max_request_bytes_(options.max_request_bytes),
        fault_injector_(options.fault_injector),
        counters_(counters),
        size_(size) {
    target_.fd = fd_.get();
    target_.direct = direct;
    target_.path = std::move(path);
    target_.owner = owner;
  }

  ~UringStateFile() override {
    std::unique_lock<std::mutex> lock(mu_);
    drained_.wait(lock, [this] { return in_flight_ == 0; });
    // fd_ closes after this body.
  }

  IoFuture ReadAsync(uint64_t offset, std::span<std::byte> buffer) override {
    return Start(FaultInjector::Op::kRead, offset, buffer.data(), buffer.size());
  }

  IoFuture WriteAsync(uint64_t offset, std::span<const std::byte> buffer) override {
    // The kernel only reads from the buffer of a write.
    return Start(FaultInjector::Op::kWrite, offset, const_cast<std::byte*>(buffer.data()), buffer.size());
  }

  absl::Status Reserve(uint64_t bytes) override {
    if (bytes > static_cast<uint64_t>(std::numeric_limits<off_t>::max())) {
      return CountError(absl::InvalidArgumentError(fmt::format("reserve of {} bytes for {}: too large", bytes,
                                                               target_.path.string())));
    }
    const uint64_t before = size();
    int64_t result = fallocate(target_.fd, 0, 0, static_cast<off_t>(bytes)) == 0 ? 0 : -errno;
    if (fault_injector_ != nullptr) {
      result = fault_injector_->Adjust(FaultInjector::Op::kReserve, target_.path, 0, bytes, result);
    }
    if (result < 0) {
      // fallocate may have allocated part of the range before it failed: give it
      // back, so a refused reservation leaves the file as it was.
      Truncate(before).IgnoreError();
      return CountError(ErrnoToIoStatus(static_cast<int>(-result),
                                        fmt::format("reserve (fallocate) of {} bytes for {}", bytes,
                                                    target_.path.string())));
    }
    GrowSize(bytes);
    return absl::OkStatus();
  }

  absl::Status Truncate(uint64_t bytes) override {
    if (bytes > static_cast<uint64_t>(std::numeric_limits<off_t>::max())) {
      return absl::InvalidArgumentError(fmt::format("truncate of {} to {} bytes: too large", target_.path.string(), bytes));
    }
    struct stat st {};
    if (fstat(target_.fd, &st) != 0) return ErrnoToIoStatus(errno, fmt::format("fstat of {}", target_.path.string()));
    if (ftruncate(target_.fd, static_cast<off_t>(bytes)) != 0) {
      return CountError(ErrnoToIoStatus(errno, fmt::format("truncate of {} to {} bytes", target_.path.string(), bytes)));
    }
    // A failed fallocate may leave blocks past the end of the file that ftruncate
    // does not free: punch them out (filesystems without hole punching keep them).
    const uint64_t allocated = static_cast<uint64_t>(st.st_blocks) * 512;
    const uint64_t reach = std::max<uint64_t>({allocated, static_cast<uint64_t>(st.st_size), bytes});
    if (reach > bytes) {
      fallocate(target_.fd, FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE, static_cast<off_t>(bytes),
                static_cast<off_t>(reach - bytes));
    }
    size_.store(bytes, std::memory_order_release);
    return absl::OkStatus();
  }

  IoFuture SyncAsync() override { return Start(FaultInjector::Op::kSync, 0, nullptr, 0); }

  absl::Status Sync() override {
    int64_t result = fdatasync(target_.fd) == 0 ? 0 : -errno;
    if (fault_injector_ != nullptr) {
      result = fault_injector_->Adjust(FaultInjector::Op::kSync, target_.path, 0, 0, result);
    }
    if (result < 0) {
      return CountError(
          ErrnoToIoStatus(static_cast<int>(-result), fmt::format("sync (fdatasync) of {}", target_.path.string())));
    }
    return absl::OkStatus();
  }

  uint64_t size() const override { return size_.load(std::memory_order_acquire); }
  bool direct_io() const override { return target_.direct; }
  const std::filesystem::path& path() const override { return target_.path; }

 private:
  absl::Status CountError(absl::Status status) {
    if (counters_ != nullptr) counters_->errors.fetch_add(1, std::memory_order_relaxed);
    return status;
  }

  void GrowSize(uint64_t end) {
    uint64_t current = size_.load(std::memory_order_relaxed);
    while (current < end && !size_.compare_exchange_weak(current, end, std::memory_order_acq_rel)) {
    }
  }

  absl::Status CheckArguments(FaultInjector::Op op, uint64_t offset, const std::byte* data, uint64_t length) const {
    const char* verb = op == FaultInjector::Op::kRead ? "read" : "write";
    const auto address = reinterpret_cast<uintptr_t>(data);
    if (offset % kBlockSize != 0 || length % kBlockSize != 0 || address % kBlockSize != 0) {
      return absl::InvalidArgumentError(fmt::format(
          "{} of {} at offset {} length {} buffer {:#x}: offset, length and buffer address must be multiples of {}",
          verb, target_.path.string(), offset, length, address, kBlockSize));
    }
    if (offset > static_cast<uint64_t>(std::numeric_limits<off_t>::max()) - length) {
      return absl::InvalidArgumentError(fmt::format("{} of {} at offset {} length {}: beyond the largest file offset",
                                                    verb, target_.path.string(), offset, length));
    }
    return absl::OkStatus();
  }

  IoFuture Start(FaultInjector::Op op, uint64_t offset, std::byte* data, uint64_t length) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      ++in_flight_;
    }
    const bool sync = op == FaultInjector::Op::kSync;  // one request, no buffer
    const absl::Status valid = sync ? absl::OkStatus() : CheckArguments(op, offset, data, length);
    const uint64_t pieces =
        sync || !valid.ok() || length == 0 ? 1 : (length + max_request_bytes_ - 1) / max_request_bytes_;
    // `finish` runs once every request has ended; the returned future is set
    // after it. Nothing of `this` is touched after in_flight_ drops, so a
    // continuation of the future may destroy this file.
    auto finish = [this, op, offset, length, counters = counters_](const absl::Status& status) {
      if (counters != nullptr) {
        if (!status.ok()) {
          counters->errors.fetch_add(1, std::memory_order_relaxed);
        } else if (op == FaultInjector::Op::kRead) {
          counters->read_ops.fetch_add(1, std::memory_order_relaxed);
          counters->bytes_read.fetch_add(length, std::memory_order_relaxed);
        } else if (op == FaultInjector::Op::kWrite) {
          counters->write_ops.fetch_add(1, std::memory_order_relaxed);
          counters->bytes_written.fetch_add(length, std::memory_order_relaxed);
        }
      }
      if (status.ok() && op == FaultInjector::Op::kWrite) GrowSize(offset + length);
      {
        std::lock_guard<std::mutex> lock(mu_);
        if (--in_flight_ == 0) drained_.notify_all();
      }
      return status;
    };
    auto transfer = std::make_shared<Transfer>(op, offset, length, static_cast<uint32_t>(pieces));
    IoFuture future = transfer->done().Then(std::move(finish));

    std::vector<std::unique_ptr<Request>> requests;
    requests.reserve(pieces);
    if (sync) {
      auto r = std::make_unique<Request>();
      r->kind = Request::Kind::kSync;
      r->target = &target_;
      r->transfer = transfer;
      requests.push_back(std::move(r));
    } else if (!valid.ok() || length == 0) {
      auto r = std::make_unique<Request>();
      r->kind = Request::Kind::kNop;
      r->target = &target_;
      r->offset = offset;
      r->nop_status = valid;
      r->transfer = transfer;
      requests.push_back(std::move(r));
    } else {
      for (uint64_t at = 0; at < length; at += max_request_bytes_) {
        auto r = std::make_unique<Request>();
        r->kind = op == FaultInjector::Op::kRead ? Request::Kind::kRead : Request::Kind::kWrite;
        r->target = &target_;
        r->data = data + at;
        r->offset = offset + at;
        r->length = std::min(max_request_bytes_, length - at);
        r->transfer = transfer;
        requests.push_back(std::move(r));
      }
    }
    queue_->Submit(std::move(requests));
    return future;
  }

  FileDescriptor fd_;
  IoTarget target_;
  const std::shared_ptr<UringQueue> queue_;
  const uint64_t max_request_bytes_;
  FaultInjector* const fault_injector_;
  IoCounters* const counters_;
  std::atomic<uint64_t> size_;

  std::mutex mu_;
  std::condition_variable drained_;
  uint64_t in_flight_ = 0;  // transfers whose finish has not yet released the file
};

class UringIoEngine final : public IoEngine {
 public:
  explicit UringIoEngine(const IoEngineOptions& options) : options_(options) {}

  ~UringIoEngine() override {
    std::map<dev_t, std::shared_ptr<UringQueue>> queues;
    {
      std::lock_guard<std::mutex> lock(mu_);
      queues = queues_;
    }
    for (auto& [dev, queue] : queues) queue->Shutdown();
  }

  absl::StatusOr<std::unique_ptr<StateFile>> Open(const std::filesystem::path& path, bool create,
                                                  IoCounters* counters, IoOwner owner) override {
    return OpenRelative(AT_FDCWD, path.c_str(), path, create, counters, owner);
  }

  absl::StatusOr<std::unique_ptr<StateFile>> OpenAt(const DirFd& dir, const std::string& name, bool create,
                                                    IoCounters* counters, IoOwner owner) override {
    if (name.empty() || name.find('/') != std::string::npos) {
      return absl::InvalidArgumentError(fmt::format("OpenAt: '{}' is not one path component", name));
    }
    return OpenRelative(dir.get(), name.c_str(), dir.path() / name, create, counters, owner);
  }

  // Opens `name` relative to `dirfd` (AT_FDCWD: `name` is a path), never
  // following a last-component symlink; `path` names the file in messages.
  absl::StatusOr<std::unique_ptr<StateFile>> OpenRelative(int dirfd, const char* name, const std::filesystem::path& path,
                                                          bool create, IoCounters* counters, IoOwner owner) {
    struct stat before {};
    const bool existed = fstatat(dirfd, name, &before, AT_SYMLINK_NOFOLLOW) == 0;
    const int base_flags = O_RDWR | O_CLOEXEC | O_NOFOLLOW | (create ? O_CREAT : 0);

    FileDescriptor fd(openat(dirfd, name, base_flags | O_DIRECT, 0600));
    int result = fd.get() >= 0 ? 0 : -errno;
    if (options_.fault_injector != nullptr) {
      const int injected = options_.fault_injector->AdjustOpenDirect(path, result);
      if (injected < 0) result = injected;
    }
    bool direct = true;
    if (result == -EINVAL) {
      fd.Reset();
      if (!options_.allow_buffered_fallback) {
        if (!existed && create) unlinkat(dirfd, name, 0);
        return absl::FailedPreconditionError(fmt::format(
            "open of {}: the filesystem refuses O_DIRECT (tmpfs?) and buffered fallback is disabled; put the "
            "storage path on a filesystem of the SSD (ext4, xfs)",
            path.string()));
      }
      fd = FileDescriptor(openat(dirfd, name, base_flags, 0600));
      result = fd.get() >= 0 ? 0 : -errno;
      direct = false;
      if (result == 0) {
        fmt::print(stderr,
                   "fuyou storage: warning: {} does not support O_DIRECT (tmpfs?); using buffered I/O, which goes "
                   "through the page cache\n",
                   path.string());
      }
    }
    if (result == -ELOOP) {
      return absl::FailedPreconditionError(fmt::format(
          "open of {}: it is a symbolic link, and fuyoud never follows links under a storage path; remove it",
          path.string()));
    }
    if (result < 0) {
      return ErrnoToIoStatus(-result, fmt::format("open of {}{}", path.string(), direct ? " with O_DIRECT" : ""));
    }

    struct stat st {};
    if (fstat(fd.get(), &st) != 0) return ErrnoToIoStatus(errno, fmt::format("fstat of {}", path.string()));
    if (!S_ISREG(st.st_mode)) {
      return absl::FailedPreconditionError(fmt::format("open of {}: not a regular file", path.string()));
    }
    absl::StatusOr<std::shared_ptr<UringQueue>> queue = QueueFor(st.st_dev);
    if (!queue.ok()) return queue.status();
    return std::make_unique<UringStateFile>(std::move(fd), direct, path, owner, static_cast<uint64_t>(st.st_size),
                                            *std::move(queue), options_, counters);
  }

 private:
  absl::StatusOr<std::shared_ptr<UringQueue>> QueueFor(dev_t dev) {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = queues_.find(dev);
    if (it != queues_.end()) return it->second;
    absl::StatusOr<std::unique_ptr<UringQueue>> queue =
        UringQueue::Create(options_.queue_depth, options_.max_request_bytes, options_.fault_injector,
                           fmt::format("{}:{}", major(dev), minor(dev)));
    if (!queue.ok()) return queue.status();
    std::shared_ptr<UringQueue> shared = *std::move(queue);
    queues_.emplace(dev, shared);
    return shared;
  }

  const IoEngineOptions options_;
  std::mutex mu_;
  std::map<dev_t, std::shared_ptr<UringQueue>> queues_;  // one ring per filesystem
};

}  // namespace

IoOwner IoOwner::Next(uint32_t user, IoPriority priority) {
  static std::atomic<uint64_t> last{0};
  return IoOwner(last.fetch_add(1, std::memory_order_relaxed) + 1, user, priority);
}

absl::Status StateFile::Read(uint64_t offset, std::span<std::byte> buffer) {
  return ReadAsync(offset, buffer).status();
}

absl::Status StateFile::Write(uint64_t offset, std::span<const std::byte> buffer) {
  return WriteAsync(offset, buffer).status();
}

absl::StatusOr<std::unique_ptr<IoEngine>> IoEngine::Create(const IoEngineOptions& options) {
  if (options.queue_depth == 0 || options.queue_depth > kMaxQueueDepth) {
    return absl::InvalidArgumentError(
        fmt::format("IoEngine: queue_depth {} must be in [1, {}]", options.queue_depth, kMaxQueueDepth));
  }
  if (options.max_request_bytes == 0 || options.max_request_bytes % kBlockSize != 0 ||
      options.max_request_bytes > kMaxRequestBytesLimit) {
    return absl::InvalidArgumentError(
        fmt::format("IoEngine: max_request_bytes {} must be a multiple of {} in [{}, {}]", options.max_request_bytes,
                    kBlockSize, kBlockSize, kMaxRequestBytesLimit));
  }
  // Fail here, not at the first Open, when io_uring is unusable.
  io_uring probe{};
  const int ret = io_uring_queue_init(1, &probe, 0);
  if (ret < 0) {
    return absl::UnavailableError(fmt::format(
        "IoEngine: io_uring is unusable: {} (errno {}); check kernel.io_uring_disabled and seccomp profiles",
        std::strerror(-ret), -ret));
  }
  io_uring_queue_exit(&probe);
  return std::make_unique<UringIoEngine>(options);
}

}  // namespace fuyou::storage
