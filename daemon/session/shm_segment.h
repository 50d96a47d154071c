// ShmSegment: the daemon's side of a session's shared-memory segment.
//
// Created with an unguessable name, mode 0600, owned by the client's uid, and
// laid out per clientlib/include/fuyou/segment_layout.h. The name can be
// unlinked as soon as the client has mapped it (Unlink); the mapping itself
// lives until this object is destroyed. Destruction also unlinks the name, so a
// segment never outlives its session.
#pragma once

#include <sys/types.h>

#include <cstddef>
#include <filesystem>
#include <memory>
#include <span>
#include <string>

#include "absl/status/statusor.h"
#include "boost/interprocess/mapped_region.hpp"
#include "fuyou/segment_layout.h"

namespace fuyou {

// Removes the segments in `shm_dir` (/dev/shm) that a daemon which no longer
// runs created and never unlinked (it died between OpenSession and Attach).
// Returns how many were removed.
int RemoveOrphanedSegments(const std::filesystem::path& shm_dir = "/dev/shm");

class ShmSegment {
 public:
  // Creates and maps a segment. `owner_uid` becomes the owner when it differs
  // from the daemon's uid (needs CAP_CHOWN, e.g. root).
  static absl::StatusOr<std::unique_ptr<ShmSegment>> Create(const SegmentLayout& layout, uid_t owner_uid);
  ~ShmSegment();
  ShmSegment(const ShmSegment&) = delete;
  ShmSegment& operator=(const ShmSegment&) = delete;

  const std::string& name() const { return name_; }
  const SegmentLayout& layout() const { return layout_; }
  std::span<std::byte> GradRegion(uint32_t slot) const;
  std::span<std::byte> ParamRegion(uint32_t slot) const;

  // Removes the name from /dev/shm; idempotent.
  void Unlink();

 private:
  ShmSegment(std::string name, SegmentLayout layout, boost::interprocess::mapped_region region);
  std::string name_;
  SegmentLayout layout_;
  boost::interprocess::mapped_region region_;
  std::byte* base_;
  bool linked_ = true;
};

}  // namespace fuyou
