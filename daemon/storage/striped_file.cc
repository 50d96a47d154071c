#include "storage/striped_file.h"

#include <algorithm>

#include "fmt/format.h"

namespace fuyou::storage {
StripedFile::StripedFile(std::vector<std::unique_ptr<StateFile>> members, uint64_t unit)
    : members_(std::move(members)), unit_(unit) {}

StripedFile::Location StripedFile::Locate(uint64_t offset) const {
  const uint64_t index = offset / unit_;
  const uint64_t count = members_.size();
  return Location{static_cast<size_t>(index % count), (index / count) * unit_ + offset % unit_};
}

uint64_t StripedFile::MemberBytes(size_t member, uint64_t bytes) const {
  const uint64_t count = members_.size();
  const uint64_t full_units = bytes / unit_;
  const uint64_t rest = bytes % unit_;
  // Member m holds units m, m + count, ...; the partial last unit goes to its member.
  uint64_t units = full_units / count + (member < full_units % count ? 1 : 0);
  uint64_t total = units * unit_;
  if (rest != 0 && member == full_units % count) total += rest;
  return total;
}

template <typename Span, typename Submit>
IoFuture StripedFile::Split(uint64_t offset, Span buffer, Submit submit) {
  if (members_.size() == 1) return submit(*members_[0], offset, buffer);
  if (offset % kBlockSize != 0 || buffer.size() % kBlockSize != 0) {
    return MakeReadyFuture<void>(absl::InvalidArgumentError(fmt::format(
        "striped transfer at {} of {} bytes on {} is not {}-byte aligned", offset, buffer.size(), path().string(),
        kBlockSize)));
  }
  std::vector<IoFuture> pieces;
  uint64_t done_bytes = 0;
  while (done_bytes < buffer.size()) {
    const uint64_t at = offset + done_bytes;
    const uint64_t length = std::min<uint64_t>(unit_ - at % unit_, buffer.size() - done_bytes);
    const Location where = Locate(at);
    pieces.push_back(submit(*members_[where.member], where.offset, buffer.subspan(done_bytes, length)));
    done_bytes += length;
  }
  return AllOf(pieces);  // ready at once when there are no pieces
}

IoFuture StripedFile::ReadAsync(uint64_t offset, std::span<std::byte> buffer) {
  return Split(offset, buffer, [](StateFile& file, uint64_t at, std::span<std::byte> piece) {
    return file.ReadAsync(at, piece);
  });
}

IoFuture StripedFile::WriteAsync(uint64_t offset, std::span<const std::byte> buffer) {
  return Split(offset, buffer, [](StateFile& file, uint64_t at, std::span<const std::byte> piece) {
    return file.WriteAsync(at, piece);
  });
}

absl::Status StripedFile::Reserve(uint64_t bytes) {
  std::vector<uint64_t> before;
  for (const auto& member : members_) before.push_back(member->size());
  for (size_t m = 0; m < members_.size(); ++m) {
    const uint64_t need = MemberBytes(m, bytes);
    if (need > before[m]) {
      if (absl::Status status = members_[m]->Reserve(need); !status.ok()) {
        // The member that failed gave its space back itself; the ones before it
        // grew and give it back here, so the file is as it was.
        for (size_t grown = 0; grown < m; ++grown) {
          if (members_[grown]->size() > before[grown]) members_[grown]->Truncate(before[grown]).IgnoreError();
        }
        return status;
      }
    }
  }
  return absl::OkStatus();
}

absl::Status StripedFile::Truncate(uint64_t bytes) {
  absl::Status first;
  for (size_t m = 0; m < members_.size(); ++m) {
    absl::Status status = members_[m]->Truncate(MemberBytes(m, bytes));
    if (!status.ok() && first.ok()) first = std::move(status);
  }
  return first;
}

absl::Status StripedFile::Sync() {
  for (auto& member : members_) {
    if (absl::Status status = member->Sync(); !status.ok()) return status;
  }
  return absl::OkStatus();
}

IoFuture StripedFile::SyncAsync() {
  if (members_.size() == 1) return members_[0]->SyncAsync();
  std::vector<IoFuture> syncs;
  for (auto& member : members_) syncs.push_back(member->SyncAsync());
  return AllOf(syncs);
}

uint64_t StripedFile::size() const {
  if (members_.size() == 1) return members_[0]->size();
  // The logical prefix is held while every member holds its share of it; the
  // members grow together, so the smallest bounds it.
  uint64_t smallest = UINT64_MAX;
  for (const auto& member : members_) smallest = std::min(smallest, member->size());
  return smallest / unit_ * unit_ * members_.size();
}

bool StripedFile::direct_io() const {
  return std::all_of(members_.begin(), members_.end(), [](const auto& member) { return member->direct_io(); });
}

const std::filesystem::path& StripedFile::path() const { return members_[0]->path(); }

}  // namespace fuyou::storage
