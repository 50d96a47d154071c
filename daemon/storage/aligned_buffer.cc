#include "storage/aligned_buffer.h"

#include <sys/mman.h>

#include <cerrno>
#include <cstdint>
#include <cstring>
#include <utility>

#include "absl/status/status.h"
#include "fmt/format.h"

namespace fuyou::storage {
namespace {

constexpr size_t kHugePageSize = size_t{2} << 20;

size_t RoundUp(size_t bytes, size_t unit) { return (bytes + unit - 1) / unit * unit; }

}  // namespace

absl::StatusOr<AlignedBuffer> AlignedBuffer::Allocate(size_t bytes) {
  if (bytes == 0) return AlignedBuffer();
  const bool huge = bytes >= kHugePageSize;
  if (bytes > SIZE_MAX - 2 * kHugePageSize) {
    return absl::ResourceExhaustedError(fmt::format("AlignedBuffer: {} bytes cannot be mapped", bytes));
  }
  // Only 4 KiB rounding: the DRAM budget counts these bytes, and rounding a
  // 3 MiB chunk to 4 MiB would waste a quarter of it. The whole 2 MiB pages
  // inside get huge pages; a partial one at the end keeps 4 KiB pages.
  const size_t size = RoundedSize(bytes);
  // A mapping is only page-aligned; for huge pages map one extra huge page and
  // trim both ends so the kept range starts on a 2 MiB boundary.
  const size_t map_size = huge ? size + kHugePageSize : size;
  void* mapped = mmap(nullptr, map_size, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (mapped == MAP_FAILED) {
    const int err = errno;
    return absl::ResourceExhaustedError(
        fmt::format("AlignedBuffer: mmap of {} bytes failed: {} (errno {})", map_size, std::strerror(err), err));
  }
  auto* base = static_cast<std::byte*>(mapped);
  std::byte* data = base;
  if (huge) {
    const auto addr = reinterpret_cast<uintptr_t>(base);
    data = reinterpret_cast<std::byte*>(RoundUp(addr, kHugePageSize));
    const size_t head = static_cast<size_t>(data - base);
    const size_t tail = map_size - head - size;
    if (head > 0) munmap(base, head);
    if (tail > 0) munmap(data + size, tail);
    // Advisory: without THP (or with it set to "never") the buffer still works
    // with 4 KiB pages, so a failure here is not an error.
    madvise(data, size, MADV_HUGEPAGE);
  }
  AlignedBuffer buffer;
  buffer.data_ = data;
  buffer.size_ = size;
  return buffer;
}

void AlignedBuffer::ShrinkTo(size_t bytes) {
  const size_t keep = RoundedSize(bytes);
  if (keep >= size_) return;
  if (keep == 0) {
    *this = AlignedBuffer();
    return;
  }
  munmap(data_ + keep, size_ - keep);
  size_ = keep;
}

AlignedBuffer::~AlignedBuffer() {
  if (data_ != nullptr) munmap(data_, size_);
}

AlignedBuffer::AlignedBuffer(AlignedBuffer&& other) noexcept
    : data_(std::exchange(other.data_, nullptr)), size_(std::exchange(other.size_, 0)) {}

AlignedBuffer& AlignedBuffer::operator=(AlignedBuffer&& other) noexcept {
  if (this != &other) {
    if (data_ != nullptr) munmap(data_, size_);
    data_ = std::exchange(other.data_, nullptr);
    size_ = std::exchange(other.size_, 0);
  }
  return *this;
}

}  // namespace fuyou::storage
