#include "session/session_segment.h"

#include <fcntl.h>
#include <linux/magic.h>
#include <sys/stat.h>
#include <sys/vfs.h>

#include <cerrno>
#include <cstring>

#include "common/status_util.h"
#include "fmt/format.h"
#include "fuyou/segment_handover.h"

namespace fuyou {
namespace {

namespace bip = boost::interprocess;

// A file descriptor as Boost.Interprocess's mapped_region takes it: any type
// with get_mapping_handle() and get_mode().
struct MappableFd {
  int fd;
  bip::mapping_handle_t get_mapping_handle() const { return bip::mapping_handle_t{fd, false}; }
  bip::mode_t get_mode() const { return bip::read_write; }
};

}  // namespace

absl::StatusOr<std::unique_ptr<SessionSegment>> SessionSegment::FromClientFd(int fd, const SegmentLayout& layout) {
  const uint64_t total = layout.TotalBytes();
  struct stat info {};
  if (::fstat(fd, &info) != 0) return ErrnoStatus(errno, "fstat of the segment fd");
  if (!S_ISREG(info.st_mode)) {
    return absl::InvalidArgumentError("the segment fd is not a regular file; send a memfd (memfd_create)");
  }
  if (static_cast<uint64_t>(info.st_size) != total) {
    return absl::InvalidArgumentError(
        fmt::format("the segment is {} bytes but the session's segment_bytes is {}", info.st_size, total));
  }
  // Only a memfd made with MFD_ALLOW_SEALING can carry these seals; any other
  // file fails F_GET_SEALS (EINVAL) or reports F_SEAL_SEAL alone. Only tmpfs
  // memfds: after a hole is punched in a hugetlbfs one (MFD_HUGETLB), a fault
  // with the huge page pool empty is a SIGBUS, where tmpfs allocates a page.
  // (No layout's size is a multiple of 2 MiB today, so the size check above
  // refuses those already; this keeps it so if the layout changes.)
  const int seals = ::fcntl(fd, F_GET_SEALS);
  struct statfs filesystem {};
  const bool tmpfs = ::fstatfs(fd, &filesystem) == 0 && filesystem.f_type == TMPFS_MAGIC;
  if (seals < 0 || !tmpfs || (static_cast<unsigned>(seals) & kRequiredSegmentSeals) != kRequiredSegmentSeals) {
    return absl::FailedPreconditionError(
        "the segment must be a memfd sealed with F_SEAL_SHRINK|F_SEAL_GROW (memfd_create with "
        "MFD_ALLOW_SEALING, then fcntl F_ADD_SEALS): an unsealed segment could be truncated under the daemon");
  }
  try {
    bip::mapped_region region(MappableFd{fd}, bip::read_write, 0, total);
    auto* header = static_cast<SegmentHeader*>(region.get_address());
    header->num_slots = layout.num_slots;
    header->reserved = 0;
    header->slot_bytes = layout.slot_bytes;
    header->total_bytes = total;
    __atomic_store_n(&header->magic, kSegmentMagic, __ATOMIC_RELEASE);
    return std::unique_ptr<SessionSegment>(new SessionSegment(layout, std::move(region)));
  } catch (const bip::interprocess_exception& error) {
    // EACCES: an fd opened read-only; EPERM: a memfd sealed against writes.
    return absl::FailedPreconditionError(fmt::format(
        "cannot map the segment shared read-write: {}; send the memfd itself, writable, without F_SEAL_WRITE",
        error.what()));
  }
}

SessionSegment::SessionSegment(SegmentLayout layout, bip::mapped_region region)
    : layout_(layout), region_(std::move(region)), base_(static_cast<std::byte*>(region_.get_address())) {}

std::span<std::byte> SessionSegment::GradRegion(uint32_t slot) const {
  return {base_ + layout_.GradOffset(slot), layout_.slot_bytes};
}

std::span<std::byte> SessionSegment::ParamRegion(uint32_t slot) const {
  return {base_ + layout_.ParamOffset(slot), layout_.slot_bytes};
}

}  // namespace fuyou
