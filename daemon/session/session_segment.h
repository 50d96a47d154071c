// SessionSegment: the daemon's mapping of a session's shared-memory segment.
//
// The client creates the segment (a memfd sealed against shrinking and growing)
// and hands its fd over the segment socket (fuyou/segment_handover.h says why
// the client creates it and not the daemon). FromClientFd checks the fd before
// the daemon touches a byte of it, maps it MAP_SHARED read-write, and writes the
// SegmentHeader (proto/include/fuyou/segment_layout.h) that the client
// checks. The mapping lives until this object is destroyed; the fd is not kept.
//
// Why the seals are required: the client keeps its own fd, and a segment it
// could shrink would make the daemon's next access to a slot a SIGBUS. With
// F_SEAL_SHRINK nobody can truncate it, and the size checked here holds for the
// life of the mapping.
#pragma once

#include <cstddef>
#include <memory>
#include <span>

#include "absl/status/statusor.h"
#include "boost/interprocess/mapped_region.hpp"
#include "fuyou/segment_layout.h"

namespace fuyou {

class SessionSegment {
 public:
  // Maps `fd` (not taken; the caller closes it) as the segment of `layout`.
  // Refused, with nothing mapped:
  //   INVALID_ARGUMENT     not a regular file, or its size is not layout.TotalBytes();
  //   FAILED_PRECONDITION  not a memfd sealed with F_SEAL_SHRINK | F_SEAL_GROW, or
  //                        not mappable shared read-write (a read-only fd, F_SEAL_WRITE).
  static absl::StatusOr<std::unique_ptr<SessionSegment>> FromClientFd(int fd, const SegmentLayout& layout);
  SessionSegment(const SessionSegment&) = delete;
  SessionSegment& operator=(const SessionSegment&) = delete;

  const SegmentLayout& layout() const { return layout_; }
  std::span<std::byte> GradRegion(uint32_t slot) const;
  std::span<std::byte> ParamRegion(uint32_t slot) const;

 private:
  SessionSegment(SegmentLayout layout, boost::interprocess::mapped_region region);
  SegmentLayout layout_;
  boost::interprocess::mapped_region region_;
  std::byte* base_;
};

}  // namespace fuyou
