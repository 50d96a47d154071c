#include "journal/activation_spill.h"

#include <cstring>

#include "common/status_util.h"
#include "fmt/format.h"
#include "common/checksum.h"

namespace fuyou {

absl::StatusOr<BounceBuffers::Lent> BounceBuffers::Take(uint64_t bytes) {
  std::unique_lock lock(mutex_);
  Buffer* free = nullptr;
  size_t index = 0;
  returned_.wait(lock, [&] {
    for (size_t i = 0; i < buffers_.size(); ++i) {
      if (!buffers_[i].lent) {
        free = &buffers_[i];
        index = i;
        return true;
      }
    }
    return false;
  });
  if (free->memory.size() < bytes) {
    free->memory = storage::AlignedBuffer();  // the old one goes first
    FUYOU_ASSIGN_OR_RETURN(free->memory, storage::AlignedBuffer::Allocate(bytes));
  }
  free->lent = true;
  return Lent{index, free->memory.span().first(bytes)};
}

void BounceBuffers::Give(size_t index) {
  {
    std::lock_guard lock(mutex_);
    buffers_[index].lent = false;
  }
  returned_.notify_one();
}

void BounceBuffers::Trim() {
  std::lock_guard lock(mutex_);
  for (Buffer& buffer : buffers_) {
    if (!buffer.lent) buffer.memory = storage::AlignedBuffer();
  }
}

ActivationSpill::ActivationSpill(std::unique_ptr<JournalSpillFiles> files, JournalQuotaHooks quota)
    : files_(std::move(files)), quota_(std::move(quota)) {}

ActivationSpill::~ActivationSpill() { Drop(); }

void ActivationSpill::WaitForTransfers() { in_flight_.WaitAll().IgnoreError(); }

Future<void> ActivationSpill::Spill(uint64_t key, std::span<const std::byte> bytes) {
  if (files_ == nullptr) {
    return MakeReadyFuture<void>(
        absl::FailedPreconditionError("fuyoud has no storage path for activation scratch files"));
  }
  if (bytes.empty()) {
    return MakeReadyFuture<void>(
        absl::InvalidArgumentError(fmt::format("activation {}: nothing to spill (0 bytes)", key)));
  }
  if (auto found = entries_.find(key); found != entries_.end()) {
    const Future<void>& written = found->second.written;
    if (!written.ready() || written.result().ok()) {
      return MakeReadyFuture<void>(absl::InvalidArgumentError(fmt::format(
          "activation {} is already spilled in this session; recall it or drop the activations first", key)));
    }
    entries_.erase(found);  // its write failed (and was answered so): the key may be spilled again
  }
  if (entries_.size() >= kMaxActivations) {
    return MakeReadyFuture<void>(absl::ResourceExhaustedError(fmt::format(
        "the session already has {} activations spilled, the most one session may hold; recall or drop some",
        entries_.size())));
  }
  // bytes.size() <= one slot, far below overflow.
  const uint64_t padded = (bytes.size() + storage::kBlockSize - 1) / storage::kBlockSize * storage::kBlockSize;
  if (quota_.take) {
    if (absl::Status taken = quota_.take(padded); !taken.ok()) return MakeReadyFuture<void>(taken);
  }
  auto location = files_->Allocate(padded);  // admitted by the storage budget first
  if (!location.ok()) {
    if (quota_.give) quota_.give(padded);
    const bool refused = absl::IsResourceExhausted(location.status());
    return MakeReadyFuture<void>(absl::Status(
        location.status().code(),
        fmt::format("activation {}: {}{}", key, location.status().message(),
                    refused ? "; the session goes on (recall or drop activations, or keep this one in host memory)"
                            : "")));
  }
  charged_ += padded;  // the blocks are allocated until Drop, whatever happens below
  absl::StatusOr<BounceBuffers::Lent> lent = bounce_->Take(padded);
  if (!lent.ok()) return MakeReadyFuture<void>(lent.status());
  std::memcpy(lent->bytes.data(), bytes.data(), bytes.size());
  std::memset(lent->bytes.data() + bytes.size(), 0, padded - bytes.size());  // written, not checksummed: deterministic
  const uint64_t checksum = Checksum64(lent->bytes.data(), bytes.size());
  const std::string file = files_->path(location->file).string();
  Future<void> written = files_->WriteAsync(*location, lent->bytes)
                             .Then([bounce = bounce_, index = lent->index, key, padded, file,
                                    offset = location->offset](const absl::Status& status) {
                               bounce->Give(index);
                               if (status.ok()) return status;
                               return absl::Status(status.code(),
                                                   fmt::format("activation {}: cannot write {} bytes to {} (offset "
                                                               "{}): {}",
                                                               key, padded, file, offset, status.message()));
                             });
  in_flight_.Add(written);
  entries_.emplace(key, Entry{*location, bytes.size(), checksum, written});
  return written;
}

Future<uint64_t> ActivationSpill::Recall(uint64_t key, std::span<std::byte> out) {
  auto found = entries_.find(key);
  if (found == entries_.end()) {
    return MakeReadyFuture<uint64_t>(absl::NotFoundError(fmt::format(
        "activation {} is not spilled in this session (never spilled, already recalled, or dropped at the end of "
        "the step)",
        key)));
  }
  const Entry entry = found->second;
  if (out.size() < entry.bytes) {
    return MakeReadyFuture<uint64_t>(absl::InvalidArgumentError(
        fmt::format("activation {} is {} bytes, more than the {} bytes it should be recalled into", key, entry.bytes,
                    out.size())));
  }
  entries_.erase(found);
  if (absl::Status written = entry.written.status(); !written.ok()) {  // waits for a write still in flight
    return MakeReadyFuture<uint64_t>(absl::Status(
        written.code(), fmt::format("activation {} cannot be recalled: its spill failed: {}", key, written.message())));
  }
  absl::StatusOr<BounceBuffers::Lent> lent = bounce_->Take(entry.location.bytes);
  if (!lent.ok()) return MakeReadyFuture<uint64_t>(lent.status());
  const std::string file = files_->path(entry.location.file).string();
  Future<uint64_t> recalled =
      files_->ReadAsync(entry.location, lent->bytes)
          .Then([bounce = bounce_, lent = *lent, key, entry, file, out](const absl::Status& read)
                    -> absl::StatusOr<uint64_t> {
            absl::Status status = read;
            if (!status.ok()) {
              status = absl::Status(read.code(),
                                    fmt::format("activation {}: cannot read it back from {} (offset {}): {}", key,
                                                file, entry.location.offset, read.message()));
            } else if (Checksum64(lent.bytes.data(), entry.bytes) != entry.checksum) {
              status = absl::DataLossError(fmt::format(
                  "activation {}: the {} bytes read back from {} (offset {}) do not match their checksum", key,
                  entry.bytes, file, entry.location.offset));
            } else {
              std::memcpy(out.data(), lent.bytes.data(), entry.bytes);
            }
            bounce->Give(lent.index);
            if (!status.ok()) return status;
            return entry.bytes;
          });
  in_flight_.Add(recalled.Then([](const absl::StatusOr<uint64_t>& result) { return result.status(); }));
  return recalled;
}

ActivationSpill::Dropped ActivationSpill::Drop() {
  WaitForTransfers();
  Dropped dropped{static_cast<uint32_t>(entries_.size()), charged_};
  entries_.clear();
  if (files_ != nullptr && charged_ != 0) files_->Clear();  // gives the storage budget's charge back
  if (quota_.give && charged_ != 0) quota_.give(charged_);
  charged_ = 0;
  bounce_->Trim();
  return dropped;
}

absl::StatusOr<ActivationSpill::Where> ActivationSpill::Locate(uint64_t key) const {
  const auto found = entries_.find(key);
  if (found == entries_.end()) return absl::NotFoundError(fmt::format("activation {} is not spilled", key));
  return Where{files_->path(found->second.location.file), found->second.location.offset};
}

}  // namespace fuyou
