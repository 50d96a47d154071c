#include "journal/grad_journal.h"

#include <cstring>

#include "common/checksum.h"
#include "common/status_util.h"
#include "fmt/format.h"

namespace fuyou {
namespace {

uint64_t RoundUpToBlock(uint64_t bytes) {
  return (bytes + storage::kBlockSize - 1) / storage::kBlockSize * storage::kBlockSize;
}

}  // namespace

GradJournal::GradJournal(StateCache& cache, std::string cache_key, std::unique_ptr<JournalSpillFiles> spill,
                         JournalQuotaHooks quota, JournalOptions options)
    : cache_(cache),
      cache_key_(std::move(cache_key)),
      spill_(std::move(spill)),
      quota_(std::move(quota)),
      options_(options) {}

GradJournal::~GradJournal() { Clear(); }

bool GradJournal::Has(uint32_t chunk_id) const {
  auto found = entries_.find(chunk_id);
  return found != entries_.end() && found->second.valid;
}

void GradJournal::Release(uint32_t chunk_id, Entry& entry) {
  if (entry.dram) {
    cache_.Drop(cache_key_, chunk_id);
    entry.dram.Reset();
    dram_bytes_ -= entry.padded;
  }
  if (entry.held) cache_.ReleaseHold(entry.padded);
  entry.held = false;
  if (quota_.give) quota_.give(entry.bytes);
}

absl::StatusOr<StatePin> GradJournal::Transient(uint32_t chunk_id, uint64_t padded) {
  // Waits for the budget as a state read does. Dropped at once: nobody looks it
  // up, and its memory goes back to the budget when the access releases it.
  auto pin = cache_.Create(cache_key_, chunk_id, padded, /*wait=*/true, /*loading=*/false, /*timeout_ms=*/120000);
  if (pin.ok()) cache_.Drop(cache_key_, chunk_id);
  return pin;
}

absl::StatusOr<JournalAccess> GradJournal::Begin(uint32_t chunk_id, uint64_t bytes) {
  if (bytes == 0) return absl::InvalidArgumentError(fmt::format("chunk {}: an empty gradient journal", chunk_id));
  const uint64_t padded = RoundUpToBlock(bytes);
  auto found = entries_.find(chunk_id);
  if (found != entries_.end() && found->second.bytes != bytes) {
    Release(chunk_id, found->second);
    entries_.erase(found);
    found = entries_.end();
  }
  if (found == entries_.end()) {
    if (quota_.take) {
      if (absl::Status taken = quota_.take(bytes); !taken.ok()) {
        return absl::Status(taken.code(), fmt::format("chunk {}: {}", chunk_id, taken.message()));
      }
    }
    Entry entry;
    entry.bytes = bytes;
    entry.padded = padded;
    // DRAM first: within this session's cap, a hold of the cache's half budget,
    // and a buffer the budget has room for without waiting.
    if (dram_bytes_ + padded <= options_.max_dram_bytes && cache_.TryHold(padded)) {
      entry.held = true;
      auto pin = cache_.Create(cache_key_, chunk_id, padded, /*wait=*/false);
      if (pin.ok()) {
        entry.dram = std::move(*pin);
        dram_bytes_ += padded;
      } else {
        cache_.ReleaseHold(padded);
        entry.held = false;
      }
    }
    if (!entry.dram) {
      absl::Status refused;
      if (!spill_) {
        refused = absl::ResourceExhaustedError(fmt::format(
            "chunk {}: a gradient journal of {} bytes does not fit the DRAM budget's room for journals and the "
            "daemon has no scratch space to spill it to; journal fewer chunks or raise --dram-budget",
            chunk_id, bytes));
      } else if (auto location = spill_->Allocate(padded); location.ok()) {
        entry.spilled = true;
        entry.location = *location;
      } else {
        refused = absl::Status(location.status().code(),
                               fmt::format("chunk {}: a gradient journal of {} bytes does not fit the DRAM budget "
                                           "and cannot be spilled: {}; the chunk has no journal and nothing of the "
                                           "step changed",
                                           chunk_id, bytes, location.status().message()));
      }
      if (!refused.ok()) {
        if (quota_.give) quota_.give(bytes);
        return refused;
      }
    }
    found = entries_.emplace(chunk_id, std::move(entry)).first;
  }
  Entry& entry = found->second;
  entry.valid = false;  // until Save
  JournalAccess access;
  access.chunk_id_ = chunk_id;
  if (entry.spilled) {
    auto pin = Transient(chunk_id, entry.padded);
    if (!pin.ok()) return pin.status();
    access.transient_ = std::move(*pin);
    access.data_ = access.transient_.data();
    // The padding is checksummed out but written: keep it deterministic.
    std::memset(access.data_ + entry.bytes, 0, entry.padded - entry.bytes);
  } else {
    access.data_ = entry.dram.data();
  }
  return access;
}

absl::StatusOr<JournalAccess> GradJournal::Open(uint32_t chunk_id) {
  auto found = entries_.find(chunk_id);
  if (found == entries_.end() || !found->second.valid) {
    return absl::FailedPreconditionError(
        fmt::format("chunk {} has no gradient journal in this step (send it with JOURNAL_USE_KEEP first)", chunk_id));
  }
  Entry& entry = found->second;
  JournalAccess access;
  access.chunk_id_ = chunk_id;
  if (!entry.spilled) {
    access.data_ = entry.dram.data();
    return access;
  }
  auto pin = Transient(chunk_id, entry.padded);
  if (!pin.ok()) return pin.status();
  access.transient_ = std::move(*pin);
  access.data_ = access.transient_.data();
  absl::Status read = spill_->Read(entry.location, std::span<std::byte>(access.data_, entry.padded));
  if (read.ok() && Checksum64(access.data_, entry.bytes) != entry.checksum) {
    read = absl::DataLossError(fmt::format(
        "chunk {}: the gradient journal read back from {} (offset {}) does not match its checksum", chunk_id,
        spill_->path(entry.location.file).string(), entry.location.offset));
  }
  if (!read.ok()) {
    entry.valid = false;  // its bytes cannot be trusted: the chunk has no journal any more
    return read;
  }
  return access;
}

absl::Status GradJournal::Save(JournalAccess& access, bool changed) {
  auto found = entries_.find(access.chunk_id_);
  if (found == entries_.end()) return absl::InternalError("GradJournal::Save of a journal that is gone");
  Entry& entry = found->second;
  if (entry.spilled && changed) {
    entry.valid = false;
    const uint64_t checksum = Checksum64(access.data_, entry.bytes);
    absl::Status written = spill_->Write(entry.location, std::span<const std::byte>(access.data_, entry.padded));
    if (!written.ok()) {
      return absl::Status(written.code(), fmt::format("chunk {}: cannot spill its gradient journal: {}",
                                                      access.chunk_id_, written.message()));
    }
    entry.checksum = checksum;
    spill_written_bytes_ += entry.bytes;
  }
  entry.valid = true;
  return absl::OkStatus();
}

void GradJournal::Clear() {
  for (auto& [chunk_id, entry] : entries_) Release(chunk_id, entry);
  entries_.clear();
  if (spill_) spill_->Clear();
}

uint64_t GradJournal::bytes() const {
  uint64_t total = 0;
  for (const auto& [chunk_id, entry] : entries_) total += entry.bytes;
  return total;
}

uint64_t GradJournal::spilled_bytes() const {
  uint64_t total = 0;
  for (const auto& [chunk_id, entry] : entries_) total += entry.spilled ? entry.bytes : 0;
  return total;
}

}  // namespace fuyou
