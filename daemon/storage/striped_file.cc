#include "storage/striped_file.h"

#include <algorithm>
#include <atomic>
#include <mutex>

#include "fmt/format.h"

namespace fuyou::storage {
namespace {

// Joins the completions of a transfer's pieces: `done` runs once, after the last
// piece, with the first error if any (so the buffer is free by then).
struct PieceJoin {
  explicit PieceJoin(size_t pieces, IoCallback done) : remaining(pieces), done(std::move(done)) {}
  void Finish(absl::Status status) {
    {
      std::lock_guard lock(mutex);
      if (!status.ok() && first_error.ok()) first_error = std::move(status);
    }
    if (remaining.fetch_sub(1) == 1) done(first_error);
  }
  std::atomic<size_t> remaining;
  IoCallback done;
  std::mutex mutex;
  absl::Status first_error;
};

}  // namespace

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
void StripedFile::Split(uint64_t offset, Span buffer, IoCallback done, Submit submit) {
  if (members_.size() == 1) {
    submit(*members_[0], offset, buffer, std::move(done));
    return;
  }
  if (offset % kBlockSize != 0 || buffer.size() % kBlockSize != 0) {
    done(absl::InvalidArgumentError(fmt::format("striped transfer at {} of {} bytes on {} is not {}-byte aligned",
                                                offset, buffer.size(), path().string(), kBlockSize)));
    return;
  }
  size_t pieces = 0;
  for (uint64_t at = offset; at < offset + buffer.size(); at = (at / unit_ + 1) * unit_) ++pieces;
  if (pieces == 0) {
    done(absl::OkStatus());
    return;
  }
  auto join = std::make_shared<PieceJoin>(pieces, std::move(done));
  uint64_t done_bytes = 0;
  while (done_bytes < buffer.size()) {
    const uint64_t at = offset + done_bytes;
    const uint64_t length = std::min<uint64_t>(unit_ - at % unit_, buffer.size() - done_bytes);
    const Location where = Locate(at);
    submit(*members_[where.member], where.offset, buffer.subspan(done_bytes, length),
           [join](absl::Status status) { join->Finish(std::move(status)); });
    done_bytes += length;
  }
}

void StripedFile::ReadAsync(uint64_t offset, std::span<std::byte> buffer, IoCallback done) {
  Split(offset, buffer, std::move(done), [](StateFile& file, uint64_t at, std::span<std::byte> piece, IoCallback cb) {
    file.ReadAsync(at, piece, std::move(cb));
  });
}

void StripedFile::WriteAsync(uint64_t offset, std::span<const std::byte> buffer, IoCallback done) {
  Split(offset, buffer, std::move(done),
        [](StateFile& file, uint64_t at, std::span<const std::byte> piece, IoCallback cb) {
          file.WriteAsync(at, piece, std::move(cb));
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
