#include "session/shm_segment.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <signal.h>

#include <cerrno>
#include <charconv>
#include <random>

#include "boost/interprocess/shared_memory_object.hpp"
#include "common/status_util.h"
#include "fmt/format.h"

namespace fuyou {
namespace {

namespace bip = boost::interprocess;

constexpr std::string_view kNamePrefix = "fuyou-";

// "fuyou-<daemon pid>-<128 random bits>". The random bits are the only thing
// between another local user and the segment until it is unlinked; the pid lets
// a later daemon remove what a dead one left behind (RemoveOrphanedSegments).
std::string RandomSegmentName() {
  std::random_device device;
  uint64_t high = (uint64_t{device()} << 32) | device();
  uint64_t low = (uint64_t{device()} << 32) | device();
  return fmt::format("{}{}-{:016x}{:016x}", kNamePrefix, ::getpid(), high, low);
}

}  // namespace

absl::StatusOr<std::unique_ptr<ShmSegment>> ShmSegment::Create(const SegmentLayout& layout, uid_t owner_uid) {
  const std::string name = RandomSegmentName();
  const uint64_t total = layout.TotalBytes();
  try {
    bip::permissions owner_only;
    owner_only.set_permissions(0600);
    bip::shared_memory_object shm(bip::create_only, name.c_str(), bip::read_write, owner_only);
    const int fd = shm.get_mapping_handle().handle;
    auto fail = [&](int err, std::string_view what) {
      bip::shared_memory_object::remove(name.c_str());
      return ErrnoStatus(err, fmt::format("shared-memory segment /{}: {}", name, what));
    };
    // fchmod: the creation mode was filtered by the umask.
    if (::fchmod(fd, 0600) != 0) return fail(errno, "fchmod 0600");
    if (owner_uid != ::geteuid() && ::fchown(fd, owner_uid, static_cast<gid_t>(-1)) != 0) {
      return fail(errno, fmt::format("cannot give the segment to uid {}", owner_uid));
    }
    shm.truncate(static_cast<bip::offset_t>(total));
    // Reserve the pages now so that a full /dev/shm is an error at open, not a
    // SIGBUS in the middle of a step.
    if (int err = ::posix_fallocate(fd, 0, static_cast<off_t>(total)); err != 0) {
      return fail(err, fmt::format("cannot reserve {} bytes in /dev/shm", total));
    }
    bip::mapped_region region(shm, bip::read_write);
    auto* header = static_cast<SegmentHeader*>(region.get_address());
    header->num_slots = layout.num_slots;
    header->reserved = 0;
    header->slot_bytes = layout.slot_bytes;
    header->total_bytes = total;
    __atomic_store_n(&header->magic, kSegmentMagic, __ATOMIC_RELEASE);
    return std::unique_ptr<ShmSegment>(new ShmSegment(name, layout, std::move(region)));
  } catch (const bip::interprocess_exception& error) {
    bip::shared_memory_object::remove(name.c_str());
    return absl::ResourceExhaustedError(
        fmt::format("cannot create a shared-memory segment of {} bytes: {}", total, error.what()));
  }
}

int RemoveOrphanedSegments(const std::filesystem::path& shm_dir) {
  int removed = 0;
  std::error_code ec;
  for (const auto& entry : std::filesystem::directory_iterator(shm_dir, ec)) {
    const std::string name = entry.path().filename().string();
    if (name.rfind(kNamePrefix, 0) != 0) continue;
    const size_t dash = name.find('-', kNamePrefix.size());
    if (dash == std::string::npos) continue;
    pid_t pid = 0;
    const char* first = name.data() + kNamePrefix.size();
    if (std::from_chars(first, name.data() + dash, pid).ec != std::errc() || pid <= 0) continue;
    // Only segments whose daemon is gone; a live daemon (this one or another)
    // owns its own.
    if (::kill(pid, 0) == 0 || errno != ESRCH) continue;
    if (std::filesystem::remove(entry.path(), ec)) ++removed;
  }
  return removed;
}

ShmSegment::ShmSegment(std::string name, SegmentLayout layout, bip::mapped_region region)
    : name_(std::move(name)),
      layout_(layout),
      region_(std::move(region)),
      base_(static_cast<std::byte*>(region_.get_address())) {}

ShmSegment::~ShmSegment() { Unlink(); }

void ShmSegment::Unlink() {
  if (!linked_) return;
  linked_ = false;
  bip::shared_memory_object::remove(name_.c_str());
}

std::span<std::byte> ShmSegment::GradRegion(uint32_t slot) const {
  return {base_ + layout_.GradOffset(slot), layout_.slot_bytes};
}

std::span<std::byte> ShmSegment::ParamRegion(uint32_t slot) const {
  return {base_ + layout_.ParamOffset(slot), layout_.slot_bytes};
}

}  // namespace fuyou
