#include "storage/memory_state_file.h"

#include <cerrno>
#include <cstring>
#include <vector>

#include "fmt/format.h"
#include "storage/uring_queue.h"

namespace fuyou::storage {

struct MemoryIoEngine::Bytes {
  std::mutex mutex;
  std::vector<std::byte> data;  // guarded by mutex; size() is the file's size
};

namespace {

class MemoryStateFile final : public StateFile {
 public:
  MemoryStateFile(std::filesystem::path path, std::shared_ptr<MemoryIoEngine::Bytes> bytes, FaultInjector* faults,
                  IoCounters* counters)
      : path_(std::move(path)), bytes_(std::move(bytes)), faults_(faults), counters_(counters) {}

  IoFuture ReadAsync(uint64_t offset, std::span<std::byte> buffer) override {
    return MakeReadyFuture<void>(Transfer(FaultInjector::Op::kRead, offset, buffer.data(), buffer.size()));
  }
  IoFuture WriteAsync(uint64_t offset, std::span<const std::byte> buffer) override {
    return MakeReadyFuture<void>(
        Transfer(FaultInjector::Op::kWrite, offset, const_cast<std::byte*>(buffer.data()), buffer.size()));
  }
  absl::Status Reserve(uint64_t bytes) override {
    if (absl::Status fault = Fault(FaultInjector::Op::kReserve, bytes, "reserve (fallocate)"); !fault.ok()) {
      return fault;
    }
    std::lock_guard lock(bytes_->mutex);
    if (bytes_->data.size() < bytes) bytes_->data.resize(bytes);
    return absl::OkStatus();
  }
  absl::Status Truncate(uint64_t bytes) override {
    std::lock_guard lock(bytes_->mutex);
    bytes_->data.resize(bytes);
    return absl::OkStatus();
  }
  absl::Status Sync() override {
    return Fault(FaultInjector::Op::kSync, 0, "sync (fdatasync)");
  }
  IoFuture SyncAsync() override { return MakeReadyFuture<void>(Sync()); }
  uint64_t size() const override {
    std::lock_guard lock(bytes_->mutex);
    return bytes_->data.size();
  }
  bool direct_io() const override { return true; }
  const std::filesystem::path& path() const override { return path_; }

 private:
  // The injected result of a Reserve or Sync, as the engine maps it.
  absl::Status Fault(FaultInjector::Op op, uint64_t bytes, const char* what) {
    const int64_t result = faults_ == nullptr ? 0 : faults_->Adjust(op, path_, 0, bytes, 0);
    if (result >= 0) return absl::OkStatus();
    if (counters_ != nullptr) counters_->errors.fetch_add(1, std::memory_order_relaxed);
    return internal::ErrnoToIoStatus(static_cast<int>(-result), fmt::format("{} of {}", what, path_.string()));
  }

  absl::Status Transfer(FaultInjector::Op op, uint64_t offset, std::byte* data, uint64_t length) {
    absl::Status status = Move(op, offset, data, length);
    if (counters_ != nullptr) {
      if (!status.ok()) {
        counters_->errors.fetch_add(1, std::memory_order_relaxed);
      } else if (op == FaultInjector::Op::kRead) {
        counters_->read_ops.fetch_add(1, std::memory_order_relaxed);
        counters_->bytes_read.fetch_add(length, std::memory_order_relaxed);
      } else {
        counters_->write_ops.fetch_add(1, std::memory_order_relaxed);
        counters_->bytes_written.fetch_add(length, std::memory_order_relaxed);
      }
    }
    return status;
  }

  absl::Status Move(FaultInjector::Op op, uint64_t offset, std::byte* data, uint64_t length) {
    const char* verb = op == FaultInjector::Op::kRead ? "read" : "write";
    const auto address = reinterpret_cast<uintptr_t>(data);
    if (offset % kBlockSize != 0 || length % kBlockSize != 0 || address % kBlockSize != 0) {
      return absl::InvalidArgumentError(fmt::format(
          "{} of {} at offset {} length {} buffer {:#x}: offset, length and buffer address must be multiples of {}",
          verb, path_.string(), offset, length, address, kBlockSize));
    }
    std::lock_guard lock(bytes_->mutex);
    std::vector<std::byte>& file = bytes_->data;
    int64_t result = static_cast<int64_t>(length);
    if (op == FaultInjector::Op::kRead && offset + length > file.size()) result = 0;  // end of file
    if (faults_ != nullptr) result = faults_->Adjust(op, path_, offset, length, result);
    const std::string what = fmt::format("{} of {} at offset {} length {}", verb, path_.string(), offset, length);
    if (result < 0) return internal::ErrnoToIoStatus(static_cast<int>(-result), what);
    if (op == FaultInjector::Op::kRead) {
      if (static_cast<uint64_t>(result) < length || offset + length > file.size()) {
        return absl::OutOfRangeError(fmt::format("{} failed: end of file", what));
      }
      std::memcpy(data, file.data() + offset, length);
      return absl::OkStatus();
    }
    if (result == 0) return absl::InternalError(fmt::format("{} failed: wrote 0 bytes", what));
    if (file.size() < offset + length) file.resize(offset + length);
    std::memcpy(file.data() + offset, data, static_cast<uint64_t>(result));  // a short write lands in part
    if (static_cast<uint64_t>(result) < length) {
      return absl::DataLossError(fmt::format("{} failed: short write of {} bytes", what, result));
    }
    return absl::OkStatus();
  }

  const std::filesystem::path path_;
  const std::shared_ptr<MemoryIoEngine::Bytes> bytes_;
  FaultInjector* const faults_;
  IoCounters* const counters_;
};

}  // namespace

absl::StatusOr<std::unique_ptr<StateFile>> MemoryIoEngine::Open(const std::filesystem::path& path, bool create,
                                                                IoCounters* counters, IoOwner /*owner*/) {
  std::lock_guard lock(mutex_);
  auto it = files_.find(path);
  if (it == files_.end()) {
    if (!create) return absl::NotFoundError(fmt::format("open of {} failed: no such file (in memory)", path.string()));
    it = files_.emplace(path, std::make_shared<Bytes>()).first;
  }
  return std::make_unique<MemoryStateFile>(path, it->second, fault_injector_, counters);
}

absl::StatusOr<std::unique_ptr<StateFile>> MemoryIoEngine::OpenAt(const DirFd& dir, const std::string& name,
                                                                  bool create, IoCounters* counters,
                                                                  IoOwner owner) {
  return Open(dir.path() / name, create, counters, owner);
}

std::string MemoryIoEngine::Contents(const std::filesystem::path& path) const {
  std::shared_ptr<Bytes> bytes;
  {
    std::lock_guard lock(mutex_);
    auto it = files_.find(path);
    if (it == files_.end()) return {};
    bytes = it->second;
  }
  std::lock_guard lock(bytes->mutex);
  return std::string(reinterpret_cast<const char*>(bytes->data.data()), bytes->data.size());
}

}  // namespace fuyou::storage
