// StripedFile: software RAID-0 over one file per storage path (one per SSD).
//
// Logical byte b lives in member (b / unit) % members, at member offset
// (b / unit / members) * unit + b % unit. A transfer is cut at unit boundaries
// and every piece is in flight at once, so reading or writing one chunk's states
// uses every SSD together. With a single member this is a thin pass-through: no
// loss when there is only one path.
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "storage/io_engine.h"

namespace fuyou::storage {

class StripedFile final : public StateFile {
 public:
  // Default stripe unit: large enough for sequential SSD requests, small enough
  // that a 16 MiB chunk spans many members.
  static constexpr uint64_t kDefaultUnit = uint64_t{1} << 20;

  // `members` (at least one) become owned; `unit` is a multiple of kBlockSize.
  StripedFile(std::vector<std::unique_ptr<StateFile>> members, uint64_t unit = kDefaultUnit);

  // A transfer over several members is ready when all its pieces are (AllOf),
  // with the first error in the pieces' order.
  IoFuture ReadAsync(uint64_t offset, std::span<std::byte> buffer) override;
  IoFuture WriteAsync(uint64_t offset, std::span<const std::byte> buffer) override;
  // Reserves on every member what its share of `bytes` logical bytes needs; on
  // failure every member is given back what it had before.
  absl::Status Reserve(uint64_t bytes) override;
  // Truncates every member to its share of `bytes` logical bytes.
  absl::Status Truncate(uint64_t bytes) override;
  absl::Status Sync() override;
  // Every member's SyncAsync at once (AllOf: the first error in member order).
  IoFuture SyncAsync() override;
  // Logical size: the largest logical size all members can hold.
  uint64_t size() const override;
  // True only when every member uses O_DIRECT.
  bool direct_io() const override;
  // The first member's path (for messages).
  const std::filesystem::path& path() const override;

  size_t members() const { return members_.size(); }
  // Where logical byte `offset` lives.
  struct Location {
    size_t member;
    uint64_t offset;
  };
  Location Locate(uint64_t offset) const;
  // Bytes member `member` needs to hold logical bytes [0, bytes).
  uint64_t MemberBytes(size_t member, uint64_t bytes) const;

 private:
  template <typename Span, typename Submit>
  IoFuture Split(uint64_t offset, Span buffer, Submit submit);

  std::vector<std::unique_ptr<StateFile>> members_;
  uint64_t unit_;
};

}  // namespace fuyou::storage
