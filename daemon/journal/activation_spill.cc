#include "journal/activation_spill.h"

#include <cstring>

#include "common/status_util.h"
#include "fmt/format.h"
#include "xxhash.h"

namespace fuyou {

ActivationSpill::ActivationSpill(std::unique_ptr<JournalSpillFiles> files, JournalQuotaHooks quota,
                                 StorageCharge storage)
    : files_(std::move(files)), quota_(std::move(quota)), storage_(std::move(storage)) {}

ActivationSpill::~ActivationSpill() { Drop(); }

absl::StatusOr<std::span<std::byte>> ActivationSpill::Bounce(uint64_t bytes) {
  if (bounce_.size() < bytes) {
    bounce_ = storage::AlignedBuffer();  // the old one goes first
    FUYOU_ASSIGN_OR_RETURN(bounce_, storage::AlignedBuffer::Allocate(bytes));
  }
  return bounce_.span().first(bytes);
}

absl::Status ActivationSpill::Spill(uint64_t key, std::span<const std::byte> bytes) {
  if (files_ == nullptr) {
    return absl::FailedPreconditionError("fuyoud has no storage path for activation scratch files");
  }
  if (bytes.empty()) return absl::InvalidArgumentError(fmt::format("activation {}: nothing to spill (0 bytes)", key));
  if (entries_.contains(key)) {
    return absl::InvalidArgumentError(fmt::format(
        "activation {} is already spilled in this session; recall it or drop the activations first", key));
  }
  if (entries_.size() >= kMaxActivations) {
    return absl::ResourceExhaustedError(fmt::format(
        "the session already has {} activations spilled, the most one session may hold; recall or drop some",
        entries_.size()));
  }
  // bytes.size() <= one slot, far below overflow.
  const uint64_t padded = (bytes.size() + storage::kBlockSize - 1) / storage::kBlockSize * storage::kBlockSize;
  if (quota_.take) FUYOU_RETURN_IF_ERROR(quota_.take(padded));
  StorageBudget::Grant grant;  // until the blocks are allocated, when the free space shows them
  if (storage_.budget != nullptr) {
    auto admitted = storage_.budget->Admit(storage_.uid, padded, storage_.what);
    if (!admitted.ok()) {
      if (quota_.give) quota_.give(padded);
      return absl::Status(admitted.status().code(),
                          fmt::format("activation {}: {}; the session goes on (recall or drop activations, or keep "
                                      "this one in host memory)",
                                      key, admitted.status().message()));
    }
    grant = std::move(*admitted);
  }
  auto location = files_->Allocate(padded);
  if (!location.ok()) {
    if (quota_.give) quota_.give(padded);
    return absl::Status(location.status().code(),
                        fmt::format("activation {}: {}", key, location.status().message()));
  }
  charged_ += padded;  // the blocks are allocated until Drop, whatever happens below
  if (storage_.budget != nullptr) storage_.budget->HoldScratch(storage_.uid, padded);
  grant.Reset();
  FUYOU_ASSIGN_OR_RETURN(std::span<std::byte> buffer, Bounce(padded));
  std::memcpy(buffer.data(), bytes.data(), bytes.size());
  std::memset(buffer.data() + bytes.size(), 0, padded - bytes.size());  // written, not checksummed: deterministic
  const uint64_t checksum = XXH3_64bits(buffer.data(), bytes.size());
  if (absl::Status written = files_->Write(*location, buffer); !written.ok()) {
    return absl::Status(written.code(), fmt::format("activation {}: cannot write {} bytes to {} (offset {}): {}", key,
                                                    padded, files_->path(location->file).string(), location->offset,
                                                    written.message()));
  }
  entries_.emplace(key, Entry{*location, bytes.size(), checksum});
  return absl::OkStatus();
}

absl::StatusOr<uint64_t> ActivationSpill::Recall(uint64_t key, std::span<std::byte> out) {
  auto found = entries_.find(key);
  if (found == entries_.end()) {
    return absl::NotFoundError(fmt::format(
        "activation {} is not spilled in this session (never spilled, already recalled, or dropped at the end of "
        "the step)",
        key));
  }
  const Entry entry = found->second;
  if (out.size() < entry.bytes) {
    return absl::InvalidArgumentError(
        fmt::format("activation {} is {} bytes, more than the {} bytes it should be recalled into", key, entry.bytes,
                    out.size()));
  }
  entries_.erase(found);
  FUYOU_ASSIGN_OR_RETURN(std::span<std::byte> buffer, Bounce(entry.location.bytes));
  const std::filesystem::path path = files_->path(entry.location.file);
  if (absl::Status read = files_->Read(entry.location, buffer); !read.ok()) {
    return absl::Status(read.code(), fmt::format("activation {}: cannot read it back from {} (offset {}): {}", key,
                                                 path.string(), entry.location.offset, read.message()));
  }
  if (XXH3_64bits(buffer.data(), entry.bytes) != entry.checksum) {
    return absl::DataLossError(fmt::format(
        "activation {}: the {} bytes read back from {} (offset {}) do not match their checksum", key, entry.bytes,
        path.string(), entry.location.offset));
  }
  std::memcpy(out.data(), buffer.data(), entry.bytes);
  return entry.bytes;
}

ActivationSpill::Dropped ActivationSpill::Drop() {
  Dropped dropped{static_cast<uint32_t>(entries_.size()), charged_};
  entries_.clear();
  if (files_ != nullptr && charged_ != 0) files_->Clear();
  if (quota_.give && charged_ != 0) quota_.give(charged_);
  if (storage_.budget != nullptr && charged_ != 0) storage_.budget->GiveScratch(storage_.uid, charged_);
  charged_ = 0;
  return dropped;
}

absl::StatusOr<ActivationSpill::Where> ActivationSpill::Locate(uint64_t key) const {
  const auto found = entries_.find(key);
  if (found == entries_.end()) return absl::NotFoundError(fmt::format("activation {} is not spilled", key));
  return Where{files_->path(found->second.location.file), found->second.location.offset};
}

}  // namespace fuyou
