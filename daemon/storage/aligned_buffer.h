// AlignedBuffer: an anonymous mapping for I/O and optimizer states, 4 KiB-aligned,
// backed by transparent huge pages when the kernel allows (MADV_HUGEPAGE), which
// keeps large O_DIRECT requests physically contiguous. Owns its mapping.
#pragma once

#include <cstddef>
#include <span>

#include "absl/status/statusor.h"

namespace fuyou::storage {

class AlignedBuffer {
 public:
  AlignedBuffer() = default;
  // Maps `bytes` rounded up to 4096; at least 2 MiB starts on a 2 MiB boundary
  // (huge pages). RESOURCE_EXHAUSTED on failure.
  static absl::StatusOr<AlignedBuffer> Allocate(size_t bytes);
  // The size() a buffer allocated for `bytes` has: `bytes` rounded up to 4096
  // (Allocate uses it; StateCache looks up a spare of that size).
  static size_t RoundedSize(size_t bytes) { return (bytes + 4095) / 4096 * 4096; }
  ~AlignedBuffer();
  AlignedBuffer(AlignedBuffer&& other) noexcept;
  AlignedBuffer& operator=(AlignedBuffer&& other) noexcept;
  AlignedBuffer(const AlignedBuffer&) = delete;
  AlignedBuffer& operator=(const AlignedBuffer&) = delete;

  // Keeps only the first RoundedSize(bytes) bytes (bytes <= size()): the rest
  // is unmapped, the kept pages stay as they are (faulted in, their bytes
  // unchanged), so a spare reused for a smaller entry costs no page faults.
  void ShrinkTo(size_t bytes);

  std::byte* data() const { return data_; }
  // Usable bytes (the rounded size).
  size_t size() const { return size_; }
  std::span<std::byte> span() const { return {data_, size_}; }

 private:
  std::byte* data_ = nullptr;
  size_t size_ = 0;
};

}  // namespace fuyou::storage
