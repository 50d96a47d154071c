// SpareBuffers: a few freed AlignedBuffers kept for reuse, so a cache that frees
// a chunk's buffer and at once needs one of the same size (eviction then a read,
// every chunk of every step once the states outgrow DRAM) does not unmap and map
// again: a fresh anonymous mapping costs a page fault and the kernel's zeroing
// of every page, as much CPU as the read's own checksum.
//
// Contract: Take(size) returns a buffer of exactly `size` usable bytes cut
// from the smallest kept buffer at least that large (AlignedBuffer::ShrinkTo:
// its first pages stay faulted in, the rest is unmapped), holding whatever
// its last user left, or none. (Growing a smaller one with mremap would move
// it off its 2 MiB alignment and split its huge pages.) The taker the taker zeroes what it does not fill
// itself (ZeroFrom) before anyone reads it, so no bytes pass from one job to
// another. At most `max_buffers` are kept; Put beyond that frees the buffer.
// Not thread-safe: the owner (StateCache) guards it with its own mutex.
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <vector>

#include "storage/aligned_buffer.h"

namespace fuyou::storage {

class SpareBuffers {
 public:
  explicit SpareBuffers(size_t max_buffers) : max_buffers_(max_buffers) {}

  // A buffer of `size` bytes (AlignedBuffer::size(), i.e. already rounded)
  // cut from the smallest kept one at least that large; nullopt when every
  // kept one is smaller.
  std::optional<AlignedBuffer> Take(size_t size);
  // Zeroes `buffer` from byte `keep` on (all of it when keep is 0).
  static void ZeroFrom(AlignedBuffer& buffer, size_t keep);
  // Keeps `buffer` (empty ones are ignored), or frees it when full.
  void Put(AlignedBuffer buffer);
  // Frees one kept buffer (the oldest); false when none is kept.
  bool FreeOne();
  void Clear() { buffers_.clear(); }

  // The bytes the kept buffers take.
  uint64_t bytes() const;
  size_t count() const { return buffers_.size(); }

 private:
  size_t max_buffers_;
  std::vector<AlignedBuffer> buffers_;  // oldest first
};

}  // namespace fuyou::storage
